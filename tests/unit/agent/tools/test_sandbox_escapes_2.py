"""Code written by someone who has read the sandbox's source, trying its side entrances: the
32-bit and x32 system call entries, leaving the process group to outlive the call, host
objects within reach (descriptors, keyrings, file locks), and resources no limit covered.
Each case makes the attempt for real through the tool's own entry (`run_python`) and checks
the host afterwards: which processes are alive, whether a lock or a connection got through.
A case that needs something this kernel lacks (32-bit emulation, confinement) skips, saying
which."""

import asyncio
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from flowrl.agent.tools import _sandbox_end, _sandbox_filter, sandbox
from flowrl.agent.tools.sandbox import SandboxLimits, run_python

LIMITS = SandboxLimits(cpu_s=2, wall_s=20.0, memory_mb=256, output_bytes=4000)
X86_64 = sys.platform == "linux" and os.uname().machine == "x86_64"
# a function of (number, a, b, c) that makes an i386 system call through `int 0x80`, machine
# code written into an executable mapping: push rbx; eax, ebx, ecx, edx = the arguments
INT80 = """
import ctypes, mmap
CODE = bytes.fromhex("53" "89f8" "89f3" "4189c8" "89d1" "4489c2" "cd80" "5b" "c3")
page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
page.write(CODE)
address = ctypes.addressof(ctypes.c_char.from_buffer(page))
call32 = ctypes.CFUNCTYPE(*[ctypes.c_int] * 5)(address)
"""


def attempt(code: str, limits: SandboxLimits = LIMITS):
    return asyncio.run(run_python(code, limits))


def needs_confinement():
    state = sandbox.confinement()
    if not state.available:
        pytest.skip(f"no confinement here: {state.reason}")


def needs_32_bit_entry():
    if not X86_64:
        pytest.skip("the 32-bit entry is x86-64's")
    probe = INT80 + "import os\nassert call32(20, 0, 0, 0) == os.getpid()  # i386 getpid\n"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=30)
    if done.returncode != 0:  # SIGSEGV: the kernel has no IA32 emulation
        pytest.skip(f"this kernel has no 32-bit entry (the probe ended {done.returncode})")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("what", "number", "args"),
    [
        ("fork", 2, (0, 0, 0)),
        ("clone, new user and PID namespaces", 120, (0x10000000 | 0x20000000 | 17, 0, 0)),
        ("unshare a user namespace", 310, (0x10000000, 0, 0)),
        ("setsid", 66, (0, 0, 0)),
        ("keyctl: read the session keyring", 288, (11, 0xFFFFFFFD, 0)),
        ("getpid, harmless", 20, (0, 0, 0)),
    ],
)
def test_the_32_bit_entry_kills_the_child(what, number, args):
    needs_32_bit_entry()
    code = INT80 + f"result = call32({number}, {', '.join(map(str, args))})\n"
    code += "import os\nif result == 0:\n    os._exit(0)  # a child, had it worked\n"
    code += "print('ran', result)\n"
    result = attempt(code)
    assert result.returncode in (-signal.SIGSYS, 128 + signal.SIGSYS), (what, result)
    assert "ran" not in result.stdout
    message = result.message(LIMITS)
    assert message == "stopped: the code made a system call the python tool does not allow"


@pytest.mark.slow
def test_the_x32_range_kills_the_child():
    if not X86_64:
        pytest.skip("the x32 range is x86-64's")
    code = (
        "import ctypes\nlibc = ctypes.CDLL(None)\n"
        "print('ran', libc.syscall(0x40000000 | 39))  # x32 getpid\n"
    )
    result = attempt(code)
    assert result.returncode in (-signal.SIGSYS, 128 + signal.SIGSYS) and "ran" not in result.stdout


