"""Load a user's object from a graph-file reference: "file.py:name" (relative to the graph's
folder) or "package.module:name". Tools, parsers and interactions are referenced this way."""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from pathlib import Path


class ToolError(ValueError):
    """A tool reference that cannot be loaded or described."""


def load_object(ref: str, base_dir: str | Path = ".", what: str = "tool"):
    """The object "file.py:name" (relative to base_dir) or "package.module:name" names."""
    module_ref, _, name = ref.rpartition(":")
    if not module_ref or not name:
        raise ToolError(f'{what} "{ref}": write "file.py:name" or "package.module:name"')
    if module_ref.endswith(".py"):
        path = Path(module_ref) if Path(module_ref).is_absolute() else Path(base_dir) / module_ref
        if not path.is_file():
            raise ToolError(f'{what} "{ref}": no file {path}')
        key = "flowrl_user_" + re.sub(r"\W", "_", str(path.resolve()))
        module = sys.modules.get(key)
        if module is None:
            spec = importlib.util.spec_from_file_location(key, path)
            _importable_siblings(path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            sys.modules[key] = module
    else:
        try:
            module = importlib.import_module(module_ref)
        except ImportError as e:
            raise ToolError(f'{what} "{ref}": cannot import {module_ref} ({e})') from e
    if not hasattr(module, name):
        raise ToolError(f'{what} "{ref}": {module_ref} has no "{name}"')
    return getattr(module, name)


def _importable_siblings(path: Path) -> None:
    """Put a user file's folder on sys.path, so `import helpers` beside it works the same under
    the `flowrl` script (whose sys.path[0] is its bin folder) as under `python -m flowrl.cli`
    (whose sys.path[0] is the working directory). Appended: an installed package of the same
    name wins over a file there."""
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.append(folder)
