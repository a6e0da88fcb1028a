"""Run untrusted Python in a child process under limits: the `python` tool's engine.

What bounds a run (each stops it with a message the model can read; the rollout goes on):

- CPU time: RLIMIT_CPU; the child's SIGXCPU handler exits with a CPU_EXIT status at the soft
  limit, the kernel's SIGKILL follows a second later if the code is stuck inside a C call;
- wall time: the whole process tree is killed after `wall_s` (a sleeping or blocked program
  spends no CPU);
- memory: RLIMIT_AS, so a huge allocation fails with MemoryError inside the child;
- output: stdout and stderr go to files under RLIMIT_FSIZE, so writing more fails there with
  "File too large" (any file the code writes is bounded the same way); the parent reads at
  most the limit back;
- processes: a seccomp filter (installed with prctl through ctypes, on x86-64 and arm64)
  refuses fork, vfork and clone without CLONE_THREAD: threads work, a fork bomb's first fork
  fails with EAGAIN. Where seccomp is unavailable RLIMIT_NPROC = `processes` is set instead,
  which binds only users other than root;
- network: the child runs in new network and PID namespaces (`unshare --map-root-user --net
  --pid --fork --kill-child`): no interface but a downed loopback, so a connection fails with
  "Network is unreachable", and killing `unshare` on a timeout kills every process inside.
  Where unprivileged user namespaces are off (or `unshare` is missing) the child instead
  replaces `socket.socket` and `socket.create_connection` with functions that raise, which
  stops ordinary code but not code that works around it (ctypes);
- files: the working directory is a fresh scratch directory, deleted afterwards; the
  environment holds only PATH, HOME (the scratch directory) and one-thread BLAS settings.

This is a resource guard for a model's code, not a security boundary: the child reads and
writes the host's file system with the rights of the user running flowrl. Point a tool at a
real sandbox service for code you would not run on the machine.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import attrs

CHILD = Path(__file__).with_name("_sandbox_child.py")
CPU_EXIT = 124  # as in _sandbox_child.py


@attrs.frozen
class SandboxLimits:
    cpu_s: int = 5  # CPU seconds
    wall_s: float = 10.0  # wall-clock seconds for the whole run
    memory_mb: int = 512  # address space of each process
    output_bytes: int = 16_384  # of stdout and of stderr (and of any file written)
    processes: int = 16  # RLIMIT_NPROC where seccomp cannot refuse new processes


@attrs.frozen
class SandboxResult:
    stdout: str
    stderr: str
    status: str  # "ok", "error" (non-zero exit), "cpu", "timeout", "killed"
    returncode: int | None

    def message(self, limits: SandboxLimits) -> str:
        """What the model sees: the output, and why the run stopped if it did not finish."""
        out = self.stdout
        if self.stderr:
            out += ("\n" if out else "") + self.stderr
        reason = {
            "cpu": f"stopped: the code used more than {limits.cpu_s} s of CPU time",
            "timeout": f"stopped: the code ran longer than {limits.wall_s:g} s",
            "killed": f"stopped: the process was killed (signal {-(self.returncode or 0)})",
        }.get(self.status)
        if "Resource temporarily unavailable" in self.stderr:
            reason = "stopped: the python tool may not start processes"
        elif "MemoryError" in self.stderr:
            reason = f"stopped: the code needed more than {limits.memory_mb} MB of memory"
        elif "File too large" in self.stderr or "File too large" in self.stdout:
            reason = f"output cut: more than {limits.output_bytes} bytes were written"
        if reason:
            out = f"{out.rstrip()}\n{reason}" if out.strip() else reason
        return out if out.strip() else "(no output)"


@functools.cache
def isolation() -> tuple[str, ...]:
    """The command prefix that gives the child fresh network and PID namespaces, or ()
    where `unshare` cannot (no binary, or user namespaces disabled)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    flags = ["--net", "--pid", "--fork", "--kill-child"]
    prefix = (unshare, "--map-root-user", *flags)
    try:
        done = subprocess.run([*prefix, "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ()
    return prefix if done.returncode == 0 else ()


async def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` as a script in a child process under `limits` (see the module docstring).
    Cancelling the call (a tool timeout) kills the child's whole process tree."""
    run_dir = Path(tempfile.mkdtemp(prefix="flowrl-python-"))
    work = run_dir / "work"
    work.mkdir()
    (work / "main.py").write_text(code)
    prefix = isolation()
    settings = {
        "cpu_s": limits.cpu_s,
        "memory_bytes": limits.memory_mb * 2**20,
        "output_bytes": limits.output_bytes,
        "processes": limits.processes,
        "block_network": not prefix,
    }
    command = [*prefix, sys.executable, "-I", str(CHILD), json.dumps(settings), str(work)]
    stdout_path, stderr_path = run_dir / "stdout", run_dir / "stderr"
    process = None
    try:
        with open(stdout_path, "wb") as stdout, open(stderr_path, "wb") as stderr:
            process = await asyncio.create_subprocess_exec(
                *command,
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,  # its own process group: killed as one
                env={
                    "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                    "HOME": str(work),
                    "OMP_NUM_THREADS": "1",
                    "OPENBLAS_NUM_THREADS": "1",
                    "LANG": "C.UTF-8",
                },
            )
        try:
            returncode = await asyncio.wait_for(process.wait(), limits.wall_s)
            status = _status(returncode)
        except TimeoutError:
            _kill(process)
            returncode, status = await process.wait(), "timeout"
        return SandboxResult(
            _read(stdout_path, limits.output_bytes),
            _read(stderr_path, limits.output_bytes, skip=("unshare: ",)),
            status,
            returncode,
        )
    finally:
        if process is not None and process.returncode is None:
            _kill(process)  # cancelled: leave nothing running
        shutil.rmtree(run_dir, ignore_errors=True)


def _status(returncode: int) -> str:
    """ "ok", "error" (an exit code), "cpu" (the child's SIGXCPU handler exits with CPU_EXIT
    at the soft CPU limit; SIGKILL comes at the hard one) or "killed" (another signal). A
    signal shows as -N, or as 128 + N where a wrapper reports its child's death."""
    if returncode == 0:
        return "ok"
    if returncode == CPU_EXIT:
        return "cpu"
    number = -returncode if returncode < 0 else max(returncode - 128, 0)
    if number in (signal.SIGXCPU, signal.SIGKILL):
        return "cpu"
    return "killed" if number else "error"


def _kill(process) -> None:
    """SIGKILL the child's process group (with `unshare --kill-child`, killing unshare also
    kills the PID namespace, and every process in it)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read(path: Path, limit: int, skip=()) -> str:
    """At most `limit` bytes of a file, without lines that start with `skip` (the wrapper's
    own complaints about its child's death)."""
    with open(path, "rb") as f:
        text = f.read(limit).decode("utf-8", errors="replace")
    return "\n".join(line for line in text.splitlines() if not line.startswith(skip)).strip()
