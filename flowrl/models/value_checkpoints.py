"""Reward-model and critic checkpoints in the formats that exist in the wild, loaded as a
`ValueModel`, and written back as one transformers loads.

Loaded (`head = "value"`):
- a `*ForSequenceClassification` directory (num_labels = 1): its `score` layer is the head
  (transformers, TRL's RewardTrainer, most published reward models);
- a causal LM directory whose weights also hold a value head: TRL's
  `AutoModelForCausalLMWithValueHead` (`v_head.summary.weight` / `.bias`), OpenRLHF's and
  flowrl's own (`value_head.weight` / `.bias`, in the weights or in `value_head.safetensors`,
  which `flowrl export` writes for a critic);
- any other causal LM: a new head, zero-initialised (a critic to train).

Written (`save_value_model`): a `*ForSequenceClassification` directory when the head has no
bias (a Bradley-Terry reward model never moves it: the loss sees only differences of scores),
so `AutoModelForSequenceClassification.from_pretrained` loads it; else the causal LM plus
`value_head.safetensors` (a critic, whose bias carries the mean return).
"""

import json
from pathlib import Path

import torch
from torch import nn

from flowrl.models.value_head import ValueModel

HEAD_FILE = "value_head.safetensors"
HEAD_KEYS = (  # (weight, bias) names, in the order they are looked for
    ("value_head.weight", "value_head.bias"),  # flowrl, OpenRLHF
    ("v_head.summary.weight", "v_head.summary.bias"),  # TRL's value-head wrapper
)


def is_classifier(path: str) -> bool:
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    architectures = json.loads(config.read_text()).get("architectures") or []
    return any(a.endswith("ForSequenceClassification") for a in architectures)


def load_value_model(path: str, dtype: torch.dtype, pretrained) -> ValueModel:
    """The ValueModel of a local directory; `pretrained(cls, path, **kwargs)` loads a
    transformers class (flowrl/models/loading.py, which turns a missing file into a clear
    error)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    if is_classifier(path):
        classifier = pretrained(AutoModelForSequenceClassification, path, dtype=dtype)
        if classifier.config.num_labels != 1:
            raise ValueError(
                f"{path}: a reward model needs num_labels = 1, its config.json says "
                f"{classifier.config.num_labels}: score with a one-label classifier"
            )
        return ValueModel(classifier, head=classifier.score)
    lm = pretrained(AutoModelForCausalLM, path, dtype=dtype)
    return ValueModel(lm, head=saved_head(Path(path), lm.config.hidden_size, dtype))


def saved_head(directory: Path, hidden: int, dtype: torch.dtype) -> nn.Linear | None:
    """A value head stored beside a causal LM's weights (None if there is none)."""
    tensors = _head_tensors(directory)
    for weight_key, bias_key in HEAD_KEYS:
        if weight_key in tensors:
            weight = tensors[weight_key].reshape(1, hidden)
            head = nn.Linear(hidden, 1, bias=True, dtype=dtype)
            with torch.no_grad():
                head.weight.copy_(weight)
                head.bias.copy_(tensors.get(bias_key, torch.zeros(1)).reshape(1))
            return head
    return None


def _head_tensors(directory: Path) -> dict:
    """The value-head tensors among a directory's weight files (safetensors or torch .bin,
    single or sharded), read without loading the rest."""
    wanted = {key for pair in HEAD_KEYS for key in pair}
    files = [
        directory / HEAD_FILE,
        directory / "model.safetensors",
        directory / "pytorch_model.bin",
    ]
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (directory / index).is_file():
            weight_map = json.loads((directory / index).read_text()).get("weight_map", {})
            files += sorted({directory / f for k, f in weight_map.items() if k in wanted})
    out = {}
    for file in files:
        if not file.is_file():
            continue
        if file.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(file), framework="pt") as f:
                out.update({k: f.get_tensor(k) for k in wanted & set(f.keys())})
        else:  # weights_only: a .bin file runs no code
            state = torch.load(file, map_location="cpu", weights_only=True)
            out.update({k: v for k, v in state.items() if k in wanted})
    return out


def save_value_model(module: ValueModel, out: Path, pad_token_id: int | None) -> None:
    """Write `module` to `out` (see the module docstring for which format)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    head = module.value_head
    config = type(module.config).from_dict(module.config.to_dict())
    base = (config.architectures or [type(module.config).__name__.replace("Config", "Model")])[0]
    family = base.split("For")[0].removesuffix("Model") or base
    if head.bias is None or not bool(head.bias.detach().abs().max() > 0):
        config.architectures, config.num_labels = [f"{family}ForSequenceClassification"], 1
        if config.pad_token_id is None:  # transformers scores a batch only with a pad id
            config.pad_token_id = pad_token_id
        target = AutoModelForSequenceClassification.from_config(config, dtype=head.weight.dtype)
        target.model.load_state_dict(module.model.state_dict())
        with torch.no_grad():
            target.score.weight.copy_(head.weight)
        target.save_pretrained(out)
        return
    config.architectures = [f"{family}ForCausalLM"]
    target = AutoModelForCausalLM.from_config(config, dtype=head.weight.dtype)
    missing = target.model.load_state_dict(module.model.state_dict())
    assert not missing.missing_keys, missing
    target.save_pretrained(out)  # its LM head is the (tied or new) one of the config
    state = {"value_head.weight": head.weight.detach().contiguous()}
    state["value_head.bias"] = head.bias.detach().contiguous()
    save_file(state, str(out / HEAD_FILE))
