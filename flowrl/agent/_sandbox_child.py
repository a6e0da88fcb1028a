"""The child side of sandbox.py: set the limits on itself, then run the code.

Run as `python -I _sandbox_child.py SETTINGS_JSON WORK_DIR`. Soft and hard limits are set
equal (the CPU hard limit one second later), so the code cannot raise them again. A seccomp
filter then refuses every new process (fork, vfork, clone without CLONE_THREAD; clone3 says
ENOSYS so glibc falls back to clone): threads work, a fork bomb gets EAGAIN on its first fork.
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

# seccomp: syscall numbers and audit arch per machine (clone3 is 435 everywhere)
SYSCALLS = {
    "x86_64": (0xC000003E, {"clone": 56, "fork": 57, "vfork": 58}),
    "aarch64": (0xC00000B7, {"clone": 220}),
}
CLONE_THREAD, EAGAIN, ENOSYS, CLONE3 = 0x10000, 11, 38, 435
LOAD, JEQ, JSET, RET = 0x20, 0x15, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, ..|JSET|K, BPF_RET|K
ALLOW, ERRNO = 0x7FFF0000, 0x00050000


def no_new_processes() -> bool:
    """Install the seccomp filter; False where the machine or kernel does not support it."""
    if platform.machine() not in SYSCALLS:
        return False
    arch, numbers = SYSCALLS[platform.machine()]
    refuse = [numbers[n] for n in ("fork", "vfork") if n in numbers]
    program = [(LOAD, 0, 0, 4), (JEQ, 0, 0, arch), (LOAD, 0, 0, 0)]  # jf patched below
    program.append((JEQ, 0, 0, CLONE3))  # -> ENOSYS
    program += [(JEQ, 0, 0, n) for n in refuse]  # -> EAGAIN
    program += [(JEQ, 0, 0, numbers["clone"]), (LOAD, 0, 0, 16), (JSET, 0, 0, CLONE_THREAD)]
    allow, eagain, enosys = len(program), len(program) + 1, len(program) + 2
    program += [(RET, 0, 0, ALLOW), (RET, 0, 0, ERRNO | EAGAIN), (RET, 0, 0, ERRNO | ENOSYS)]

    def jump(index, true, false):  # BPF jumps are relative to the next instruction
        code, _, _, k = program[index]
        program[index] = (code, true - index - 1, false - index - 1, k)

    jump(1, 2, allow)  # another architecture's calls are not ours to filter
    jump(3, enosys, 4)
    for i in range(len(refuse)):
        jump(4 + i, eagain, 5 + i)
    clone = 4 + len(refuse)
    jump(clone, clone + 1, allow)
    jump(clone + 2, allow, eagain)  # a thread (CLONE_THREAD) is allowed, a process is not
    filters = b"".join(struct.pack("HBBI", *instruction) for instruction in program)
    buffer = ctypes.create_string_buffer(filters)
    fprog = struct.pack("HL", len(program), ctypes.addressof(buffer))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        return False
    return libc.prctl(22, 2, ctypes.c_char_p(fprog), 0, 0) == 0  # PR_SET_SECCOMP, FILTER


CPU_EXIT = 124  # the exit code that tells the parent the CPU limit stopped the code


def _cpu_limit(signum, frame):
    os.write(2, b"\nCPU time limit reached\n")
    os._exit(CPU_EXIT)


def _no_network(*args, **kwargs):
    raise PermissionError("network access is disabled in the python tool")


def main() -> None:
    settings, work = json.loads(sys.argv[1]), sys.argv[2]
    os.chdir(work)
    cpu = settings["cpu_s"]
    signal.signal(signal.SIGXCPU, _cpu_limit)  # at the soft limit; SIGKILL at the hard one
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (settings["memory_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (settings["output_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if settings["block_network"]:
        import socket

        socket.socket = socket.create_connection = socket.socketpair = _no_network
    if not no_new_processes():  # RLIMIT_NPROC at least (it binds only users other than root)
        resource.setrlimit(resource.RLIMIT_NPROC, (settings["processes"],) * 2)
    sys.argv = ["main.py"]
    sys.path.insert(0, work)
    with open("main.py") as f:
        code = compile(f.read(), "main.py", "exec")
    try:
        exec(code, {"__name__": "__main__", "__file__": "main.py"})
    except SystemExit:
        raise
    except BaseException as e:  # the traceback from the code's own frames on
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        sys.exit(1)


if __name__ == "__main__":
    main()
