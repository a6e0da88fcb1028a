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
        if path == LIBRARY / "testing.py":
            continue
        package = ".".join(path.relative_to(ROOT).parent.parts)  # its folder, as a package
        if "flowrl.testing" in imported_modules(path.read_text(), package):
            offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, f"import flowrl.models.tiny instead of flowrl.testing in {offenders}"
