"""Partial rollouts with groups streamed into the queue: run.partial_rollout = L, with
run.staleness = k > 0 (docs/scaling.md, "Partial rollouts").

The rollout stage works in rounds instead of whole batches. Round r:

    v = version(complete, k, start)  complete: the steps whose batch is assembled so far
    rows = the groups still in flight + the next prompt batch (n rows per prompt)
    every unfinished row samples at most L more tokens on the weights of update v, from its
        prompt and its response so far (its KV computed again on these weights)
    a row ends at its stop token or at max_new_tokens; a group (the n rows of a prompt) whose
        rows have all ended joins the finished groups; the other groups carry over to round r+1
    while batch_size groups are finished, the first batch_size are the batch of step complete+1,
        and the rest of the rollout stage (reward, advantage) runs on it, as on a whole batch

So a weight sync waits for at most L tokens of decoding, never for the longest response, and a
long response is spread over rounds that also decode new prompts. Every token keeps the version
that sampled it (`token_version`, (b, t)); a row's `weight_version` is its oldest token's. The
version rule reads counts, never timing, so a run is reproducible and a resume continues it
exactly; when no response is split, round r is step r's batch with the version of whole batches.
It never waits on itself: the round that completes step s + 1 needs update s - k at most.

A checkpoint after step s holds the state after the last round generated with weights older
than update s (finished groups, groups in flight with their tokens so far, batches assembled for
later steps, the loader's position); a resume generates the rounds after it from the
checkpoint's weights, as the uninterrupted run did.
"""

from __future__ import annotations

import attrs
import torch

from flowrl.protocol import DataProto
from flowrl.runtime.executor import LEFT_PADDED, StepResult
from flowrl.runtime.pipeline import (
    TRACK,
    VERSION_KEY,
    Pipeline,
    Producer,
    Queued,
    Rollout,
    next_version,
)

TOKEN_VERSION = "token_version"  # (b, t) int64: the update whose weights sampled each token
RESPONSE = ("responses", "response_mask", "rollout_logprobs", TOKEN_VERSION)  # right-padded
# a row's bookkeeping: its group, whether it ended, the rounds it sampled in
GROUP, ENDED, SEGMENTS = "group", "ended", "segments"


@attrs.define
class Rounds:
    """The rollout stage's state between rounds (all of it deterministic)."""

    done: int = 0  # rounds generated
    complete: int = 0  # steps whose batch is assembled
    groups: int = 0  # groups admitted (a group's id is its number)
    carry: DataProto | None = None  # rows of the groups in flight
    pool: DataProto | None = None  # finished groups not yet in a batch
    loader: dict | None = None  # the loader's state after the last round's prompts
    metrics: list = attrs.Factory(list)  # the generate metrics of rounds since the last batch


@attrs.define
class _Snapshot:
    need: int | None  # the version of the round after it (None: no round after it)
    rounds: Rounds


