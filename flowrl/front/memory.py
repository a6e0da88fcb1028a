"""Memory estimates without loading anything: bytes per model part on one rank of a pool, and
the offload policy they imply. Sizes come from `schema.KNOWN_SIZES` for the aliases, from a local
model's config.json, or from `n_params`. No torch or ray here.

Per rank: under strategy "ddp" every rank holds the whole model (weights, grads, optimizer);
under "fsdp" each holds 1/ranks of each, and a model that also generates on the pool keeps an
unsharded copy for its rollout engine (`rollout_weights`, in the compute dtype). The KV cache is
never sharded: a rank's cache holds its own share of the step's rows.
"""

import json
import math
from pathlib import Path

from flowrl.front import schema

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


def model_line(config: schema.ModelConfig, memory: dict, shards: int = 0) -> str:
    role = "trainable" if config.trainable else "frozen"
    if shards:
        role += f", fsdp over {shards} rank{'s' * (shards > 1)}"
    size = ", ".join(f"{p} {size_text(b)}" for p, b in memory.items()) or "size unknown"
    return f"{config.path} ({config.head} head, {role}; {size})"


def size_text(n: float) -> str:
    return f"{n / GB:.2f} GB" if n >= GB / 10 else f"{n / 1024**2:.1f} MB"


def model_bytes(
    config: schema.ModelConfig,
    base_dir: Path,
    modes: set,
    tokens: int,
    ranks: int = 1,
    sharded: bool = False,
    device: str = "cpu",
) -> dict:
    """Bytes per part of a model on one rank: weights; grads and AdamW state if it trains there
    (`"train" in modes`); a KV cache of `tokens` positions (the rank's rows) if it generates
    there. `sharded` (fsdp): weights, grads and optimizer are split over the `ranks`, and
    generating needs an unsharded copy of the weights (`rollout_weights`)."""
    arch = architecture(config, base_dir)
    if not arch:
        return {}
    params, width = arch["params"], BYTES[config.dtype]
    shards = ranks if sharded else 1
    out = {"weights": math.ceil(params * width / shards)}
    if "train" in modes:
        out["grads"] = math.ceil(params * width / shards)
        out["optimizer"] = math.ceil(params * 8 / shards)  # AdamW's two fp32 moments
    if "rollout" in modes:
        compute = BYTES[compute_dtype(config, device, sharded)]
        if sharded:
            out["rollout_weights"] = params * compute
        out["kv_cache"] = tokens * arch["layers"] * 2 * arch["kv_dim"] * compute
    return out


def compute_dtype(config: schema.ModelConfig, device: str, sharded: bool) -> str:
    """The dtype forward passes run in: `param_dtype` under fsdp on cuda (FSDP2's mixed
    precision), else the weights' `dtype` (CPU computes in the dtype it stores)."""
    if sharded and device == "cuda" and config.param_dtype:
        return config.param_dtype
    return config.dtype


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
    from flowrl.models import hub

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


# -- the table of docs/scaling.md ------------------------------------------------------------

TABLE_SIZES = (0.5e9, 1.5e9, 3e9, 7e9, 14e9, 32e9, 72e9)  # parameters
TABLE_RANKS = (1, 2, 4, 8, 16, 32, 64)


def grpo_per_rank(params: int, ranks: int, strategy: str = "fsdp") -> tuple[int, int]:
    """Bytes per rank of GRPO's models on one cuda pool, without KV cache and activations (they
    depend on the batch): (all parts resident, the peak with offload = "always", when only one
    call's parts are on the device). The policy has fp32 weights and AdamW state, computes in
    bf16 (param_dtype) and generates; the reference is frozen. The estimate `flowrl plan` prints."""
    sharded = strategy == "fsdp"
    policy = schema.ModelConfig(
        path="n_params", trainable=True, n_params=int(params), param_dtype="bfloat16"
    )
    ref = schema.ModelConfig(path="n_params", n_params=int(params))
    train = model_bytes(policy, Path("."), {"train", "rollout"}, 0, ranks, sharded, "cuda")
    frozen = model_bytes(ref, Path("."), {"inference"}, 0, ranks, sharded, "cuda")
    phases = [  # what each call needs on the device (compiler.NEEDS)
        sum(train[p] for p in ("weights", "grads", "optimizer")),
        train.get("rollout_weights", train["weights"]),
        frozen["weights"],
    ]
    return sum(train.values()) + sum(frozen.values()), max(phases)


def scaling_table(sizes=TABLE_SIZES, ranks=TABLE_RANKS, device_gb: float = 80.0) -> str:
    """Markdown: for each model size (rows) and fsdp ranks (columns), GB per rank with every
    part resident / the peak with offload = "always"; a cell over 90% of `device_gb` (where
    offload = "auto" would turn offloading on) shows "-"."""

    def cell(n: int) -> str:
        return f"{n / GB:.0f}" if n <= 0.9 * device_gb * GB else "-"

    lines = ["| parameters | " + " | ".join(f"{r} rank{'s' * (r > 1)}" for r in ranks) + " |"]
    lines.append("|---" * (len(ranks) + 1) + "|")
    for size in sizes:
        cells = [" / ".join(cell(n) for n in grpo_per_rank(size, r)) for r in ranks]
        lines.append(f"| {size / 1e9:g}B | " + " | ".join(cells) + " |")
    return "\n".join(lines)
