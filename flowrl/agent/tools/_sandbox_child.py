"""The child side of sandbox.py: confine itself, set the limits, then run the code.

Run as `python -I _sandbox_child.py SETTINGS_JSON WORK_DIR`, the code on standard input. In
order, each step before the code runs, nothing run where one fails:

1. join the per-call cgroups in settings["cgroups"] (pids.max bounds processes and threads
   where RLIMIT_NPROC does not: for root; a memory limit bounds all the call's memory);
2. die with flowrl (PR_SET_PDEATHSIG), and join a fresh, anonymous session keyring (the
   one inherited is the trainer's);
3. with settings["view"] (inside `unshare --map-root-user --mount ...`, so this process is
   root of a user namespace of its own), build its file system: a tmpfs root holding
   read-only binds of the paths the parent lists, a private /scratch and /tmp (size and
   inode limits), /dev's harmless nodes and a read-only /proc of its PID namespace; set the
   IPC namespace's limits to zero; pivot into it, detach the old root, and drop every
   capability (bounding set, securebits, capset), so neither it nor a program it executes
   can remount a read-only bind writable or mount anything;
4. the limits, soft and hard equal (the CPU hard limit one second later), so the code cannot
   raise them again: CPU, address space, file size, open files, no core, no locked memory,
   no message queues, 64 pending signals, and processes and threads (RLIMIT_NPROC, where a
   user namespace counts them per call);
5. the seccomp filter (_sandbox_filter.py): an allowlist, the 32-bit and x32 entries kill
   the process, no new process, no leaving the process group or clearing the parent-death
   signal. Confined, a run without it does not start.
"""

import ctypes
import json
import os
import resource
import signal
import struct
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I left it out
import _sandbox_filter  # noqa: E402 (the filter, beside this file)

LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.syscall.restype = ctypes.c_long
KEYCTL_JOIN_SESSION_KEYRING = 1
PENDING_SIGNALS = 64  # RLIMIT_SIGPENDING
# the IPC namespace's limits: no SysV shared memory, message queue or semaphore set
IPC_LIMITS = {"shmmax": "0", "shmall": "0", "shmmni": "0", "msgmni": "0", "sem": "0 0 0 0"}


# mount(2) flags; statvfs reports a mount's flags with the same values
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE, MNT_DETACH = 4096, 16384, 1 << 18, 2
LOCKED = 1 | 2 | 4 | 8 | 1024 | 2048 | 4096  # ro, nosuid, nodev, noexec, the atime flags
PROC = MS_NOSUID | MS_NODEV | MS_NOEXEC
DEVICES = ("null", "zero", "full", "random", "urandom")
# /proc files shown as empty: every key's name on the machine, timers and scheduler state
MASKED = ("keys", "key-users", "timer_list", "sched_debug", "kcore", "latency_stats")
SCRATCH = "/scratch"  # the working directory inside the view
SETUP_EXIT = 125  # the view could not be built: nothing was run


class SetupError(OSError):
    pass


def _call(what: str, result: int) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise SetupError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source, target, fstype, flags, data=None) -> None:
    args = (source, target, fstype, data)
    encoded = [None if s is None else s.encode() for s in args]
    result = LIBC.mount(*encoded[:3], flags, encoded[3])
    _call(f"mount {source or ''} on {target}", result)


def _bind(source: str, target: str, flags: int) -> None:
    """Bind `source` at `target` (made as a directory or an empty file), then remount it with
    `flags` on top of the flags it has (a remount that dropped them is refused)."""
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    _mount(source, target, None, MS_BIND)
    kept = os.statvfs(target).f_flag & LOCKED
    _mount(None, target, None, MS_REMOUNT | MS_BIND | kept | flags)


