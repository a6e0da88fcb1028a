"""Find a node module from a graph's `uses` and read its SPEC.

`uses` is one of:
- a built-in name: "advantage.gae" is nodes/advantage/gae.py (installed as flowrl.nodes...);
- a Python file, relative to the graph file: "my_nodes/shaped_reward.py";
- an importable module: "mypackage.my_node".
Every form ends at a file a reader can open; `NodeRef.location` is its file:line.
"""

import importlib
import importlib.util
import pkgutil
import re
from functools import cache
from pathlib import Path

import attrs

import flowrl.nodes
from flowrl import refs
from flowrl.errors import FlowrlError
from flowrl.nodespec import NodeSpec

BUILTIN_PREFIX = "flowrl.nodes."


@attrs.frozen
class NodeRef:
    name: str  # as written in `uses`
    spec: NodeSpec
    file: str
    line: int  # the line of `SPEC =`
    doc: str  # the module docstring's first paragraph, on one line

    @property
    def location(self) -> str:
        return f"{self.file}:{self.line}"


class UnknownNode(FlowrlError, LookupError):
    """A `uses` that names no node module."""


@cache
def builtin_names() -> tuple[str, ...]:
    """Every built-in node name, e.g. ("advantage.gae", ..., "generate", ...)."""
    names = []
    for info in pkgutil.walk_packages(flowrl.nodes.__path__, BUILTIN_PREFIX):
        if not info.ispkg and not info.name.rsplit(".", 1)[-1].startswith("_"):
            names.append(info.name.removeprefix(BUILTIN_PREFIX))
    return tuple(sorted(names))


def resolve(uses: str, base_dir: Path | None = None) -> NodeRef:
    """The node that `uses` names; raises UnknownNode with a message that says what to write."""
    module = node_module(uses, base_dir)
    spec = getattr(module, "SPEC", None)
    if not isinstance(spec, NodeSpec):
        raise UnknownNode(f'{module.__file__} has no `SPEC = NodeSpec(...)` (uses = "{uses}")')
    return NodeRef(uses, spec, module.__file__, _spec_line(module.__file__), _first_line(module))


def node_module(uses: str, base_dir: Path | None = None):
    """The module `uses` names: a node file's path, a built-in name or a dotted module."""
    if uses.endswith(".py"):
        path = Path(uses) if base_dir is None else Path(base_dir) / uses
        if not path.is_file():
            raise UnknownNode(f'no node file "{path}"')
        module = refs.load_file(path, "node", uses, error=UnknownNode)
    elif uses in builtin_names():
        module = importlib.import_module(BUILTIN_PREFIX + uses)
    elif re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_]\w*)+", uses) and _importable(uses):
        module = importlib.import_module(uses)
    else:
        raise UnknownNode(f'unknown node "{uses}"')
    return module


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _spec_line(file: str) -> int:
    for number, text in enumerate(Path(file).read_text().splitlines(), start=1):
        if text.startswith("SPEC"):
            return number
    return 1


def _first_line(module) -> str:
    """The docstring's first paragraph as one line (a sentence may wrap in the source)."""
    paragraph = (module.__doc__ or "").strip().split("\n\n", 1)[0]
    return " ".join(line.strip() for line in paragraph.splitlines())
