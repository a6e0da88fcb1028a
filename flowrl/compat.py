"""Old spellings that keep working for one minor version, each with a warning naming the new one.

Only what a user of an earlier release could have written gets an old spelling: a public name
(docs/api-stability.md), an import or a reference that the docs of an earlier release showed
(`from flowrl.validators import checked`, `"flowrl.agent.builtin:calc"` in a graph), and a graph
key. A module that docs/api-stability.md calls internal (`flowrl.front`, `flowrl.runtime`,
`flowrl.engines.*` below the contract, `flowrl.agent`, ...) and that no such doc showed gets no
alias when it moves: it is internal so that it can move (its old spelling fails at import).

Modules and names users imported before a rename stay importable: `MOVED_MODULES` maps an old
module to its new home, and `MOVED_NAMES` a name that left a module for another. Importing an
old spelling gives a stand-in module that forwards every attribute to the new one (the same
objects: classes compare equal, `isinstance` holds) and warns once, with a
`FlowrlDeprecationWarning` that names the import to write instead. Graph keys renamed between
releases are declared where the key lives (`RENAMED` on a node's params class, `RENAMED_KEYS`
in flowrl/front/schema.py for tables) and read by flowrl/front/typed_toml.py, which warns, as
`flowrl check` does; `check --strict` refuses them. A keyword that a public constructor took
under another name warns through `warn` where it is read (`HFRollout(lockstep=...)`).

Every entry is also in CHANGELOG.md (a test fails when one is missing); entries go when the
version named in `REMOVED_IN` ships. No torch or ray here: `import flowrl` installs the finder.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

REMOVED_IN = "0.3.0"


class FlowrlDeprecationWarning(DeprecationWarning):
    """An old spelling of a module, a name or a graph key: it works until `REMOVED_IN`.
    Shown by default (flowrl/__init__.py adds the filter), unlike DeprecationWarning, since
    the code that triggers it is the user's node or test file, not `__main__`."""


# old module -> new module, each shown by the docs of an earlier release (the validators in
# 0.1's "A node" and d74feff's; `estimators` in 0.1's; the backend table's hf_rollout and the
# engine's sequence_scores in docs/extending.md; the tool schema helper in docs/testing.md; the
# built-in tools as graph references; the SGLang smoke command in docs/scaling.md)
MOVED_MODULES = {
    "flowrl.validators": "flowrl.params",
    "flowrl.front.validators": "flowrl.params",
    "flowrl.estimators": "flowrl.math.estimators",
    "flowrl.engines.hf_rollout": "flowrl.engines.hf.engine",
    "flowrl.engines.sequence_scores": "flowrl.engines.train.sequence_scores",
    "flowrl.agent.schema": "flowrl.agent.tools.schema",
    "flowrl.agent.builtin": "flowrl.agent.tools.builtin",
    "flowrl.smoke": "flowrl.engines.sglang.smoke",  # `python -m flowrl.smoke` too: get_code
}

# modules whose public names flowrl.api exports: their old spellings point there
PUBLIC_MODULES = ("flowrl.params",)

# (old module, name) -> "new.module:name", for names that left a module that stays
MOVED_NAMES: dict[tuple[str, str], str] = {
    # docs/extending.md's update nodes before this release: from flowrl.nodespec import
    # MINI_BATCHES, NodeSpec (the hooks' records moved to flowrl/hooks.py)
    ("flowrl.nodespec", "MINI_BATCHES"): "flowrl.api:MINI_BATCHES",
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
