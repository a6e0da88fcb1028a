"""What a run that ends early says: what was kept, and the command that goes on."""

import os
import shutil
from pathlib import Path

from flowrl.runtime import checkpoint


def after_stop(run_dir: Path, trainer, command: str) -> str:
    """What a stopped run kept, and how to go on."""
    if trainer is None or not trainer.started:
        return f"it had not started its first step; nothing was kept. Start again with: {command}"
    done = trainer.steps_done
    kept = f"steps up to {done} are logged in {run_dir / 'metrics.jsonl'}. " if done else ""
    good = checkpoint.newest_complete(run_dir)
    if good is None:
        return (
            f"{kept}no checkpoint was written yet, so there is nothing to resume: start again "
            f"with: {command}"
        )
    return (
        f"{kept}The last checkpoint, {good}, is intact. Resume with: {command} --resume {run_dir}"
    )


def failed_write(trainer, what: str, error: Exception) -> str:
    """A failed write, where, why (a full disk said as such) and what is intact."""
    cause = error
    while cause.__cause__ is not None and not isinstance(cause, OSError):
        cause = cause.__cause__
    if isinstance(cause, OSError) and cause.strerror:
        reason = cause.strerror
    else:  # torch's writer names no errno ("unexpected pos ..."): a probe write finds it
        reason = probe(trainer.run_dir) or str(cause).strip().splitlines()[0]
    try:
        free = shutil.disk_usage(trainer.run_dir).free
        if free < 64 * 2**20:
            reason += f"; the disk is full ({free / 2**20:.1f} MiB free)"
    except OSError:
        pass
    good = checkpoint.newest_complete(trainer.run_dir)
    intact = f"{good} is intact" if good else "no complete checkpoint was written before"
    fix = f"start again: {trainer.command}"
    if good:
        fix = f"resume: {trainer.command} --resume {trainer.run_dir}"
    return (
        f"{what} could not be written under {trainer.run_dir} ({reason}); {intact}. Free space "
        f"(or make the folder writable), then {fix}"
    )


def probe(folder: Path) -> str:
    """Why a write of 1 MiB into `folder` fails ('' when it succeeds)."""
    path = Path(folder) / ".flowrl-write-probe"
    try:
        with open(path, "wb") as f:
            for _ in range(16):
                f.write(b"\0" * 65536)
            f.flush()
            os.fsync(f.fileno())
        return ""
    except OSError as e:
        return e.strerror or str(e)
    finally:
        path.unlink(missing_ok=True)
