"""Nothing of a python tool call outlives it: how sandbox.py ends a call and checks it ended.

A call's processes are ended three ways at once, each enough where it applies:

- the PID namespace's init (the wrapper `unshare`'s child, found through /proc and held by a
  pidfd) is killed: when a namespace's init dies the kernel kills every other process in
  it, and the init's pidfd turns readable only after they are gone;
- the process group the call was started in is killed: the seccomp filter refuses setsid
  and setpgid, so nothing of the call leaves it (the unconfined path has only this);
- the per-call cgroup, where one can be made (root, or a delegated cgroup v2 subtree with
  the pids controller): cgroup.kill (v2) or every member (v1) is killed, and the cgroup is
  removed once empty. Its pids.max also bounds the call's processes and threads, which
  RLIMIT_NPROC does not do for root, and where the memory controller is there too, its
  memory limit bounds all the call's memory: processes, tmpfs, pipes, kernel memory.

`end` kills the inits and the cgroup; `reap` waits until each init's pidfd is readable (the
wrapper reaps it: no zombie is left for the host's pid 1), kills the group, waits for the
wrapper and removes the cgroup once empty: a call returns only when nothing of it is alive.
"""

from __future__ import annotations

import asyncio
import functools
import os
import secrets
import select
import signal
import time
import warnings
from pathlib import Path

GONE_S = 10.0  # how long a SIGKILLed process may take to be gone before a warning


class CallCgroup:
    """The cgroups of one call (one directory on cgroup v2, one per hierarchy on v1):
    processes and threads at most `processes`, memory at most `memory_bytes` (all of the
    call's: its processes, tmpfs, pipes, kernel memory) where a memory cgroup can be made."""

    def __init__(self, bases: dict[str, Path], processes: int, memory_bytes: int):
        name = f"flowrl-python-{secrets.token_hex(6)}"
        self.paths = sorted({base / name for base in bases.values()})
        self.memory, self.oom_kills = None, 0
        try:
            for path in self.paths:
                path.mkdir()
            (bases["pids"] / name / "pids.max").write_text(str(processes))
            if "memory" in bases:
                self.memory = bases["memory"] / name
                self._limit_memory(memory_bytes)
        except OSError:
            self.remove()
            raise

    def _limit_memory(self, memory_bytes: int) -> None:
        if (self.memory / "memory.max").exists():  # v2; no swap beyond it
            (self.memory / "memory.max").write_text(str(memory_bytes))
            if (self.memory / "memory.swap.max").exists():
                (self.memory / "memory.swap.max").write_text("0")
            return
        (self.memory / "memory.limit_in_bytes").write_text(str(memory_bytes))  # v1
        if (self.memory / "memory.memsw.limit_in_bytes").exists():
            (self.memory / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))

    @property
    def procs(self) -> list[str]:
        return [str(path / "cgroup.procs") for path in self.paths]

    def kill(self) -> None:
        for path in self.paths:
            try:
                if (path / "cgroup.kill").exists():  # v2, Linux 5.14 on: all at once
                    (path / "cgroup.kill").write_text("1")
                for pid in (path / "cgroup.procs").read_text().split():  # v1
                    _signal(int(pid))
            except FileNotFoundError:  # removed already
                pass

    def remove(self) -> bool:
        """Remove the cgroups that are empty (counting the memory cgroup's OOM kills
        first); True when all are gone."""
        gone = True
        for path in self.paths:
            if path == self.memory:
                self.oom_kills = max(self.oom_kills, _oom_kills(path))
            try:
                path.rmdir()
            except FileNotFoundError:
                pass
            except OSError:  # EBUSY: a member is still exiting
                gone = False
        return gone

    def exists(self) -> bool:
        return any(path.exists() for path in self.paths)


def call_cgroup(processes: int, memory_bytes: int) -> CallCgroup | None:
    """Fresh cgroups below this process's own, or None where no pids cgroup can be made."""
    bases = _cgroup_bases()
    _sweep(tuple(sorted(set(bases.values()))))
    if "pids" not in bases:
        return None
    try:
        return CallCgroup(bases, processes, memory_bytes)
    except OSError:
        return None


STALE_S = 600  # an empty call cgroup older than this was left by a flowrl that was killed


