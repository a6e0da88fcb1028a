"""The batch's decode steps (slots.py `Batch` inherits them): sample a token for every
decoding request, let the finished ones leave, feed the others in one model call with the new
tokens of the requests joining. A runner that samples on the device (runner.py `Block`) makes
up to BLOCK_STEPS steps at once while nobody joins, read back once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import attrs
import torch

from flowrl.engines.hf.runner import Block, ModelRunner
from flowrl.engines.hf.sampling import sample_rows
from flowrl.engines.rollout import Request, Result

# decode steps a runner that samples on the device makes per read back (runner.py `Block`):
# the host reads its rows' tokens once per block; a row that stops within it idles to its end
BLOCK_STEPS = 16


@attrs.define(eq=False)
class Row:
    """One request inside the engine."""

    request: Request
    deliver: Callable  # (Result | BaseException) -> None, on the caller's loop
    slot: int = -1
    tokens: list = attrs.Factory(list)  # ids whose keys and values fill the slot's columns
    new: list = attrs.Factory(list)  # ids to feed before this turn's first sample
    # its random stream: a torch.Generator (eager runner), a counter stream's key (a runner
    # that samples on the device: sampling.py); None: greedy
    stream: torch.Generator | int | None = None
    out: list = attrs.Factory(list)
    logprobs: list = attrs.Factory(list)
    next: int = -1  # the token sampled last, fed at the next decode call
    stopped: str = ""  # "abort" once released or cancelled while running


class BatchParts(Protocol):
    """What `Decoding` needs of the class it is mixed into (slots.py `Batch`): the batch's
    state, and how it seats rows and lays out calls (tests/unit/engines/hf/
    test_decoding_parts.py checks both sides against this list)."""

    runner: ModelRunner  # makes the model calls, owns the slot cache
    eos: int
    slots: list[Row | None]  # slot -> its row: decoding ones first, then held ones
    decoding: int  # slots 0..decoding-1 decode
    logits: torch.Tensor | None  # (decoding, v) next-token logits of those slots
    counts: dict[str, int]  # model calls and tokens, by kind
    held: dict[str, Row]  # request id -> its row, kept for a next turn
    hold: Callable[[str], None]  # told of each request kept for a next turn

    def admit(self, arrivals: list[Row]) -> None: ...

    def _seat(self, rows: list[Row]) -> tuple[list[Row], list[Row], list[tuple[Row, Row]]]: ...

    def _cached_prefix(self, leaders: list[Row]) -> list[Row]: ...

    def _call(self, chunks: list[list[int]], offsets: list[int], lo: int, packed=False): ...

    def _copy_rows(self, copies: list[tuple[Row, Row]]) -> None: ...

    def _swap(self, a: int, b: int) -> None: ...


@attrs.frozen
class Read:
    """A block read back already: `read()` gives its tokens and log-probs."""

    tokens: list
    logprobs: list

    def read(self) -> tuple[list, list]:
        return self.tokens, self.logprobs


class Decoding:
    """`step` and what it needs, for a class that is a `BatchParts` (slots.py `Batch`)."""

    def step(self, joining: list[Row]) -> None:
        """Sample a token for every decoding row; then one call feeds them, with the new tokens
        of `joining` (returning requests, new prompts) packed beside them. A runner that
        samples on the device makes up to BLOCK_STEPS such steps at once while nobody joins."""
        if not joining and self._blocks():
            self._decode_block()
            return
        if self.decoding:
            self._sample()
        if not self.decoding:  # nothing decodes: the joining requests get a prefill call
            self.logits = None
            self.admit(joining)
            return
        rows = self.slots[: self.decoding]
        joined, leaders, copies = self._seat(joining)
        self._cached_prefix(leaders)
        chunks = [[r.next] for r in rows] + [r.new for r in joined]
        offsets = [len(r.tokens) for r in rows + joined]
        self.logits = self._call(chunks, offsets, 0, packed=True)
        for row in rows:
            row.tokens.append(row.next)
        for row in joined:
            self.counts["prefill_tokens"] += len(row.new)
            row.tokens, row.new = row.tokens + row.new, []
        self.decoding += len(joined)
        self._copy_rows(copies)

    def _sample(self) -> None:
        """Each decoding row's next token; the rows that finished leave their slots."""
        rows = self.slots[: self.decoding]
        tokens, logprobs = sample_rows(rows, self.logits)
        leaving = []
        for row, token, logprob in zip(rows, tokens, logprobs, strict=True):
            if row.stopped or self._take(row, token, logprob):
                leaving.append(row)
            else:
                row.next = token
        self._leave(leaving)

    def _take(self, row: Row, token: int, logprob: float) -> bool:
        """Append a sampled token to `row`'s output -> whether it ended the turn."""
        row.out.append(token)
        row.logprobs.append(logprob if row.request.logprobs else 0.0)
        if token == self.eos:
            row.stopped = "stop"
        elif len(row.out) >= row.request.max_new_tokens:
            row.stopped = "length"
        return bool(row.stopped)

    def _leave(self, leaving: list[Row]) -> None:
        """The finished rows leave the decoding slots (last first) and get their results.
        When none is kept, the rows that move into the freed slots move in one copy
        (`_vacate_all`)."""
        if leaving and not any(self._keeps(r) for r in leaving):
            self._vacate_all(leaving)
            return
        for row in sorted(leaving, key=lambda r: -r.slot):
            last = self.decoding - 1
            if self._keeps(row):  # its cache goes on living past the decoding slots
                self._swap(row.slot, last)
            else:  # nothing of it is kept: the last decoding row moves into its slot
                self._vacate(row.slot, last)
            self.decoding -= 1
            self._finish(row)

    def _take_block(self, row: Row, tokens, logprobs) -> bool:
        """`_take` of a block's tokens for `row` up to its stop (its eos, or its last token):
        the taken ones are appended, all but a stopping one fed -> whether it stopped."""
        limit = row.request.max_new_tokens - len(row.out)
        n = min(len(tokens), limit)
        try:
            n = tokens.index(self.eos, 0, n) + 1
            stopped = "stop"
        except ValueError:
            stopped = "length" if n == limit else ""
        taken = list(tokens[:n])
        row.out += taken
        row.logprobs += list(logprobs[:n]) if row.request.logprobs else [0.0] * n
        row.tokens += taken[:-1] if stopped else taken  # fed in the block
        if stopped:
            row.stopped = stopped
        return bool(stopped)

    def _blocks(self) -> bool:
        """Whether the next steps can run as a device block (runner.py `Block`): the runner
        samples on the device, and the decoding rows share their sampling settings and have
        no forced ids left."""
        rows = self.slots[: self.decoding]
        return bool(
            rows
            and self.runner.device_sampling
            and self.logits is not None
            and len({r.request.sampling for r in rows}) == 1
            and all(len(r.out) >= len(r.request.forced) for r in rows)
        )

    def _decode_block(self) -> None:
        """Up to BLOCK_STEPS decode steps on the device, read back once: each row takes its
        tokens up to its stop; the rows that finished leave their slots. Where a row can go
        on past the block, the next block is queued behind it before it is read (its
        finished rows tracked on the device, fed nowhere), so the device decodes while the
        host takes the first block's tokens; then both are taken and the rows leave."""
        rows = self.slots[: self.decoding]
        left = [r.request.max_new_tokens - len(r.out) for r in rows]
        block = Block(
            keys=[r.stream or 0 for r in rows],
            counters=[len(r.out) for r in rows],
            offsets=[len(r.tokens) for r in rows],
            left=left,
            sampling=rows[0].request.sampling,
            logprobs=any(r.request.logprobs for r in rows),
            steps=min(BLOCK_STEPS, max(left)),
            eos=self.eos,
        )
        launch = getattr(self.runner, "launch_block", None)
        if launch is None:  # a runner that reads each block back at once
            tokens, logprobs, logits = self.runner.decode_block(self.logits, block)
            launched = [(block, Read(tokens, logprobs))]
        else:
            first = launch(self.logits, block)
            launched = [(block, first)]
            if max(left) > block.steps:  # a row goes on: the next block, queued behind
                after = attrs.evolve(
                    block,
                    counters=[c + block.steps for c in block.counters],
                    offsets=[o + block.steps for o in block.offsets],
                    left=[n - block.steps for n in left],
                    steps=min(BLOCK_STEPS, max(left) - block.steps),
                )
                launched.append((after, launch(first.logits, after, done=first.done)))
            logits = launched[-1][1].logits
        leaving, gone = [], set()
        for b, handle in launched:  # the first block is taken while the device runs the next
            tokens, logprobs = handle.read()
            self.counts["decode_calls"] += b.calls
            # per row (d lists of steps): a row's tokens taken as slices, not one by one
            columns, chances = list(zip(*tokens, strict=True)), list(zip(*logprobs, strict=True))
            for k, row in enumerate(rows):
                if id(row) in gone:
                    continue
                if row.stopped or self._take_block(row, columns[k], chances[k]):
                    leaving.append(row)  # a row released while the block ran takes nothing
                    gone.add(id(row))
        index = {id(row): k for k, row in enumerate(rows)}
        self.logits = None  # the rows' order changes as they leave
        self._leave(leaving)
        staying = [index[id(r)] for r in self.slots[: self.decoding]]
        self.logits = logits if not leaving else logits[staying]

    def _keeps(self, row: Row) -> bool:
        request = row.request
        return bool(request.keep and request.request_id and row.stopped != "abort")

    def _vacate_all(self, leaving: list[Row]) -> None:
        """`_vacate` for every leaving row (last first), the slots' bookkeeping first and
        the cached columns after, in one `runner.move` of every moved row from the slot it
        had to the slot it ends in (a row may move twice: only its ends count). Sources are
        past the decoding rows left, destinations before: no slot is both."""
        start: dict[int, tuple[Row, int]] = {}  # id(row) -> (row, its slot before)
        for row in sorted(leaving, key=lambda r: -r.slot):
            last = self.decoding - 1
            moved = self.slots[last]
            if row.slot != last:
                start.setdefault(id(moved), (moved, moved.slot))
                self.slots[row.slot], moved.slot = moved, row.slot
            self.slots[last] = None
            self.decoding -= 1
            self._finish(row)
        moves = [(slot, row.slot, len(row.tokens)) for row, slot in start.values()]
        if moves:
            src, dst, columns = zip(*moves, strict=True)
            self.runner.move(list(src), list(dst), max(columns))

    def _vacate(self, slot: int, last: int) -> None:
        """Free `slot` (its row is done) by moving the row at `last` into it: one row's
        columns copied, where a swap copies two."""
        moved = self.slots[last]
        if slot != last:
            self.runner.move([last], [slot], len(moved.tokens))
            self.slots[slot], moved.slot = moved, slot
        self.slots[last] = None

    def _finish(self, row: Row) -> None:
        request = row.request
        if self._keeps(row):
            self.held[request.request_id] = row
            self.hold(request.request_id)
        elif self.slots[row.slot] is row:
            self.slots[row.slot] = None
        row.deliver(Result(list(row.out), list(row.logprobs), row.stopped))
