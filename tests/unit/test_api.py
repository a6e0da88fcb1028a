"""The public API and its promise: every name the docs show imports from where they say, the
public module loads without torch, and old spellings (modules, names, graph keys) keep working
with a warning naming the new one, each listed in CHANGELOG.md."""

import ast
import importlib
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from flowrl import api, compat
from flowrl.compat import FlowrlDeprecationWarning
from flowrl.front import dsl, registry

ROOT = Path(__file__).resolve().parents[2]
OLD = ROOT / "tests/data/previous_release"


def doc_imports() -> list[tuple[str, str, str]]:
    """(page, module, name) of every `from flowrl... import name` in a code block of the docs
    and the README."""
    found = []
    for page in sorted([*ROOT.glob("docs/*.md"), ROOT / "README.md"]):
        for block in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S):
            # the import statements of a block (a block may be a fragment that does not parse)
            statements = re.findall(r"^from flowrl[\w.]* import (?:\([^)]*\)|.*)$", block, re.M)
            for node in ast.walk(ast.parse("\n".join(statements))):
                if isinstance(node, ast.ImportFrom):
                    found += [(page.name, node.module, a.name) for a in node.names]
    return found


def test_every_name_the_docs_import_is_there_and_the_docs_use_the_public_api():
    imports = doc_imports()
    assert len(imports) > 20  # the pages do show code
    for page, module, name in imports:
        imported = importlib.import_module(module)
        assert hasattr(imported, name), f"{page}: from {module} import {name}"
    # a node author's imports come from flowrl.api; the rest are worked examples of internals
    # (an estimator's math, a built-in node subclassed, a shipped scorer)
    internal = {m for _, m, _ in imports} - {"flowrl.api"}
    assert internal <= {
        "flowrl.lazy",
        "flowrl.math.estimators",
        "flowrl.nodes.update",
        "flowrl.rewards",
    }