# Every way out of the process group and the namespace that the code could try: each
# attempt prints what it got; then the code sleeps, to be killed by the wall clock (or ends).
ESCAPES = """
import ctypes, os, subprocess, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
print(os.getpid(), os.getpgrp(), os.readlink('/proc/self/ns/pid'), flush=True)
def report(what, value):
    print(what, value, ctypes.get_errno() if value == -1 else 0, flush=True)
    if value == 0:  # a child: stay alive past the call, as an escape would
        time.sleep(60)
        os._exit(0)
report('pdeathsig', libc.prctl(1, 0, 0, 0, 0))  # PR_SET_PDEATHSIG 0
report('setsid', libc.setsid())
report('setpgid', libc.setpgid(0, 0))
report('fork', libc.fork())
report('vfork', libc.syscall(58))
report('clone new pid namespace', libc.syscall(56, 0x20000000 | 17, 0, 0, 0, 0))
report('clone parent', libc.syscall(56, 0x00008000 | 17, 0, 0, 0, 0))
report('clone3', libc.syscall(435, 0, 0))
report('unshare pid namespace', libc.unshare(0x20000000))
report('daemon', libc.daemon(0, 0))
for how in ('os.fork', 'posix_spawn', 'Popen new session'):
    try:
        if how == 'os.fork':
            pid = os.fork()
        elif how == 'posix_spawn':
            pid = os.posix_spawn('/bin/sleep', ['sleep', '60'], {})
        else:
            pid = subprocess.Popen(['sleep', '60'], start_new_session=True).pid
        report(how, pid)
    except OSError as e:
        print(how, -1, e.errno, flush=True)
"""


def alive_in(namespace: str) -> list[int]:
    """Processes of this machine in the PID namespace `namespace` ("pid:[inode]")."""
    pids = []
    for entry in Path("/proc").glob("[0-9]*/ns/pid"):
        try:
            if os.readlink(entry) == namespace:
                pids.append(int(entry.parent.parent.name))
        except OSError:
            pass
    return pids


def alive_in_group(group: int) -> list[int]:
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if group in (int(fields[2]), int(fields[3])):  # its process group or session
            pids.append(int(stat.parent.name))
    return pids


def check_nothing_outlived(result, confined: bool) -> dict:
    lines = result.stdout.splitlines()
    pid, group, namespace = lines[0].split()
    outcome = {" ".join(line.split()[:-2]): line.split()[-2:] for line in lines[1:]}
    if confined:
        assert alive_in(namespace) == [], f"left alive: {outcome}"
    else:
        assert not Path(f"/proc/{pid}").exists() and alive_in_group(int(group)) == [], outcome
    for what in ("pdeathsig", "setsid", "setpgid"):
        assert outcome[what] == ["-1", "1"], (what, outcome[what])  # EPERM
    made = {what: v for what, v in outcome.items() if v[0] not in ("-1",)}
    assert made == {}, f"processes were made: {made}"
    return outcome


@pytest.mark.slow
@pytest.mark.parametrize("ending", ["wall clock", "own end", "cancelled"])
def test_nothing_of_a_call_outlives_it(ending):
    needs_confinement()
    limits = SandboxLimits(cpu_s=5, wall_s=2.0 if ending == "wall clock" else 20.0)
    code = ESCAPES + ("" if ending == "own end" else "time.sleep(60)\n")
    if ending == "cancelled":  # the tool's own timeout cancels the call
        namespace = _cancelled_call(code, limits)
        assert alive_in(namespace) == [], "the cancelled call left processes alive"
        return
    result = attempt(code, limits)
    assert result.status == ("timeout" if ending == "wall clock" else "ok"), result
    check_nothing_outlived(result, confined=True)


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def _cancelled_call(code: str, limits: SandboxLimits) -> str:
    """Start the call, find its PID namespace from outside (the wrapper is this process's
    child, the namespace's init the wrapper's), cancel the call once the code has made its
    attempts and sleeps; the namespace ("pid:[inode]")."""

    async def go():
        task = asyncio.ensure_future(run_python(code, limits))
        namespace = None
        for _ in range(400):
            await asyncio.sleep(0.05)
            inits = [i for wrapper in _children(os.getpid()) for i in _children(wrapper)]
            if inits and namespace is None:
                namespace = os.readlink(f"/proc/{inits[0]}/ns/pid")
            if namespace and _sleeping_in(namespace):
                break
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return namespace

    namespace = asyncio.run(go())
    assert namespace is not None, "the call's namespace was not found"
    return namespace


def _sleeping_in(namespace: str) -> bool:
    """The namespace's init is in its final sleep: its wait channel is a sleep."""
    for pid in alive_in(namespace):
        try:
            if "nanosleep" in Path(f"/proc/{pid}/wchan").read_text():
                return True
        except OSError:
            pass
    return False


