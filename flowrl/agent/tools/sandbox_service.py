"""The `sandbox_fusion` tool: code runs in a sandbox service, never on the training machine.

It speaks SandboxFusion's `run_code` API, the one verl's SandboxFusionTool calls: POST
{url}/run_code with {"code", "language", "run_timeout", "compile_timeout",
"memory_limit_MB"}; the answer is {"status": "Success" | "Failed" | "SandboxError",
"message", "compile_result", "run_result"}, each result {"status": "Finished" |
"TimeLimitExceeded" | "Error", "stdout", "stderr", "return_code", "execution_time"}. The
code's own failures ("Failed": an exception, a non-zero exit, the time limit) are output the
model reads; the service's (unreachable, HTTP errors, "SandboxError") raise
SandboxServiceError, which the session shows and counts as every tool's error. Connection
errors and HTTP 5xx are retried with exponential backoff; a request that gets no answer in
`request_timeout_s` is not (the code may still be running there).

Configured as verl's tool is, in a tool YAML (the agent node's `tool_config`), under verl's
key names, so a verl YAML needs only its class_name changed:

    tools:
      - class_name: sandbox_fusion      # or flowrl.agent.tools.sandbox_service.SandboxFusionTool
        config: {sandbox_fusion_url: "http://localhost:8080", default_timeout: 10}

The standard library's urllib only: no new dependency. A blocking request is fine in the
async `execute`: every call runs on a thread and event loop of its own (runner.py).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import attrs

from flowrl.errors import InfraError

SCHEMA = {
    "type": "function",
    "function": {
        "name": "code_interpreter",
        "description": "Run a Python program in a sandbox and return what it prints.",
        "parameters": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "description": "the program; print what you need"}
            },
            "required": ["code"],
        },
    },
}
# verl's keys that flowrl reads elsewhere or not at all: concurrency is the agent node's
# max_parallel_calls, the call's time limit its tool_timeout_s
UNUSED = ("type", "num_workers", "rate_limit", "enable_global_rate_limit")


class SandboxServiceError(InfraError):
    """The service could not run the code (not the code's own failure): the request is an
    infrastructure failure (`flowrl.errors.InfraError`), not a tool error the model reads."""


@attrs.frozen
class ServiceSettings:
    url: str  # the service's run_code endpoint
    run_timeout: float = attrs.field(default=10.0, converter=float)  # the code's, there
    compile_timeout: float = attrs.field(default=10.0, converter=float)
    language: str = "python"
    memory_limit_mb: int = attrs.field(default=1024, converter=int)
    # one HTTP request; 0 = the run and compile timeouts + 10 s
    request_timeout_s: float = attrs.field(default=0.0, converter=float)
    retries: int = attrs.field(default=3, converter=int)  # on connection errors, HTTP 5xx
    retry_delay_s: float = attrs.field(default=1.0, converter=float)  # doubled each retry


def service_settings(config: dict) -> ServiceSettings:
    """The settings a tool YAML's `config` gives, under verl's names; ValueError naming the
    key for a missing URL, an unknown key or a bad value."""
    names = {
        "sandbox_fusion_url": "url",
        "default_timeout": "run_timeout",
        "compile_timeout": "compile_timeout",
        "default_language": "language",
        "memory_limit_mb": "memory_limit_mb",
        "request_timeout_s": "request_timeout_s",
        "retries": "retries",
        "retry_delay_s": "retry_delay_s",
    }
    unknown = sorted(set(config) - set(names) - set(UNUSED))
    if unknown:
        raise ValueError(f"config has unknown keys {unknown}; it reads {sorted(names)}")
    url = str(config.get("sandbox_fusion_url") or "").rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(
            f"config.sandbox_fusion_url = {url!r}: give the service's address, "
            'e.g. sandbox_fusion_url: "http://localhost:8080" in the tool YAML'
        )
    values = {names[k]: v for k, v in config.items() if k in names and k != "sandbox_fusion_url"}
    try:
        settings = ServiceSettings(url.removesuffix("/run_code") + "/run_code", **values)
    except (TypeError, ValueError) as e:
        raise ValueError(f"config: {e}") from e
    if not (settings.run_timeout > 0 and settings.compile_timeout > 0):
        raise ValueError("config: default_timeout and compile_timeout must be positive")
    if settings.retries < 0 or settings.retry_delay_s < 0 or settings.request_timeout_s < 0:
        raise ValueError("config: retries, retry_delay_s and request_timeout_s must be >= 0")
    return settings


def post_run_code(code: str, settings: ServiceSettings) -> dict:
    """The service's answer to one run_code request, retried as the module docstring says."""
    body = {
        "code": code,
        "language": settings.language,
        "run_timeout": settings.run_timeout,
        "compile_timeout": settings.compile_timeout,
        "memory_limit_MB": settings.memory_limit_mb,
    }
    timeout = settings.request_timeout_s or settings.run_timeout + settings.compile_timeout + 10
    request = urllib.request.Request(
        settings.url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    problem = ""
    for attempt in range(settings.retries + 1):
        if attempt:
            time.sleep(settings.retry_delay_s * 2 ** (attempt - 1))
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                text = response.read()
        except urllib.error.HTTPError as e:
            problem = f"HTTP {e.code}: {e.read()[:500].decode(errors='replace')}"
            if e.code < 500:  # the request itself is wrong: trying again changes nothing
                raise SandboxServiceError(f"{settings.url} answered {problem}") from e
            continue
        except (TimeoutError, urllib.error.URLError, ConnectionError) as e:
            reason = getattr(e, "reason", e)
            if isinstance(reason, TimeoutError):
                raise SandboxServiceError(
                    f"{settings.url} gave no answer within {timeout:g} s"
                ) from e
            problem = f"{type(reason).__name__}: {reason}"
            continue
        try:
            return json.loads(text)
        except ValueError as e:
            raise SandboxServiceError(f"{settings.url} answered with no JSON: {text[:200]}") from e
    tries = settings.retries + 1
    raise SandboxServiceError(f"{settings.url} failed {tries} tries; the last: {problem}")


def output_text(answer: dict, settings: ServiceSettings) -> str:
    """What the model sees of an answer: the output, and why the run stopped if it did not
    finish; SandboxServiceError for the service's own failure."""
    status = answer.get("status")
    if status not in ("Success", "Failed"):
        message = answer.get("message") or "no message"
        raise SandboxServiceError(f"the sandbox service answered status {status!r}: {message}")
    parts, reason = [], ""
    for stage in ("compile_result", "run_result"):
        result = answer.get(stage) or {}
        parts += [result.get("stdout") or "", result.get("stderr") or ""]
        if result.get("status") == "TimeLimitExceeded":
            reason = f"stopped: the code ran longer than {settings.run_timeout:g} s"
    out = "\n".join(p.rstrip("\n") for p in parts if p.strip())
    if reason:
        out = f"{out}\n{reason}" if out else reason
    elif status == "Failed" and not out:
        out = answer.get("message") or "the code failed with no output"
    return out or "(no output)"


class SandboxFusionTool:
    """verl's BaseTool shape (create, execute, calc_reward, release), so flowrl runs it as
    it runs verl's tools (verl.py): `code_interpreter(code)` answered by the service."""

    tool_schema = SCHEMA

    def __init__(self, config: dict | None = None, tool_schema=None):
        self.settings = service_settings(dict(config or {}))
        self.tool_schema = tool_schema or SCHEMA

    async def create(self, instance_id: str, **kwargs):
        return instance_id, ""

    async def execute(self, instance_id: str, parameters: dict, **kwargs):
        code = parameters.get("code")
        if not isinstance(code, str) or not code.strip():
            raise ValueError('code_interpreter needs "code", the program to run')
        return output_text(post_run_code(code, self.settings), self.settings), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        return None
