"""Memory estimates without loading anything: bytes per model part on a pool, and the offload
policy they imply. Sizes come from `schema.KNOWN_SIZES` for the aliases, from a local model's
config.json, or from `n_params`. No torch or ray here.
"""

import json
from pathlib import Path

from flowrl import schema

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DEFAULT_MEMORY_GB = {"cuda": 80.0, "cpu": 0.0}
GB = 1024**3


def offload_policy(pool: schema.PoolConfig, memory: dict) -> tuple[str, str]:
    if pool.offload != "auto":
        return pool.offload, "set in the file"
    if pool.device == "cpu":
        return "never", "auto: the device is host memory"
    budget = (pool.device_memory_gb or DEFAULT_MEMORY_GB[pool.device]) * GB
    need = sum(sum(parts.values()) for parts in memory.values())
    if any(not parts for parts in memory.values()):
        return "always", "auto: a model's size is unknown"
    verdict = "never" if need <= 0.9 * budget else "always"
    return verdict, f"auto: estimate {size_text(need)} vs {size_text(budget)} on the device"


def model_line(config: schema.ModelConfig, memory: dict) -> str:
    role = "trainable" if config.trainable else "frozen"
    size = ", ".join(f"{p} {size_text(b)}" for p, b in memory.items()) or "size unknown"
    return f"{config.path} ({config.head} head, {role}; {size})"


def size_text(n: float) -> str:
    return f"{n / GB:.2f} GB" if n >= GB / 10 else f"{n / 1024**2:.1f} MB"


def model_bytes(config: schema.ModelConfig, base_dir: Path, modes: set, tokens: int) -> dict:
    """Bytes per part of a model on one pool: weights; grads and AdamW state if it trains there
    (`"train" in modes`); a KV cache of `tokens` positions if it generates there."""
    arch = architecture(config, base_dir)
    if not arch:
        return {}
    width = BYTES[config.dtype]
    out = {"weights": arch["params"] * width}
    if "train" in modes:
        out["grads"] = arch["params"] * width
        out["optimizer"] = arch["params"] * 8  # AdamW's two fp32 moments
    if "rollout" in modes:
        out["kv_cache"] = tokens * arch["layers"] * 2 * arch["kv_dim"] * width
    return out


def architecture(config: schema.ModelConfig, base_dir: Path) -> dict:
    known = schema.KNOWN_SIZES.get(config.path)
    if known:
        arch = dict(known)
    else:
        path = Path(config.path) if Path(config.path).is_absolute() else base_dir / config.path
        try:
            arch = from_hf_config(json.loads((path / "config.json").read_text()))
        except (OSError, ValueError, KeyError):
            arch = {}
        if not arch and not path.exists():  # a hub name: its config in the local cache
            arch = _from_cache(config.path)
    if config.n_params:
        arch = {"layers": 0, "kv_dim": 0, **arch, "params": config.n_params}
    return arch


def _from_cache(name: str) -> dict:
    from flowrl import hub

    try:
        cached = hub.cached_config(name)
        return from_hf_config(cached) if cached else {}
    except (OSError, ValueError, KeyError):
        return {}


def from_hf_config(c: dict) -> dict:
    hidden, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    heads = c["num_attention_heads"]
    kv_dim = hidden * c.get("num_key_value_heads", heads) // heads
    per_layer = 2 * hidden * hidden + 2 * hidden * kv_dim + 3 * hidden * c["intermediate_size"]
    embeddings = vocab * hidden * (1 if c.get("tie_word_embeddings", False) else 2)
    return {"params": layers * per_layer + embeddings, "layers": layers, "kv_dim": kv_dim}