@pytest.mark.slow
def test_nothing_outlives_an_unconfined_call(monkeypatch):
    monkeypatch.setenv(sandbox.UNCONFINABLE, "1")
    monkeypatch.setattr(sandbox, "_NOTICE", ["said"])  # no warning in this test's output
    if sandbox.platform.machine() not in _sandbox_filter.AUDIT_ARCH:
        pytest.skip("no system call filter for this machine: unconfined code can fork")
    result = attempt(ESCAPES + "time.sleep(60)\n", SandboxLimits(cpu_s=5, wall_s=2.0))
    assert result.status == "timeout"
    check_nothing_outlived(result, confined=False)


@pytest.mark.slow
def test_output_comes_through_pipes_and_is_cut():
    code = (
        "import os\nfds = sorted(os.listdir('/proc/self/fd'))\n"
        "print(json.dumps({fd: os.readlink(f'/proc/self/fd/{fd}') for fd in fds[:3]}), fds)\n"
        "try:\n    os.posix_fallocate(1, 0, 2**30)\nexcept OSError as e:\n"
        "    print('fallocate', e.errno)\n"
    )
    result = attempt("import json\n" + code)
    first = result.stdout.splitlines()[0]
    targets = json.loads(first[: first.rindex("}") + 1])
    assert first.endswith("['0', '1', '2', '3']")  # 3: the listing's own descriptor
    assert targets["0"] == "/dev/null" and targets["1"].startswith("pipe:")
    assert targets["2"].startswith("pipe:") and "fallocate" in result.stdout
    start = time.monotonic()
    flood = attempt("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n")
    assert time.monotonic() - start < 10 and flood.cut and len(flood.stdout) == 4000
    assert flood.message(LIMITS).endswith("output cut: more than 4000 bytes were written")


@pytest.mark.slow
def test_the_names_of_this_machines_keys_are_not_listed():
    """/proc/keys lists every key its reader may view (as root: every root key's name)."""
    needs_confinement()
    if not X86_64:
        pytest.skip("add_key below uses x86-64's number")
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    name = f"flowrl-escape-{os.getpid()}".encode()
    key = libc.syscall(248, b"user", name, b"payload", 7, ctypes.c_int(-3))  # add_key
    if key < 0:
        pytest.skip(f"no session keyring to test with (errno {ctypes.get_errno()})")
    try:
        result = attempt("print(open('/proc/keys').read(), open('/proc/key-users').read())")
    finally:
        libc.syscall(250, 3, ctypes.c_long(key))  # KEYCTL_REVOKE
    assert result.status == "ok" and name.decode() not in result.stdout
    assert result.stdout.strip() == ""


@pytest.mark.slow
def test_a_file_lock_in_the_view_holds_against_nothing(tmp_path):
    """The code locks a file of the view (the interpreter's os.py) for seconds; this
    process takes the same lock meanwhile, every 50 ms. Then the other way round."""
    needs_confinement()
    target = os.path.realpath(os.__file__)
    code = (
        f"import fcntl, os, time\nf = open({target!r})\n"
        "fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
        "fcntl.lockf(f, fcntl.LOCK_SH | fcntl.LOCK_NB)\n"
        "print(time.time(), flush=True)\ntime.sleep(3)\n"
    )
    attempts, stop = [], threading.Event()

    def take():
        with open(target) as f:
            while not stop.is_set():
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    fcntl.flock(f, fcntl.LOCK_UN)
                    attempts.append((time.time(), True))
                except OSError:
                    attempts.append((time.time(), False))
                time.sleep(0.05)

    thread = threading.Thread(target=take)
    thread.start()
    try:
        result = attempt(code)
    finally:
        stop.set()
        thread.join()
    locked_at = float(result.stdout.split()[0])
    after = [ok for when, ok in attempts if when > locked_at]
    assert after and all(after), "a lock from the sandbox held against this process"
    with open(target) as f:  # this process holds it: the code's lock is a no-op, not a wait
        fcntl.flock(f, fcntl.LOCK_EX)
        again = attempt(code.replace("time.sleep(3)", ""))
    assert again.status == "ok", again


