"""How a transformers model takes its arguments across releases and wrappers, for the engines
that call it (the train engine's forward, the rollout engine's model runner)."""

import functools
import inspect

from torch import nn


def cache_argument(module: nn.Module, cache) -> dict:
    """The KV cache as the model's forward names it: `cache` from transformers 5.x (which
    warns that `past_key_values` is deprecated, once per process, so once per worker),
    `past_key_values` before. Decided on the forward's own signature, unwrapping adapters."""
    return {_cache_name(type(innermost(module))): cache}


@functools.cache
def _cache_name(cls) -> str:
    parameters = inspect.signature(cls.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def innermost(module: nn.Module) -> nn.Module:
    """The transformers model under peft and other wrappers (a forward of **kwargs)."""
    while hasattr(module, "get_base_model") and module.get_base_model() is not module:
        module = module.get_base_model()
    return module
