"""Models: loading by path or alias, the embedded default, value heads.

The names below load on first use (flowrl/lazy.py), so that the torch-free parts (the embedded
model's cache location, the tiny tokenizer) import without torch: `flowrl check` reads
tokenizers where torch is not installed.
"""

from typing import TYPE_CHECKING

from flowrl.lazy import exports

if TYPE_CHECKING:  # for readers and type checkers; at run time __getattr__ imports them
    from flowrl.models.embedded import ModelNotFound, ensure_cached
    from flowrl.models.loading import load_model, load_tokenizer, resolve_path
    from flowrl.models.value_head import ValueModel

__getattr__ = exports(
    __name__,
    {
        "ModelNotFound": "flowrl.models.embedded:ModelNotFound",
        "ensure_cached": "flowrl.models.embedded:ensure_cached",
        "load_model": "flowrl.models.loading:load_model",
        "load_tokenizer": "flowrl.models.loading:load_tokenizer",
        "resolve_path": "flowrl.models.loading:resolve_path",
        "ValueModel": "flowrl.models.value_head:ValueModel",
    },
)

__all__ = [
    "ModelNotFound",
    "ValueModel",
    "ensure_cached",
    "load_model",
    "load_tokenizer",
    "resolve_path",
]
