"""The CLI's error handling and choices: one error base, constants from one place."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from flowrl import cli, nodespec
from flowrl.data import DataError
from flowrl.errors import FlowrlError, GraphErrors
from flowrl.front import schema
from flowrl.front.registry import UnknownNode
from flowrl.math import ops
from flowrl.models import ModelNotFound
from flowrl.nodes.update import critic, policy
from flowrl.rewards import ScorerError

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("cls", [GraphErrors, DataError, ModelNotFound, ScorerError, UnknownNode])
def test_every_user_error_derives_from_the_base(cls):
    assert issubclass(cls, FlowrlError)


def test_cli_reports_any_flowrl_error_without_traceback(monkeypatch, capsys):
    class NewKindOfError(FlowrlError):  # a subclass the CLI has never heard of
        pass

    def fails(args):
        raise NewKindOfError("pool main, rank 1: it broke")

    monkeypatch.setattr(cli, "cmd_nodes", fails)
    assert cli.main(["nodes"]) == 1
    assert capsys.readouterr().err == "flowrl: pool main, rank 1: it broke\n"


def test_cli_lets_a_bug_through(monkeypatch):
    def fails(args):
        raise KeyError("a bug in flowrl, not a user's mistake")

    monkeypatch.setattr(cli, "cmd_nodes", fails)
    with pytest.raises(KeyError):
        cli.main(["nodes"])


def test_backend_choices_come_from_the_schema(capsys):
    with pytest.raises(SystemExit):
        cli.main(["run", "g.toml", "--backend", "slurm"])
    err = capsys.readouterr().err
    assert all(f"'{name}'" in err for name in schema.BACKENDS)


def test_heads_are_defined_once():
    from flowrl.models import loading

    assert schema.HEADS is nodespec.HEADS and loading.HEADS is nodespec.HEADS


def test_loss_aggregation_modes_are_defined_once():
    for params in (critic.Params, policy.Params):
        with pytest.raises(ValueError):
            params(agg="sum")
        for mode in ops.AGG_MODES:
            assert params(agg=mode).agg == mode
    assert not hasattr(critic, "AGG") and not hasattr(policy, "AGG")
    assert attrs.fields(policy.Params).agg.default in ops.AGG_MODES


def test_a_directory_as_the_graph_says_it_is_one(tmp_path):
    (tmp_path / "aux").mkdir()
    (tmp_path / "aux" / "grpo.toml").write_text("")
    result = subprocess.run(
        [sys.executable, "-m", "flowrl.cli", "check", "aux"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert "aux: file: is a directory, not a graph file" in result.stderr
    assert "aux/grpo.toml" in result.stderr and "shipped graph" not in result.stderr


def test_a_tool_file_imports_its_sibling_from_any_working_directory(tmp_path):
    """The `flowrl` script puts its bin folder, not the working directory, first on sys.path;
    a tool file's folder is put there by flowrl itself, so its siblings import either way."""
    folder = tmp_path / "algo"
    folder.mkdir()
    (folder / "units.py").write_text("FACTOR = 0.3048\n")
    (folder / "unit_tool.py").write_text(
        "from units import FACTOR\n\n\n"
        "def feet_to_metres(feet: float) -> str:\n"
        '    """Convert feet to metres.\n\n    Args:\n        feet: a length in feet\n    """\n'
        "    return str(feet * FACTOR)\n"
    )
    graph = (ROOT / "graphs/grpo_tools.toml").read_text()
    graph = graph.replace(
        'tools = ["calculator"]', 'tools = ["calculator", "unit_tool.py:feet_to_metres"]'
    )
    graph = graph.replace('parser = "tag"', 'parser = "hermes"')
    (folder / "g.toml").write_text(graph)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code = (
        "import sys; sys.path[0] = sys.prefix\n"
        "from flowrl.cli import main\nsys.exit(main(sys.argv[1:]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, "check", str(folder / "g.toml")],
        capture_output=True,
        text=True,
        cwd=elsewhere,
    )
    assert result.returncode == 0, result.stderr


def without_make_flags() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_run_uses_the_chosen_pythons_flowrl():
    """`make run PYTHON=venv/bin/python` runs that Python's flowrl, not a `flowrl` on PATH."""
    result = subprocess.run(
        ["make", "-n", "--no-print-directory", "run"]
        + ["PYTHON=/opt/venv/bin/python", "GRAPH=graphs/grpo.toml"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=without_make_flags(),  # under `make test` an outer make's flags would be inherited
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "/opt/venv/bin/python -m flowrl.cli run graphs/grpo.toml" in lines
    # then the comparison with the README's row, by the same Python
    assert lines[-1] == "/opt/venv/bin/python bench/readme.py --compare graphs/grpo.toml"
    assert not any(line.startswith("flowrl ") for line in result.stdout.splitlines())
