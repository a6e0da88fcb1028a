"""A script that calls `run_tiny` at its top level, without `if __name__ == "__main__":`, runs
once: the scorer's child processes start without re-running it (flowrl/rewards/pool.py,
`clean_main`)."""

import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = pytest.mark.slow  # runs a script in a child process, which starts its own


def test_run_tiny_from_a_script_without_a_main_guard_runs_once(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "from pathlib import Path\n"
        "from flowrl.testing import run_tiny\n"
        "with open(Path(__file__).parent / 'ran.txt', 'a') as f:\n"
        "    f.write('ran\\n')\n"
        f"run = run_tiny({str(ROOT / 'graphs/grpo.toml')!r}, Path(__file__).parent / 'runs')\n"
        "print('steps', len([m for m in run.metrics if 'time_s' in m]))\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "steps 2" in done.stdout
    assert (tmp_path / "ran.txt").read_text() == "ran\n"  # the children did not run it again
    assert len(list((tmp_path / "runs").iterdir())) == 1
