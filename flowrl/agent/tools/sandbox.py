"""Run untrusted Python in a confined child process under limits: the `python` tool's engine.

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
- files (confinement): with `--mount --ipc` added, the child builds its own file system
  before running the code (_sandbox_child.py): a read-only view of what the interpreter
  needs (/usr and the merged-/usr symlinks, the loader's cache, this interpreter's prefixes
  with the standard library and site-packages: `view()`), a private writable /scratch (the
  working directory and HOME) and /tmp (tmpfs, `scratch_mb` each), /dev's null, zero, full,
  random and urandom, and a read-only /proc of its PID namespace; it pivots into it,
  detaches the host's root and drops every capability. So writes outside /scratch and /tmp
  fail ("Read-only file system"), and the run directory, the checkout, the home directory,
  /etc and every other path do not exist for the code: reads fail from the view, not from
  file modes (as root, a mode-600 file is readable wherever it is visible). Root inside is
  root of a user namespace only, holding no capability: it cannot remount the view
  writable, and the seccomp filter refuses unshare and setns too (and the keyrings, which
  it would otherwise share with flowrl). The environment holds only PATH, HOME and
  one-thread BLAS settings.

Why this mechanism: the namespaces the network isolation already used plus a mount
namespace, built in the child with mount(2) and pivot_root(2) through ctypes: nothing to
install (bubblewrap, which does the same, is not on every machine; `unshare` is part of
util-linux), the same whether flowrl runs as root or not, and the view hides paths rather
than denying access to them (Landlock, also available on recent kernels, denies by path but
gives no private /tmp or /proc of its own). It adds about 2 ms to a call of about 65 ms
(bench/sandbox.py; docs/performance.md).

Where the kernel does not allow it (no user namespaces, not Linux: `confinement()` says
why) the code runs unconfined in a scratch directory of the host, with the user's rights on
every file: the agent node's `sandbox = "auto"` (the default) warns once, `"required"`
refuses (SandboxUnavailable; `flowrl check` reports it as an error). It is not a VM:
the code shares the host's kernel, and a kernel bug is an escape. For code you would not run
on the machine at all, the sandbox_fusion tool sends it to a sandbox service
(sandbox_service.py).
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
import threading
import warnings
from pathlib import Path

import attrs

CHILD = Path(__file__).with_name("_sandbox_child.py")
CPU_EXIT = 124  # as in _sandbox_child.py
SANDBOX_SETTINGS = ("auto", "required")  # an agent node's `sandbox`
# the system's programs and libraries (merged-/usr systems have symlinks for the rest)
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache")


@attrs.frozen
class SandboxLimits:
    cpu_s: int = 5  # CPU seconds
    wall_s: float = 10.0  # wall-clock seconds for the whole run
    memory_mb: int = 512  # address space of each process
    output_bytes: int = 16_384  # of stdout and of stderr (and of any file written)
    processes: int = 16  # RLIMIT_NPROC where seccomp cannot refuse new processes
    scratch_mb: int = 64  # of /scratch and of /tmp, each, in a confined run (tmpfs)


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


@attrs.frozen
class Confinement:
    available: bool
    reason: str = ""  # why not, in words


@functools.cache
def view() -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """What the confined child sees of the host, read-only: (directories and files to bind,
    (path, target) symlinks to recreate). The system's programs and libraries, the loader's
    cache, and this interpreter's prefixes (its standard library and site-packages)."""
    wanted = [*SYSTEM, *(os.path.abspath(p) for p in _interpreter_paths())]
    binds, links, seen = [], [], set()
    while wanted:
        path = wanted.pop(0)
        if path in seen or path == "/" or not os.path.lexists(path):
            continue
        seen.add(path)
        if os.path.islink(path):
            links.append((path, os.readlink(path)))
            wanted.append(os.path.realpath(path))
        else:
            binds.append(path)

    def inside_a_bind(path):
        return any(path.startswith(other.rstrip("/") + "/") for other in binds)

    return (
        tuple(sorted(p for p in binds if not inside_a_bind(p))),
        tuple(sorted((p, t) for p, t in links if not inside_a_bind(p))),
    )


def _interpreter_paths() -> list[str]:
    prefixes = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix}
    return [*sorted(prefixes), os.path.dirname(os.path.realpath(sys.executable))]


def confinement() -> Confinement:
    """Whether the child can be confined to its view on this machine: a probe that builds
    the view once and runs a one-line program in it (once per process: the first calls of
    a step, each on a thread of its own, wait for the one probe)."""
    with _PROBE:
        return _probe()


