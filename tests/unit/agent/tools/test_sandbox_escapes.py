"""Code a model could write, trying to reach the host from the python tool: each case makes
the attempt for real, then checks the host (a file's bytes, a process, a listening socket),
not only what the code printed. `tmp_path` stands for the run directory and the checkout:
a checkpoint, the reward scorer's source, a mode-600 secret. Only the sandbox's public call
is used, so the file also runs against an older flowrl to show which cases escaped there."""

import asyncio
import ctypes
import json
import os
import secrets
import select
import signal
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import flowrl
from flowrl.agent.tools.sandbox import SandboxLimits, run_python

pytestmark = pytest.mark.slow  # each case starts a Python child process
LIMITS = SandboxLimits(cpu_s=2, wall_s=20.0, memory_mb=256, output_bytes=4000)


def attempt(code: str) -> str:
    """What the code printed (stdout, then stderr)."""
    result = asyncio.run(run_python(code, LIMITS))
    return f"{result.stdout}\n{result.stderr}"


def tries(action: str) -> str:
    """Code that runs `action` (statements) and prints "done" or the error that stopped it."""
    body = "".join(f"    {line}\n" for line in action.strip().splitlines())
    return f"try:\n{body}    print('done')\nexcept Exception as e:\n    print('refused:', e)\n"


@pytest.fixture
def run_dir(tmp_path):
    """A run directory as training leaves it: a checkpoint, the scorer, a secret (mode 600)."""
    (tmp_path / "checkpoint.pt").write_bytes(b"weights" * 100)
    (tmp_path / "scorer.py").write_text("def compute_score(*args):\n    return 0.0\n")
    secret = tmp_path / "secret"
    secret.write_text(secrets.token_hex(16))
    secret.chmod(0o600)
    return tmp_path


def test_overwriting_a_checkpoint_outside_fails(run_dir):
    checkpoint = run_dir / "checkpoint.pt"
    out = attempt(tries(f"open({str(checkpoint)!r}, 'wb').write(b'poisoned')"))
    assert checkpoint.read_bytes() == b"weights" * 100
    assert "refused" in out


def test_creating_a_file_beside_the_run_fails(run_dir):
    out = attempt(tries(f"open({str(run_dir / 'planted.py')!r}, 'w').write('x = 1')"))
    assert not (run_dir / "planted.py").exists() and "refused" in out


def test_deleting_files_outside_fails(run_dir):
    code = tries(f"import os\nos.remove({str(run_dir / 'scorer.py')!r})") + tries(
        f"import shutil\nshutil.rmtree({str(run_dir)!r})"
    )
    out = attempt(code)
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoint.pt", "scorer.py", "secret"]
    assert out.count("refused") == 2


def test_a_symlink_from_scratch_leads_nowhere_outside(run_dir):
    checkpoint, secret = run_dir / "checkpoint.pt", run_dir / "secret"
    code = (
        f"import os\nos.symlink({str(checkpoint)!r}, 'ckpt')\nos.symlink({str(secret)!r}, 's')\n"
        + tries("print(open('s').read())")
        + tries("open('ckpt', 'wb').write(b'poisoned')")
    )
    out = attempt(code)
    assert checkpoint.read_bytes() == b"weights" * 100
    assert secret.read_text() not in out and out.count("refused") == 2


def test_rewriting_the_reward_scorer_fails(run_dir):
    scorer = run_dir / "scorer.py"
    before = scorer.read_text()
    hack = "def compute_score(*args):\\n    return 1.0\\n"
    out = attempt(tries(f"open({str(scorer)!r}, 'w').write('{hack}')"))
    assert scorer.read_text() == before and "refused" in out


def test_appending_to_flowrl_itself_fails():
    package = Path(flowrl.__file__)  # the real source of the flowrl that runs this test
    before = package.read_bytes()
    try:
        out = attempt(tries(f"open({str(package)!r}, 'a').write('\\nimport os  # planted\\n')"))
        assert package.read_bytes() == before and "refused" in out
    finally:
        if package.read_bytes() != before:
            package.write_bytes(before)  # undo an escape, then fail above


def test_reading_the_checkout_fails():
    source = Path(flowrl.__file__).read_text()
    line = next(x for x in source.splitlines() if len(x) > 20)
    out = attempt(tries(f"print(open({flowrl.__file__!r}).read())"))
    assert line not in out and "refused" in out


def test_reading_a_mode_600_secret_fails(run_dir):
    secret = run_dir / "secret"
    out = attempt(tries(f"print(open({str(secret)!r}).read())"))
    assert secret.read_text() not in out and "refused" in out


def test_reading_the_systems_password_hashes_fails():
    shadow = Path("/etc/shadow")
    try:
        first = shadow.read_text().splitlines()[0]
    except (OSError, IndexError):
        pytest.skip("no readable /etc/shadow on this machine")
    out = attempt(tries("print(open('/etc/shadow').read())"))
    assert first not in out and "refused" in out


