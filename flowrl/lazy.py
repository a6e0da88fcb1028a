"""Deferred imports, so node modules can say `torch.where(...)` yet load without torch.

`flowrl check` imports every node module of a graph to read its SPEC, and must work where torch
is not installed. A node module writes `from flowrl.lazy import torch`; the real import happens
on first attribute access, i.e. when the node's math first runs.
"""

import importlib
from types import ModuleType


class LazyModule:
    """Stands in for a module until one of its attributes is needed."""

    def __init__(self, name: str):
        self._name = name

    def _module(self) -> ModuleType:
        return importlib.import_module(self._name)  # cached in sys.modules after the first call

    def __getattr__(self, attr: str):
        return getattr(self._module(), attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}>"


torch = LazyModule("torch")
F = LazyModule("torch.nn.functional")
np = LazyModule("numpy")
