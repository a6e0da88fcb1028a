"""run.loggers: names checked by `flowrl check`, a missing extra named with its install command,
and events kept out of the step-indexed loggers."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from flowrl.errors import GraphErrors
from flowrl.front import dsl
from flowrl.runtime import loggers

ROOT = Path(__file__).resolve().parents[3]
GRPO = str(ROOT / "graphs/grpo.toml")


def problems(overrides) -> list[str]:
    with pytest.raises(GraphErrors) as caught:
        dsl.load(GRPO, overrides)
    return [str(p) for p in caught.value.problems]


def test_unknown_logger_is_a_check_error():
    (problem,) = problems(['run.loggers=["jsonl", "mlflow"]'])
    assert "[run]" in problem and '"mlflow"' in problem
    assert 'one of "jsonl", "tensorboard", "wandb"' in problem


def test_missing_extra_names_file_key_and_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    (problem,) = problems(['run.loggers=["tensorboard", "wandb"]'])
    assert problem.startswith(f"{GRPO}: [run] loggers:")
    assert '"wandb" needs the package wandb' in problem
    assert "pip install wandb" in problem


def test_flowrl_check_exits_2_naming_the_missing_extra(tmp_path):
    """In a fresh interpreter where `wandb` cannot be found on the path."""
    hide = (
        "import sys, importlib.util as u; real = u.find_spec\n"
        "u.find_spec = lambda n, *a: None if n == 'wandb' else real(n, *a)\n"
        "from flowrl.cli import main; sys.exit(main(sys.argv[1:]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", hide, "check", GRPO, 'run.loggers=["wandb"]'],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert "[run] loggers" in result.stderr and "pip install wandb" in result.stderr


def test_jsonl_is_always_on_and_gets_the_events(tmp_path):
    class Recorder:
        def __init__(self, run_dir, spec):
            self.rows = []

        def log(self, row):
            self.rows.append(row)

        def close(self):
            pass

    loggers.LOGGERS["recorder"] = Recorder
    try:
        fan = loggers.Loggers(["recorder"], tmp_path, spec=None)
    finally:
        del loggers.LOGGERS["recorder"]
    fan.log({"event": "resume", "step": 2})
    fan.log({"step": 3, "score/mean": 0.5})
    fan.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"event": "resume", "step": 2}, {"step": 3, "score/mean": 0.5}]
    (recorder,) = [x for x in fan.loggers if isinstance(x, Recorder)]
    assert recorder.rows == [{"step": 3, "score/mean": 0.5}]