@pytest.mark.slow
def test_threads_past_the_limit_fail():
    limits = SandboxLimits(cpu_s=5, wall_s=20.0, processes=8)
    code = (
        "import threading, time\nstarted = 0\nfor _ in range(64):\n"
        "    threading.Thread(target=time.sleep, args=(2,), daemon=True).start()\n"
        "    started += 1\n"
    )
    result = attempt(code, limits)
    if result.status == "ok":
        pytest.skip("this machine bounds no thread count for this user (root without a cgroup)")
    assert "can't start new thread" in result.stderr
    assert result.message(limits).endswith("stopped: the code may run at most 8 threads")


@pytest.mark.slow
@pytest.mark.parametrize("where", ["/tmp", "/scratch"])
def test_inodes_and_bytes_of_tmp_and_scratch_are_bounded(where):
    needs_confinement()
    limits = SandboxLimits(cpu_s=5, wall_s=20.0, scratch_inodes=200, scratch_mb=1)
    files = f"import os\nfor k in range(1000):\n    open(f'{where}/f{{k}}', 'w').close()\n"
    result = attempt(files, limits)
    assert "No space left on device" in result.stderr
    data = f"for k in range(100):\n    open(f'{where}/d{{k}}', 'wb').write(bytes(16000))\n"
    result = attempt(data, SandboxLimits(cpu_s=5, wall_s=20.0, scratch_mb=1, output_bytes=16000))
    assert "No space left on device" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("how", ["allocation", "files in /tmp and /scratch"])
def test_a_calls_memory_is_bounded_as_a_whole(how):
    """Where a memory cgroup can be made, the call's memory in all: here 100 MB, against an
    address space of 512 MB and 64 MB of /tmp and of /scratch each."""
    if "memory" not in _sandbox_end._cgroup_bases():
        pytest.skip("no memory cgroup can be made here (root, or cgroup v2 delegation)")
    needs_confinement()
    limits = SandboxLimits(cpu_s=5, wall_s=20.0, call_memory_mb=100, output_bytes=2**20)
    code = {
        "allocation": "x = bytearray(200 * 2**20)\n",
        "files in /tmp and /scratch": "for k in range(120):\n"
        "    open(f'/{\"tmp\" if k < 60 else \"scratch\"}/f{k}', 'wb').write(bytes(2**20))\n",
    }[how]
    result = attempt(code + "print('done')\n", limits)
    assert result.status == "memory" and "done" not in result.stdout, result
    assert result.message(limits).startswith("stopped: the call used more than 100 MB")


@pytest.mark.slow
def test_open_files_are_bounded():
    limits = SandboxLimits(cpu_s=5, wall_s=20.0, open_files=32)
    code = "import os\npipes = [os.pipe() for _ in range(100)]\n"
    result = attempt(code, limits)
    assert "Too many open files" in result.stderr


@pytest.mark.slow
def test_shared_memory_has_no_way_in():
    """SysV segments, POSIX message queues and memfd live outside the address-space limit."""
    code = (
        "import ctypes, mmap, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.shmget(0, 2**30, 0o1000 | 0o600), ctypes.get_errno())  # IPC_CREAT\n"
        "print(libc.syscall(_mq_open, b'/q', 0o100 | 2, 0o600, None), ctypes.get_errno())\n"
        "try:\n    os.memfd_create('x')\n    print('memfd made')\nexcept OSError as e:\n"
        "    print('memfd', e.errno)\n"
        "try:\n    mmap.mmap(-1, 2**30, flags=mmap.MAP_SHARED)\n    print('mapped')\n"
        "except OSError as e:\n    print('mmap', e.errno)\n"
    )
    mq_open = 240 if X86_64 else 180
    result = attempt(f"_mq_open = {mq_open}\n" + code)
    shm, mq, memfd, shared = result.stdout.splitlines()
    assert shm.startswith("-1 ") and mq.startswith("-1 ") and memfd.startswith("memfd ")
    assert shared == "mmap 12", result.stdout  # ENOMEM: the address-space limit