def build_view(view: dict, code: str) -> None:
    """Make the tmpfs at view["root"] this process's root: a private /tmp and /scratch
    (holding main.py), read-only binds of view["read_only"] (after /tmp, so a virtual
    environment under /tmp shows), view["symlinks"], /dev's harmless nodes, a read-only
    /proc of this PID namespace; the IPC limits zero; the old root detached."""
    root = view["root"]
    limits = f"size={view['scratch_mb']}m,nr_inodes={view['scratch_inodes']}"
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here reaches the host
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m,nr_inodes=4096")
    for path, mode in (("/tmp", "1777"), (SCRATCH, "0755")):
        os.makedirs(root + path, exist_ok=True)
        _mount("tmpfs", root + path, "tmpfs", MS_NOSUID | MS_NODEV, f"mode={mode},{limits}")
    for path in view["read_only"]:
        _bind(path, root + path, MS_RDONLY)
    for path, target in view["symlinks"]:
        os.makedirs(os.path.dirname(root + path), exist_ok=True)
        os.symlink(target, root + path)
    for name in DEVICES:  # read-only: writing to a device works, chmod on it does not
        _bind(f"/dev/{name}", f"{root}/dev/{name}", MS_RDONLY | MS_NOSUID | MS_NOEXEC)
    for name, fd in (("fd", ""), ("stdin", "/0"), ("stdout", "/1"), ("stderr", "/2")):
        os.symlink(f"/proc/self/fd{fd}", f"{root}/dev/{name}")
    with open(root + SCRATCH + "/main.py", "w") as f:
        f.write(code)
    os.makedirs(root + "/etc", exist_ok=True)
    with open(root + "/etc/passwd", "w") as f:  # who `getpass` and `pwd` say this is
        f.write(f"root:x:0:0:root:{SCRATCH}:/bin/sh\n")
    with open(root + "/etc/group", "w") as f:
        f.write("root:x:0:\n")
    os.makedirs(root + "/proc")
    try:
        _mount("proc", root + "/proc", "proc", PROC)
    except SetupError:  # a container that hides parts of its /proc: the view has none
        pass
    else:  # read-only, or no run at all
        _zero_ipc_limits(root + "/proc/sys/kernel/")
        for name in MASKED:  # what other users' processes and the kernel hold
            if os.path.exists(f"{root}/proc/{name}"):
                _mount("/dev/null", f"{root}/proc/{name}", None, MS_BIND)
        _mount(None, root + "/proc", None, MS_REMOUNT | MS_BIND | MS_RDONLY | PROC)
    _mount(None, root, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(root)
    _call("pivot_root", LIBC.pivot_root(b".", b"."))  # the old root now lies on top of "/"
    _call("umount the old root", LIBC.umount2(b".", MNT_DETACH))
    os.chdir(SCRATCH)
    drop_capabilities()


def _zero_ipc_limits(kernel: str) -> None:
    """No SysV shared memory, message queue or semaphore in this IPC namespace (its memory
    would lie outside RLIMIT_AS). The filter refuses the calls too: a kernel that does not
    let a user namespace's root set these (before 5.19) is covered by that."""
    for name, value in IPC_LIMITS.items():
        try:
            with open(kernel + name, "w") as f:
                f.write(value)
        except OSError:
            pass


def drop_capabilities() -> None:
    """No capability now or after an execve: securebits keep root from regaining them, the
    bounding set is emptied, then every set is cleared."""
    _call("securebits", LIBC.prctl(28, 0xEF, 0, 0, 0))  # NOROOT, NO_SETUID_FIXUP, ..., locked
    for capability in range(64):
        if LIBC.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP; EINVAL past the last
            break
    LIBC.prctl(47, 4, 0, 0, 0)  # PR_CAP_AMBIENT_CLEAR_ALL
    header = struct.pack("Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    _call("capset", LIBC.capset(header, bytes(24)))


CPU_EXIT = 124  # the exit code that tells the parent the CPU limit stopped the code


def _cpu_limit(signum, frame):
    os.write(2, b"\nCPU time limit reached\n")
    os._exit(CPU_EXIT)


def _no_network(*args, **kwargs):
    raise PermissionError("network access is disabled in the python tool")


def join_cgroups(procs: list[str]) -> None:
    """Move this process into the per-call cgroups whose cgroup.procs files are `procs`."""
    for path in procs:
        with open(path, "w") as f:
            f.write("0")  # this process


def die_with_parent(flowrl: int) -> None:
    """SIGKILL when the process that started this one dies: flowrl, or a wrapper (unshare)
    that dies with flowrl (`setpriv --pdeathsig`). Kept through execve; the filter refuses to
    clear it. Started by flowrl itself, and flowrl gone already: exit. (The init of a PID
    namespace sees its parent as 0.)"""
    _call("PR_SET_PDEATHSIG", LIBC.prctl(1, signal.SIGKILL, 0, 0, 0))
    if os.getppid() not in (flowrl, 0):
        raise ValueError("flowrl, which started it, is gone")


def fresh_keyring() -> None:
    """A new anonymous session keyring: the inherited one is the trainer's (and shared by
    every call). The filter refuses the keyring calls after this; where the kernel has no
    keyrings there is nothing to leave."""
    machine = os.uname().machine
    if machine in _sandbox_filter.COLUMN:  # elsewhere the number is not known here
        keyctl = _sandbox_filter.NUMBERS["keyctl"][_sandbox_filter.COLUMN[machine]]
        LIBC.syscall(keyctl, KEYCTL_JOIN_SESSION_KEYRING, None)


def set_limits(settings: dict) -> None:
    """Soft and hard limits equal (the CPU hard one a second later): the code cannot raise
    them."""
    cpu = settings["cpu_s"]
    signal.signal(signal.SIGXCPU, _cpu_limit)  # at the soft limit; SIGKILL at the hard one
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    limits = {
        resource.RLIMIT_AS: settings["memory_bytes"],
        resource.RLIMIT_FSIZE: settings["output_bytes"],
        resource.RLIMIT_NOFILE: settings["open_files"],
        resource.RLIMIT_CORE: 0,
        resource.RLIMIT_MEMLOCK: 0,
        resource.RLIMIT_MSGQUEUE: 0,
        resource.RLIMIT_SIGPENDING: PENDING_SIGNALS,  # each queued signal is kernel memory
    }
    if settings["count_processes"]:  # in a user namespace of its own: this call's count
        limits[resource.RLIMIT_NPROC] = settings["processes"]
    for which, value in limits.items():
        resource.setrlimit(which, (value, value))


def setup(settings: dict, work: str, source: str) -> str:
    """Every step of the module docstring before the code; returns the working directory.
    Raises OSError or ValueError where one fails."""
    join_cgroups(settings["cgroups"])
    die_with_parent(settings["parent"])
    fresh_keyring()
    if settings["view"]:
        build_view(settings["view"], source)
        work = SCRATCH
    else:
        os.chdir(work)
        with open("main.py", "w") as f:
            f.write(source)
        if os.geteuid() == 0:  # unconfined root keeps root's files, not its capabilities
            drop_capabilities()  # (CAP_SYS_RESOURCE would raise every limit below)
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)  # the parent's pipe, read to its end, goes
    os.close(null)
    set_limits(settings)
    if settings["view"]:
        said = _sandbox_filter.install()
        if said:
            raise ValueError(said)
    else:  # no namespaces: no socket at all, and signals only to itself
        import socket

        socket.socket = socket.create_connection = socket.socketpair = _no_network
        if _sandbox_filter.install(own_pid=os.getpid()):  # no filter: RLIMIT_NPROC at least
            resource.setrlimit(resource.RLIMIT_NPROC, (settings["processes"],) * 2)
    return work


def main() -> None:
    settings, work = json.loads(sys.argv[1]), sys.argv[2]
    source = sys.stdin.read()
    try:
        work = setup(settings, work, source)
    except (OSError, ValueError) as e:  # nothing runs unconfined that should be confined
        said = e.strerror if isinstance(e, SetupError) else e  # without "[Errno n]"
        os.write(2, f"python tool: cannot confine the code ({said})\n".encode())
        os._exit(SETUP_EXIT)
    sys.argv = ["main.py"]
    sys.stdout.reconfigure(line_buffering=True)  # what it printed before a stop comes back
    sys.path.insert(0, work)
    code = compile(source, "main.py", "exec")
    try:
        exec(code, {"__name__": "__main__", "__file__": "main.py"})
    except SystemExit:
        raise
    except BaseException as e:  # the traceback from the code's own frames on
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        sys.exit(1)


if __name__ == "__main__":
    main()
