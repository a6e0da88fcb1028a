"""The python tool's sandbox: code runs in a child process, never in this one; an infinite
loop, a sleep, a huge allocation, too much output, a network call and a fork bomb are each
stopped with a clear message, and the next run works."""

import ast
import asyncio
import os
import time
from pathlib import Path

import pytest

from flowrl.agent.parsers import ToolCall
from flowrl.agent.tools import sandbox
from flowrl.agent.tools.builtin import python
from flowrl.agent.tools.sandbox import SandboxLimits, SandboxUnavailable, isolation, run_python
from flowrl.agent.tools.toolbox import Toolbox

LIMITS = SandboxLimits(cpu_s=1, wall_s=30.0, memory_mb=256, output_bytes=2000)


def run(code, limits=LIMITS):
    result = asyncio.run(run_python(code, limits))
    return result, result.message(limits)


def test_code_runs_in_another_process_in_a_fresh_scratch_directory():
    marker = "flowrl_sandbox_marker"
    code = (
        "import os\nprint(os.getpid(), os.getppid(), os.getcwd())\n"
        f"globals()['{marker}'] = 1\nopen('file.txt', 'w').write('x')\n"
    )
    result, _ = run(code)
    assert result.status == "ok"
    pid, parent, cwd = result.stdout.split()
    assert int(parent) != os.getpid() and (int(pid) != os.getpid() or isolation())
    assert cwd.startswith("/") and cwd != os.getcwd() and not Path(cwd).exists()  # removed
    assert marker not in globals()


def test_the_python_tool_never_runs_code_in_this_process():
    seen = []
    os.environ["FLOWRL_SANDBOX_PROBE"] = "parent"
    text = asyncio.run(python("import os\nprint(os.environ.get('FLOWRL_SANDBOX_PROBE'))"))
    seen.append(text)
    del os.environ["FLOWRL_SANDBOX_PROBE"]
    assert seen == ["None"]  # a child with its own, minimal environment


def test_an_infinite_loop_is_stopped_by_the_cpu_limit():
    result, message = run("while True:\n    pass")
    assert result.status == "cpu"
    assert message.endswith("stopped: the code used more than 1 s of CPU time")


def test_a_sleeping_program_is_stopped_by_the_wall_clock():
    start = time.perf_counter()
    result, message = run("import time\ntime.sleep(60)", SandboxLimits(wall_s=0.5))
    assert time.perf_counter() - start < 5
    assert result.status == "timeout" and message == "stopped: the code ran longer than 0.5 s"


def test_a_huge_allocation_fails_inside_the_child():
    result, message = run("x = bytearray(10**10)")
    assert "MemoryError" in result.stderr
    assert message.endswith("stopped: the code needed more than 256 MB of memory")


def test_output_past_the_limit_is_cut():
    result, message = run("print('x' * 5000)\n")
    assert message.endswith("output cut: more than 2000 bytes were written")
    result, message = run("for i in range(10000):\n    print(i)\n")
    assert len(result.stdout) <= 2000 and message.endswith("bytes were written")


def test_a_network_call_fails():
    code = "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=5)"
    start = time.perf_counter()
    result, message = run(code)
    assert time.perf_counter() - start < 5 and result.status == "error"
    expected = "Network is unreachable" if isolation() else "network access is disabled"
    assert expected in message


def test_a_fork_bomb_is_stopped():
    # a bounded probe first: never start a real fork bomb where processes are not refused
    probe = (
        "import os, time\nmade = 0\nfor _ in range(32):\n    try:\n        pid = os.fork()\n"
        "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(2)\n"
        "        os._exit(0)\n    made += 1\nprint(made)\n"
    )
    result, _ = run(probe)
    if int(result.stdout.split()[0]) >= 16:
        pytest.skip("this machine cannot refuse new processes to the sandbox")
    result, message = run("import os\nwhile True:\n    os.fork()\n")
    assert message.endswith("stopped: the python tool may not start processes")
    threads = "import threading\nt = threading.Thread(target=print, args=('in a thread',))\n"
    result, _ = run(threads + "t.start()\nt.join()\n")
    assert result.stdout == "in a thread"  # threads still work


def test_a_tool_timeout_kills_the_child():
    # a CPU limit of this process's own marks its child's command line: other test runs on
    # a shared machine start children with the same code at the same time
    marker = 10_000 + os.getpid()
    limits = SandboxLimits(cpu_s=marker, wall_s=60.0)
    session = Toolbox([]).open({})

    async def go():
        await session.start()
        return await asyncio.wait_for(run_python("import time\ntime.sleep(60)", limits), 0.5)

    with pytest.raises(TimeoutError):
        asyncio.run(go())
    time.sleep(0.2)
    left = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if f'"cpu_s": {marker},'.encode() in cmdline.read_bytes():
                left.append(cmdline)
        except OSError:
            pass
    assert left == []
    assert asyncio.run(python("print(6 * 7)")) == "42"  # and the next run works