@pytest.mark.slow
def test_unconfined_calls_reach_no_socket_and_no_other_process(monkeypatch):
    monkeypatch.setenv(sandbox.UNCONFINABLE, "1")
    monkeypatch.setattr(sandbox, "_NOTICE", [])
    assert not sandbox.confinement().available
    assert sandbox.UNCONFINABLE in sandbox.confinement().reason
    if sandbox.platform.machine() not in _sandbox_filter.AUDIT_ARCH:
        pytest.skip("no system call filter for this machine")
    server = socket.socket(socket.AF_UNIX)
    path = f"/tmp/flowrl-escape-{os.getpid()}.sock"
    server.bind(path)
    server.listen(1)
    server.setblocking(False)
    victim = subprocess.Popen(["sleep", "60"])
    code = (
        "import ctypes, socket, struct\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "for family in (socket.AF_UNIX, socket.AF_INET, 40):\n"
        "    print('socket', libc.socket(family, socket.SOCK_STREAM, 0), ctypes.get_errno())\n"
        f"print('kill', libc.kill({victim.pid}, 9), ctypes.get_errno())\n"
        "print('kill self', libc.kill(0, 0))\n"
    )
    try:
        with pytest.warns(UserWarning, match="network"):
            result = attempt(code)
        with pytest.raises(BlockingIOError):
            server.accept()
        assert victim.poll() is None, "the unconfined code killed another process"
    finally:
        victim.kill()
        victim.wait()
        server.close()
        os.unlink(path)
    assert result.stdout.splitlines() == [
        "socket -1 13",  # EACCES
        "socket -1 13",
        "socket -1 13",
        "kill -1 1",  # EPERM
        "kill self 0",
    ]


@pytest.mark.slow
def test_unconfined_code_holds_no_capability_and_cannot_raise_its_limits(monkeypatch):
    """Unconfined as root, CAP_SYS_RESOURCE would raise every hard limit."""
    monkeypatch.setenv(sandbox.UNCONFINABLE, "1")
    monkeypatch.setattr(sandbox, "_NOTICE", ["said"])
    code = (
        "import resource\nstatus = open('/proc/self/status').read()\n"
        "print(status.split('CapEff:')[1].split()[0])\n"
        "try:\n    resource.setrlimit(resource.RLIMIT_CPU, (100, 100))\n    print('raised')\n"
        "except (OSError, ValueError) as e:\n    print('refused')\n"
    )
    result = attempt(code)
    assert result.stdout.splitlines() == ["0000000000000000", "refused"], result


@pytest.mark.slow
def test_a_virtual_environment_under_tmp_is_in_view(monkeypatch, tmp_path):
    needs_confinement()
    venv = Path("/tmp") / f"flowrl-venv-{os.getpid()}"
    (venv / "lib").mkdir(parents=True)
    (venv / "lib" / "marker.py").write_text("VALUE = 7\n")
    paths = sandbox._interpreter_paths()
    monkeypatch.setattr(sandbox, "_interpreter_paths", lambda: [*paths, str(venv)])
    sandbox.view.cache_clear()
    try:
        code = (
            f"import os, sys\nsys.path.insert(0, {str(venv / 'lib')!r})\nimport marker\n"
            "open('/tmp/mine', 'w').write('x')\n"
            "print(marker.VALUE, sorted(os.listdir('/tmp')))\n"
            f"try:\n    open({str(venv / 'planted')!r}, 'w')\nexcept OSError as e:\n"
            "    print(e.strerror)\n"
        )
        result = attempt(code)
        binds, _ = sandbox.view()  # the venv, and the interpreter's own if under /tmp
        under_tmp = sorted({Path(p).parts[2] for p in binds if p.startswith("/tmp/")})
    finally:
        sandbox.view.cache_clear()
        (venv / "lib" / "marker.py").unlink()
        (venv / "lib").rmdir()
        venv.rmdir()
    assert venv.name in under_tmp
    listing = sorted([*under_tmp, "mine"])
    assert result.stdout.splitlines() == [f"7 {listing}", "Read-only file system"]
    assert not (venv / "planted").exists()


def test_the_filter_kills_other_architectures_and_x32_first():
    """The program's first instructions, per machine: the arch check, then the x32 bit."""
    for machine, arch in _sandbox_filter.AUDIT_ARCH.items():
        program = _sandbox_filter.program(machine)
        load, check, kill = program[:3]
        assert load == (0x20, 0, 0, 4) and check == (0x15, 1, 0, arch)
        assert kill == (0x06, 0, 0, 0x80000000)
    x86 = _sandbox_filter.program("x86_64")
    assert x86[3:6] == [(0x20, 0, 0, 0), (0x45, 0, 1, 0x40000000), (0x06, 0, 0, 0x80000000)]


