"""What the OpenAI-compatible endpoint does with a request, apart from HTTP: the prompt's
token ids (the chat template applied here, on the server, as vLLM does), the rollout
backend's samples, and the answer in OpenAI's shape (with vLLM's `prompt_token_ids` and
`token_ids` when `return_token_ids` is set).

    prompt ids   = chat template of `messages` (+ `tools`), with the generation prompt
    samples      = backend.generate(Request(prompt ids, max_tokens, sampling, seed_i)), i < n
    each sample  -> cut at the first `stop` string, its text parsed for tool calls
                 -> recorded under the caller's episode (record.py), with the policy version

The ids and log-probs answered and recorded are the engine's own: the ids it sampled and the
log-prob of each under the distribution it was drawn from (after temperature, top-k, top-p).
A `stop` string cuts the answer after the token that completes it (the engine stops only at
its eos, so tokens past the cut were sampled and dropped: they cost time, not correctness,
since each kept token depends only on those before it).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
import zlib
from collections import Counter

import attrs

from flowrl.agent.chat import ChatTokens
from flowrl.agent.parsers import HERMES, make_parser
from flowrl.engines.rollout import Request, Sampling, mix
from flowrl.serve.protocol import ApiError, ChatBody, CompletionBody, chat_messages
from flowrl.serve.top import top_logprobs


@attrs.frozen
class Sample:
    """One choice: the ids sampled (cut at a stop string), their log-probs, its text and why
    it ended ("stop", "length"; "tool_calls" is set when its text is parsed)."""

    ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    top: list | None = None  # per id: [(token, log-prob), ...], when top_logprobs is asked


@attrs.define
class Endpoint:
    """The endpoint over one rollout backend.

    Args:
        backend: a `flowrl.engines.rollout.RolloutBackend` (its tokenizer's eos ends a turn).
        model_name: the name `/v1/models` lists and requests may give as `model`.
        context: the most tokens a prompt and its completion may hold together.
        parser: the tool-call parser ("hermes", "tag", "file.py:function"), as the agent node's.
        max_n: the most choices one request may ask for (`n`).
        max_tokens: the most tokens one call samples; a request asking more gets this many
            (None: what the context leaves).
        sampling: the settings of a request that gives none of its own (None: OpenAI's,
            temperature 1); with `do_sample` False every request is greedy (validation).
        seed: the base of the seeds of requests that give none (each gets one from its episode's
            name and call count, or mix(seed, counter) outside an episode).
        recorder: where each call is recorded (record.py), or None.
        chat_template: a template text used instead of the tokenizer's, or None.
        base_dir: where a parser named by reference resolves.
    """

    backend: object
    model_name: str = "flowrl"
    context: int = 8192
    parser: str = "hermes"
    max_n: int = 16
    max_tokens: int | None = None
    seed: int = 0
    recorder: object = None
    sampling: Sampling | None = None
    chat_template: str | None = None
    base_dir: str = "."
    version: int = 0  # the policy version set at the step's start (`set_version`)
    stats: Counter = attrs.field(factory=Counter)  # calls, tokens, errors by code
    last_error: str = ""  # the traceback of the last request the engine failed
    inflight: dict = attrs.field(factory=dict)  # episode -> {(loop, job)} sampling now
    chat: ChatTokens = attrs.field(init=False)
    calls: int = attrs.field(init=False, default=0)
    episode_calls: Counter = attrs.field(init=False, factory=Counter)  # calls per episode
    synced_at: int = attrs.field(init=False, default=0)  # the backend's syncs at set_version

    def __attrs_post_init__(self):
        self.chat = ChatTokens(self.backend.tokenizer, self.chat_template)

    @property
    def tokenizer(self):
        return self.backend.tokenizer

    def _call_seed(self, episode: str) -> int:
        """The seed of a call that gives none: from the episode's name and its call count
        (episodes run at once arrive in any order, so a global counter would make a rollout
        depend on timing); a call of no episode counts on the endpoint's own calls."""
        if not episode:
            return mix(self.seed, self.calls)
        self.episode_calls[episode] += 1
        return mix(mix(self.seed, zlib.crc32(episode.encode())), self.episode_calls[episode])

    def set_version(self, version: int) -> None:
        """The policy version from now on (a step's start): a weight sync the backend takes
        later (`weights_version`, e.g. under run.staleness while an episode runs) raises it."""
        self.version, self.synced_at = version, getattr(self.backend, "weights_version", 0)

    def policy_version(self) -> int:
        """The version a call starting now samples with."""
        return self.version + getattr(self.backend, "weights_version", 0) - self.synced_at

    def models(self) -> dict:
        card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "flowrl"}
        return {"object": "list", "data": [card]}

    # -- the two generation routes ----------------------------------------------------------
    async def chat_completion(self, body: ChatBody, episode: str) -> tuple[dict, list[Sample]]:
        """The prompt ids of a chat body and its samples (see `chat_answer`)."""
        self._check_model(body.model)
        messages = chat_messages(body.messages)
        tools = body.tools or None
        try:
            ids = self.chat.encode(messages, generation_prompt=True, tools=tools)
        except Exception as e:  # the template raised on these messages (a jinja error)
            raise ApiError(
                400, f"the chat template failed on these messages: {e}", "messages"
            ) from None
        wanted = (
            body.max_completion_tokens
            if body.max_completion_tokens is not None
            else body.max_tokens
        )
        samples = await self.sample(ids, body, wanted, episode)
        return {"prompt_ids": ids}, samples

    async def completion(
        self, body: CompletionBody, episode: str
    ) -> list[tuple[list[int], list[Sample]]]:
        """Each prompt of a completion body (text or token ids) with its samples."""
        self._check_model(body.model)
        if body.echo and body.logprobs is not None:
            raise ApiError(400, "echo with logprobs is not supported (no prompt log-probs)", "echo")
        prompts = body.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise ApiError(400, "prompt must not be empty", "prompt")
        out = []
        for prompt in prompts:
            ids = self._prompt_ids(prompt)
            out.append((ids, await self.sample(ids, body, body.max_tokens, episode)))
        return out

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        else:
            vocab = len(self.tokenizer)
            if any(not 0 <= i < vocab for i in prompt):
                raise ApiError(400, f"prompt token ids must lie in [0, {vocab})", "prompt")
            ids = list(prompt)
        if not ids:
            raise ApiError(400, "the prompt has no tokens", "prompt")
        return ids

    def _check_model(self, model: str) -> None:
        if model and model != self.model_name:
            raise ApiError(
                404,
                f"The model `{model}` does not exist (this endpoint serves `{self.model_name}`).",
                "model",
                "model_not_found",
            )

    # -- sampling ----------------------------------------------------------------------------
    async def sample(self, ids: list[int], body, wanted: int | None, episode: str) -> list[Sample]:
        """`body.n` samples of `ids`, each cut at the body's stop strings and recorded."""
        if body.n > self.max_n:
            raise ApiError(400, f"n is {body.n}; this endpoint allows at most {self.max_n}", "n")
        stops = body.stops()
        room = self.context - len(ids)
        if room <= 0 or (wanted is not None and wanted > room):
            asked = "" if wanted is None else f" and {wanted} in the completion"
            raise ApiError(
                400,
                f"This model's maximum context length is {self.context} tokens. However, you "
                f"requested {len(ids) + (wanted or 0)} tokens ({len(ids)} in the messages{asked}).",
                "messages" if isinstance(body, ChatBody) else "prompt",
                "context_length_exceeded",
            )
        limit = min(room if wanted is None else wanted, self.max_tokens or room)
        sampling = self._sampling(body)
        self.calls += 1
        base = body.seed if body.seed is not None else self._call_seed(episode)
        version = self.policy_version()  # at the call's start
        requests = [Request(ids, limit, sampling, seed=mix(base, i)) for i in range(body.n)]
        results = await self._generate(requests, episode)
        samples = [self._cut(r.ids, r.logprobs, r.finish_reason, stops) for r in results]
        k = (body.top_logprobs or 0) if isinstance(body, ChatBody) else (body.logprobs or 0)
        if k:
            module = getattr(self.backend, "view", None) or self.backend.module
            tops = [
                await asyncio.to_thread(top_logprobs, module, ids, s.ids, k, sampling.temperature)
                for s in samples
            ]
            samples = [attrs.evolve(s, top=t) for s, t in zip(samples, tops, strict=True)]
        self.stats["calls"] += 1
        self.stats["completion_tokens"] += sum(len(s.ids) for s in samples)
        if self.recorder is not None:
            for sample in samples:
                self.recorder.add(
                    episode, ids, sample.ids, sample.logprobs, version, sample.finish_reason
                )
        return samples

    async def _generate(self, requests: list[Request], episode: str):
        """The backend's results, unless `cancel(episode)` ends the episode first."""
        job = asyncio.ensure_future(_all(self.backend.generate(r) for r in requests))
        entry = (asyncio.get_running_loop(), job)
        self.inflight.setdefault(episode, set()).add(entry)
        try:
            return await job
        except asyncio.CancelledError:
            if not job.cancelled():  # the request itself was cancelled (the client left)
                raise
            raise ApiError(
                409, "the episode has ended (its time ran out)", code="episode_ended"
            ) from None
        finally:
            self.inflight.get(episode, set()).discard(entry)

    def cancel(self, episode: str) -> None:
        """End the calls of `episode` still sampling (from any thread): the engine drops them
        and each caller gets a 409. The program node calls it when an episode's time is up."""
        self.episode_calls.pop(episode, None)  # its calls' seeds start again if reused
        for loop, job in self.inflight.pop(episode, set()):
            loop.call_soon_threadsafe(job.cancel)

    def _sampling(self, body) -> Sampling:
        default = self.sampling or Sampling()
        temperature = default.temperature if body.temperature is None else body.temperature
        greedy = temperature == 0 or not default.do_sample
        return Sampling(
            temperature=temperature or 1.0,
            top_p=default.top_p if body.top_p is None else body.top_p,
            top_k=default.top_k if body.top_k is None else body.top_k,
            do_sample=not greedy,
        )

    def _cut(self, ids: list[int], logprobs: list[float], reason: str, stops: list[str]) -> Sample:
        if reason == "abort":
            raise ApiError(
                500, "the engine dropped the request (it was released or offloaded)", code="aborted"
            )
        text = self.chat.decode(ids)
        at = min((p for p in (text.find(s) for s in stops) if p >= 0), default=-1)
        if at < 0:
            return Sample(list(ids), list(logprobs), text, reason)
        end = at + next(len(s) for s in stops if text.find(s) == at)
        lo, hi = 1, len(ids)  # the fewest tokens whose text holds the stop string
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self.chat.decode(ids[:mid])) >= end:
                hi = mid
            else:
                lo = mid + 1
        return Sample(list(ids[:lo]), list(logprobs[:lo]), text[:at], "stop")

    # -- answers -------------------------------------------------------------------------------
    def tool_calls(self, text: str, tools: list[dict] | None) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of an assistant text: the calls the model's parser finds, or
        none when one of them is malformed (then the whole text is the content, and counted)."""
        names = [t.get("function", {}).get("name", "") for t in tools or []]
        calls = make_parser(self.parser, names, self.base_dir)(text)
        if not calls:
            return text, []
        if any(c.error for c in calls):
            self.stats["malformed_tool_calls"] += 1
            return text, []
        out = []
        for call in calls:
            arguments = call.arguments
            if isinstance(arguments, str):  # a tag call's one argument: the tool's one parameter
                arguments = {_one_parameter(tools, call.name): arguments}
            function = {"name": call.name, "arguments": json.dumps(arguments)}
            out.append(
                {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": function}
            )
        content = HERMES.sub("", text).strip() if self.parser == "hermes" else text
        return content or None, out

    def chat_answer(self, body: ChatBody, prompt_ids: list[int], samples: list[Sample]) -> dict:
        """The chat.completion object of the samples of one chat body."""
        choices = []
        for i, s in enumerate(samples):
            use_tools = body.tools and body.tool_choice != "none"
            content, calls = self.tool_calls(s.text, body.tools) if use_tools else (s.text, [])
            message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            choice = {
                "index": i,
                "message": message,
                "finish_reason": "tool_calls" if calls else s.finish_reason,
            }
            choice["logprobs"] = self.chat_logprobs(s) if body.logprobs else None
            if body.return_token_ids:
                choice["token_ids"] = s.ids
            choices.append(choice)
        answer = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": usage(len(prompt_ids), samples),
        }
        if body.return_token_ids:
            answer["prompt_token_ids"] = prompt_ids
        return answer

    def chat_logprobs(self, s: Sample) -> dict:
        tops = s.top or [[] for _ in s.ids]
        content = []
        for token, logprob, top in zip(s.ids, s.logprobs, tops, strict=True):
            entry = self._token(token, logprob)
            entry["top_logprobs"] = [self._token(t, lp) for t, lp in top]
            content.append(entry)
        return {"content": content}

    def _token(self, token: int, logprob: float) -> dict:
        text = self.tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def completion_answer(
        self, body: CompletionBody, prompts: list[tuple[list[int], list[Sample]]]
    ) -> dict:
        """The text_completion object of every prompt's samples (choice index = prompt * n + i)."""
        choices, prompt_tokens, samples_all = [], 0, []
        for p, (ids, samples) in enumerate(prompts):
            prompt_tokens += len(ids)
            samples_all += samples
            echo = self.tokenizer.decode(ids) if body.echo else ""
            for i, s in enumerate(samples):
                choice = {
                    "index": p * body.n + i,
                    "text": echo + s.text,
                    "finish_reason": s.finish_reason,
                }
                choice["logprobs"] = (
                    self.completion_logprobs(s) if body.logprobs is not None else None
                )
                if body.return_token_ids:
                    choice["prompt_token_ids"], choice["token_ids"] = ids, s.ids
                choices.append(choice)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": usage(prompt_tokens, samples_all),
        }

    def completion_logprobs(self, s: Sample) -> dict:
        tokens = [self.tokenizer.decode([t]) for t in s.ids]
        offsets = [len(self.chat.decode(s.ids[:k])) for k in range(len(tokens))]
        top = None
        if s.top is not None:
            top = [{self.tokenizer.decode([t]): lp for t, lp in row} for row in s.top]
        return {
            "tokens": tokens,
            "token_logprobs": s.logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }


async def _all(coroutines):
    """gather as a task, which `cancel` leaves cancelled (a cancelled gather raises instead)."""
    return await asyncio.gather(*coroutines)


def usage(prompt_tokens: int, samples: list[Sample]) -> dict:
    completion = sum(len(s.ids) for s in samples)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }


def _one_parameter(tools: list[dict] | None, name: str) -> str:
    for tool in tools or []:
        function = tool.get("function", {})
        if function.get("name") == name:
            properties = list(function.get("parameters", {}).get("properties", {}))
            if len(properties) == 1:
                return properties[0]
    return "input"
