"""The child side of sandbox.py: confine itself, set the limits, then run the code.

Run as `python -I _sandbox_child.py SETTINGS_JSON WORK_DIR`. With settings["view"] (inside
`unshare --map-root-user --mount ...`, so this process is root of a user namespace of its
own) it first builds its file system: a tmpfs root holding read-only binds of the paths the
parent lists, a private /scratch and /tmp, /dev's harmless nodes and a read-only /proc of its
PID namespace; pivots into it, detaches the old root, and drops every capability (bounding
set, securebits, capset), so neither it nor a program it executes can remount a read-only
bind writable or mount anything. Soft and hard limits are set equal (the CPU hard limit one
second later), so the code cannot raise them again. A seccomp filter then refuses every new
process (fork, vfork, clone without CLONE_THREAD; clone3 says ENOSYS so glibc falls back to
clone), new namespaces (unshare, setns) and the kernel's keyrings (add_key, request_key,
keyctl: the child inherits flowrl's session keyring): threads work, a fork bomb gets EAGAIN
on its first fork.
"""

import ctypes
import json
import os
import platform
import resource
import signal
import struct
import sys
import traceback

LIBC = ctypes.CDLL(None, use_errno=True)

# seccomp: syscall numbers and audit arch per machine (clone3 is 435 everywhere)
SYSCALLS = {
    "x86_64": (0xC000003E, {"clone": 56, "fork": 57, "vfork": 58, "unshare": 272, "setns": 308}),
    "aarch64": (0xC00000B7, {"clone": 220, "unshare": 97, "setns": 268}),
}
KEYS = {"x86_64": (248, 249, 250), "aarch64": (217, 218, 219)}  # add_key, request_key, keyctl
CLONE_THREAD, EPERM, EAGAIN, ENOSYS, CLONE3 = 0x10000, 1, 11, 38, 435
LOAD, JEQ, JSET, RET = 0x20, 0x15, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, ..|JSET|K, BPF_RET|K
ALLOW, ERRNO = 0x7FFF0000, 0x00050000


def seccomp_filter() -> bool:
    """Install the seccomp filter; False where the machine or kernel does not support it."""
    if platform.machine() not in SYSCALLS:
        return False
    arch, numbers = SYSCALLS[platform.machine()]
    refused = [(CLONE3, ENOSYS)] + [(numbers[n], EAGAIN) for n in ("fork", "vfork") if n in numbers]
    refused += [(numbers["unshare"], EPERM), (numbers["setns"], EPERM)]
    refused += [(number, EPERM) for number in KEYS[platform.machine()]]  # the keyrings it shares
    program = [(LOAD, 0, 0, 4), (JEQ, 0, 0, arch), (LOAD, 0, 0, 0)]  # jumps patched below
    program += [(JEQ, 0, 0, number) for number, _ in refused]
    clone = len(program)
    program += [(JEQ, 0, 0, numbers["clone"]), (LOAD, 0, 0, 16), (JSET, 0, 0, CLONE_THREAD)]
    allow = len(program)
    returns = {errno: allow + 1 + k for k, errno in enumerate((EAGAIN, ENOSYS, EPERM))}
    program += [(RET, 0, 0, ALLOW)] + [(RET, 0, 0, ERRNO | errno) for errno in returns]

    def jump(index, true, false):  # BPF jumps are relative to the next instruction
        code, _, _, k = program[index]
        program[index] = (code, true - index - 1, false - index - 1, k)

    jump(1, 2, allow)  # another architecture's calls are not ours to filter
    for k, (_, errno) in enumerate(refused):
        jump(3 + k, returns[errno], 4 + k)
    jump(clone, clone + 1, allow)
    jump(clone + 2, allow, returns[EAGAIN])  # a thread (CLONE_THREAD) is allowed, a process not
    filters = b"".join(struct.pack("HBBI", *instruction) for instruction in program)
    buffer = ctypes.create_string_buffer(filters)
    fprog = struct.pack("HL", len(program), ctypes.addressof(buffer))
    if LIBC.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        return False
    return LIBC.prctl(22, 2, ctypes.c_char_p(fprog), 0, 0) == 0  # PR_SET_SECCOMP, FILTER


# mount(2) flags; statvfs reports a mount's flags with the same values
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE, MNT_DETACH = 4096, 16384, 1 << 18, 2
LOCKED = 1 | 2 | 4 | 8 | 1024 | 2048 | 4096  # ro, nosuid, nodev, noexec, the atime flags
PROC = MS_NOSUID | MS_NODEV | MS_NOEXEC
DEVICES = ("null", "zero", "full", "random", "urandom")
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
    """Make the tmpfs at view["root"] this process's root: read-only binds of
    view["read_only"], view["symlinks"], /dev's harmless nodes, a private /tmp and /scratch
    (holding main.py), a read-only /proc of this PID namespace; the old root detached."""
    root, size = view["root"], f"size={view['scratch_mb']}m"
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here reaches the host
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    for path in view["read_only"]:
        _bind(path, root + path, MS_RDONLY)
    for path, target in view["symlinks"]:
        os.makedirs(os.path.dirname(root + path), exist_ok=True)
        os.symlink(target, root + path)
    for name in DEVICES:  # read-only: writing to a device works, chmod on it does not
        _bind(f"/dev/{name}", f"{root}/dev/{name}", MS_RDONLY | MS_NOSUID | MS_NOEXEC)
    for name, fd in (("fd", ""), ("stdin", "/0"), ("stdout", "/1"), ("stderr", "/2")):
        os.symlink(f"/proc/self/fd{fd}", f"{root}/dev/{name}")
    for path, mode in (("/tmp", "1777"), (SCRATCH, "0755")):
        os.makedirs(root + path, exist_ok=True)
        _mount("tmpfs", root + path, "tmpfs", MS_NOSUID | MS_NODEV, f"mode={mode},{size}")
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
        _mount(None, root + "/proc", None, MS_REMOUNT | MS_BIND | MS_RDONLY | PROC)
    _mount(None, root, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(root)
    _call("pivot_root", LIBC.pivot_root(b".", b"."))  # the old root now lies on top of "/"
    _call("umount the old root", LIBC.umount2(b".", MNT_DETACH))
    os.chdir(SCRATCH)
    drop_capabilities()


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


def main() -> None:
    settings, work = json.loads(sys.argv[1]), sys.argv[2]
    os.chdir(work)
    with open("main.py") as f:
        source = f.read()
    if settings["view"]:
        try:
            build_view(settings["view"], source)
        except (OSError, ValueError) as e:  # nothing runs outside the view
            said = e.strerror if isinstance(e, SetupError) else e  # without "[Errno n]"
            os.write(2, f"python tool: cannot confine the code ({said})\n".encode())
            os._exit(SETUP_EXIT)
        work = SCRATCH
    cpu = settings["cpu_s"]
    signal.signal(signal.SIGXCPU, _cpu_limit)  # at the soft limit; SIGKILL at the hard one
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (settings["memory_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (settings["output_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if settings["block_network"]:
        import socket

        socket.socket = socket.create_connection = socket.socketpair = _no_network
    if not seccomp_filter():  # RLIMIT_NPROC at least (it binds only users other than root)
        resource.setrlimit(resource.RLIMIT_NPROC, (settings["processes"],) * 2)
    sys.argv = ["main.py"]
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
