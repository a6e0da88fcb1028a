"""The python tool's seccomp filter: an allowlist of the system calls a Python program needs,
as a classic BPF program that the child (_sandbox_child.py) installs before the code runs.

In order, for every call the code makes (any thread, after any execve):

1. its architecture is the machine's own (AUDIT_ARCH_X86_64 or AUDIT_ARCH_AARCH64), else the
   process is killed: on x86-64 the 32-bit entry (`int 0x80`, `sysenter`) reaches the kernel
   with AUDIT_ARCH_I386 and its own numbering, on arm64 AArch32 code with AUDIT_ARCH_ARM;
2. on x86-64, a number with the x32 bit (0x40000000) kills the process;
3. calls judged by their arguments: clone makes threads only (CLONE_THREAD, no namespace
   flag; a process gets EAGAIN), prctl may not clear or change the parent-death signal,
   fcntl's and flock's locks succeed and lock nothing (a lock taken on a file of the
   read-only view would hold against the host and other calls), a lease is refused, and
   socket opens only AF_UNIX, AF_INET, AF_INET6 and AF_NETLINK sockets (AF_VSOCK and the
   others reach past a network namespace). Unconfined (no namespaces), socket is refused
   outright and signals go only to the process itself;
4. calls refused with a telling errno: fork and vfork (EAGAIN), clone3 (ENOSYS: the C
   library falls back to clone), setsid and setpgid (the process group is how a call is
   killed), unshare and setns, the keyrings (EPERM);
5. the allowlist below; every other call fails with ENOSYS, as on a kernel without it:
   mount and its kin, ptrace, bpf, perf_event_open, io_uring (whose operations bypass this
   filter), userfaultfd, SysV and POSIX IPC, memfd_create, fallocate, inotify, personality,
   modify_ldt, process_vm_*, pidfd_*, the set*id calls, POSIX timers (kernel memory no
   limit bounds: setitimer and timerfd remain), membarrier and everything else a program
   that computes does not need.

The numbers come from the kernel's uapi headers (asm/unistd_64.h for x86-64,
asm-generic/unistd.h for arm64; Linux 6.1). A machine not in AUDIT_ARCH gets no filter, and
the sandbox then claims no confinement (sandbox.py).
"""

import ctypes
import platform
import struct

AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
COLUMN = {"x86_64": 0, "aarch64": 1}
X32_BIT = 0x40000000
# name: (x86-64 number, arm64 number or None where arm64 has no such call)
# fmt: off
NUMBERS = {
    "read": (0, 63), "write": (1, 64), "open": (2, None), "close": (3, 57), "stat": (4, None),
    "fstat": (5, 80), "lstat": (6, None), "poll": (7, None), "lseek": (8, 62), "mmap": (9, 222),
    "mprotect": (10, 226), "munmap": (11, 215), "brk": (12, 214), "rt_sigaction": (13, 134),
    "rt_sigprocmask": (14, 135), "rt_sigreturn": (15, 139), "ioctl": (16, 29),
    "pread64": (17, 67), "pwrite64": (18, 68), "readv": (19, 65), "writev": (20, 66),
    "access": (21, None), "pipe": (22, None), "select": (23, None), "sched_yield": (24, 124),
    "mremap": (25, 216), "msync": (26, 227), "mincore": (27, 232), "madvise": (28, 233),
    "dup": (32, 23), "dup2": (33, None), "pause": (34, None), "nanosleep": (35, 101),
    "getitimer": (36, 102), "alarm": (37, None), "setitimer": (38, 103), "getpid": (39, 172),
    "sendfile": (40, 71), "socket": (41, 198), "connect": (42, 203), "accept": (43, 202),
    "sendto": (44, 206), "recvfrom": (45, 207), "sendmsg": (46, 211), "recvmsg": (47, 212),
    "shutdown": (48, 210), "bind": (49, 200), "listen": (50, 201), "getsockname": (51, 204),
    "getpeername": (52, 205), "socketpair": (53, 199), "setsockopt": (54, 208),
    "getsockopt": (55, 209), "clone": (56, 220), "fork": (57, None), "vfork": (58, None),
    "execve": (59, 221), "exit": (60, 93), "wait4": (61, 260), "kill": (62, 129),
    "uname": (63, 160), "fcntl": (72, 25), "flock": (73, 32), "fsync": (74, 82),
    "fdatasync": (75, 83), "truncate": (76, 45), "ftruncate": (77, 46), "getdents": (78, None),
    "getcwd": (79, 17), "chdir": (80, 49), "fchdir": (81, 50), "rename": (82, None),
    "mkdir": (83, None), "rmdir": (84, None), "creat": (85, None), "link": (86, None),
    "unlink": (87, None), "symlink": (88, None), "readlink": (89, None), "chmod": (90, None),
    "fchmod": (91, 52), "umask": (95, 166), "gettimeofday": (96, 169), "getrlimit": (97, 163),
    "getrusage": (98, 165), "sysinfo": (99, 179), "times": (100, 153), "getuid": (102, 174),
    "getgid": (104, 176), "geteuid": (107, 175), "getegid": (108, 177), "getppid": (110, 173),
    "getpgrp": (111, None), "getgroups": (115, 158), "getresuid": (118, 148),
    "getresgid": (120, 150), "getpgid": (121, 155), "getsid": (124, 156), "capget": (125, 90),
    "rt_sigpending": (127, 136), "rt_sigtimedwait": (128, 137), "rt_sigqueueinfo": (129, 138),
    "rt_sigsuspend": (130, 133), "sigaltstack": (131, 132), "utime": (132, None),
    "mknod": (133, None), "statfs": (137, 43), "fstatfs": (138, 44), "getpriority": (140, 141),
    "sched_getparam": (143, 121), "sched_getscheduler": (145, 120),
    "sched_get_priority_max": (146, 125), "sched_get_priority_min": (147, 126),
    "sched_rr_get_interval": (148, 127), "prctl": (157, 167), "arch_prctl": (158, None),
    "setrlimit": (160, 164), "gettid": (186, 178), "readahead": (187, 213), "getxattr": (191, 8),
    "lgetxattr": (192, 9), "fgetxattr": (193, 10), "listxattr": (194, 11),
    "llistxattr": (195, 12), "flistxattr": (196, 13), "tkill": (200, 130), "time": (201, None),
    "futex": (202, 98), "sched_setaffinity": (203, 122), "sched_getaffinity": (204, 123),
    "getdents64": (217, 61), "set_tid_address": (218, 96), "restart_syscall": (219, 128),
    "fadvise64": (221, 223), "timer_create": (222, 107), "timer_settime": (223, 110),
    "timer_gettime": (224, 108), "timer_getoverrun": (225, 109), "timer_delete": (226, 111),
    "clock_gettime": (228, 113), "clock_getres": (229, 114), "clock_nanosleep": (230, 115),
    "exit_group": (231, 94), "epoll_wait": (232, None), "epoll_ctl": (233, 21),
    "tgkill": (234, 131), "utimes": (235, None), "waitid": (247, 95), "openat": (257, 56),
    "mkdirat": (258, 34), "mknodat": (259, 33), "futimesat": (261, None), "newfstatat": (262, 79),
    "unlinkat": (263, 35), "renameat": (264, 38), "linkat": (265, 37), "symlinkat": (266, 36),
    "readlinkat": (267, 78), "fchmodat": (268, 53), "faccessat": (269, 48), "pselect6": (270, 72),
    "ppoll": (271, 73), "set_robust_list": (273, 99), "get_robust_list": (274, 100),
    "splice": (275, 76), "tee": (276, 77), "vmsplice": (278, 75), "utimensat": (280, 88),
    "epoll_pwait": (281, 22), "signalfd": (282, None), "timerfd_create": (283, 85),
    "eventfd": (284, None), "timerfd_settime": (286, 86), "timerfd_gettime": (287, 87),
    "accept4": (288, 242), "signalfd4": (289, 74), "eventfd2": (290, 19),
    "epoll_create": (213, None), "epoll_create1": (291, 20), "dup3": (292, 24),
    "pipe2": (293, 59), "preadv": (295, 69), "pwritev": (296, 70),
    "rt_tgsigqueueinfo": (297, 240), "recvmmsg": (299, 243), "prlimit64": (302, 261),
    "sendmmsg": (307, 269), "getcpu": (309, 168), "getrandom": (318, 278),
    "renameat2": (316, 276), "execveat": (322, 281), "membarrier": (324, 283),
    "copy_file_range": (326, 285), "preadv2": (327, 286), "pwritev2": (328, 287),
    "statx": (332, 291), "rseq": (334, 293), "close_range": (436, 436), "openat2": (437, 437),
    "faccessat2": (439, 439), "epoll_pwait2": (441, 441), "futex_waitv": (449, 449),
    "sched_getattr": (315, 275), "setsid": (112, 157), "setpgid": (109, 154),
    "unshare": (272, 97), "setns": (308, 268), "clone3": (435, 435), "add_key": (248, 217),
    "request_key": (249, 218), "keyctl": (250, 219),
    "fchmodat2": (452, 452), "seccomp": (317, 277), "chown": (92, None), "fchown": (93, 55),
    "lchown": (94, None), "fchownat": (260, 54),
}
# fmt: on

