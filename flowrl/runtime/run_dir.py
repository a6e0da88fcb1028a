"""Run directories: made once and exclusively, locked for the life of a run.

A new run's directory is `<run.out_dir>/<graph>-<YYYYmmdd-HHMMSS>` (then `-1`, `-2`, ... when
taken), made with one `mkdir`, which fails when the name exists: two runs started in the same
second get two directories, whatever the timing. It is made before any model loads, and removed
again, with any folder of run.out_dir it had to make, when the run is refused or stopped before
its first step.

A run, or a resume, holds `RUN_DIR/run.lock` (an exclusive `flock`, with the holder's pid in
the file) until it ends; a second run or resume of the same directory is refused, naming that
pid. The kernel drops the lock of a process that dies, so a lock left by a killed run is stale
by construction: the next resume takes it and says whose it was. The file itself stays (emptied
on release): deleting it would let a third process lock a new file while a second still holds
the old one. Torch-free.
"""

import contextlib
import fcntl
import os
import shutil
import socket
from datetime import datetime
from pathlib import Path

from flowrl.errors import FlowrlError

LOCK = "run.lock"


class RunDirError(FlowrlError, RuntimeError):
    """The run directory cannot be made, written, locked or resumed."""


def create(out_dir: str | Path, stem: str) -> tuple[Path, list[Path]]:
    """Make a new, empty run directory under `out_dir`.

    Returns:
        (the directory, the folders of `out_dir` this call had to make, deepest first).
    """
    made = _make_parents(Path(out_dir))
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    for k in range(100_000):
        path = Path(out_dir) / (f"{stem}-{stamp}" + (f"-{k}" if k else ""))
        try:
            os.mkdir(path)  # atomic: exactly one of two same-second runs gets a name
            return path, made
        except FileExistsError:
            continue
        except OSError as e:
            remove(None, made)
            raise RunDirError(
                f"cannot make a run directory in {out_dir} ({e.strerror or e}): set run.out_dir "
                "to a folder you can write, or free space"
            ) from e
    raise RunDirError(f"{out_dir}: no free run directory name for {stem}-{stamp}")


def _make_parents(out_dir: Path) -> list[Path]:
    missing = []
    folder = out_dir
    while not folder.exists() and not folder.is_symlink() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    made = []
    try:
        for folder in reversed(missing):
            try:
                folder.mkdir()
            except FileExistsError:  # a run started at the same time made it: not ours
                if not folder.is_dir():
                    raise
                continue
            made.insert(0, folder)
    except OSError as e:
        remove(None, made)
        raise RunDirError(
            f"run.out_dir {out_dir} cannot be made ({e.strerror or e}: {e.filename or folder}):"
            " set run.out_dir to a folder you can write"
        ) from e
    if not out_dir.is_dir():
        raise RunDirError(
            f"run.out_dir {out_dir} is not a folder: set run.out_dir to a folder (or a new name)"
        )
    return made


def remove(run_dir: Path | None, made: list[Path]) -> None:
    """Undo `create`: the run directory, then the parents it made, if they are empty."""
    if run_dir is not None:
        shutil.rmtree(run_dir, ignore_errors=True)
    for folder in made:
        with contextlib.suppress(OSError):
            folder.rmdir()  # only when empty: another run may have started in it


def resume_target(given: str) -> tuple[Path, Path | None]:
    """(run directory, the checkpoint asked for or None) of `--resume GIVEN`: a run directory,
    or one of its checkpoints (RUN_DIR/checkpoints/step_NNNNNN). Creates nothing."""
    path = Path(given)
    if not path.exists():
        where = "a link to nothing" if path.is_symlink() else "no such directory"
        raise RunDirError(
            f"--resume {given}: {where}. Give a run directory (a folder under run.out_dir, "
            "e.g. runs/grpo-20250101-120000) or one of its checkpoints"
        )
    if not path.is_dir():
        raise RunDirError(
            f"--resume {given}: this is a file, not a run directory: give the folder that "
            "holds graph.toml and checkpoints/ (or one of its checkpoints/step_NNNNNN)"
        )
    if path.parent.name == "checkpoints" and path.name.startswith("step_"):
        return path.parent.parent, path
    if not (path / "graph.toml").is_file():
        raise RunDirError(
            f"--resume {given}: not a run directory (it has no graph.toml): give the folder "
            "a run made under run.out_dir"
        )
    return path, None


class Lock:
    """The exclusive lock of a run directory, held from `acquire` to `release`."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK
        self.fd: int | None = None
        self.stale: str = ""  # the pid of a dead holder whose lock this one took over

    def acquire(self) -> "Lock":
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise RunDirError(
                f"cannot lock the run directory {self.path.parent} ({e.strerror or e}): make it "
                "writable, or set run.out_dir to a folder you can write"
            ) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _holder(fd) or "pid not yet written"
            os.close(fd)
            stop = f" or stop it (kill {holder.split()[1]})" if holder[4:].isdigit() else ""
            raise RunDirError(
                f"{self.path.parent} is in use by another flowrl process ({holder}, see "
                f"{self.path}); two runs must not share a run directory. Wait for it to end"
                f"{stop}, then resume; or start a new run"
            ) from None
        previous = _holder(fd)
        if previous:
            self.stale = previous
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, 0)  # empty: nobody holds it (the file stays, see module doc)
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None


def _holder(fd: int) -> str:
    """The 'pid N on HOST' written by the lock's holder ('' when none is)."""
    try:
        text = os.pread(fd, 200, 0).decode(errors="replace").strip()
    except OSError:
        return ""
    return text.split(" on ")[0] if text.startswith("pid ") else ""
