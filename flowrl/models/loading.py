"""Load a model and tokenizer by path: an alias, a local HF directory, a hub name found in the
local Hugging Face cache (flowrl/models/hub.py), or "tiny" (a small random model built
in-process, for tests). Nothing is downloaded."""

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from flowrl.models import embedded, hub, value_checkpoints
from flowrl.nodespec import HEADS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_path(path: str) -> str:
    """The local directory behind a model path: the embedded model's cache, the directory
    itself, or a hub name's snapshot in the local Hugging Face cache (flowrl/models/hub.py); raises
    ModelNotFound, saying how to download it, when it is none of these."""
    if path == embedded.ALIAS:
        return str(embedded.ensure_cached())
    if path == "tiny" or Path(path).exists():
        return path
    snapshot = hub.cached_snapshot(path)
    if snapshot is None:
        raise embedded.ModelNotFound(hub.not_found(path))
    return str(snapshot)


def load_tokenizer(path: str):
    """The tokenizer of a model path; pad falls back to eos."""
    if path == "tiny":
        from flowrl.models.tiny import tiny_tokenizer

        return tiny_tokenizer()
    tokenizer = _pretrained(AutoTokenizer, resolve_path(path))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(path: str, *, head: str = "lm", dtype: str = "float32", seed: int = 0):
    """(module, tokenizer) for a model path.

    Args:
        path: "smollm2-135m-instruct" (embedded), a local HF directory, a hub id already in
            the local HF cache, or "tiny".
        head: "lm" gives the causal LM; "value" a ValueModel: the backbone with a scalar head,
            the `score` layer of a *ForSequenceClassification directory, a value head saved
            beside a causal LM (TRL, OpenRLHF, flowrl), or a new one, zero-initialised
            (flowrl/models/value_checkpoints.py).
        dtype: "float32", "bfloat16" or "float16".
        seed: seeds whatever is initialised at random (the tiny model), without touching the
            global random state.
    """
    if head not in HEADS:
        raise ValueError(f"head must be one of {HEADS}, got {head!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if path == "tiny":
            from flowrl.models.tiny import tiny_model

            module = tiny_model(head=head, seed=seed)
        else:
            module = _load_module(resolve_path(path), head, DTYPES[dtype])
    tokenizer = load_tokenizer(path)
    if path == embedded.ALIAS:
        embedded.check(module, tokenizer)
    return module.to(DTYPES[dtype]), tokenizer


def _load_module(path: str, head: str, dtype: torch.dtype):
    if head == "value":  # every reward-model and critic format: flowrl/models/value_checkpoints.py
        return value_checkpoints.load_value_model(path, dtype, _pretrained)
    return _pretrained(AutoModelForCausalLM, path, dtype=dtype)


def _pretrained(cls, path: str, **kwargs):
    try:
        return cls.from_pretrained(path, local_files_only=True, **kwargs)
    except OSError as e:  # a directory without the files transformers needs
        raise embedded.ModelNotFound(
            f'cannot load model "{path}": {e}. Use a directory written by save_pretrained, a '
            f'hub name in the local Hugging Face cache, "{embedded.ALIAS}" (the embedded '
            'default), or "tiny" for tests; nothing is downloaded at run time'
        ) from e