# the calls allowed as they are (those judged by their arguments are in `program`)
ALLOWED = """
read write open openat openat2 close close_range creat lseek pread64 pwrite64 readv writev
preadv pwritev preadv2 pwritev2 sendfile splice tee vmsplice copy_file_range readahead
fadvise64 stat fstat lstat newfstatat statx statfs fstatfs access faccessat faccessat2
getdents getdents64 getcwd chdir fchdir rename renameat renameat2 mkdir mkdirat rmdir link
linkat unlink unlinkat symlink symlinkat readlink readlinkat chmod fchmod fchmodat fchmodat2
mknod mknodat chown fchown lchown fchownat umask truncate ftruncate fsync fdatasync utime
utimes utimensat futimesat
getxattr lgetxattr fgetxattr listxattr llistxattr flistxattr ioctl dup dup2 dup3 pipe pipe2
poll ppoll select pselect6 epoll_create epoll_create1 epoll_ctl epoll_wait epoll_pwait
epoll_pwait2 eventfd eventfd2 signalfd signalfd4 timerfd_create timerfd_settime
timerfd_gettime mmap munmap mprotect mremap msync mincore madvise brk rt_sigaction
rt_sigprocmask rt_sigreturn rt_sigpending rt_sigtimedwait rt_sigsuspend sigaltstack pause
nanosleep clock_nanosleep clock_gettime clock_getres gettimeofday time times getitimer
setitimer alarm futex
futex_waitv set_robust_list get_robust_list set_tid_address rseq arch_prctl
sched_yield sched_getaffinity sched_setaffinity sched_getparam sched_getscheduler
sched_getattr sched_get_priority_max sched_get_priority_min sched_rr_get_interval getcpu
getpriority getrandom uname sysinfo getrusage getrlimit setrlimit prlimit64 capget getpid
getppid gettid getuid geteuid getgid getegid getresuid getresgid getgroups getpgrp getpgid
getsid execve execveat wait4 waitid exit exit_group restart_syscall connect accept accept4
bind listen shutdown getsockname getpeername socketpair setsockopt getsockopt sendto
recvfrom sendmsg recvmsg sendmmsg recvmmsg
""".split()
# refused with the errno a program understands
REFUSED = {"fork": 11, "vfork": 11, "clone3": 38, "setsid": 1, "setpgid": 1, "unshare": 1}
REFUSED |= {"setns": 1, "add_key": 1, "request_key": 1, "keyctl": 1}
EPERM, EAGAIN, EACCES, ENOSYS, EAFNOSUPPORT = 1, 11, 13, 38, 97
CLONE_THREAD = 0x10000
NAMESPACES = 0x80 | 0x20000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000
NAMESPACES |= 0x40000000  # CLONE_NEWTIME, NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
PR_SET_PDEATHSIG, F_SETLEASE = 1, 1024
LOCKS = (6, 7, 37, 38)  # F_SETLK, F_SETLKW, F_OFD_SETLK, F_OFD_SETLKW (64-bit: no *64 forms)
FAMILIES = (1, 2, 10, 16)  # AF_UNIX, AF_INET, AF_INET6, AF_NETLINK
SIGNALS = ("kill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo")  # arg 0: the process
# classic BPF (linux/filter.h, linux/seccomp.h)
LOAD, JEQ, JSET, RET = 0x20, 0x15, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, ..|JSET|K, BPF_RET|K
NR, ARCH, ARG = 0, 4, (16, 24)  # offsets in seccomp_data; an argument's low 32 bits (little endian)
ALLOW, ERRNO, KILL = 0x7FFF0000, 0x00050000, 0x80000000  # KILL: SECCOMP_RET_KILL_PROCESS


