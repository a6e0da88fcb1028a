"""Every Python file the docs and flowrl's own text name exists, beside test_api.py's check
that the docs' imports resolve: a file moved or renamed leaves no reader at a dead path.

A path with a folder (`flowrl/runtime/guards.py`, `runtime/steps.py`, `tests/unit/toy/
sampler.py`) is read from the repository's root, or from flowrl/ when it starts with one of
flowrl's packages (`engines/hf/scheduler.py`); `flowrl/nodes/` and `flowrl/graphs/` are
nodes/ and graphs/, which install there. A bare file name (`scheduler.py`) must be some file
of the repository, unless it is the name of a user's file in an example (`my_*.py`,
`file.py`, ...) or another project's file (`EXAMPLES`). A path after a commit
(`78fcd10:bench/legacy_rollout.py`) names that commit's file, which `git show` reads, and is
not checked."""

import re
from pathlib import Path

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
TOP = {"flowrl", "tests", "bench", "nodes", "graphs", "examples", "docs"}
INSTALLED = {"flowrl/nodes/": "nodes/", "flowrl/graphs/": "graphs/"}
# a path, not after a letter, a dot, a slash, a colon (a commit's `abc1234:path`) or a
# placeholder (`<name>_executor.py`)
PATH = re.compile(r"(?<![\w./:>-])((?:[A-Za-z_][\w.-]*/)*[A-Za-z_]\w*\.py)\b")
USER_FILE = re.compile(r"(test_)?my(_\w+)?\.py|file\.py|main\.py")
# bare names of files that are not flowrl's: a user's files in the docs' examples, and
# other projects' files the docs compare with
EXAMPLES = {
    "generate_rollout.py",  # docs/extending.md's backend example, written by the reader
    "adaptive_kl.py",  # docs/extending.md: the reader's loss with params and state
    "test_adaptive_kl.py",  # and its test
    "openai_rollout.py",  # docs/extending.md: the reader's backend for a server
    "hard_first.py",  # docs/data.md, docs/testing.md: the reader's sampler
    "try_endpoint.py",  # docs/agents.md: the reader's script against the endpoint
    "sim_user.py",  # docs/multi-turn.md: a user's simulated-user interaction
    "tutor.py",  # docs/multi-turn.md: a user's interaction
    "gsm8k_multiturn_w_tool.py",  # verl's example data script
    "tool_agent_loop.py",  # verl's agent loop
}
# paths with a folder that are another project's, by the file naming them
ELSEWHERE = {
    ("flowrl/engines/sglang/backend.py", "models/llama.py"),  # in sglang's wheel (srt/)
}


def texts() -> list[Path]:
    docs = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
    code = [p for p in sorted((ROOT / "flowrl").rglob("*.py")) if not _installed(p)]
    return docs + code


def _installed(path: Path) -> bool:
    """nodes/ and graphs/ seen again through a link at flowrl/nodes, flowrl/graphs."""
    return path.relative_to(ROOT).as_posix().startswith(tuple(INSTALLED))


def missing(name: str, source: str, names: set[str]) -> bool:
    """Whether `name`, named in the file `source`, leads to no file."""
    if USER_FILE.fullmatch(name.rpartition("/")[2]):
        return False  # a user's file in an example (`tests/test_my_algo.py`)
    if "/" not in name:
        return name not in names and name not in EXAMPLES
    for installed, home in INSTALLED.items():
        if name.startswith(installed):
            name = home + name.removeprefix(installed)
    first = name.split("/")[0]
    if first in TOP:
        return not (ROOT / name).is_file()
    if (ROOT / "flowrl" / first).is_dir() and (source, name) not in ELSEWHERE:
        return not (ROOT / "flowrl" / name).is_file()
    return False  # a user's folder in an example (`my_nodes/bonus.py`), or another project's


def test_every_python_file_the_docs_and_flowrls_text_name_exists():
    names = {p.name for p in ROOT.rglob("*.py") if ".git" not in p.parts}
    dead = []
    for path in texts():
        source = path.relative_to(ROOT).as_posix()
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for found in PATH.finditer(line):
                if missing(found.group(1), source, names):
                    dead.append(f"{source}:{number}: {found.group(1)}")
    assert not dead, "files named but not there (moved? renamed?):\n" + "\n".join(dead)


def test_the_check_finds_a_dead_path_and_passes_a_live_one():
    names = {"guards.py", "scheduler.py"}
    src = "docs/x.md"
    assert missing("flowrl/runtime/no_such_module.py", src, names)
    assert missing("engines/hf/hf_rollout.py", src, names)  # read from flowrl/
    assert missing("hf_rollout.py", src, names)  # a bare name no file has
    assert not missing("flowrl/runtime/guards.py", src, names)
    assert not missing("runtime/guards.py", src, names)
    assert not missing("flowrl/nodes/reward/model.py", src, names)  # installed from nodes/
    assert not missing("scheduler.py", src, names)
    assert not missing("my_losses.py", src, names)  # a user's file in an example
    assert not missing("verl/tools/base_tool.py", src, names)  # another project's
    line = "`git show 78fcd10:bench/legacy_rollout.py`"
    assert [m.group(1) for m in PATH.finditer(line)] == []  # a commit's file: not read here
