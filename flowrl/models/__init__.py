"""Models: loading by path or alias, the embedded default, value heads.

The names below load on first use, so that the torch-free parts (the embedded model's cache
location, the tiny tokenizer) import without torch: `flowrl check` reads tokenizers where
torch is not installed.
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for readers and type checkers; at run time __getattr__ imports them
    from flowrl.models.embedded import ModelNotFound, ensure_cached
    from flowrl.models.loading import load_model, load_tokenizer, resolve_path
    from flowrl.models.value_head import ValueModel

# public name -> (module, attribute)
_NAMES = {
    "ModelNotFound": ("flowrl.models.embedded", "ModelNotFound"),
    "ensure_cached": ("flowrl.models.embedded", "ensure_cached"),
    "load_model": ("flowrl.models.loading", "load_model"),
    "load_tokenizer": ("flowrl.models.loading", "load_tokenizer"),
    "resolve_path": ("flowrl.models.loading", "resolve_path"),
    "ValueModel": ("flowrl.models.value_head", "ValueModel"),
}


def __getattr__(name: str):
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _NAMES[name]
    return getattr(importlib.import_module(module), attr)


__all__ = [
    "ModelNotFound",
    "ValueModel",
    "ensure_cached",
    "load_model",
    "load_tokenizer",
    "resolve_path",
]
