"""The HTTP side of the endpoint: FastAPI routes over an `Endpoint` (endpoint.py), the key
check, OpenAI's error shape, and server-sent events for `stream: true`.

    GET  /v1/models
    POST /v1/chat/completions     messages (+ tools, tool_choice) -> chat.completion
    POST /v1/completions          text or token-id prompts -> text_completion

Keys (`Keys`): a request carries `Authorization: Bearer <key>`. The key is the endpoint's
fixed key, or one opened for an episode (`Keys.open`): its calls are recorded under that
episode. With the fixed key a request may name its episode in the `X-Episode-Id` header. An
endpoint with no fixed key and no episode open takes any key (as vLLM without --api-key).

Streaming: the rollout contract returns a whole turn, so a streamed answer's chunks (one per
token, then the tool calls, then the finish reason) are sent once the turn is sampled; the
shape is OpenAI's (and vLLM's `prompt_token_ids` in the first chunk, `token_ids` per chunk).
"""

from __future__ import annotations

import json
import secrets
import threading
import traceback

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from flowrl.serve.endpoint import Endpoint, Sample
from flowrl.serve.protocol import ApiError, ChatBody, CompletionBody, parse_body

EPISODE_HEADER = "x-episode-id"


class Keys:
    """Which keys the endpoint takes: `fixed` (None: none fixed) and one per open episode;
    `required`: no key is taken but these (else, with neither, any key is)."""

    def __init__(self, fixed: str | None = None, required: bool = False):
        self.fixed, self.required = fixed, required
        self.episodes: dict[str, str] = {}  # key -> episode id
        self.lock = threading.Lock()

    def open(self, episode: str) -> str:
        """A new key whose calls are recorded under `episode`."""
        key = f"ep-{secrets.token_urlsafe(18)}"
        with self.lock:
            self.episodes[key] = episode
        return key

    def close(self, key: str) -> None:
        with self.lock:
            self.episodes.pop(key, None)

    def episode(self, authorization: str | None, header: str | None) -> str:
        """The episode a request's key names ("" for none), or ApiError(401)."""
        key = ""
        if authorization and authorization.lower().startswith("bearer "):
            key = authorization[7:].strip()
        with self.lock:
            if key in self.episodes:
                return self.episodes[key]
            open_ = self.fixed is None and not self.episodes and not self.required
        if open_ or (self.fixed is not None and secrets.compare_digest(key, self.fixed)):
            return header or ""
        shown = f"{key[:4]}...{key[-2:]}" if len(key) > 8 else "(none)" if not key else "***"
        raise ApiError(401, f"Incorrect API key provided: {shown}", code="invalid_api_key")


def make_app(endpoint: Endpoint, keys: Keys) -> FastAPI:
    """The FastAPI application serving `endpoint` to callers holding one of `keys`."""
    app = FastAPI(title="flowrl", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        endpoint.stats[f"errors/{error.code}"] += 1
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(404)
    async def not_found(request: Request, error):
        return await api_error(
            request,
            ApiError(404, f"Unknown route {request.method} {request.url.path}", code="unknown_url"),
        )

    @app.exception_handler(Exception)
    async def crashed(request: Request, error: Exception):
        endpoint.stats["errors/internal_error"] += 1
        endpoint.last_error = "".join(traceback.format_exception(error))
        message = f"the engine failed: {type(error).__name__}: {error}"
        return JSONResponse(ApiError(500, message).body(), status_code=500)

    def episode_of(request: Request) -> str:
        return keys.episode(
            request.headers.get("authorization"), request.headers.get(EPISODE_HEADER)
        )

    @app.get("/v1/models")
    async def models(request: Request):
        episode_of(request)
        return endpoint.models()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        episode = episode_of(request)
        body = parse_body(await request.body(), ChatBody)
        prompt, samples = await endpoint.chat_completion(body, episode)
        if body.stream:
            return _events(chat_chunks(endpoint, body, prompt["prompt_ids"], samples))
        return endpoint.chat_answer(body, prompt["prompt_ids"], samples)

    @app.post("/v1/completions")
    async def completions(request: Request):
        episode = episode_of(request)
        body = parse_body(await request.body(), CompletionBody)
        prompts = await endpoint.completion(body, episode)
        answer = endpoint.completion_answer(body, prompts)
        if body.stream:
            return _events(completion_chunks(body, answer))
        return answer

    return app


def _events(chunks):
    def lines():
        for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream")


def chat_chunks(endpoint: Endpoint, body: ChatBody, prompt_ids: list[int], samples: list[Sample]):
    """The chat.completion.chunk objects of an answer: per choice a role chunk, one chunk per
    token (or, when the text holds tool calls, its content then its calls), a finish chunk;
    then a usage chunk when `stream_options.include_usage`."""
    answer = endpoint.chat_answer(body, prompt_ids, samples)
    head = {
        "id": answer["id"],
        "object": "chat.completion.chunk",
        "created": answer["created"],
        "model": answer["model"],
    }

    def chunk(index, delta, finish=None, extra=None):
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": None,
            "finish_reason": finish,
            **(extra or {}),
        }
        return {**head, "choices": [choice]}

    first = {"prompt_token_ids": prompt_ids} if body.return_token_ids else {}
    for choice, sample in zip(answer["choices"], samples, strict=True):
        yield {**chunk(choice["index"], {"role": "assistant", "content": ""}), **first}
        first = {}
        message = choice["message"]
        if "tool_calls" in message:
            ids = {"token_ids": sample.ids} if body.return_token_ids else {}
            if message["content"]:
                yield chunk(choice["index"], {"content": message["content"]})
            calls = [{"index": k, **c} for k, c in enumerate(message["tool_calls"])]
            yield chunk(choice["index"], {"tool_calls": calls}, extra=ids)
        else:
            yield from _token_chunks(endpoint, body, choice, sample, chunk)
        yield chunk(choice["index"], {}, choice["finish_reason"])
    if (body.stream_options or {}).get("include_usage"):
        yield {**head, "choices": [], "usage": answer["usage"]}


def _token_chunks(endpoint, body, choice, sample: Sample, chunk):
    logprobs = choice["logprobs"]["content"] if body.logprobs else None
    shown = ""
    for k, token in enumerate(sample.ids):
        text = endpoint.chat.decode(sample.ids[: k + 1])
        delta_text, shown = text[len(shown) :], text
        if len(shown) > len(sample.text):  # past a stop string: the answer's text ends before it
            delta_text = delta_text[: max(0, len(sample.text) - (len(shown) - len(delta_text)))]
        extra = {"token_ids": [token]} if body.return_token_ids else {}
        out = chunk(choice["index"], {"content": delta_text}, extra=extra)
        if logprobs is not None:
            out["choices"][0]["logprobs"] = {"content": [logprobs[k]]}
        yield out


def completion_chunks(body: CompletionBody, answer: dict):
    """The text_completion chunks of an answer: one per choice with its text, ids and
    log-probs, then a usage chunk when asked."""
    head = {
        "id": answer["id"],
        "object": "text_completion",
        "created": answer["created"],
        "model": answer["model"],
    }
    for choice in answer["choices"]:
        yield {**head, "choices": [choice]}
    if (body.stream_options or {}).get("include_usage"):
        yield {**head, "choices": [], "usage": answer["usage"]}
