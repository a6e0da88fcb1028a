"""`flowrl export RUN_DIR [--step N] -o DIR`: a trained model as a plain Hugging Face directory.

Reads the run's resolved graph (RUN_DIR/graph.toml) for the model's path, head and dtype, builds
the model as the run did (an alias loads its cached HF config and tokenizer), loads the weights
of checkpoint step N (a sharded checkpoint, whatever the ranks that wrote it, or a ddp one) in
this process alone, and writes `save_pretrained` output plus the tokenizer, so that
`AutoModelForCausalLM.from_pretrained(DIR)` loads it with no flowrl installed; a reward model
(`head = "value"`) becomes a directory `AutoModelForSequenceClassification.from_pretrained`
loads (a critic, whose head has a bias, the LM plus `value_head.safetensors`).
"""

import json
from pathlib import Path

import toml
import torch

from flowrl.front import schema
from flowrl.models import lora
from flowrl.runtime import checkpoint


def export(run_dir, out, step: int | None = None, model: str | None = None) -> Path:
    """Write model `model` (default: the run's only trainable model) of checkpoint `step`
    (default: the latest) as a Hugging Face model directory `out`; returns `out`."""
    from flowrl.engines.train import sharded_checkpoint
    from flowrl.models import load_model

    run_dir, out = Path(run_dir), Path(out)
    raw = toml.loads(_read(run_dir / "graph.toml"))
    name, config = _model(raw, model)
    directory = _checkpoint(run_dir, step)
    seed = raw.get("run", {}).get("seed", 0)
    path = _model_path(run_dir, config.path)
    module, tokenizer = load_model(path, head=config.head, dtype=config.dtype, seed=seed)
    pool = config.pool or next(iter(raw.get("pools", {})), "main")
    sharded, single = directory / f"pool-{pool}", directory / f"pool-{pool}.pt"
    if sharded.is_dir():
        sharded_checkpoint.load_weights(module, sharded, name)
    elif single.exists():
        state = torch.load(single, map_location="cpu", weights_only=True)  # runs no code
        if config.lora:  # the checkpoint holds the adapter: fold it into the base weights
            lora.load_weights(lora.add_adapter(module, config.lora), state[name]["module"])
            merged = lora.merged_state(module)
            module, _ = load_model(path, head=config.head, dtype=config.dtype, seed=seed)
            module.load_state_dict(merged)  # strict: exactly the plain model's keys
        else:
            module.load_state_dict(state[name]["module"])
    else:
        raise SystemExit(f"flowrl export: {directory} holds no state of pool {pool}")
    out.mkdir(parents=True, exist_ok=True)
    if config.head == "value":  # a reward model or critic: flowrl/models/value_checkpoints.py
        from flowrl.models.value_checkpoints import save_value_model

        save_value_model(module, out, tokenizer.pad_token_id)
    else:
        module.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as e:
        raise SystemExit(f"flowrl export: {path} is missing: is this a run directory?") from e


def _model_path(run_dir: Path, path: str) -> str:
    """A model path relative to the run's graph file resolves from that file's folder, as in
    the run (run.json says where it was); aliases and absolute paths stay as they are."""
    try:
        base = Path(json.loads((run_dir / "run.json").read_text())["base_dir"])
    except (OSError, ValueError, KeyError):
        return path
    return str(base / path) if not Path(path).is_absolute() and (base / path).exists() else path


def _model(raw: dict, wanted: str | None) -> tuple[str, schema.ModelConfig]:
    models = raw.get("models", {})
    trainable = [n for n, table in models.items() if table.get("trainable")]
    if wanted is None and len(trainable) != 1:
        raise SystemExit(
            f"flowrl export: the run trains {len(trainable)} models ({', '.join(trainable)}): "
            "name one with --model"
        )
    name = wanted or trainable[0]
    if name not in models:
        raise SystemExit(f"flowrl export: no model {name}; the run has {', '.join(models)}")
    return name, schema.ModelConfig(**models[name])


def _checkpoint(run_dir: Path, step: int | None) -> Path:
    found = checkpoint.checkpoints(run_dir)
    steps = ", ".join(p.name[len(checkpoint.PREFIX) :].lstrip("0") or "0" for p in found)
    if not found:
        raise SystemExit(f"flowrl export: no checkpoint in {run_dir}/checkpoints")
    if step is None:
        return found[-1]
    for path in found:
        if int(path.name[len(checkpoint.PREFIX) :]) == step:
            return path
    raise SystemExit(f"flowrl export: no checkpoint of step {step}; steps saved: {steps}")
