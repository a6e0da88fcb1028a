"""The sandbox_fusion tool against a local HTTP server that speaks SandboxFusion's run_code
API: the request it sends, the output the model reads (a failure of the code is output, a
failure of the service an error the session counts), retries on 5xx and refused
connections, no retry on 4xx, a request that gets no answer, and its config errors."""

import asyncio
import json
import socket
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from flowrl.agent.parsers import ToolCall
from flowrl.agent.tools import ToolError
from flowrl.agent.tools.sandbox_service import (
    SandboxFusionTool,
    SandboxServiceError,
    output_text,
    post_run_code,
    service_settings,
)
from flowrl.agent.tools.session import Session
from flowrl.agent.tools.toolbox import Toolbox
from flowrl.agent.tools.verl import VerlTool


def answer(stdout="", stderr="", status="Success", run_status="Finished", code=0):
    run = {"status": run_status, "stdout": stdout, "stderr": stderr, "return_code": code}
    return 200, {"status": status, "message": "", "compile_result": None, "run_result": run}


class Service:
    """A run_code endpoint that answers each POST with the next scripted (HTTP code, JSON)
    and keeps the request bodies; `hang` makes it take a request and never answer."""

    def __init__(self, *replies):
        self.replies, self.requests, self.release = list(replies), [], threading.Event()
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                size = int(self.headers["Content-Length"])
                service.requests.append((self.path, json.loads(self.rfile.read(size))))
                code, body = service.replies.pop(0)
                if code == "hang":
                    service.release.wait(10)
                    return
                data = json.dumps(body).encode() if isinstance(body, dict) else body.encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.01,), daemon=True).start()

    def close(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def service(request):
    made = []

    def start(*replies):
        made.append(Service(*replies))
        return made[-1]

    yield start
    for s in made:
        s.close()


def run(tool, code):
    return asyncio.run(tool.execute("id", {"code": code}))[0]


def tool_for(url, **config):
    return SandboxFusionTool({"sandbox_fusion_url": url, "retry_delay_s": 0, **config})


def test_the_request_has_the_run_code_shape_and_the_output_comes_back(service):
    server = service(answer(stdout="42\n"))
    text = run(tool_for(server.url, default_timeout=3, memory_limit_mb=256), "print(6 * 7)")
    assert text == "42"
    path, body = server.requests[0]
    assert path == "/run_code"
    assert body == {
        "code": "print(6 * 7)",
        "language": "python",
        "run_timeout": 3.0,
        "compile_timeout": 10.0,
        "memory_limit_MB": 256,
    }


def test_the_codes_own_failures_are_output_the_model_reads(service):
    traceback = "Traceback (most recent call last):\nZeroDivisionError: division by zero\n"
    server = service(
        answer(stderr=traceback, status="Failed", code=1),
        answer(stdout="tick\n", status="Failed", run_status="TimeLimitExceeded", code=-9),
        answer(status="Failed", code=1),
    )
    tool = tool_for(server.url, default_timeout=3)
    assert run(tool, "1/0") == traceback.rstrip()
    assert run(tool, "while True: pass") == "tick\nstopped: the code ran longer than 3 s"
    assert run(tool, "exit(1)") == "the code failed with no output"


def test_a_5xx_is_retried_and_a_4xx_is_not(service):
    server = service((503, "busy"), (502, "busy"), answer(stdout="ok"))
    assert run(tool_for(server.url), "print('ok')") == "ok"
    assert len(server.requests) == 3
    server = service((400, '{"detail": "unknown language"}'), answer(stdout="never"))
    with pytest.raises(SandboxServiceError, match="answered HTTP 400.*unknown language"):
        run(tool_for(server.url), "x")
    assert len(server.requests) == 1


def test_the_services_failures_end_the_request_as_infrastructure_not_a_tool_error(service):
    """The model did nothing wrong when the service is down: the call raises through the
    session (the request ends "infra" and leaves its group) instead of answering the model an
    error text its group would score as a failure."""
    from flowrl.errors import InfraError

    server = service(*[(500, "internal error")] * 3)
    with pytest.raises(InfraError, match="failed 3 tries; the last: HTTP 500: internal error"):
        call(Session([make(server.url, retries=2)], {}), "print(1)")
    assert len(server.requests) == 3
    server = service((200, {"status": "SandboxError", "message": "no runner for python"}))
    with pytest.raises(SandboxServiceError, match="'SandboxError': no runner for python"):
        run(tool_for(server.url), "x")


def test_a_refused_connection_is_retried_then_reported():
    with socket.socket() as probe:  # a port nobody listens on any more
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(SandboxServiceError, match="failed 2 tries; the last: Connection"):
        run(tool_for(f"http://127.0.0.1:{port}", retries=1), "x")


def test_a_request_without_an_answer_is_not_retried(service):
    server = service(("hang", None), answer(stdout="never"))
    with pytest.raises(SandboxServiceError, match="gave no answer within 0.2 s"):
        run(tool_for(server.url, request_timeout_s=0.2), "x")
    assert len(server.requests) == 1


def test_a_tool_yaml_names_the_service(service, tmp_path):
    server = service(answer(stdout="3\n"))
    (tmp_path / "tools.yaml").write_text(
        textwrap.dedent(
            f"""
            tools:
              - class_name: sandbox_fusion
                config: {{type: native, sandbox_fusion_url: "{server.url}/run_code",
                          num_workers: 4, default_timeout: 5}}
            """
        )
    )
    box = Toolbox([], tmp_path, "tools.yaml")
    assert box.names == ["code_interpreter"]
    result = call(box.open({}), "print(1 + 2)")
    assert (result.status, result.text) == ("ok", "3")
    assert server.requests[0][0] == "/run_code"  # the /run_code given is not doubled


def test_config_errors_name_the_key(service):
    with pytest.raises(ToolError, match="config.sandbox_fusion_url = ''"):
        Toolbox(["sandbox_fusion"])  # its URL can only come from a tool YAML
    with pytest.raises(ValueError, match=r"unknown keys \['sandbox_url'\]"):
        service_settings({"sandbox_url": "http://x"})
    with pytest.raises(ValueError, match="default_timeout and compile_timeout must be positive"):
        service_settings({"sandbox_fusion_url": "http://x", "default_timeout": 0})
    settings = service_settings({"sandbox_fusion_url": "http://x/"})
    assert settings.url == "http://x/run_code"
    assert output_text({"status": "Success", "run_result": {}}, settings) == "(no output)"


def test_an_answer_that_is_not_json_is_an_error(service):
    server = service((200, "<html>gateway</html>"))
    with pytest.raises(SandboxServiceError, match="answered with no JSON"):
        post_run_code("x", service_settings({"sandbox_fusion_url": server.url}))


def make(url, **config):
    return VerlTool(SandboxFusionTool, {"sandbox_fusion_url": url, "retry_delay_s": 0, **config})


def call(session, code):
    async def go():
        await session.start()
        return await session.call(ToolCall("code_interpreter", {"code": code}), 30.0)

    return asyncio.run(go())