@pytest.mark.parametrize("machine", ["riscv64", "armv7l"])
def test_no_confinement_is_claimed_without_a_filter(monkeypatch, machine):
    monkeypatch.setattr(sandbox.platform, "machine", lambda: machine)
    sandbox._probe.cache_clear()
    try:
        state = sandbox.confinement()
    finally:
        sandbox._probe.cache_clear()
    assert not state.available and machine in state.reason


@pytest.mark.slow
def test_queued_signals_and_posix_timers_are_bounded():
    """Each queued real-time signal and each POSIX timer is kernel memory outside RLIMIT_AS:
    10000 signals sent to itself while blocked, then a POSIX timer."""
    code = (
        "import ctypes, os, signal\nsignal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGRTMIN])\n"
        "for _ in range(10000):\n    os.kill(os.getpid(), signal.SIGRTMIN)\n"
        "print(open('/proc/self/status').read().split('SigQ:')[1].split()[0])\n"
        "libc = ctypes.CDLL(None, use_errno=True)\ntimer = ctypes.c_int()\n"
        "print(libc.timer_create(1, None, ctypes.byref(timer)), ctypes.get_errno())\n"
    )
    result = attempt(code)
    queued, timers = result.stdout.splitlines()
    assert queued == "64/64", result  # queued / RLIMIT_SIGPENDING: the rest were not queued
    assert timers == "-1 38"  # ENOSYS


def run_filter(program, nr: int, arch: int, args=(0,) * 6) -> int:
    """Classic BPF as the kernel runs a seccomp filter (the four instructions it uses) on one
    seccomp_data: the action returned."""
    data = {0: nr & 0xFFFFFFFF, 4: arch}
    data |= {16 + 8 * k: value & 0xFFFFFFFF for k, value in enumerate(args)}
    pc, accumulator = 0, 0
    while True:
        op, jt, jf, k = program[pc]
        if op == 0x20:
            accumulator = data[k]
        elif op in (0x15, 0x45):
            hit = accumulator == k if op == 0x15 else bool(accumulator & k)
            pc += jt if hit else jf
        elif op == 0x06:
            return k
        pc += 1


@pytest.mark.parametrize("machine", sorted(_sandbox_filter.AUDIT_ARCH))
def test_the_filter_decides_each_kind_of_call(machine):
    """Every machine's program, run here on the calls that matter."""
    f = _sandbox_filter
    program, arch = f.program(machine), f.AUDIT_ARCH[machine]
    unconfined = f.program(machine, own_pid=4242)

    def number(name):
        return f.NUMBERS[name][f.COLUMN[machine]]

    allow, kill, enosys = f.ALLOW, f.KILL, f.ERRNO | f.ENOSYS
    thread = 0x10000 | 0x100 | 0x800 | 0x400 | 0x200  # CLONE_THREAD, VM, SIGHAND, FILES, FS
    cases = [
        (program, number("read"), arch, (), allow),
        (program, number("read"), 0x40000003, (), kill),  # AUDIT_ARCH_I386
        (program, number("read"), 0x40000028, (), kill),  # AUDIT_ARCH_ARM
        (program, number("clone"), arch, (thread,), allow),
        (program, number("clone"), arch, (17,), f.ERRNO | f.EAGAIN),  # SIGCHLD: a process
        (program, number("clone"), arch, (thread | 0x20000000,), f.ERRNO | f.EPERM),
        (program, number("clone3"), arch, (), enosys),
        (program, number("setsid"), arch, (), f.ERRNO | f.EPERM),
        (program, number("setpgid"), arch, (), f.ERRNO | f.EPERM),
        (program, number("prctl"), arch, (1, 0), f.ERRNO | f.EPERM),  # PR_SET_PDEATHSIG
        (program, number("prctl"), arch, (15, 0), allow),  # PR_SET_NAME
        (program, number("fcntl"), arch, (3, 7), f.ERRNO),  # F_SETLKW: no-op, returns 0
        (program, number("fcntl"), arch, (3, 1024), f.ERRNO | f.EPERM),  # F_SETLEASE
        (program, number("fcntl"), arch, (3, 1), allow),  # F_GETFD
        (program, number("flock"), arch, (3, 2), f.ERRNO),
        (program, number("keyctl"), arch, (), f.ERRNO | f.EPERM),
        (program, number("socket"), arch, (40, 1, 0), f.ERRNO | f.EAFNOSUPPORT),  # AF_VSOCK
        (program, number("socket"), arch, (2, 1, 0), allow),
        (program, number("kill"), arch, (1, 9), allow),
        (program, {"x86_64": 165, "aarch64": 40}[machine], arch, (), enosys),  # mount
        (unconfined, number("socket"), arch, (1, 1, 0), f.ERRNO | f.EACCES),
        (unconfined, number("kill"), arch, (4242, 9), allow),
        (unconfined, number("kill"), arch, (-1, 9), f.ERRNO | f.EPERM),
        (unconfined, number("tgkill"), arch, (4243, 4243, 9), f.ERRNO | f.EPERM),
    ]
    if machine == "x86_64":
        cases += [(program, 0x40000000 | number("read"), arch, (), kill)]
    for code, nr, audit, args, expected in cases:
        action = run_filter(code, nr, audit, (*args, *[0] * (6 - len(args))))
        assert action == expected, (machine, nr, hex(audit), args, hex(action))