def program(machine: str, own_pid: int | None = None) -> list[tuple[int, int, int, int]]:
    """The filter's instructions for `machine`; with `own_pid`, the unconfined variant (no
    socket, signals only to that process)."""
    number = {name: pair[COLUMN[machine]] for name, pair in NUMBERS.items()}
    code = [(LOAD, 0, 0, ARCH), (JEQ, 1, 0, AUDIT_ARCH[machine]), (RET, 0, 0, KILL)]
    code += [(LOAD, 0, 0, NR)]
    if machine == "x86_64":
        code += [(JSET, 0, 1, X32_BIT), (RET, 0, 0, KILL)]

    def on(name, *body):  # `body` judges this call; the others jump past it, A still nr
        if number[name] is not None:  # labels starting with "." are the block's own
            code.extend([(JEQ, 0, ".next", number[name]), *body, ".next"])
            for k in range(len(code) - len(body) - 2, len(code)):
                code[k] = _local(code[k], name)

    allow, eperm = [".allow", (RET, 0, 0, ALLOW)], [".eperm", (RET, 0, 0, ERRNO | EPERM)]
    load = [(LOAD, 0, 0, ARG[0])]
    on(
        "clone",
        *load,
        (JSET, ".eperm", 0, NAMESPACES),
        (JSET, ".allow", ".eagain", CLONE_THREAD),
        *allow,
        ".eagain",
        (RET, 0, 0, ERRNO | EAGAIN),
        *eperm,
    )
    on("prctl", *load, (JEQ, ".eperm", ".allow", PR_SET_PDEATHSIG), *allow, *eperm)
    locks = [(JEQ, ".unlocked", 0, k) for k in LOCKS]
    on(
        "fcntl",
        (LOAD, 0, 0, ARG[1]),
        *locks,
        (JEQ, ".eperm", ".allow", F_SETLEASE),
        *allow,
        ".unlocked",
        (RET, 0, 0, ERRNO | 0),
        *eperm,
    )
    on("flock", (RET, 0, 0, ERRNO | 0))
    if own_pid is None:  # signals reach only the call's own PID namespace
        families = [(JEQ, ".allow", 0, family) for family in FAMILIES]
        on("socket", *load, *families, (RET, 0, 0, ERRNO | EAFNOSUPPORT), *allow)
        for name in (*SIGNALS, "tkill"):
            on(name, (RET, 0, 0, ALLOW))
    else:
        on("socket", (RET, 0, 0, ERRNO | EACCES))
        on("tkill", (RET, 0, 0, ERRNO | EPERM))
        for name in SIGNALS:
            mine = (JEQ, ".allow", 0, own_pid)  # itself, or (kill) its own group: 0
            on(name, *load, mine, (JEQ, ".allow", ".eperm", 0), *allow, *eperm)
    for name, errno in REFUSED.items():
        on(name, (RET, 0, 0, ERRNO | errno))
    code += [(JEQ, "allow", 0, number[name]) for name in ALLOWED if number[name] is not None]
    code += [(RET, 0, 0, ERRNO | ENOSYS), "allow", (RET, 0, 0, ALLOW)]
    return _resolve(code)


def _local(item, name):
    """A block's labels, made its own: ".x" -> "clone.x"."""
    if isinstance(item, str):
        return name + item if item.startswith(".") else item
    code, jt, jf, k = item
    jt, jf = (name + j if isinstance(j, str) and j.startswith(".") else j for j in (jt, jf))
    return (code, jt, jf, k)


def _resolve(code) -> list[tuple[int, int, int, int]]:
    """Labels to jumps: BPF jumps are forward, relative to the next instruction, at most 255."""
    where, instructions = {}, []
    for item in code:
        if isinstance(item, str):
            where[item] = len(instructions)
        else:
            instructions.append(item)
    out = []
    for index, (op, jt, jf, k) in enumerate(instructions):
        jt, jf = (where[j] - index - 1 if isinstance(j, str) else j for j in (jt, jf))
        if not (0 <= jt <= 255 and 0 <= jf <= 255):
            raise ValueError(f"instruction {index}: a jump of {jt} or {jf} does not fit")
        out.append((op, jt, jf, k))
    return out


def install(own_pid: int | None = None) -> str:
    """Install the filter on every thread of this process (it holds for what it executes
    too); "" when done, else why not."""
    machine = platform.machine()
    if machine not in AUDIT_ARCH:
        return f"no system call table for this machine ({machine})"
    instructions = program(machine, own_pid)
    packed = b"".join(struct.pack("HBBI", *instruction) for instruction in instructions)
    buffer = ctypes.create_string_buffer(packed)
    fprog = struct.pack("HL", len(instructions), ctypes.addressof(buffer))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS: no setuid gain past this
        return f"PR_SET_NO_NEW_PRIVS failed (errno {ctypes.get_errno()})"
    seccomp = NUMBERS["seccomp"][COLUMN[machine]]
    # SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC: every thread, or none
    if libc.syscall(seccomp, 1, 1, ctypes.c_char_p(fprog)) != 0:
        return f"the seccomp filter was refused (errno {ctypes.get_errno()})"
    return ""
