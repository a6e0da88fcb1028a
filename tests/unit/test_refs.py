"""flowrl/refs.py: the one resolver from "file.py:name" / "package.module:name" to an object,
used for executors, rollout backends, tools, parsers, interactions, scorers and node files."""

import subprocess
import sys
from pathlib import Path

import pytest

from flowrl import refs
from flowrl.rewards import ScorerError, resolve_scorer

ROOT = Path(__file__).resolve().parents[2]


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_two_files_of_one_name_in_two_folders_are_two_modules(tmp_path):
    _write(tmp_path / "a" / "score.py", "def compute_score(s, t, g, e=None):\n    return 1.0\n")
    _write(tmp_path / "b" / "score.py", "def compute_score(s, t, g, e=None):\n    return 2.0\n")
    first = resolve_scorer("a/score.py:compute_score", tmp_path)
    second = resolve_scorer("b/score.py:compute_score", tmp_path)
    assert (first("x", "y", "z"), second("x", "y", "z")) == (1.0, 2.0)
    assert first.__module__ != second.__module__


def test_a_file_runs_once_however_it_is_named(tmp_path):
    """Cached by resolved path: "tools.py", "./tools.py" and the absolute path are one module."""
    _write(
        tmp_path / "tools.py", "import itertools\nCOUNT = itertools.count()\nRUNS = next(COUNT)\n"
    )
    _write(tmp_path / "sub" / "x.txt", "")
    counts = [
        refs.load("tools.py:COUNT", tmp_path),
        refs.load("./tools.py:COUNT", tmp_path),
        refs.load("../tools.py:COUNT", tmp_path / "sub"),
        refs.load(f"{tmp_path / 'tools.py'}:COUNT"),
    ]
    assert all(c is counts[0] for c in counts)
    assert next(counts[0]) == 1  # the top level ran once (RUNS took 0)


def test_a_module_reference_imports_the_module():
    assert refs.load("flowrl.errors:FlowrlError").__name__ == "FlowrlError"


@pytest.mark.parametrize(
    ("ref", "words"),
    [
        ("score.py", ['tool "score.py"', '"file.py:name"', '"package.module:name"']),
        ("missing.py:f", ['tool "missing.py:f"', "no file", "missing.py", "check the path"]),
        ("score.py:nope", ['tool "score.py:nope"', 'score.py has no "nope"', "define it"]),
        ("no_such_pkg.mod:f", ['tool "no_such_pkg.mod:f"', "cannot import no_such_pkg.mod"]),
    ],
)
def test_errors_name_the_reference_the_file_and_the_fix(tmp_path, ref, words):
    _write(tmp_path / "score.py", "def f():\n    pass\n")
    with pytest.raises(refs.RefError) as info:
        refs.load(ref, tmp_path, "tool")
    for word in words:
        assert word in str(info.value)


def test_a_callers_error_class_is_raised():
    with pytest.raises(ScorerError, match='scorer "nowhere.py:f": no file'):
        resolve_scorer("nowhere.py:f")


def test_a_file_that_fails_to_load_loads_afresh_once_fixed(tmp_path):
    path = _write(tmp_path / "broken.py", "raise RuntimeError('half written')\n")
    with pytest.raises(RuntimeError, match="half written"):
        refs.load("broken.py:x", tmp_path)
    path.write_text("x = 3\n")
    assert refs.load("broken.py:x", tmp_path) == 3


def test_refs_imports_no_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import flowrl.refs, flowrl.backends, flowrl.lazy\n"
        "assert 'torch' not in [m.split('.')[0] for m in sys.modules if sys.modules[m]]\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
