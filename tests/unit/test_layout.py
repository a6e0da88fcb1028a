"""Rules of the package layout, checked on the source (parsed, never imported)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ROOT / "flowrl"


def imported_modules(source: str, package: str) -> set[str]:
    """Every module a source file imports, relative imports resolved against `package` (the
    dotted package the file belongs to); `from a import b` counts as a and as a.b, since b
    may be a submodule."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # from . / .. import: relative to the package, one level up per dot
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1] + ([module] if module else [])
                module = ".".join(parts)
            found |= {module} | {f"{module}.{alias.name}" for alias in node.names}
    return found


def test_imported_modules_sees_every_form_of_import():
    source = (
        "import flowrl.testing\n"
        "def f():\n"
        "    from flowrl import testing\n"
        "    from .. import testing as t\n"
        "    from ..testing import tiny_model\n"
    )
    found = imported_modules(source, "flowrl.models")
    assert {"flowrl.testing", "flowrl.testing.tiny_model"} <= found
    assert imported_modules("from flowrl import testing", "flowrl") >= {"flowrl.testing"}
    assert imported_modules("from . import testing", "flowrl") >= {"flowrl.testing"}
    assert "flowrl.testing" not in imported_modules("from flowrl.models import tiny", "flowrl")


def test_no_library_module_imports_the_test_fixtures():
    """flowrl.testing is for tests; library code (the "tiny" model path included) must use
    flowrl.models.tiny, so that the library never depends on its test helpers."""
    offenders = []
    for path in sorted(LIBRARY.rglob("*.py")):
        # flowrl.api re-exports the testing helpers by name, loaded on first use only
        if path in (LIBRARY / "testing.py", LIBRARY / "api.py"):
            continue
        package = ".".join(path.relative_to(ROOT).parent.parts)  # its folder, as a package
        if "flowrl.testing" in imported_modules(path.read_text(), package):
            offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, f"import flowrl.models.tiny instead of flowrl.testing in {offenders}"


def library_imports(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the flowrl modules it imports (anywhere in the file, deferred imports too),
    each import resolved to the longest module name it names; a package's `__init__` is the
    package's own name."""
    modules = {}
    for path in sorted((root / "flowrl").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    edges = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges[name] = set()
        for imported in imported_modules(path.read_text(), package):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                edges[name].add(imported)
    # `from flowrl import dsl` names the package and the module: keep the module only
    for name, targets in edges.items():
        edges[name] = {t for t in targets if not any(o.startswith(t + ".") for o in targets)}
    return edges


def import_cycles(root: Path = ROOT) -> list[list[str]]:
    import networkx as nx

    edges = library_imports(root)
    return list(nx.simple_cycles(nx.DiGraph([(a, b) for a, bs in edges.items() for b in bs])))


def test_no_import_circle_in_the_library():
    cycles = import_cycles()
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c + c[:1]) for c in cycles)


def test_the_circle_check_sees_a_deferred_import(tmp_path):
    # the circle the runtime once had: the executor imports the worker, whose error path
    # imported a helper back from the executor inside a function
    runtime = tmp_path / "flowrl" / "runtime"
    runtime.mkdir(parents=True)
    for package in (tmp_path / "flowrl", runtime):
        (package / "__init__.py").write_text("")
    (runtime / "executor.py").write_text("from flowrl.runtime.pool_worker import PoolWorker\n")
    (runtime / "pool_worker.py").write_text(
        "def call():\n    from flowrl.runtime.executor import describe\n"
    )
    (cycle,) = import_cycles(tmp_path)
    assert sorted(cycle) == ["flowrl.runtime.executor", "flowrl.runtime.pool_worker"]
    (runtime / "pool_worker.py").write_text("from flowrl import protocol\n")
    assert import_cycles(tmp_path) == []


FRONT = "flowrl.front"
BACK = ("flowrl.engines", "flowrl.runtime")  # torch and ray live behind these


