"""What stops a run by name: checks before any model loads (devices, packages, a writable run
directory) and the errors that end a run cleanly (signals, non-finite steps)."""

import contextlib
import os
import signal
import threading
from datetime import datetime
from pathlib import Path

import torch

from flowrl.backends import ROLLOUT_BACKENDS, missing_package
from flowrl.errors import FlowrlError


class NonFiniteStop(FlowrlError, RuntimeError):
    """Too many steps in a row had a non-finite loss or gradient norm."""


class FailedStepsStop(FlowrlError, RuntimeError):
    """Too many steps in a row trained on nothing (every request failed)."""


class Stopped(FlowrlError, RuntimeError):
    """SIGINT or SIGTERM stopped the run between or during steps."""


@contextlib.contextmanager
def stopped_by_signals(file: str, run_dir: Path):
    """Turn SIGINT and SIGTERM into `Stopped`, so the run unwinds: a checkpoint being
    written is discarded (checkpoint.writing), the executor shuts its workers down (run's
    `finally`), and the message says how to resume."""

    def stop(signum, frame):
        raise Stopped(
            f"stopped by {signal.Signals(signum).name}; the last checkpoint is intact. "
            f"Resume with: flowrl run {file} --resume {run_dir}"
        )

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


class DeviceError(FlowrlError, RuntimeError):
    """A pool asks for a device this machine does not have."""


def check_devices(plan) -> None:
    """A CUDA pool on a machine without CUDA fails here, by name, before any model loads (on a
    Ray cluster, RAY_ADDRESS set, the cluster's GPUs count instead: Ray places the pool)."""
    if os.environ.get("RAY_ADDRESS") or torch.cuda.is_available():
        return
    for name, pool in plan.pools.items():
        if pool.device == "cuda":
            raise DeviceError(
                f'{plan.file}: [pools.{name}] device = "cuda", but this machine has no CUDA '
                'device: set device = "cpu" (e.g. pools.'
                f'{name}.device="cpu" on the command line), or run where GPUs are'
            )


class MissingPackage(FlowrlError, RuntimeError):
    """A graph picks a rollout backend whose package is not installed."""


def check_packages(plan) -> None:
    """A rollout backend whose package is not installed (sglang) fails here, by name, before
    any model loads (on a Ray cluster, RAY_ADDRESS set, the workers' packages count: skipped)."""
    if os.environ.get("RAY_ADDRESS"):
        return
    for name in sorted({d.model for d in plan.spec.nodes.values() if d.mode == "rollout"}):
        backend = plan.spec.models[name].rollout
        if package := missing_package(backend):
            raise MissingPackage(
                f'{plan.file}: [models.{name}] rollout = "{backend}" needs the {package} '
                f"package, which is not installed: {ROLLOUT_BACKENDS[backend].install}"
            )


def writable(run_dir: Path) -> None:
    """Create the run directory and check it takes files, before any model loads."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise RunDirError(
            f"run directory {run_dir} is not writable ({e.strerror}): set run.out_dir to a "
            "folder you can write, or free space"
        ) from e


class RunDirError(FlowrlError, RuntimeError):
    """The run directory cannot be written."""


def new_run_dir(spec) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path(spec.run.out_dir) / f"{Path(spec.file).stem}-{stamp}"
    path, k = base, 1
    while path.exists():
        path, k = Path(f"{base}-{k}"), k + 1
    return path
