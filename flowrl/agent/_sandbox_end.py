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
  RLIMIT_NPROC does not do for root.

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
    """A cgroup of one call, bounding its processes and threads at `processes`."""

    def __init__(self, path: Path, processes: int):
        self.path = path
        path.mkdir()
        try:
            (path / "pids.max").write_text(str(processes))
        except OSError:
            path.rmdir()
            raise

    @property
    def procs(self) -> Path:
        return self.path / "cgroup.procs"

    def kill(self) -> None:
        try:
            if (self.path / "cgroup.kill").exists():  # v2, Linux 5.14 on: all at once
                (self.path / "cgroup.kill").write_text("1")
            for pid in self.procs.read_text().split():  # v1; on v2 none should be left
                _signal(int(pid))
        except FileNotFoundError:  # removed already
            pass

    def remove(self) -> bool:
        """Remove the cgroup if it is empty; True when it is gone."""
        try:
            self.path.rmdir()
        except FileNotFoundError:
            return True
        except OSError:  # EBUSY: a member is still exiting
            return False
        return True


def call_cgroup(processes: int) -> CallCgroup | None:
    """A fresh cgroup under this process's own pids cgroup, or None where none can be made."""
    base = _pids_cgroup()
    if base is None:
        return None
    try:
        return CallCgroup(base / f"flowrl-python-{secrets.token_hex(6)}", processes)
    except OSError:
        return None


@functools.cache
def _pids_cgroup() -> Path | None:
    """This process's cgroup of the pids controller, where this user may make one below it:
    cgroup v2 with pids in its subtree_control, else the v1 pids hierarchy."""
    try:
        memberships = Path("/proc/self/cgroup").read_text().splitlines()
        mounts = [
            line.split(" - ") for line in Path("/proc/self/mountinfo").read_text().splitlines()
        ]
    except OSError:
        return None
    for line in memberships:
        _, controllers, path = line.split(":", 2)
        for fields, (fstype, _, options) in ((m[0].split(), m[1].split()[:3]) for m in mounts):
            root, mount_point = fields[3], fields[4]
            v2 = controllers == "" and fstype == "cgroup2"
            v1 = "pids" in controllers.split(",") and fstype == "cgroup" and "pids" in options
            if not (v1 or v2) or not path.startswith(root):
                continue
            where = Path(mount_point + "/" + path[len(root) :].lstrip("/"))
            try:
                usable = not v2 or "pids" in (where / "cgroup.subtree_control").read_text().split()
            except OSError:
                usable = False
            if usable and os.access(where, os.W_OK):
                return where
    return None


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
        alive = bool(waiting) or (group is not None and group.path.exists())
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