class PartialPipeline(Pipeline):
    """`Pipeline` with rounds of at most `stages.partial` tokens per response.

    Args:
        produce: the `Producer` of each round's prompts (the round's number and version);
            called in the rollout thread (or inline).
        tokenizer: the policy's: its eos ends a response; the generating node's
            `Continuation.finish` gets it (generate decodes response_text with it).
        The others: see `Pipeline`.
    """

    def __init__(
        self, executor, stages, produce: Producer, tokenizer, start, steps, queued: Queued | None
    ):
        self.tokenizer = tokenizer
        self.continues = executor.spec.nodes[stages.generate_node].spec.continues
        self.stop_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        if queued is not None and queued.batches and queued.rounds is None:
            raise ValueError(
                "the checkpoint's queue holds whole batches (run.partial_rollout was 0 when it "
                "was written): resume it with run.partial_rollout = 0"
            )
        saved = (queued.rounds if queued else None) or {}
        rows = queued.rows if queued else {}
        self.rounds = Rounds(
            done=saved.get("done", 0),
            complete=saved.get("complete", start),
            groups=saved.get("groups", 0),
            carry=rows.get("carry"),
            pool=rows.get("pool"),
            loader=queued.loader if queued else None,
            metrics=saved.get("metrics", []),
        )
        self.assembled = {r.step: r for r in (queued.batches if queued else [])}
        self.pending_slices: list = []  # the rounds' slices not yet given to a batch
        need = next_version(self.rounds.complete, stages.staleness, start, steps)
        self.snapshots = [_Snapshot(need, self.rounds)]  # before the rollout thread starts
        super().__init__(executor, stages, produce, start, steps, queued)

    def _done(self) -> int:
        return self.rounds.complete

    def _produce_next(self, version: int) -> None:
        with self.gen:
            self._load(version)
            rounds, batches = self._round(self.rounds, version)
        with self.cond:
            self.rounds = rounds
            for rollout in batches:
                self.ready[rollout.step] = self.assembled[rollout.step] = rollout
            self.snapshots.append(_Snapshot(self._need(), rounds))
            self._forget()
            self.cond.notify_all()

    # -- one round ------------------------------------------------------------------------
    def _round(self, state: Rounds, version: int) -> tuple[Rounds, list[Rollout]]:
        stages, r = self.stages, state.done + 1
        batch, loader, record = self.produce(r, version)
        new = self._admitted(batch, state.groups)
        rows = new if state.carry is None else _concat([state.carry, new])
        active = torch.nonzero(rows[ENDED] == 0).flatten()
        changes = {stages.generate_node: {"n": 1, "max_new_tokens": stages.partial}}
        walked = self.executor.run_stage(
            self._contexts(rows.index(active), batch.meta),
            stages.generate_items,
            record,
            TRACK,
            changes,
        )
        rows = self._extended(rows, active, walked.batch, version)
        ended = _groups_ended(rows)
        finished, carry = rows.index(ended), rows.index(~ended)
        pool = _concat([state.pool, self._completed(finished, batch.meta)])
        if not len(pool):
            pool = None
        generated = [*state.metrics, {**walked.metrics, "partial/in_flight": float(len(carry))}]
        self.pending_slices += walked.slices
        complete, out = state.complete, []
        while pool is not None and len(pool) >= stages.rows and complete < self.steps:
            complete += 1
            chosen = _trimmed(pool.index(slice(0, stages.rows)))
            pool = pool.index(slice(stages.rows, None))
            # reward, advantage: on the step's batch, as with whole batches (an estimator that
            # normalises over the batch sees the batch it trains on)
            after = self.executor.run_stage(chosen, stages.after_items, record, TRACK)
            segments = chosen[SEGMENTS].float()
            metrics = {
                **_mean(generated),  # the rounds since the last batch (generate/*: per round)
                **after.metrics,
                "partial/segments_mean": float(segments.mean()),
                "partial/split_rows": float((segments > 1).float().mean()),
            }
            slices, self.pending_slices = self.pending_slices + after.slices, []
            oldest = int(chosen[VERSION_KEY].min())
            out.append(Rollout(complete, oldest, StepResult(after.batch, metrics, slices)))
        if out:
            generated = []
        rounds = Rounds(
            done=r,
            complete=complete,
            groups=state.groups + len(batch),
            carry=carry if len(carry) else None,
            pool=pool if pool is not None and len(pool) else None,
            loader=loader,
            metrics=generated,
        )
        return rounds, out

    def _admitted(self, batch: DataProto, groups: int) -> DataProto:
        """A round's prompt batch as rows in flight: n per prompt, each group numbered, no
        tokens yet."""
        n = self.stages.samples
        rows = batch.repeat(n, interleave=True)
        b = len(rows)
        rows[GROUP] = torch.arange(groups, groups + len(batch)).repeat_interleave(n)
        rows[ENDED] = torch.zeros(b, dtype=torch.long)
        rows[SEGMENTS] = torch.zeros(b, dtype=torch.long)
        for key in RESPONSE:
            dtype = torch.float32 if key == "rollout_logprobs" else torch.long
            rows[key] = torch.zeros((b, 0), dtype=dtype)
        return rows

    def _contexts(self, rows: DataProto, meta: dict) -> DataProto:
        """Each row's prompt and response so far as one left-padded prompt."""
        columns = ("prompts", "prompt_mask", "responses", "response_mask")
        ids = [
            _real(p, pm) + _real(t, tm)
            for p, pm, t, tm in zip(*(rows[c] for c in columns), strict=True)
        ]
        width = max((len(x) for x in ids), default=0)
        prompts = torch.full((len(ids), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for i, row in enumerate(ids):
            prompts[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
            mask[i, width - len(row) :] = 1
        return DataProto.from_dict({"prompts": prompts, "prompt_mask": mask}, meta=dict(meta))

    def _extended(self, rows: DataProto, active, out: DataProto, version: int) -> DataProto:
        """`rows` with the round's tokens appended to the active ones' responses (cut at
        max_new_tokens), each stamped `version`, and `ended` set where a response ended."""
        cap, limit = self.stages.max_new_tokens, self.stages.partial
        lengths = rows["response_mask"].sum(-1).tolist()
        columns = {
            key: [row[:n].tolist() for row, n in zip(rows[key], lengths, strict=True)]
            for key in RESPONSE
        }
        ended, segments = rows[ENDED].clone(), rows[SEGMENTS].clone()
        new_lengths = out["response_mask"].sum(-1).tolist()
        logprobs = out.get("rollout_logprobs")
        for j, i in enumerate(active.tolist()):
            sampled = new_lengths[j]
            take = min(sampled, cap - lengths[i])
            ids = out["responses"][j, :take].tolist()
            columns["responses"][i] += ids
            columns["response_mask"][i] += [1] * take
            values = logprobs[j, :take].tolist() if logprobs is not None else [0.0] * take
            columns["rollout_logprobs"][i] += values
            columns[TOKEN_VERSION][i] += [version] * take
            stopped = sampled < limit or (take > 0 and ids[-1] == self.stop_id)
            ended[i] = int(stopped or lengths[i] + take >= cap)
            segments[i] += 1
        width = max((len(x) for x in columns["responses"]), default=0)
        kept = {k: rows[k] for k in rows.keys() if k not in RESPONSE}
        for key, values in columns.items():
            dtype = torch.float32 if key == "rollout_logprobs" else torch.long
            tensor = torch.zeros((len(values), width), dtype=dtype)
            for i, row in enumerate(values):
                tensor[i, : len(row)] = torch.tensor(row, dtype=dtype)
            kept[key] = tensor
        kept[ENDED], kept[SEGMENTS] = ended, segments
        return DataProto.from_columns(kept, rows.meta)

    def _completed(self, rows: DataProto, meta: dict) -> DataProto:
        """Finished rows as the generating node's output: the columns of its `Continuation`
        added (generate's response_attention and response_text; rollout_logprobs kept only if
        the node returns them) and each row's weight_version, the version of its oldest
        token."""
        columns = {k: rows[k] for k in rows.keys() if k != ENDED}
        if not self.stages.logprobs:
            del columns["rollout_logprobs"]
        made = self.continues.finish(rows, self.tokenizer)
        if set(made) != set(self.continues.columns):
            raise ValueError(
                f"[nodes.{self.stages.generate_node}]: its Continuation.finish returned "
                f"{sorted(made)}, not its columns {sorted(self.continues.columns)}: return "
                "exactly the columns it declares"
            )
        columns.update(made)
        mask = rows["response_mask"]
        huge = torch.iinfo(torch.long).max
        oldest = torch.where(mask.bool(), rows[TOKEN_VERSION], huge).min(-1).values
        columns[VERSION_KEY] = torch.where(oldest == huge, 0, oldest)  # (b,)
        return DataProto.from_columns(columns, dict(meta))

    # -- the train stage and checkpoints ----------------------------------------------------
    def take(self, step: int) -> tuple[Rollout, dict]:
        rollout, metrics = super().take(step)
        batch = rollout.result.batch
        mask = batch["response_mask"].bool()
        stale = (step - 1 - batch[TOKEN_VERSION]).float()[mask]
        if len(stale):
            metrics["async/token_staleness_mean"] = float(stale.mean())
            metrics["async/token_staleness_max"] = float(stale.max())
        with self.cond:  # later checkpoints are of this step or later
            self.assembled = {s: r for s, r in self.assembled.items() if s >= step}
            while len(self.snapshots) > 1 and _before(self.snapshots[0].need, step):
                self.snapshots.pop(0)
        return rollout, metrics

    def queued(self, step: int) -> Queued:
        """For a checkpoint after `step`: the state after the last round generated with weights
        older than update `step` (waiting for it): what a resume cannot generate again."""
        if self.thread is None:
            self._catch_up(step)
        with self.cond:
            self.cond.wait_for(lambda: self._snapshot(step) is not None or self.error is not None)
            snapshot = self._snapshot(step)
            if snapshot is None:
                raise self.error
        state = snapshot.rounds
        batches = [self.assembled[s] for s in range(step + 1, state.complete + 1)]
        counters = {"done": state.done, "complete": state.complete, "groups": state.groups}
        counters["metrics"] = state.metrics
        rows = {name: v for name in ("carry", "pool") if (v := getattr(state, name)) is not None}
        return Queued(batches, state.loader, counters, rows)

    def _snapshot(self, step: int) -> _Snapshot | None:
        for snapshot in self.snapshots:
            if not _before(snapshot.need, step):
                return snapshot
        return None


def _before(need: int | None, step: int) -> bool:
    """Whether the round after a snapshot uses weights older than update `step`."""
    return need is not None and need < step


def _real(ids: torch.Tensor, mask: torch.Tensor) -> list[int]:
    return ids[mask.bool()].tolist()


def _concat(parts: list) -> DataProto:
    return DataProto.concat_padded([p for p in parts if p is not None], LEFT_PADDED)


def _groups_ended(rows: DataProto) -> torch.Tensor:
    """(b,) bool: the rows whose group has ended (all its rows)."""
    groups, ended = rows[GROUP], rows[ENDED].bool()
    open_groups = groups[~ended].unique()
    return ~torch.isin(groups, open_groups)


def _mean(rows: list[dict]) -> dict:
    """Each key's mean over the dicts that have it."""
    keys = {k for row in rows for k in row}
    return {k: sum(r[k] for r in rows if k in r) / sum(k in r for r in rows) for k in keys}


def _trimmed(batch: DataProto) -> DataProto:
    """A batch cut out of the pool, without the padding only other rows needed: the response
    columns cut to its longest response, the prompts to its longest prompt."""
    response = int(batch["response_mask"].sum(-1).max()) if len(batch) else 0
    prompt = int(batch["prompt_mask"].sum(-1).max()) if len(batch) else 0
    width = batch["prompt_mask"].shape[1]
    columns = {key: batch[key] for key in batch.keys()}
    for key in (*RESPONSE, "response_attention"):
        if key in columns:
            columns[key] = columns[key][:, :response]
    for key in LEFT_PADDED:
        columns[key] = columns[key][:, width - prompt :]
    return DataProto.from_columns(columns, batch.meta)
