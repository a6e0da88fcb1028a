"""The request bodies the endpoint accepts and the errors it answers, in OpenAI's shapes.

A body is checked whole before anything runs: a field OpenAI's API does not define (or vLLM's
`return_token_ids` / `top_k`, which flowrl also takes) is a 400 naming the field, as OpenAI
answers "Unrecognized request argument supplied"; so is a value out of range. Errors read

    {"error": {"message": ..., "type": "invalid_request_error", "param": ..., "code": ...}}

with status 400 (a bad request), 401 (a wrong key), 404 (an unknown route or model) or 500 (the
engine failed). No torch.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
    """An error the endpoint answers in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str = ""):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code or {400: "invalid_request", 401: "invalid_api_key", 404: "not_found"}.get(
            status, "internal_error"
        )

    @property
    def type(self) -> str:
        return {401: "authentication_error", 404: "invalid_request_error"}.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error"
        )

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = ""
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)  # vLLM's extra: 0 = off
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict | None = None
    user: str | None = None
    return_token_ids: bool | None = None  # vLLM's: prompt and completion ids in the answer
    frequency_penalty: float | None = None
    presence_penalty: float | None = None

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ApiError(400, "stop takes at most 4 non-empty strings", "stop")
        return stops


class ChatBody(_Body):
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class CompletionBody(_Body):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


def parse_body(raw: bytes, cls: type[_Body]) -> _Body:
    """The body `raw` as `cls`, or an ApiError(400) naming what is wrong."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    try:
        body = cls.model_validate(data)
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        if first["type"] == "extra_forbidden":
            message = f"Unrecognized request argument supplied: {param}"
        else:
            message = f"{param}: {first['msg']}"
        raise ApiError(400, message, param) from None
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(body, name):
            raise ApiError(400, f"{name} is not supported (only 0)", name)
    return body


def chat_messages(messages: list[dict]) -> list[dict]:
    """OpenAI messages as a chat template takes them: content parts joined into one string,
    an assistant's tool calls with their JSON arguments parsed into dicts."""
    if not messages:
        raise ApiError(400, "messages must not be empty", "messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        role = message.get("role")
        if role not in ROLES:
            raise ApiError(400, f"{where}.role must be one of {', '.join(ROLES)}", f"{where}.role")
        message = dict(message)
        message["content"] = _text(message.get("content"), f"{where}.content")
        if message.get("tool_calls"):
            message["tool_calls"] = [
                _call(c, f"{where}.tool_calls.{k}") for k, c in enumerate(message["tool_calls"])
            ]
        out.append(message)
    return out


def _text(content, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise ApiError(400, f"{where}: only text parts are supported", where)
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise ApiError(400, f"{where} must be a string or a list of text parts", where)


def _call(call, where: str) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ApiError(400, f"{where} needs function.name", where)
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except json.JSONDecodeError as e:
            raise ApiError(
                400,
                f"{where}.function.arguments is not valid JSON: {e.msg}",
                where,
                "invalid_tool_call",
            ) from None
    return {**call, "function": {"name": function["name"], "arguments": arguments}}
