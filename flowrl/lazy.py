"""Deferred imports, so node modules can say `torch.where(...)` yet load without torch, and a
package can name its public classes yet import none of them until used.

`flowrl check` imports every node module of a graph to read its SPEC, and must work where torch
is not installed. A node module writes `from flowrl.lazy import torch`; the real import happens
on first attribute access, i.e. when the node's math first runs. A package (flowrl.engines,
flowrl.models) sets `__getattr__ = exports(__name__, {...})` for the same effect on its names.
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


def exports(package: str, names: dict[str, str]):
    """A module-level `__getattr__` (PEP 562) for `package`: each public name, mapped to its
    "package.module:attribute" (or "package.module" for a module itself), is imported on first
    use (and then cached by Python's module cache), so importing the package itself imports
    none of them."""

    def __getattr__(name: str):
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, _, attribute = names[name].partition(":")
        found = importlib.import_module(module)
        return getattr(found, attribute) if attribute else found

    return __getattr__


torch = LazyModule("torch")
np = LazyModule("numpy")
