"""Old spellings that keep working for one minor version, each with a warning naming the new one.

Modules and names users imported before a rename stay importable: `MOVED_MODULES` maps an old
module to its new home, and `MOVED_NAMES` a name that left a module for another. Importing an
old spelling gives a stand-in module that forwards every attribute to the new one (the same
objects: classes compare equal, `isinstance` holds) and warns once, with a
`FlowrlDeprecationWarning` that names the import to write instead. Graph keys renamed between
releases are declared where the key lives (`NodeSpec.renamed` for node params,
`RENAMED_KEYS` in flowrl/front/schema.py for tables) and warned about by `flowrl check`.

Every entry is also in CHANGELOG.md; entries go when the version named in `REMOVED_IN` ships.
No torch or ray here: `import flowrl` installs the finder.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

REMOVED_IN = "0.3.0"


FRONT_MODULES = (
    "batching",
    "compiler",
    "dsl",
    "graph",
    "memory",
    "overrides",
    "plan",
    "reference",
    "registry",
    "render",
    "schema",
    "tiny_run",
    "typed_toml",
)


class FlowrlDeprecationWarning(DeprecationWarning):
    """An old spelling of a module, a name or a graph key: it works until `REMOVED_IN`.
    Shown by default (flowrl/__init__.py adds the filter), unlike DeprecationWarning, since
    the code that triggers it is the user's node or test file, not `__main__`."""


# old module -> new module: 0.2.0 (one room per engine; param validators at the top) and the
# flat modules of the first layout, moved to flowrl/front/, math/ and models/
MOVED_MODULES = {
    "flowrl.validators": "flowrl.params",
    "flowrl.front.validators": "flowrl.params",
    **{f"flowrl.{m}": f"flowrl.front.{m}" for m in FRONT_MODULES},
    "flowrl.ops": "flowrl.math.ops",
    "flowrl.estimators": "flowrl.math.estimators",
    "flowrl.hub": "flowrl.models.hub",
    "flowrl.lora": "flowrl.models.lora",
    "flowrl.engines.hf_rollout": "flowrl.engines.hf.engine",
    "flowrl.engines.scheduler": "flowrl.engines.hf.scheduler",
    "flowrl.engines.slots": "flowrl.engines.hf.slots",
    "flowrl.engines.kv_cache": "flowrl.engines.hf.kv_cache",
    "flowrl.engines.packed": "flowrl.engines.hf.packed",
    "flowrl.engines.sampling": "flowrl.engines.hf.sampling",
    "flowrl.engines.sglang_backend": "flowrl.engines.sglang.backend",
    "flowrl.engines.sglang_io": "flowrl.engines.sglang.io",
    "flowrl.engines.sglang_process": "flowrl.engines.sglang.process",
    "flowrl.engines.forward": "flowrl.engines.train.forward",
    "flowrl.engines.update_loop": "flowrl.engines.train.update_loop",
    "flowrl.engines.sharding": "flowrl.engines.train.sharding",
    "flowrl.engines.sharded_checkpoint": "flowrl.engines.train.sharded_checkpoint",
    "flowrl.engines.train.host_copies": "flowrl.engines.host_copies",
    "flowrl.engines.sequence_scores": "flowrl.engines.train.sequence_scores",
    "flowrl.smoke": "flowrl.engines.sglang.smoke",  # `python -m flowrl.smoke` too: get_code
}

# modules whose public names flowrl.api exports: their old spellings point there
PUBLIC_MODULES = ("flowrl.params",)

# (old module, name) -> "new.module:name", for names that left a module (moved or kept)
MOVED_NAMES = {
    ("flowrl.engines.forward", "cache_argument"): "flowrl.models.calls:cache_argument",
    ("flowrl.engines.sglang_io", "rollout_weights"): "flowrl.engines.weights:rollout_weights",
    ("flowrl.engines.sglang_io", "weight_buckets"): "flowrl.engines.weights:weight_buckets",
    ("flowrl.engines.rollout", "run_sync"): "flowrl.engines.threads:run_sync",
    ("flowrl.engines.rollout", "start_thread"): "flowrl.engines.threads:start_thread",
}


def warn(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn that `old` is an old spelling of `new`."""
    warnings.warn(
        f"{old} is deprecated and goes in flowrl {REMOVED_IN}: use {new} "
        "(CHANGELOG.md lists every rename)",
        FlowrlDeprecationWarning,
        stacklevel=stacklevel,
    )


def _load(ref: str):
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


class _Forwarding(types.ModuleType):
    """The stand-in for a moved module: its attributes are the new module's."""

    def __init__(self, old: str, new: str):
        super().__init__(old, f"moved to {new}")
        self.__flowrl_new__ = new

    def __getattr__(self, name: str):
        ref = MOVED_NAMES.get((self.__name__, name))
        if ref is not None:
            warn(f"{self.__name__}.{name}", f"from {ref.replace(':', ' import ')}")
            return _load(ref)
        return getattr(importlib.import_module(self.__flowrl_new__), name)

    def __dir__(self):
        return dir(importlib.import_module(self.__flowrl_new__))


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old modules of `MOVED_MODULES` (only those: any other name falls through)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED_MODULES:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        return _Forwarding(spec.name, MOVED_MODULES[spec.name])

    def exec_module(self, module):
        new = MOVED_MODULES[module.__name__]
        importlib.import_module(new)  # a missing new module fails at the import, not later
        instead = f"import {new}"
        if new in PUBLIC_MODULES:  # its names are in the public API: point there
            instead = f"from flowrl.api import ... (the public API; the module is now {new})"
        warn(f"import {module.__name__}", instead)

    def get_code(self, fullname):
        """`python -m <old module>` (runpy asks for code): warn, then run the new one."""
        new = MOVED_MODULES[fullname]
        source = (
            "import runpy\nfrom flowrl import compat\n"
            f"compat.warn('python -m {fullname}', 'python -m {new}', stacklevel=2)\n"
            f"runpy.run_module({new!r}, run_name='__main__', alter_sys=True)\n"
        )
        return compile(source, f"<{fullname}: moved to {new}>", "exec")


def install() -> None:
    """Put the finder for moved modules on `sys.meta_path` (once)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())


def moved_names(module: str, names: dict[str, str] | None = None):
    """A module-level `__getattr__` (PEP 562) for a kept module whose names left for another:
    `names` maps each to "new.module:name" (default: its `MOVED_NAMES` entries)."""
    names = names or {n: ref for (m, n), ref in MOVED_NAMES.items() if m == module}

    def __getattr__(name: str):
        if name not in names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warn(f"{module}.{name}", f"from {names[name].replace(':', ' import ')}")
        return _load(names[name])

    return __getattr__
