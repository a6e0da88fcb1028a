"""Checkpoint directories, written atomically: a temp directory renamed into place.

    run_dir/checkpoints/step_000010/{controller.json, pool-<name>.pt}  (no pickle: JSON and tensors)
    run_dir/checkpoints/step_000010/pool-<name>/  (strategy fsdp: each rank's shards, written by
                                                   torch.distributed.checkpoint, and JSON)

A run killed while writing leaves only a `.tmp-` directory, which `latest` ignores, so the
previous checkpoint stays the one a `--resume` continues from; `remove_temps` clears such
leftovers (of any process) when a run resumes.

Each checkpoint's `manifest.json`, written last, lists every other file with its size and
SHA-256, the graph it was made with and the flowrl version; `problems` checks a checkpoint
against it, so a deleted, truncated or altered file is found before a resume loads anything.
"""

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path

import flowrl
from flowrl.runtime import faults

MANIFEST = "manifest.json"

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
def writing(run_dir: Path, step: int, keep: int, graph: dict | None = None):
    """Yield a temp directory to fill; on success write its manifest (`graph`: the run's
    resolved graph tables), rename it to step_NNNNNN and drop old ones."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:06d}"
    temp = root / f"{TEMP}{PREFIX}{step:06d}-{os.getpid()}"
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir()
    try:
        yield temp
        write_manifest(temp, step, graph or {})
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


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(directory: Path, step: int, graph: dict) -> None:
    files = {
        str(p.relative_to(directory)): {"size": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    manifest = {"step": step, "flowrl_version": flowrl.__version__, "graph": graph}
    manifest["files"] = files
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def problems(directory: Path) -> list[str]:
    """What is wrong with a checkpoint, by its manifest: [] when it is complete."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        files = manifest["files"]
    except FileNotFoundError:
        return [f"{MANIFEST} is missing (the write did not finish, or an older flowrl made it)"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [f"{MANIFEST} is unreadable ({e})"]
    out = []
    for name, entry in sorted(files.items()):
        path = directory / name
        if not path.is_file():
            out.append(f"{name} is missing")
        elif path.stat().st_size != entry["size"]:
            out.append(f"{name} has {path.stat().st_size} bytes, {entry['size']} were written")
        elif _sha256(path) != entry["sha256"]:
            out.append(f"{name} differs from what was written (checksum)")
    return out


def manifest(directory: Path) -> dict:
    return json.loads((directory / MANIFEST).read_text())


def newest_complete(run_dir: Path, below: Path | None = None) -> Path | None:
    """The newest checkpoint without problems (older than `below`, when given)."""
    for directory in reversed(checkpoints(run_dir)):
        if below is not None and step_of(directory) >= step_of(below):
            continue
        if not problems(directory):
            return directory
    return None


def step_of(directory: Path) -> int:
    """The step of a checkpoint directory (step_NNNNNN)."""
    return int(directory.name[len(PREFIX) :])


def set_aside_newer(directory: Path) -> list[Path]:
    """Rename the checkpoints newer than `directory` (a resume from an older one, chosen
    because they are incomplete) to `.superseded-step_NNNNNN-<pid>`: never loaded or pruned in
    their place, and not deleted either. Returns their new paths."""
    moved = []
    for newer in checkpoints(directory.parent.parent):
        if step_of(newer) > step_of(directory):
            target = newer.with_name(f".superseded-{newer.name}-{os.getpid()}")
            os.rename(newer, target)
            moved.append(target)
    return moved