def reachable(edges: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for target in edges.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def front_end_arrows(root: Path = ROOT) -> list[str]:
    """ "a -> b" for every front-end module a whose imports reach b in engines/ or runtime/,
    deferred imports included (a function of the front end may run in `flowrl check`)."""
    edges = library_imports(root)
    return [
        f"{name} -> {target}"
        for name in sorted(edges)
        if name == FRONT or name.startswith(FRONT + ".")
        for target in sorted(reachable(edges, name))
        if target.startswith(BACK)
    ]


def test_the_front_end_reaches_neither_engines_nor_runtime():
    arrows = front_end_arrows()
    assert not arrows, "the front end imports the back end: " + "; ".join(arrows)


def module_level_imports(source: str) -> set[str]:
    """Top-level package names a module imports when it is imported: statements at module
    level (inside `if`/`try` too), not in functions, not under `if TYPE_CHECKING:`."""
    found, todo = set(), list(ast.parse(source).body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.add((node.module or "").split(".")[0])
        elif isinstance(node, ast.If):
            if "TYPE_CHECKING" not in ast.unparse(node.test):
                todo += node.body + node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody
            todo += [n for handler in node.handlers for n in handler.body]
    return found


def test_no_front_end_module_imports_torch_or_ray_when_imported():
    offenders = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in sorted((LIBRARY / "front").rglob("*.py"))
        for name in sorted(module_level_imports(path.read_text()) & {"torch", "ray"})
    ]
    assert not offenders, f"import these inside the function that needs them: {offenders}"


def test_the_front_end_checks_see_a_planted_violation(tmp_path):
    front = tmp_path / "flowrl" / "front"
    engines = tmp_path / "flowrl" / "engines"
    for package in (tmp_path / "flowrl", front, engines):
        package.mkdir(exist_ok=True)
        (package / "__init__.py").write_text("")
    (engines / "train.py").write_text("import torch\n")
    (tmp_path / "flowrl" / "contract.py").write_text(
        "def f():\n    from flowrl.engines import train\n"
    )
    (front / "dsl.py").write_text("from flowrl import contract\n")  # reaches engines, deferred
    assert front_end_arrows(tmp_path) == ["flowrl.front.dsl -> flowrl.engines.train"]
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n"
    assert module_level_imports(source) == {"typing"}
    assert module_level_imports("try:\n    import ray\nexcept ImportError:\n    pass\n") == {"ray"}
    assert module_level_imports("def f():\n    import torch\n") == set()


def package_folders() -> set[str]:
    """Every folder of the library holding an __init__.py, as the package it installs as:
    flowrl/... as is, nodes/... as flowrl.nodes... (pyproject's package-dir)."""
    found = set()
    for top, package in (("flowrl", "flowrl"), ("nodes", "flowrl.nodes")):
        for init in sorted((ROOT / top).rglob("__init__.py")):
            parts = init.parent.relative_to(ROOT / top).parts
            if top == "flowrl" and parts[:1] in (("nodes",), ("graphs",)):
                continue  # links to the top-level folders in a checkout
            if "__pycache__" not in parts:
                found.add(".".join((package, *parts)))
    return found


def test_every_package_folder_is_installed():
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    missing = sorted(package_folders() - listed)
    assert not missing, f"add {missing} to [tool.setuptools] packages in pyproject.toml"
    assert {"flowrl", "flowrl.front", "flowrl.nodes.update"} <= package_folders()


def test_every_integration_file_is_in_the_slow_tier():
    """`pytest -m "not slow"` is the fast tier: every integration file (they train, start Ray
    or load models) says `pytestmark = pytest.mark.slow`."""
    unmarked = [
        path.name
        for path in sorted((ROOT / "tests" / "integration").glob("test_*.py"))
        if "pytestmark = pytest.mark.slow" not in path.read_text()
    ]
    assert not unmarked, f"add `pytestmark = pytest.mark.slow` to {unmarked}"
