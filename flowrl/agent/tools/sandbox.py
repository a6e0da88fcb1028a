"""Run untrusted Python in a confined child process under limits: the `python` tool's engine.

What bounds a run (each stops it with a message the model can read; the rollout goes on):

- CPU time: RLIMIT_CPU; the child's SIGXCPU handler exits with a CPU_EXIT status at the soft
  limit, the kernel's SIGKILL follows a second later if the code is stuck inside a C call;
- wall time: every process of the call is killed after `wall_s` (_sandbox_end.py);
- memory: RLIMIT_AS per process (a huge allocation fails with MemoryError inside the
  child); where a memory cgroup can be made (root, or cgroup v2 delegation) the call's
  memory in all, tmpfs, pipes and kernel memory included (`call_memory_mb`); elsewhere
  what lies outside RLIMIT_AS is bounded one by one: SysV IPC and POSIX message queues are
  refused (the IPC namespace's limits zero, the calls filtered), memfd_create too, /tmp and
  /scratch have a size, pipes and sockets come out of RLIMIT_NOFILE;
- output: stdout and stderr are pipes read here, at most `output_bytes` each; past that the
  pipe is closed (the child's next write fails) and the result says the output was cut.
  Files the code writes are bounded by RLIMIT_FSIZE = `output_bytes`;
- processes and threads: the seccomp filter (_sandbox_filter.py) refuses every new process
  (fork, vfork, clone without CLONE_THREAD) and every way out of the process group (setsid,
  setpgid, clearing the parent-death signal); threads are counted by RLIMIT_NPROC in the
  call's own user namespace (ordinary users) or by a per-call pids cgroup (root);
- open files (RLIMIT_NOFILE), inodes of /tmp and /scratch (tmpfs nr_inodes), queued signals
  (RLIMIT_SIGPENDING): set, never inherited;
- network: new network and PID namespaces (`unshare --map-root-user --net --pid --fork
  --kill-child`): no interface but a downed loopback ("Network is unreachable"); the filter
  allows only AF_UNIX, AF_INET, AF_INET6 and AF_NETLINK sockets (AF_VSOCK and the rest
  reach past a network namespace);
- files (confinement): with `--mount --ipc` added, the child builds its own file system
  before running the code (_sandbox_child.py): a private writable /scratch (the working
  directory and HOME) and /tmp (tmpfs), then a read-only view of what the interpreter needs
  (/usr and the merged-/usr symlinks, the loader's cache, this interpreter's prefixes with
  the standard library and site-packages, a virtual environment under /tmp included:
  `view()`), /dev's null, zero, full, random and urandom, and a read-only /proc of its PID
  namespace; it pivots into it, detaches the host's root and drops every capability. So
  writes outside /scratch and /tmp fail ("Read-only file system"), and the run directory,
  the checkout, the home directory, /etc and every other path do not exist for the code.
  File locks are no-ops (a lock on a file of the view would hold against the host), the
  keyring is a fresh anonymous one, and the filter refuses unshare, setns, mount, ptrace,
  bpf, io_uring and every call a computing program does not need; the 32-bit and x32
  system call entries kill the process. The environment holds only PATH, HOME and
  one-thread BLAS settings.

Nothing outlives a call: on its end, a timeout, an error or a cancelled call, the PID
namespace's init, the process group and the per-call cgroup are killed, and the call
returns only once they are seen gone (_sandbox_end.py).

Why this mechanism: namespaces, mount(2), pivot_root(2) and seccomp through ctypes: nothing
to install (bubblewrap, which does the same, is not on every machine; `unshare` is part of
util-linux), the same whether flowrl runs as root or not, and the view hides paths rather
than denying access to them (Landlock denies by path but gives no private /tmp or /proc).
The cost per call: bench/sandbox.py; docs/multi-turn.md.

Where the kernel does not allow it (no user namespaces, not Linux, a machine without a
filter written for it, or FLOWRL_SANDBOX_UNCONFINABLE set: `confinement()` says why) the
code runs unconfined in a scratch directory of the host, with the user's rights on every
file, under the unconfined variant of the filter where one exists (no socket at all,
signals only to itself): the agent node's `sandbox = "auto"` (the default) warns once,
`"required"` refuses (SandboxUnavailable; `flowrl check` reports it as an error). It is not
a VM: the code shares the host's kernel, and a kernel bug is an escape. For code you would
not run on the machine at all, the sandbox_fusion tool sends it to a sandbox service
(sandbox_service.py).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path

import attrs

from flowrl.agent.tools import _sandbox_end, _sandbox_filter
from flowrl.agent.tools._sandbox_end import GONE_S

UNCONFINABLE = "FLOWRL_SANDBOX_UNCONFINABLE"  # set: act as a machine that cannot confine
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
    processes: int = 16  # processes and threads together (RLIMIT_NPROC, pids cgroup)
    scratch_mb: int = 64  # of /scratch and of /tmp, each, in a confined run (tmpfs)
    scratch_inodes: int = 4096  # files and directories in each of /scratch and /tmp
    open_files: int = 64  # RLIMIT_NOFILE
    # all of a call's memory (processes, /tmp and /scratch, pipes, kernel memory) where a
    # memory cgroup can be made; 0: memory_mb + both tmpfs + 64 MB for pipes and the kernel
    call_memory_mb: int = 0

    @property
    def call_memory_bytes(self) -> int:
        megabytes = self.call_memory_mb or self.memory_mb + 2 * self.scratch_mb + 64
        return megabytes * 2**20


@attrs.frozen
class SandboxResult:
    stdout: str
    stderr: str
    status: str  # "ok", "error" (non-zero exit), "cpu", "timeout", "memory", "killed"
    returncode: int | None
    cut: bool = False  # stdout or stderr passed output_bytes: the rest was not read

    def message(self, limits: SandboxLimits) -> str:
        """What the model sees: the output, and why the run stopped if it did not finish."""
        out = self.stdout
        if self.stderr:
            out += ("\n" if out else "") + self.stderr
        reason = {
            "cpu": f"stopped: the code used more than {limits.cpu_s} s of CPU time",
            "timeout": f"stopped: the code ran longer than {limits.wall_s:g} s",
            "memory": f"stopped: the call used more than {limits.call_memory_bytes >> 20} MB of "
            "memory in all (its processes, files in /tmp and /scratch, pipes)",
            "killed": f"stopped: the process was killed (signal {-(self.returncode or 0)})",
        }.get(self.status)
        if self.returncode in (-signal.SIGSYS, 128 + signal.SIGSYS):
            reason = "stopped: the code made a system call the python tool does not allow"
        elif "Resource temporarily unavailable" in self.stderr:
            reason = "stopped: the python tool may not start processes"
        elif "can't start new thread" in self.stderr:
            reason = f"stopped: the code may run at most {limits.processes} threads"
        elif "MemoryError" in self.stderr:
            reason = f"stopped: the code needed more than {limits.memory_mb} MB of memory"
        elif self.cut:
            reason = f"output cut: more than {limits.output_bytes} bytes were written"
        elif "File too large" in self.stderr or "File too large" in self.stdout:
            reason = f"stopped: a file passed the {limits.output_bytes}-byte limit"
        if reason:
            out = f"{out.rstrip()}\n{reason}" if out.strip() else reason
        return out if out.strip() else "(no output)"


def unconfinable() -> bool:
    """FLOWRL_SANDBOX_UNCONFINABLE set (to anything but "" or "0"): this machine is treated as
    one that cannot confine, to see the notice or test the unconfined path."""
    return os.environ.get(UNCONFINABLE, "") not in ("", "0")


def isolation() -> tuple[str, ...]:
    """The command prefix that gives the child fresh network and PID namespaces, or ()
    where `unshare` cannot (no binary, user namespaces disabled, or `unconfinable()`)."""
    return () if unconfinable() else _isolation()


@functools.cache
def _isolation() -> tuple[str, ...]:
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    flags = ["--net", "--pid", "--fork", "--kill-child"]
    return _works((unshare, "--map-root-user", *flags))


@functools.cache
def tied_to_this_process() -> tuple[str, ...]:
    """The prefix that kills the child when this process dies (`setpriv --pdeathsig KILL`,
    util-linux), or () where setpriv cannot: then the child, started directly, sets its own
    parent-death signal, but a wrapper (`unshare`) outlives a killed flowrl and with it its
    child, until the CPU or a sleep ends."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return ()
    return _works((setpriv, "--pdeathsig", "KILL"))