_PROBE = threading.Lock()


@functools.cache
def _probe() -> Confinement:
    if sys.platform != "linux":
        return Confinement(False, f"it needs Linux's namespaces, and this is {sys.platform}")
    if shutil.which("unshare") is None:
        return Confinement(False, "`unshare` (util-linux) is not installed")
    if not isolation():
        return Confinement(False, "user namespaces are off: `unshare --map-root-user` fails")
    run_dir = Path(tempfile.mkdtemp(prefix="flowrl-python-"))
    try:
        command, env = _command("import os\nprint(os.getcwd())", SandboxLimits(), run_dir, True)
        done = subprocess.run(command, env=env, capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return Confinement(False, f"the probe failed: {e}")
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    if done.returncode == 0 and done.stdout.endswith(b"/scratch\n"):
        return Confinement(True)
    said = done.stderr.decode(errors="replace").strip().splitlines()
    printed = f"the probe exited {done.returncode}, printing {done.stdout[-80:]!r}"
    return Confinement(False, said[-1] if said else printed)


class SandboxUnavailable(RuntimeError):
    """sandbox = "required" on a machine where the code cannot be confined."""


def unconfined_notice(reason: str) -> str:
    return (
        f"the python tool cannot confine its code on this machine ({reason}): the code "
        "a model writes runs with the rights of the user running flowrl, so it can read and "
        "write every file that user can (checkpoints, the scorer's source, flowrl's own "
        "files, credentials); the network, other processes and resource limits stay bounded"
    )


REQUIRED_FIX = (
    "enable unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1; on "
    "Ubuntu also kernel.apparmor_restrict_unprivileged_userns=0), run the code in a sandbox "
    'service (the sandbox_fusion tool), or set sandbox = "auto" in the agent node to run it '
    "unconfined"
)
_NOTICE = []  # the notice was given in this process


def say_unconfined_once(reason: str) -> bool:
    """True the first time in this process (`flowrl check`'s finding counts as said)."""
    if _NOTICE:
        return False
    _NOTICE.append(reason)
    return True


def use_view(sandbox: str) -> bool:
    """Whether this run is confined under the agent node's `sandbox` setting: "auto"
    confines where the machine can and warns once where it cannot; "required" raises."""
    if sandbox not in SANDBOX_SETTINGS:
        raise ValueError(f'sandbox = "{sandbox}" must be one of {", ".join(SANDBOX_SETTINGS)}')
    state = confinement()
    if state.available:
        return True
    if sandbox == "required":
        notice = unconfined_notice(state.reason)
        raise SandboxUnavailable(f'sandbox = "required", but {notice}. Fix: {REQUIRED_FIX}')
    if say_unconfined_once(state.reason):
        warnings.warn(unconfined_notice(state.reason), stacklevel=3)
    return False


async def run_python(
    code: str, limits: SandboxLimits = SandboxLimits(), sandbox: str = "auto"
) -> SandboxResult:
    """Run `code` as a script in a child process under `limits` (see the module docstring),
    confined to its view where `sandbox` and the machine allow (`use_view`). Cancelling the
    call (a tool timeout) kills the child's whole process tree."""
    confined = use_view(sandbox)
    run_dir = Path(tempfile.mkdtemp(prefix="flowrl-python-"))
    stdout_path, stderr_path = run_dir / "stdout", run_dir / "stderr"
    process = None
    try:
        command, env = _command(code, limits, run_dir, confined)
        with open(stdout_path, "wb") as stdout, open(stderr_path, "wb") as stderr:
            process = await asyncio.create_subprocess_exec(
                *command,
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,  # its own process group: killed as one
                env=env,
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


def _command(code: str, limits: SandboxLimits, run_dir: Path, confined: bool):
    """(the child's command line, its environment), its files under `run_dir`."""
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
        "view": None,
    }
    if confined:
        (run_dir / "root").mkdir()
        read_only, symlinks = view()
        settings["view"] = {
            "root": str(run_dir / "root"),
            "read_only": read_only,
            "symlinks": symlinks,
            "scratch_mb": limits.scratch_mb,
        }
        prefix = (*prefix[:2], "--mount", "--ipc", *prefix[2:])
    command = [*prefix, sys.executable, "-I", str(CHILD), json.dumps(settings), str(work)]
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": "/scratch" if confined else str(work),
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "LANG": "C.UTF-8",
    }
    return command, env


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
