"""Every example of docs/testing.md runs: its files (and the node files of
docs/extending.md it tests) are written to a folder as the page lays them out, and the page's
test file runs there under pytest, from another working directory."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs/testing.md").read_text()
EXTENDING = (ROOT / "docs/extending.md").read_text()


def page_files(page: str) -> dict[str, str]:
    """path -> text of every ```python / ```toml block whose first line is `# path` (a
    `# path (continued)` block is appended to it)."""
    files: dict[str, str] = {}
    for block in re.findall(r"```(?:python|toml)\n(.*?)```", page, flags=re.S):
        first = block.splitlines()[0]
        match = re.fullmatch(r"# ([\w/]+\.(?:py|toml))( \(continued\))?", first.split(":")[0])
        if not match:
            continue
        body = block if not match[2] else block.split("\n", 1)[1]
        files[match[1]] = files.get(match[1], "") + ("\n\n" if match[2] else "") + body
    return files


@pytest.mark.slow  # a child process: a Python start-up with torch
def test_the_testing_guide_runs(tmp_path):
    project = tmp_path / "my_algo"
    files = page_files(PAGE)
    assert {"tests/test_my_algo.py", "my_tools/units.py", "my_algo.toml"} <= set(files)
    blocks = re.findall(r"```python\n(.*?)```", EXTENDING, flags=re.S)
    files["my_nodes/bonus.py"] = next(b for b in blocks if "A length bonus" in b.split("\n")[0])
    for name in ("my_nodes/top_k.py", "my_nodes/reinforce_update.py"):
        files[name] = next(b for b in blocks if b.startswith(f"# {name}"))
    for name, text in files.items():
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text(text)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(project / "tests")],
        capture_output=True,
        text=True,
        cwd=elsewhere,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    tests = re.findall(r"^def (test_\w+)", files["tests/test_my_algo.py"], flags=re.M)
    assert f"{len(tests)} passed" in result.stdout, result.stdout[-2000:]
    for name in re.findall(r"`(test_\w+)`", PAGE):  # the table names tests that exist
        assert name in tests, name
