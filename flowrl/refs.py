"""The one resolver from a reference in a graph file to a Python object.

A reference is "file.py:name" (a file, relative to the graph file's folder unless absolute) or
"package.module:name" (an importable module). Executors, rollout backends, tools, parsers,
interactions and scorers are named this way; node files (`uses = "my_node.py"`) load through
`load_file`.

A file loads once per resolved path: its module is registered in `sys.modules` under a name
made from that path, so two `score.py` files in different folders are two modules, and a file
named twice (a tool and a parser in one file) runs its top level once. Its folder is appended
to sys.path, so modules beside it import. No torch here.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

from flowrl.errors import FlowrlError

FORMS = '"file.py:name" (relative to the graph file) or "package.module:name"'
PREFIX = "flowrl_ref_"  # the sys.modules name of a loaded file is PREFIX + its path, escaped


class RefError(FlowrlError, ValueError):
    """A reference that names no loadable object."""


def load(ref: str, base_dir: str | Path = ".", what: str = "reference", error=RefError):
    """The object `ref` names.

    Args:
        ref: "file.py:name" or "package.module:name".
        base_dir: the folder a relative file resolves against (the graph file's).
        what: what the reference is for ("tool", "scorer", ...), named in errors.
        error: the exception class to raise (a caller's own, e.g. ScorerError).

    Raises:
        error: naming the reference, the file or module, and the fix. An exception the
            file's own code raises while loading passes through.
    """
    module_ref, _, name = ref.rpartition(":")
    if not module_ref or not name:
        raise error(f'{what} "{ref}": write {FORMS}')
    if module_ref.endswith(".py"):
        module = load_file(resolve(module_ref, base_dir), what, ref, error)
    else:
        try:
            module = importlib.import_module(module_ref)
        except ImportError as e:
            raise error(
                f'{what} "{ref}": cannot import {module_ref} ({e}); install it, or write {FORMS}'
            ) from e
    if not hasattr(module, name):
        where = getattr(module, "__file__", None) or module_ref
        raise error(f'{what} "{ref}": {where} has no "{name}"; define it there or fix the name')
    return getattr(module, name)


def is_reference(text: str) -> bool:
    """`text` has a reference's form, "<file or module>:<name>" (not a built-in's name)."""
    module_ref, _, name = str(text).rpartition(":")
    return bool(module_ref and name)


def resolve(file: str | Path, base_dir: str | Path = ".") -> Path:
    """`file` as an absolute path: as written if absolute, else under `base_dir`."""
    path = Path(file) if Path(file).is_absolute() else Path(base_dir) / file
    return path.resolve()


def load_file(
    path: str | Path, what: str = "reference", ref: str = "", error=RefError
) -> ModuleType:
    """The module of the Python file at `path`, executed on its first load only.

    Raises:
        error: no such file. An exception the file's own code raises passes through.
    """
    path = Path(path).resolve()
    if not path.is_file():
        raise error(
            f'{what} "{ref or path}": no file {path}; check the path (relative paths resolve '
            "against the graph file's folder)"
        )
    key = PREFIX + re.sub(r"\W", "_", str(path))
    if key in sys.modules:
        return sys.modules[key]
    module_spec = importlib.util.spec_from_file_location(key, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[key] = module  # before running it, so its own classes can be pickled by name
    _importable_siblings(path)
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[key]  # a file that failed loads afresh once it is fixed
        raise
    return module


def _importable_siblings(path: Path) -> None:
    """Put a user file's folder on sys.path, so `import helpers` beside it works the same under
    the `flowrl` script (whose sys.path[0] is its bin folder) as under `python -m flowrl.cli`
    (whose sys.path[0] is the working directory). Appended: an installed package of the same
    name wins over a file there."""
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.append(folder)
