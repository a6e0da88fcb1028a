"""The rollout-backend contract: a backend serves requests, one conversation turn each.

    result = await backend.generate(Request(ids, max_new_tokens, sampling, ...))

A `Request` is token ids in: the whole conversation so far (prompt, earlier turns, tool
output), a token limit, sampling settings, a seed and a turn number (each request samples from
its own random stream: its tokens do not depend on which other requests share a batch), and
optionally a request id with `keep = True`. A `Result` is the ids sampled (a matched stop token
included), each one's log-prob under the distribution it was drawn from, and why it ended:
"stop" (the stop token), "length" (the token limit) or "abort" (released while running).
Single-turn generation, validation and the agent node all go through `generate`; the batch
helper for the first two is flowrl/engines/batch.py.

KV reuse and freeing. A request with `keep = True` and a request id asks the backend to keep
its KV after the result: the next request with that id sends the whole conversation again,
and the backend computes only the tokens past the longest prefix it holds (flowrl's own `hf`
engine holds the request's cache rows by id; SGLang keeps every finished request's prefix in
its radix cache and matches it by content). `release(request_id)` frees what is held for the
id (a request still running ends with "abort"); a request with `keep = False` frees its KV the
moment it finishes. Callers release every id they kept, in a `finally`.

A graph picks a backend per model with `rollout = "<name>"` in `[models.<name>]`; its record
(import path, device, package, multi-turn) is a line of the torch-free table
`flowrl.backends.ROLLOUT_BACKENDS`, and the pool worker builds it with `make_rollout`. Adding
a backend is one module with one class of the shape of `RolloutBackend`, plus one line in that
table (docs/extending.md).

Memory: the compiler tracks a rollout model's `weights` and `kv_cache` parts. When a plan moves
parts off or back on the device, the pool worker calls `offload(parts)` or `reload(parts)` with
the parts that move; each backend acts on those it holds (flowrl's own engine: the KV cache; a
server with its own copy of the weights: both). After an update it calls
`sync_weights(module)`, so the next step samples from the trained weights.

"""

from __future__ import annotations

import functools
import math
import operator
from typing import Any, Protocol, runtime_checkable

import attrs

from flowrl import contracts, refs
from flowrl.backends import NoOptions, backend
from flowrl.engines import threads
from flowrl.errors import FlowrlError
from flowrl.lazy import torch

FINISH_REASONS = ("stop", "length", "abort")


