"""`flowrl run` killed with SIGKILL after its first checkpoint resumes with --resume and
finishes; the checkpoint it resumed from is intact."""

import hashlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import ROOT, tiny_overrides


def digest(directory: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_sigkill_then_resume(tmp_path):
    overrides = tiny_overrides(
        "grpo.toml", tmp_path, **{"run.steps": 40, "run.save_every": 1, "run.keep_checkpoints": 40}
    )
    command = [
        sys.executable,
        "-m",
        "flowrl.cli",
        "run",
        str(ROOT / "graphs/grpo.toml"),
        "--backend",
        "local",
        *overrides,
    ]
    process = subprocess.Popen(
        command, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    first = None
    deadline = time.time() + 120
    while time.time() < deadline and first is None:
        found = sorted(tmp_path.glob("grpo-*/checkpoints/step_000001"))
        first = found[0] if found else None
        time.sleep(0.2)
    assert first is not None, "no checkpoint appeared"
    time.sleep(1.0)
    process.send_signal(signal.SIGKILL)
    process.wait()
    run_dir = first.parent.parent
    before = digest(first)

    resumed = subprocess.run(
        [*command[:5], "--resume", str(run_dir), *command[5:]],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert digest(first) == before  # untouched by the resume
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any(x.get("event") == "resume" for x in lines)
    assert max(x.get("step", 0) for x in lines) == 40
    assert (run_dir / "checkpoints/step_000040").is_dir()
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))