def test_the_python_tool_through_a_session_reports_errors_as_text():
    session = Toolbox(["python"]).open({})

    async def go():
        await session.start()
        return await session.call(ToolCall("python", {"code": "print(1/0)"}), 30.0)

    result = asyncio.run(go())
    assert result.status == "ok"  # the tool worked; the code failed, and the model reads why
    assert result.text.startswith("Traceback") and "ZeroDivisionError" in result.text
    assert "_sandbox_child" not in result.text  # only the code's own frames


def test_the_code_sees_only_its_view_and_holds_no_capability():
    if not sandbox.confinement().available:
        pytest.skip(f"no confinement here: {sandbox.confinement().reason}")
    code = (
        "import os\nprint(sorted(os.listdir('/')))\nprint(os.getcwd())\n"
        "lines = open('/proc/self/status').read().splitlines()\n"
        "status = dict(line.split(':\\t', 1) for line in lines if ':\\t' in line)\n"
        "print(status['CapEff'], status['CapBnd'], os.getpid())\n"
    )
    result, _ = run(code)
    listing, cwd, capabilities = result.stdout.split("\n")
    read_only, symlinks = sandbox.view()
    tops = {Path(p).parts[1] for p in read_only} | {Path(p).parts[1] for p, _ in symlinks}
    assert set(ast.literal_eval(listing)) == tops | {"dev", "etc", "proc", "scratch", "tmp"}
    assert cwd == "/scratch"
    assert capabilities == "0000000000000000 0000000000000000 1"  # pid 1 of its namespace


def test_required_refuses_where_the_code_cannot_be_confined(monkeypatch):
    simulated = sandbox.Confinement(False, "simulated: no user namespaces")
    monkeypatch.setattr(sandbox, "confinement", lambda: simulated)
    with pytest.raises(SandboxUnavailable, match='sandbox = "required", but the python tool'):
        asyncio.run(run_python("print(1)", LIMITS, "required"))
    session = Toolbox(["python"], sandbox="required").open({})

    async def go():
        await session.start()
        return await session.call(ToolCall("python", {"code": "print(1)"}), 30.0)

    result = asyncio.run(go())  # the model reads why, and the call counts as an error
    assert result.status == "error" and result.text.startswith("error: SandboxUnavailable")
    assert "simulated: no user namespaces" in result.text and 'sandbox = "auto"' in result.text


def test_auto_runs_unconfined_where_it_must_and_says_so_once(monkeypatch):
    simulated = sandbox.Confinement(False, "simulated: another OS")
    monkeypatch.setattr(sandbox, "confinement", lambda: simulated)
    monkeypatch.setattr(sandbox, "_NOTICE", [])
    with pytest.warns(UserWarning) as said:
        result, _ = run("import os\nprint(os.getcwd())")
        again, _ = run("print(2)")
    notices = [str(w.message) for w in said if w.category is UserWarning]  # a ResourceWarning
    assert notices == [sandbox.unconfined_notice("simulated: another OS")]  # may pass by too
    assert result.status == "ok" and result.stdout != "/scratch" and again.stdout == "2"


def test_an_unknown_setting_is_refused():
    with pytest.raises(ValueError, match='sandbox = "off" must be one of auto, required'):
        asyncio.run(run_python("print(1)", LIMITS, "off"))


@pytest.mark.parametrize(
    ("platform", "namespaces", "says"),
    [("darwin", ("unshare",), "this is darwin"), ("linux", (), "user namespaces are off")],
)
def test_the_probe_says_why_the_code_cannot_be_confined(monkeypatch, platform, namespaces, says):
    monkeypatch.setattr(sandbox.sys, "platform", platform)
    monkeypatch.setattr(sandbox, "isolation", lambda: namespaces)
    sandbox._probe.cache_clear()
    try:
        state = sandbox.confinement()
    finally:
        sandbox._probe.cache_clear()  # the next caller probes this machine again
    assert not state.available and says in state.reason


def test_a_view_that_cannot_be_built_runs_nothing(monkeypatch):
    if not sandbox.confinement().available:
        pytest.skip(f"no confinement here: {sandbox.confinement().reason}")
    read_only, symlinks = sandbox.view()
    missing = "/flowrl-no-such-directory"
    monkeypatch.setattr(sandbox, "view", lambda: ((*read_only, missing), symlinks))
    result, message = run("print('ran unconfined')")
    assert result.status == "error" and "ran unconfined" not in result.stdout
    assert message.startswith(f"python tool: cannot confine the code (mount {missing} on ")