def _works(prefix: tuple[str, ...]) -> tuple[str, ...]:
    """`prefix` when `prefix true` runs on this machine, else ()."""
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
    the view once and runs a one-line program in it under the seccomp filter (once per
    process: the first calls of a step, each on a thread of its own, wait for the one
    probe)."""
    if unconfinable():
        return Confinement(False, f"{UNCONFINABLE} is set; unset it to confine")
    with _PROBE:
        return _probe()


_PROBE = threading.Lock()
# what the probe prints confined: its working directory, and seccomp mode 2 (a filter)
PROBE = (
    "import os\nprint(os.getcwd())\n"
    "print(open('/proc/self/status').read().split('Seccomp:')[1].split()[0])"
)


@functools.cache
def _probe() -> Confinement:
    if sys.platform != "linux":
        return Confinement(False, f"it needs Linux's namespaces, and this is {sys.platform}")
    if platform.machine() not in _sandbox_filter.AUDIT_ARCH:
        return Confinement(False, f"no system call filter is written for {platform.machine()}")
    if shutil.which("unshare") is None:
        return Confinement(False, "`unshare` (util-linux) is not installed")
    if not isolation():
        return Confinement(False, "user namespaces are off: `unshare --map-root-user` fails")
    run_dir = Path(tempfile.mkdtemp(prefix="flowrl-python-"))
    try:
        command, env = _command(SandboxLimits(), run_dir, True, None)
        done = subprocess.run(
            command, input=PROBE.encode(), env=env, capture_output=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return Confinement(False, f"the probe failed: {e}")
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    if done.returncode == 0 and done.stdout == b"/scratch\n2\n":
        return Confinement(True)
    said = done.stderr.decode(errors="replace").strip().splitlines()
    printed = f"the probe exited {done.returncode}, printing {done.stdout[-80:]!r}"
    return Confinement(False, said[-1] if said else printed)


class SandboxUnavailable(RuntimeError):
    """sandbox = "required" on a machine where the code cannot be confined."""


def unconfined_notice(reason: str) -> str:
    said = (
        f"the python tool cannot confine its code on this machine ({reason}): the code "
        "a model writes runs with the rights of the user running flowrl, so it can read and "
        "write every file that user can (checkpoints, the scorer's source, flowrl's own "
        "files, credentials); "
    )
    if sys.platform == "linux" and platform.machine() in _sandbox_filter.AUDIT_ARCH:
        return said + (
            "a system call filter still refuses it every socket (no network, no Unix socket "
            "of this machine), new processes and signals to other processes, and its CPU, "
            "memory, output and time stay bounded"
        )
    return said + (
        f"no system call filter is written for {platform.machine()}, so only Python's socket "
        "module is replaced: code that calls the C library reaches the network and this "
        "machine's services (Ray's among them), and can start processes"
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
    confined to its view where `sandbox` and the machine allow (`use_view`). However the
    call ends (the code's own end, the wall clock, an error, a cancelled call: a tool
    timeout), every process it made is killed and seen gone before it returns
    (_sandbox_end.py)."""
    confined = use_view(sandbox)
    run_dir = Path(tempfile.mkdtemp(prefix="flowrl-python-"))
    group = _sandbox_end.call_cgroup(limits.processes, limits.call_memory_bytes)
    process, readers, ended = None, [], False
    try:
        command, env = _command(limits, run_dir, confined, group)
        pipes = [os.pipe(), os.pipe()]  # stdout, stderr: read here, at most output_bytes
        try:
            process = await asyncio.create_subprocess_exec(
                *command,
                stdin=subprocess.PIPE,
                stdout=pipes[0][1],
                stderr=pipes[1][1],
                start_new_session=True,  # its own process group, which it cannot leave
                env=env,
            )
        finally:
            for _, write_end in pipes:
                os.close(write_end)
            if process is None:
                for read_end, _ in pipes:
                    os.close(read_end)
        readers = [asyncio.ensure_future(_capped(r, limits.output_bytes)) for r, _ in pipes]
        try:
            returncode = await asyncio.wait_for(_feed(process, code), limits.wall_s)
            status = _status(returncode)
        except TimeoutError:
            status = "timeout"
        await _sandbox_end.reap(process, _sandbox_end.end(process, group), group)
        ended = True
        if group is not None and group.oom_kills:  # the kernel killed it: the call's memory
            status = "memory"
        output = asyncio.gather(*readers)  # at its end now: nothing holds the pipes
        (stdout, cut_out), (stderr, cut_err) = await asyncio.wait_for(output, GONE_S)
        stderr_text = _text(stderr, skip=("unshare: ",))
        cut = cut_out or cut_err
        return SandboxResult(_text(stdout), stderr_text, status, process.returncode, cut)
    finally:
        if process is not None and not ended:  # cancelled: leave nothing running
            inits = _sandbox_end.end(process, group)
            await asyncio.shield(_sandbox_end.reap(process, inits, group))
        elif process is None and group is not None:  # it never started
            group.remove()
        for reader in readers:
            reader.cancel()
        shutil.rmtree(run_dir, ignore_errors=True)