@attrs.frozen
class Sampling:
    """How a request's tokens are chosen: greedy when `do_sample` is False or temperature 0,
    else sampled after temperature, top-k (0 = off) and top-p (1.0 = off), in that order."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    do_sample: bool = True

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0


@attrs.frozen
class Request:
    """One turn of one conversation.

    Attributes:
        ids: the whole conversation so far as token ids (a backend holding the request's KV
            computes only what follows the prefix it holds).
        max_new_tokens: the most tokens to sample; 0 gives an empty "length" result.
        sampling: the sampling settings.
        request_id: names the conversation across turns ("" for a one-off request).
        keep: hold the KV after this turn for the next request of `request_id`, until
            `release(request_id)`.
        seed: the request's random stream; the caller derives it from (run seed, step, row).
        turn: the turn number: the stream of turn k is seeded by (seed, k).
        forced: ids taken as the first sampled tokens whatever the model prefers (a scripted
            turn), each with the policy's log-prob of it at the sampling temperature.
        logprobs: compute the sampled tokens' log-probs (else 0.0).
    """

    ids: tuple[int, ...] = attrs.field(converter=tuple)
    max_new_tokens: int
    sampling: Sampling = Sampling()
    request_id: str = ""
    keep: bool = False
    seed: int = 0
    turn: int = 0
    forced: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    logprobs: bool = True


@attrs.frozen
class Result:
    """What a request sampled: ids (a matched stop token included, as the last), log-probs
    (one per id: under the distribution it was drawn from, after temperature, top-k, top-p;
    greedy: the model's at temperature 1), and the finish reason ("stop", "length", "abort")."""

    ids: list[int]
    logprobs: list[float]
    finish_reason: str


@runtime_checkable
class RolloutBackend(Protocol):
    """A rollout engine, built as `Backend(module, tokenizer, device, options=..., seed=...,
    where=...)`: the model's (possibly shared) torch module, its tokenizer, a device string
    ("cpu", "cuda:0"), its own settings (an instance of its record's `options` class, from
    `[models.<m>.rollout_options]`), the run's seed for this rank and "pool p, rank r, model
    m" for its messages. `RolloutBase` gives every member but `generate` a default."""

    device: torch.device  # where its tensors live
    tokenizer: Any  # the model's tokenizer; its eos is the stop token
    pad: int  # the id that pads results into a batch (the tokenizer's pad, else its eos)
    lockstep: bool  # requests batch as a function of their seeds (the agent starts all first)

    async def generate(self, request: Request) -> Result:
        """Sample one turn for `request` (see `Request`, `Result`). Requests may be issued
        concurrently from one event loop: a backend batches what runs at the same time."""
        ...

    def run(self, coroutine) -> Any:
        """Run `coroutine` (requests to this backend) to its end from synchronous code, on
        the loop and thread the backend needs; returns its value."""
        ...

    def release(self, request_id: str) -> None:
        """Free what is held for `request_id` (nothing held: nothing to do)."""
        ...

    def offload(self, parts: tuple[str, ...]) -> None:
        """Free the device memory of those of `parts` ("weights", "kv_cache") it holds."""
        ...

    def reload(self, parts: tuple[str, ...]) -> None:
        """Make those of `parts` it holds usable again (before a generate: "kv_cache")."""
        ...

    def sync_weights(self, source: torch.nn.Module) -> None:
        """Take the weights of `source` (the train engine's module, maybe the same object; for
        a model sharded by fsdp, the pool's unsharded rollout copy, refreshed just before)."""
        ...


class RolloutBase:
    """The contract's defaults: a backend subclasses this and writes `generate`, and whatever
    else it does differently.

    Class attributes, read by `flowrl check` for a backend named by reference (the table's
    backends say the same in their `Backend` record): `runs_on` (the one device kind it runs
    on, or None), `dtypes` (the model dtypes it serves; () for any), `multi_turn` (it keeps a
    request's KV between turns), `Options` (the attrs class of its settings).

    Defaults: `run` on a fresh event loop (`run_sync`), `pad` the tokenizer's pad id (else its
    eos), `lockstep` False, `release`, `offload` and `reload` nothing to do, `sync_weights`
    copies the source's weights unless it is the backend's own module.
    """

    runs_on: str | None = None
    dtypes: tuple[str, ...] = ()
    multi_turn: bool = False
    Options: type = NoOptions
    lockstep: bool = False

    def __init__(self, module, tokenizer, device="cpu", *, options=None, seed=0, where=""):
        self.module, self.tokenizer, self.device = module, tokenizer, torch.device(device)
        self.options = self.Options() if options is None else options
        self.seed, self.where = seed, where or f"device {device}"

    @property
    def pad(self) -> int:
        tokenizer = self.tokenizer
        pad = tokenizer.pad_token_id
        return pad if pad is not None else tokenizer.eos_token_id

    def run(self, coroutine):
        return threads.run_sync(coroutine)

    def release(self, request_id: str) -> None:
        pass

    def offload(self, parts: tuple[str, ...]) -> None:
        pass

    def reload(self, parts: tuple[str, ...]) -> None:
        pass

    weights_version = 0  # weight syncs taken so far (the endpoint stamps calls with it)

    def sync_weights(self, source) -> None:
        self.weights_version += 1
        if source is not self.module:
            self.module.load_state_dict(source.state_dict())

    def close(self) -> None:
        """Release what the backend made (a server process, a temp folder, a session) when
        the pool shuts down; called once, also after a failed run."""


def request_seed(base: int, row: int) -> int:
    """The seed of row `row` of a batch whose generator seed is `base` (splitmix64 of both)."""
    return mix(base, row)


def mix(a: int, b: int) -> int:
    """Two integers into one 63-bit seed (splitmix64's finaliser over a + golden-ratio * b),
    so that nearby pairs give unrelated streams."""
    z = (a * 0x9E3779B97F4A7C15 + b + 0x632BE59BD9B4E019) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) >> 1


def rollout_class(name: str, base_dir=".") -> type:
    """The class of backend `name` (a line of flowrl.backends.ROLLOUT_BACKENDS, or a
    reference "file.py:Class" resolved against `base_dir`), imported now."""
    return refs.load(backend(name, base_dir).ref, base_dir, what=f'rollout backend "{name}"')


def make_rollout(
    name: str,
    module,
    tokenizer,
    device: str = "cpu",
    *,
    options=None,
    seed: int = 0,
    where: str = "",
    base_dir=".",
) -> RolloutBackend:
    """A rollout engine of backend `name` over `module` (shared with the train engine when
    colocated, so a weight sync costs nothing) and `tokenizer`, on `device`.

    Args:
        options: an instance of the backend's options class (default: its defaults).
        seed: the run's seed for this rank (a backend sampling with its own random state
            seeds it from this; flowrl's own engine seeds each request instead).
        where: "pool p, rank r, model m", for the backend's error messages.
        base_dir: the folder a backend named by reference resolves against.
    """
    record = backend(name, base_dir)
    cls = refs.load(record.ref, base_dir, what=f'rollout backend "{name}"')
    options = record.options() if options is None else options
    made = f'rollout backend "{name}": {contracts.place(cls)}'
    try:
        instance = cls(module, tokenizer, device, options=options, seed=seed, where=where)
    except TypeError as e:  # an old constructor shape; `flowrl check` says so first
        raise RolloutResultError(f"{made} could not be built ({e})", BACKEND_INIT_FIX) from e
    return checking(instance, made, module)


