"""Load a model and tokenizer by path: an alias, a local HF directory, a cached hub id, or
"tiny" (a small random model built in-process, for tests). Nothing is downloaded."""

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from flowrl.models import embedded
from flowrl.models.value_head import ValueModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_path(path: str) -> str:
    """The local directory (or cached hub id) behind a model path."""
    if path == embedded.ALIAS:
        return str(embedded.ensure_cached())
    return path


def load_tokenizer(path: str):
    if path == "tiny":
        from flowrl.testing import tiny_tokenizer

        return tiny_tokenizer()
    tokenizer = _pretrained(AutoTokenizer, resolve_path(path))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(path: str, *, head: str = "lm", dtype: str = "float32"):
    """(module, tokenizer); head "value" wraps the LM's backbone in a ValueModel."""
    if path == "tiny":
        from flowrl.testing import tiny_model

        module = tiny_model()
    else:
        module = _pretrained(AutoModelForCausalLM, resolve_path(path), dtype=DTYPES[dtype])
    module = ValueModel(module) if head == "value" else module
    return module.to(DTYPES[dtype]), load_tokenizer(path)


def _pretrained(cls, path: str, **kwargs):
    try:
        return cls.from_pretrained(path, local_files_only=True, **kwargs)
    except OSError as e:
        where = "directory" if Path(path).exists() else "hub id (not in the local cache)"
        raise embedded.ModelNotFound(
            f'cannot load model "{path}" as a {where}: {e}. Use a local HF directory, '
            f'"{embedded.ALIAS}" (the embedded default), or "tiny" for tests'
        ) from e