@functools.cache
def _sweep(bases: tuple[Path, ...]) -> None:
    """Once per process: remove the empty call cgroups a killed flowrl left behind (a live
    call's cgroup is either younger or not empty, and rmdir refuses a cgroup with members)."""
    now = time.time()
    for base in bases:
        for path in base.glob("flowrl-python-*"):
            try:
                if now - path.stat().st_ctime > STALE_S:
                    path.rmdir()
            except OSError:
                pass


def _oom_kills(path: Path) -> int:
    """How many of the cgroup's processes the kernel's OOM killer ended."""
    for name in ("memory.events", "memory.oom_control"):  # v2, v1
        try:
            for line in (path / name).read_text().splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        except (OSError, ValueError):
            pass
    return 0


@functools.cache
def _cgroup_bases() -> dict[str, Path]:
    """This process's own cgroup for the pids and memory controllers, where this user may
    make cgroups below it: on cgroup v2 where the controller is in its subtree_control, else
    in the controller's v1 hierarchy."""
    try:
        memberships = Path("/proc/self/cgroup").read_text().splitlines()
        mounts = [
            line.split(" - ") for line in Path("/proc/self/mountinfo").read_text().splitlines()
        ]
    except OSError:
        return {}
    bases = {}
    for line in memberships:
        _, controllers, path = line.split(":", 2)
        for fields, (fstype, _, options) in ((m[0].split(), m[1].split()[:3]) for m in mounts):
            root, mount_point = fields[3], fields[4]
            if not path.startswith(root) or fstype not in ("cgroup", "cgroup2"):
                continue
            where = Path(mount_point + "/" + path[len(root) :].lstrip("/"))
            if not os.access(where, os.W_OK):
                continue
            for controller in ("pids", "memory"):
                if controller in bases:
                    continue
                if fstype == "cgroup2" and controllers == "":
                    try:
                        enabled = (where / "cgroup.subtree_control").read_text().split()
                    except OSError:
                        enabled = []
                    if controller in enabled:
                        bases[controller] = where
                elif controller in controllers.split(",") and controller in options.split(","):
                    bases[controller] = where
    return bases


def end(process, group: CallCgroup | None) -> list[int]:
    """SIGKILL the namespace's init processes and the cgroup now (never waits); returns the
    inits' pidfds for `reap`. The wrapper lives on to reap its init (an orphaned init would
    wait for the host's pid 1 to reap it)."""
    inits = _pidfds(_children(process.pid)) if process.returncode is None else []
    for fd in inits:
        try:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if group is not None:
        group.kill()
    if not inits:  # no namespace (unconfined), or it is gone: the group is all there is
        _kill_group(process)
    return inits


async def reap(process, inits: list[int], group: CallCgroup | None) -> None:
    """Wait until each init has died (so its namespace is empty), then kill the process
    group and wait until the wrapper is reaped and the cgroup is empty and removed; warn if
    something is still alive after GONE_S."""
    deadline = time.monotonic() + GONE_S
    waiting = list(inits)
    try:
        while waiting and time.monotonic() < deadline:
            ready, _, _ = await asyncio.to_thread(select.select, waiting, [], [], 0.5)
            waiting = [fd for fd in waiting if fd not in ready]
        _kill_group(process)
        await asyncio.wait_for(process.wait(), max(deadline - time.monotonic(), 0.1))
        while group is not None and not group.remove() and time.monotonic() < deadline:
            group.kill()
            await asyncio.sleep(0.01)
        alive = bool(waiting) or (group is not None and group.exists())
    except TimeoutError:
        alive = True
    finally:
        for fd in inits:
            os.close(fd)
    if alive:
        warnings.warn(
            f"python tool: a call's process is alive {GONE_S:g} s after SIGKILL", stacklevel=3
        )


def _kill_group(process) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:  # a kernel without CONFIG_PROC_CHILDREN: every process's parent
        pass
    except OSError:
        return []
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


def _pidfds(pids: list[int]) -> list[int]:
    fds = []
    for pid in pids:
        try:
            fds.append(os.pidfd_open(pid))
        except OSError:  # gone already
            pass
    return fds


def _signal(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