BACKEND_INIT_FIX = (
    "take __init__(self, module, tokenizer, device, *, options=None, seed=0, where=''), "
    "or subclass flowrl.api.RolloutBase and call super().__init__ with them"
)


class RolloutResultError(FlowrlError, ValueError):
    """What a rollout backend returned breaks the contract: names the backend, its file, what
    was wrong with the result and the fix."""

    def __init__(self, message: str, fix: str):
        super().__init__(f"{message}: {fix}")


def checking(instance, made: str, module=None):
    """`instance` with its `generate` checked at every call (`result_problem`): a result that
    breaks the contract raises `RolloutResultError` naming `made` (the backend and its file)
    instead of training on it. Returns the instance itself."""
    generate = instance.generate
    embeddings = getattr(module, "get_input_embeddings", lambda: None)()
    tokenizer = getattr(instance, "tokenizer", None)
    vocab = getattr(embeddings, "num_embeddings", None) or len(tokenizer or ()) or None

    @functools.wraps(generate)
    async def checked_generate(request):
        result = await generate(request)
        try:
            return checked_result(request, result, vocab)
        except _Wrong as e:
            raise RolloutResultError(f"{made} returned {e}", e.fix) from None

    instance.generate = checked_generate
    return instance


class _Wrong(ValueError):
    def __init__(self, what: str, fix: str):
        super().__init__(what)
        self.fix = fix


RESULT_FIX = "return flowrl.api.Result(ids, logprobs, finish_reason)"


def checked_result(request: Request, result, vocab: int | None = None) -> Result:
    """`result` of `request` as a `Result` of plain ints and floats, or ValueError (with a
    `.fix`) saying what breaks the contract: not a result; ids that are not token ids of the
    vocabulary; log-probs not one finite number <= 0 per id; more ids than `max_new_tokens`;
    ids that do not start with the forced ones; an unknown finish reason."""
    if not all(hasattr(result, k) for k in ("ids", "logprobs", "finish_reason")):
        raise _Wrong(f"a {type(result).__name__}, not a Result", RESULT_FIX)
    try:
        ids = [operator.index(i) for i in result.ids]
    except TypeError:
        kinds = sorted({type(i).__name__ for i in result.ids})
        raise _Wrong(f"ids of types {kinds}", "return token ids as ints (tolist())") from None
    if any(i < 0 or (vocab is not None and i >= vocab) for i in ids):
        bad = next(i for i in ids if i < 0 or i >= (vocab or math.inf))
        raise _Wrong(f"the id {bad}, outside the vocabulary [0, {vocab})", "return token ids")
    try:
        logprobs = [float(v) for v in result.logprobs]
    except (TypeError, ValueError):
        raise _Wrong("log-probs that are not numbers", "one float per id (tolist())") from None
    if len(logprobs) != len(ids):
        raise _Wrong(
            f"{len(ids)} ids with {len(logprobs)} log-probs",
            "one log-prob per sampled id (0.0 each when the request does not ask for them)",
        )
    if len(ids) > request.max_new_tokens:
        raise _Wrong(
            f"{len(ids)} ids for max_new_tokens = {request.max_new_tokens}",
            'stop at max_new_tokens and finish with reason "length"',
        )
    if tuple(ids[: len(request.forced)]) != request.forced[: len(ids)]:
        raise _Wrong(
            f"ids {ids[: len(request.forced)]} where the request forced {list(request.forced)}",
            "begin the ids with request.forced (taken as sampled)",
        )
    if bad := [v for v in logprobs if not math.isfinite(v) or v > 1e-3]:
        raise _Wrong(
            f"the log-prob {bad[0]} (not a finite number <= 0)",
            "return each sampled token's log-prob under the distribution it was drawn from "
            "(a NaN or inf is a bug in the backend, not the learning rate)",
        )
    if result.finish_reason not in FINISH_REASONS:
        reasons = ", ".join(f'"{r}"' for r in FINISH_REASONS)
        raise _Wrong(f'the finish reason "{result.finish_reason}"', f"use one of {reasons}")
    return Result(ids, logprobs, result.finish_reason)
