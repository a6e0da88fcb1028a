"""Checkpoint directories, written atomically: a temp directory renamed into place.

    run_dir/checkpoints/step_000010/{controller.json, pool-<name>.pt}  (no pickle: JSON and tensors)
    run_dir/checkpoints/step_000010/pool-<name>/  (strategy fsdp: each rank's shards, written by
                                                   torch.distributed.checkpoint, and JSON)

A run killed while writing leaves only a `.tmp-` directory, which `latest` ignores, so the
previous checkpoint stays the one a `--resume` continues from; `remove_temps` clears such
leftovers (of any process) when a run resumes.
"""

import contextlib
import os
import shutil
from pathlib import Path

from flowrl.runtime import faults

PREFIX = "step_"
TEMP = ".tmp-"


def checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX)]
    return sorted(done, key=lambda p: int(p.name[len(PREFIX) :]))


def latest(run_dir: Path) -> Path | None:
    found = checkpoints(run_dir)
    return found[-1] if found else None


@contextlib.contextmanager
def writing(run_dir: Path, step: int, keep: int):
    """Yield a temp directory to fill; on success rename it to step_NNNNNN, drop old ones."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:06d}"
    temp = root / f"{TEMP}{PREFIX}{step:06d}-{os.getpid()}"
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir()
    try:
        yield temp
        for path in temp.rglob("*"):  # the data must be on disk before the rename publishes it
            if path.is_file():
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
        faults.point("checkpoint", step)
        if final.exists():  # a re-run of this step after a resume: replace it
            shutil.rmtree(final)
        os.rename(temp, final)
    except BaseException:  # an error, a full disk or a signal: nothing half-written remains
        shutil.rmtree(temp, ignore_errors=True)
        raise
    for old in checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def remove_temps(run_dir: Path) -> list[Path]:
    """Delete the temp directories of checkpoint writes that never finished (a killed writer,
    whatever its pid); returns what was removed. Only call it when no writer is running."""
    root = Path(run_dir) / "checkpoints"
    found = sorted(root.glob(f"{TEMP}*")) if root.is_dir() else []
    for path in found:
        shutil.rmtree(path, ignore_errors=True)
    return found
