"""Models: loading by path or alias, the embedded default, value heads."""

from flowrl.models.embedded import ModelNotFound, ensure_cached
from flowrl.models.loading import load_model, load_tokenizer, resolve_path
from flowrl.models.value_head import ValueModel

__all__ = [
    "ModelNotFound",
    "ValueModel",
    "ensure_cached",
    "load_model",
    "load_tokenizer",
    "resolve_path",
]