async def _feed(process, code: str) -> int:
    """Hand the code to the child on its standard input; its exit status."""
    try:
        process.stdin.write(code.encode())
        await process.stdin.drain()
        process.stdin.close()
    except (BrokenPipeError, ConnectionResetError):  # it ended before reading it all
        pass
    return await process.wait()


async def _capped(fd: int, limit: int) -> tuple[bytes, bool]:
    """(at most `limit` bytes read from the pipe `fd`, whether more came). Past the limit
    the pipe is closed: the child's next write fails (EPIPE), it cannot fill memory here."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", buffering=0)
    )
    data = bytearray()
    try:
        while len(data) <= limit:
            chunk = await reader.read(65536)
            if not chunk:
                return bytes(data), False
            data += chunk
        return bytes(data[:limit]), True
    finally:
        transport.close()


def _command(limits: SandboxLimits, run_dir: Path, confined: bool, group):
    """(the child's command line, its environment); its working directory under `run_dir`,
    and `group` the call's cgroup or None."""
    work = run_dir / "work"
    work.mkdir()
    prefix = isolation()
    settings = {
        "cpu_s": limits.cpu_s,
        "memory_bytes": limits.memory_mb * 2**20,
        "output_bytes": limits.output_bytes,
        "open_files": limits.open_files,
        "processes": limits.processes,
        "count_processes": confined,  # in a user namespace: RLIMIT_NPROC counts this call
        "parent": os.getpid(),  # the child, started directly, dies with it
        "cgroups": group.procs if group is not None else [],
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
            "scratch_inodes": limits.scratch_inodes,
        }
        prefix = (*prefix[:2], "--mount", "--ipc", *prefix[2:])
    command = [*prefix, sys.executable, "-I", str(CHILD), json.dumps(settings), str(work)]
    command = [*tied_to_this_process(), *command]
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


def _text(data: bytes, skip=()) -> str:
    """The output as text, without lines that start with `skip` (the wrapper's own
    complaints about its child's death)."""
    text = data.decode("utf-8", errors="replace")
    return "\n".join(line for line in text.splitlines() if not line.startswith(skip)).strip()