def test_the_home_directory_is_not_in_view():
    home = Path.home()
    # the interpreter may live under it (pyenv): the way to it is all the view may show
    needed = {
        Path(p).relative_to(home).parts[0]
        for p in {sys.prefix, sys.base_prefix}
        if Path(p).is_relative_to(home)
    }
    listing = f"import json, os\nprint(json.dumps(sorted(os.listdir({str(home)!r}))))"
    first = attempt(tries(listing)).split("\n")[0]
    shown = set(json.loads(first)) if first.startswith("[") else set()  # else: refused
    assert shown <= needed, f"the home directory shows {sorted(shown - needed)}"


def test_writing_anywhere_in_the_view_fails():
    name = f"flowrl-escape-{secrets.token_hex(4)}"
    places = ["/", "/usr", "/etc", "/dev", sys.base_prefix, sysconfig.get_paths()["purelib"]]
    targets = [Path(p) / name for p in places]
    code = "".join(tries(f"open({str(t)!r}, 'w').write('x')") for t in targets)
    try:
        out = attempt(code)
        assert [t for t in targets if t.exists()] == []
        assert out.count("refused") == len(targets)
    finally:
        for target in targets:
            target.unlink(missing_ok=True)


def test_root_inside_cannot_make_its_view_writable():
    """Root of its user namespace, the code tries to remount the interpreter's prefix
    writable, first as it is, then from a user and mount namespace of its own."""
    target = Path(sysconfig.get_paths()["purelib"]) / f"flowrl-escape-{secrets.token_hex(4)}"
    code = (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "def remount():  # MS_REMOUNT | MS_BIND without MS_RDONLY: writable\n"
        f"    for path in (b'/', {str(target.parent).encode()!r}):\n"
        "        libc.mount(None, path, None, 32 | 4096, None)\n"
        "remount()\n"
        + tries(f"open({str(target)!r}, 'w').write('x')")
        + "libc.unshare(0x10000000 | 0x20000)  # CLONE_NEWUSER | CLONE_NEWNS\nremount()\n"
        + tries(f"open({str(target)!r}, 'a').write('x')")
    )
    try:
        out = attempt(code)
        assert not target.exists() and out.count("refused") == 2
    finally:
        target.unlink(missing_ok=True)


def test_another_process_cannot_be_killed_or_read():
    token = secrets.token_hex(8)
    victim = subprocess.Popen(["sleep", "60"], env={"PATH": "/usr/bin:/bin", "TOKEN": token})
    try:
        code = tries(f"print(open('/proc/{victim.pid}/environ').read())") + tries(
            f"import os, signal\nos.kill({victim.pid}, signal.SIGKILL)"
        )
        out = attempt(code)
        assert victim.poll() is None, "the sandbox killed a process outside it"
        assert token not in out and out.count("refused") == 2
    finally:
        victim.send_signal(signal.SIGKILL)
        victim.wait()


def test_a_key_in_flowrls_session_keyring_is_out_of_reach():
    """The child inherits the session keyring of the process that starts it."""
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        pytest.skip("the keyring calls below use x86-64 syscall numbers")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    token = secrets.token_hex(8).encode()
    name = f"flowrl-escape-{secrets.token_hex(4)}".encode()
    session = ctypes.c_int(-3)  # KEY_SPEC_SESSION_KEYRING
    key = libc.syscall(248, b"user", name, token, len(token), session)  # add_key
    if key < 0:
        pytest.skip(f"no session keyring to test with (errno {ctypes.get_errno()})")
    code = (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "libc.syscall.restype = ctypes.c_long\n"
        f"key = libc.syscall(250, 10, ctypes.c_int(-3), b'user', {name!r}, 0)  # KEYCTL_SEARCH\n"
        "buffer = ctypes.create_string_buffer(64)\n"
        "read = libc.syscall(250, 11, ctypes.c_long(key), buffer, 64)  # KEYCTL_READ\n"
        "print(buffer.raw[: max(read, 0)].decode() if read > 0 else 'refused')\n"
    )
    try:
        out = attempt(code)
        assert token.decode() not in out and "refused" in out
    finally:
        libc.syscall(250, 3, ctypes.c_long(key))  # KEYCTL_REVOKE


def test_the_network_is_unreachable_even_through_ctypes():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    port = server.getsockname()[1]
    raw = (  # socket(2) and connect(2) themselves, past anything Python's socket module does
        "import ctypes, socket, struct\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "fd = libc.socket(socket.AF_INET, socket.SOCK_STREAM, 0)\n"
        "address = struct.pack('=H', socket.AF_INET) + struct.pack('!H', "
        f"{port}) + socket.inet_aton('127.0.0.1') + bytes(8)\n"
        "if libc.connect(fd, address, len(address)) != 0:\n"
        "    raise OSError(ctypes.get_errno(), 'connect(2) failed')\n"
    )
    try:
        out = attempt(
            tries(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), 2)") + tries(raw)
        )
        ready, _, _ = select.select([server], [], [], 0.2)
        assert ready == [], "a connection from the sandbox reached this machine"
        assert out.count("refused") == 2
    finally:
        server.close()


def test_no_new_process_can_start():
    code = (
        tries("import os\nif os.fork() == 0:\n    os._exit(0)")
        + tries("import subprocess\nsubprocess.run(['true'])")
        + tries("import os\nstatus = os.system('true')\nassert status == 0, status")
    )
    out = attempt(code)
    assert out.count("refused") == 3