FLOWRL_LIKE = """
import asyncio, threading, time
from flowrl.agent.tools.sandbox import SandboxLimits, run_python
code = "import time\\nprint('started', flush=True)\\ntime.sleep(120)\\n"
limits = SandboxLimits(cpu_s=100, wall_s=120.0)
threading.Thread(target=lambda: asyncio.run(run_python(code, limits)), daemon=True).start()
time.sleep(120)
"""


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        for child in _children(todo.pop()):
            found.append(child)
            todo.append(child)
    return found


def _namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("confined", [True, False])
def test_a_call_dies_with_the_process_that_made_it(monkeypatch, confined):
    """flowrl killed mid-call (SIGKILL: no finally runs): the call's processes die too."""
    if confined:
        needs_confinement()
    else:
        monkeypatch.setenv(sandbox.UNCONFINABLE, "1")
    bases = set(_sandbox_end._cgroup_bases().values())
    before = {path for base in bases for path in base.glob("flowrl-python-*")}
    flowrl = subprocess.Popen(
        [sys.executable, "-W", "ignore", "-c", FLOWRL_LIKE], env=dict(os.environ)
    )
    try:
        ours = os.readlink("/proc/self/ns/pid")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until the code runs (confined: in its namespace)
            tree = _descendants(flowrl.pid)
            elsewhere = [p for p in tree if _namespace(p) not in (None, ours)]
            if tree and (elsewhere or not confined):
                break
            time.sleep(0.1)
        time.sleep(1.0)  # past the child's setup
        tree = _descendants(flowrl.pid)
        assert tree, "the call did not start"
    finally:
        flowrl.kill()
        flowrl.wait()
    deadline = time.monotonic() + 10
    while any(_running(p) for p in tree) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p for p in tree if _running(p)] == [], "the call outlived the process that made it"
    for base in set(_sandbox_end._cgroup_bases().values()):  # the killed process's, now empty
        for path in set(base.glob("flowrl-python-*")) - before:
            try:
                path.rmdir()
            except OSError:
                pass


def test_empty_call_cgroups_left_by_a_killed_flowrl_are_swept(monkeypatch):
    bases = sorted(set(_sandbox_end._cgroup_bases().values()))
    if not bases:
        pytest.skip("no cgroup can be made here (root, or cgroup v2 delegation)")
    left = [base / f"flowrl-python-left{os.getpid()}" for base in bases]
    for path in left:
        path.mkdir()
    monkeypatch.setattr(_sandbox_end, "STALE_S", -1)  # every empty one counts as stale
    _sandbox_end._sweep.cache_clear()
    group = _sandbox_end.call_cgroup(4, 2**26)
    try:
        assert group is not None and [p for p in left if p.exists()] == []
    finally:
        _sandbox_end._sweep.cache_clear()
        for path in left:
            path.rmdir() if path.exists() else None
        if group is not None:
            group.remove()