@pytest.mark.slow  # a Python child process
def test_every_public_name_loads_and_the_module_imports_no_torch():
    for name in api.__all__:
        assert getattr(api, name) is not None, name
    assert sorted(dir(api)) == sorted(api.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        api.nope  # noqa: B018
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['ray'] = None\n"
        "from flowrl.api import NodeSpec, RolloutParams, checked, count, MINI_BATCHES, Loss\n"
        "from flowrl.api import Request, Result, HFOptions, function_schema, compile\n"
        "loaded = [m.split('.')[0] for m in sys.modules if sys.modules[m] is not None]\n"
        "assert 'torch' not in loaded and 'ray' not in loaded, sorted(loaded)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr


def test_the_public_names_are_the_objects_of_their_homes():
    from flowrl import params
    from flowrl.engines import rollout
    from flowrl.nodespec import NodeSpec

    assert api.NodeSpec is NodeSpec and api.checked is params.checked
    assert api.Result is rollout.Result and api.RolloutBase is rollout.RolloutBase
    assert api.ops is importlib.import_module("flowrl.math.ops")


def fresh_import(module: str):
    """Import `module` anew (the finder runs again), recording the warnings; `__import__`, as
    an import statement does, so the warning names this file."""
    sys.modules.pop(module, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        __import__(module)
    caught = [w for w in caught if issubclass(w.category, FlowrlDeprecationWarning)]
    return sys.modules[module], caught


@pytest.mark.parametrize("old", sorted(compat.MOVED_MODULES))
def test_a_moved_module_imports_under_its_old_name_with_a_warning_naming_the_new(old):
    new = compat.MOVED_MODULES[old]
    module, caught = fresh_import(old)
    (warning,) = caught
    assert f"import {old} is deprecated" in str(warning.message)
    assert new in str(warning.message) and compat.REMOVED_IN in str(warning.message)
    assert warning.filename == __file__  # the warning points at the importing line
    real = importlib.import_module(new)
    public = [n for n in vars(real) if not n.startswith("_")]
    with warnings.catch_warnings():  # a name of MOVED_NAMES warns again: tested below
        warnings.simplefilter("ignore", FlowrlDeprecationWarning)
        assert public and all(getattr(module, n) is getattr(real, n) for n in public)


def test_a_name_that_left_its_module_is_found_there_with_a_warning():
    # no public name has left a module that stays in this release (MOVED_NAMES is empty):
    # the machinery is tested on a stand-in entry, as the next such move will use it
    ref = "flowrl.engines.threads:run_sync"
    getattr_ = compat.moved_names("flowrl.engines.rollout", {"run_sync": ref})
    with pytest.warns(
        FlowrlDeprecationWarning, match=re.escape("from flowrl.engines.threads import run_sync")
    ):
        found = getattr_("run_sync")
    assert found is importlib.import_module("flowrl.engines.threads").run_sync
    with pytest.raises(AttributeError):
        getattr_("start_thread")


@pytest.mark.parametrize(
    "internal",
    [
        "flowrl.engines.slots",
        "flowrl.compiler",
        "flowrl.ops",
        "flowrl.agent.sandbox",
        "flowrl.agent.runner",
    ],
)
def test_an_internal_module_that_moved_has_no_old_spelling(internal):
    # docs/api-stability.md: internal modules may move in any release; compat.py keeps only
    # what an earlier release's docs showed
    assert internal not in compat.MOVED_MODULES
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(internal)


def test_a_built_in_tool_named_by_its_old_reference_in_a_graph_loads_with_a_warning():
    from flowrl.agent.tools import BUILTIN_TOOLS, load_object

    sys.modules.pop("flowrl.agent.builtin", None)
    with pytest.warns(FlowrlDeprecationWarning, match="flowrl.agent.tools.builtin"):
        calc = load_object("flowrl.agent.builtin:calc")
    assert calc is load_object(BUILTIN_TOOLS["calculator"])


def test_an_unknown_name_of_a_moved_module_fails_as_a_missing_attribute():
    module, _ = fresh_import("flowrl.validators")
    with pytest.raises(AttributeError):
        module.no_such_validator  # noqa: B018
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("flowrl.no_such_module")  # the finder takes only its own


@pytest.mark.slow  # a Python child process
def test_the_moved_names_warn_where_the_user_wrote_them():
    code = (
        "try:\n"
        "    from flowrl.validators import checked, count\n"
        "except Warning as w:\n"
        "    print(type(w).__name__, w)\n"
    )
    # the user's own warning options win: -W error makes the old import fail
    command = [sys.executable, "-W", "error::DeprecationWarning", "-c", code]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    assert result.stdout.startswith("FlowrlDeprecationWarning import flowrl.validators"), (
        result.stdout + result.stderr
    )
    assert "from flowrl.api import" in result.stdout


def test_a_node_file_written_against_the_previous_docs_loads_with_a_warning():
    sys.modules.pop("flowrl.validators", None)
    with pytest.warns(FlowrlDeprecationWarning, match="import flowrl.validators"):
        spec = registry.resolve(str(OLD / "bonus.py")).spec
    assert spec.params().scale == 0.01 and spec.writes == ("bonus_scores",)


def test_a_graph_written_against_the_previous_release_checks_with_the_new_key_named(tmp_path):
    spec = dsl.load(OLD / "graph.toml")
    assert spec.nodes["generate"].params.max_parallel_calls == 1
    (said,) = spec.renamed
    assert '[nodes.generate] "max_calls_per_turn" is the old name of "max_parallel_calls"' in said
    # the new name from the command line (or a tiny run) wins over the old one in the file
    said = dsl.load(OLD / "graph.toml", ["nodes.generate.max_parallel_calls=2"])
    assert said.nodes["generate"].params.max_parallel_calls == 2
    text = (OLD / "graph.toml").read_text()
    both = text.replace("max_calls_per_turn = 1", "max_calls_per_turn = 1\nmax_parallel_calls = 2")
    (tmp_path / "bonus.py").write_text((OLD / "bonus.py").read_text())
    (tmp_path / "graph.toml").write_text(both)
    with pytest.raises(Exception, match='"max_calls_per_turn" and "max_parallel_calls" are both'):
        dsl.load(tmp_path / "graph.toml")


@pytest.mark.slow  # a Python child process
def test_check_shows_the_old_keys_and_strict_refuses_them():
    check = [sys.executable, "-m", "flowrl.cli", "check", str(OLD / "graph.toml")]
    plain = subprocess.run(check, capture_output=True, text=True, cwd=ROOT)
    assert plain.returncode == 0, plain.stderr
    assert 'warning: [nodes.generate] "max_calls_per_turn" is the old name' in plain.stdout
    assert "FlowrlDeprecationWarning: import flowrl.validators" in plain.stderr  # shown
    strict = subprocess.run([*check, "--strict"], capture_output=True, text=True, cwd=ROOT)
    assert strict.returncode == 2 and "refused by --strict: 1 old key name" in strict.stderr
    new = subprocess.run(
        [*check, "--strict", "nodes.generate.max_parallel_calls=1"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert new.returncode == 2  # the old key is still in the file: --strict refuses it
    fixed = subprocess.run(
        [sys.executable, "-m", "flowrl.cli", "check", "--strict", "graphs/grpo_tools.toml"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert fixed.returncode == 0, fixed.stderr


def test_hf_rollouts_old_lockstep_keyword_still_works_with_a_warning():
    from flowrl.engines.hf.engine import HFRollout
    from flowrl.testing import tiny_model, tiny_tokenizer

    with pytest.warns(FlowrlDeprecationWarning, match=r"HFRollout\(options=HFOptions"):
        engine = HFRollout(tiny_model(), tiny_tokenizer(), lockstep=True)
    assert engine.lockstep and engine.options.lockstep


def test_the_changelog_lists_every_old_spelling():
    text = (ROOT / "CHANGELOG.md").read_text()
    for old, new in compat.MOVED_MODULES.items():
        assert f"`{old}`" in text and f"`{new}`" in text, old
    for module, name in compat.MOVED_NAMES:
        assert f"`{module}.{name}`" in text, name
    for name in registry.builtin_names():
        for old, new in getattr(registry.resolve(name).spec.params, "RENAMED", {}).items():
            assert f"`{old}`" in text and f"`{new}`" in text, old


@pytest.mark.slow  # trains (a tiny model, two steps)
def test_the_previous_releases_graph_and_node_file_run_unchanged(tmp_path):
    from flowrl.testing import run_tiny

    sys.modules.pop("flowrl.validators", None)
    for name in [n for n in sys.modules if n.startswith("flowrl_ref_") and "bonus" in n]:
        del sys.modules[name]  # the node file loads again, through its old import
    with pytest.warns(FlowrlDeprecationWarning, match="import flowrl.validators"):
        run = run_tiny(OLD / "graph.toml", tmp_path)
    steps = [m for m in run.metrics if m["step"] > 0]
    assert len(steps) == 2 and all("update_policy/grad_norm" in m for m in steps)
    samples = (run.run_dir / "samples.jsonl").read_text()
    assert samples  # the steps logged what they trained on
    assert "old name" in "".join(dsl.load(OLD / "graph.toml").renamed)
