"""The rollout stage running ahead of the train stage: run.staleness = k > 0 (the split and the
version rule: flowrl/front/pipeline.py; docs/scaling.md).

    rollout stage (a thread)                    train stage (the controller loop)
    for r in steps:                             for s in steps:
        wait for v = version(r - 1, k, start)       take batch s from the queue
        load v on the rollout pool                  run the train stage on it
        generate, reward ... on step r's prompts    export the weights: version s
        queue batch r, every row stamped v

The version a batch is generated with depends on its step alone, never on timing, so a run is
reproducible and a resume continues it exactly. On Ray the rollout stage runs in a thread of the
controller, its calls on the rollout pool's actors, so the two pools work at once. The local
executor runs every pool in this process: there the same schedule runs in one thread (before
step s, every rollout whose weights exist: r <= s + k), with the same results and no overlap.

A checkpoint after step s keeps the queue: batches s+1 .. s+k (they were generated with weights
older than the checkpoint's) and the prompt loader's position after them (`Pipeline.queued`).
"""

import contextlib
import threading
import time
from pathlib import Path
from typing import Protocol

import attrs
import torch

from flowrl.front.pipeline import version
from flowrl.protocol import DataProto
from flowrl.runtime import weights as transfer
from flowrl.runtime.executor import StepResult
from flowrl.runtime.inputs import Recording
from flowrl.runtime.trace import Slice

VERSION_KEY = "weight_version"  # (b,) int64: the update whose weights generated the row
JOIN_TIMEOUT_S = 120.0  # for the rollout stage's thread to end once its pools are released
TRACK = "controller/rollout stage"  # the trace track of the rollout stage's controller items


class Producer(Protocol):
    """What the rollout stage asks for its next prompts, for whole batches and rounds alike
    (flowrl/runtime/feed.py: `PromptFeed.produce`).

    `number` is the prompt batch's number (a step's, or a round's of partial rollouts: it
    seeds the sampling), `version` the update whose weights generate from it. Answers the
    prompt batch with its meta, the prompt loader's state after it, and the `Recording` of
    its node calls (the weights they see: `version`)."""

    def __call__(self, number: int, version: int) -> tuple[DataProto, dict, Recording]: ...


@attrs.define
class Queued:
    """What a checkpoint after a step keeps of the pipeline: the batches generated for later
    steps, the loader's state after the last prompts read (None: nothing read ahead), and for
    partial rollouts the rounds' counters (`rounds`, JSON) and rows (`rows`: name -> DataProto,
    the finished groups not yet in a batch and the responses in flight)."""

    batches: list = attrs.Factory(list)
    loader: dict | None = None
    rounds: dict | None = None
    rows: dict = attrs.Factory(dict)


@attrs.define
class Rollout:
    """One queued batch: the rollout stage's walk of step `step`, generated with the weights of
    update `version`; `loader`: the prompt loader's state right after its prompts."""

    step: int
    version: int
    result: StepResult
    loader: dict | None = None


class Pipeline:
    """The queue between the stages, the exported weights by version, and the rollout thread.

    Args:
        executor: runs the walks (`run_stage`), the weight export and import.
        stages: the plan's PipelinePlan.
        produce: the `Producer` of the prompts; called in the rollout thread (or inline,
            locally), so the loader is read there alone while the pipeline runs.
        start: the steps done (the checkpoint's step when resuming); the rollout pool holds
            their weights.
        steps: the last step (run.steps).
        queued: what a checkpoint kept (`Queued`), or None.
    """

    def __init__(
        self, executor, stages, produce: Producer, start: int, steps: int, queued: Queued | None
    ):
        if queued is not None and queued.rounds is not None and not stages.partial:
            raise ValueError(
                "the checkpoint holds rounds of partial rollouts (run.partial_rollout was set "
                "when it was written): resume it with the same run.partial_rollout"
            )
        self.executor, self.stages, self.produce = executor, stages, produce
        self.train_pool = executor.spec.models[stages.model].pool  # where the model trains
        self.k, self.start, self.steps = stages.staleness, start, steps
        batches = queued.batches if queued else []
        self.ready = {r.step: r for r in batches}  # the queue: step -> Rollout
        self.next = start + 1 + len(self.ready)  # the next step to generate
        self.loaders = {r.step: r.loader for r in batches}
        self.weights: dict[int, object] = {}  # version -> exported weights (a Ray ref on Ray)
        self.latest = self.loaded = start  # newest version exported; version the pool holds
        self.cond = threading.Condition()
        self.gen = threading.Lock()  # the rollout pool: one walk or load at a time
        self.error: BaseException | None = None
        self.stopping, self.thread, self.sync_slices = False, None, []
        self.export(start)  # what the rollout pool holds now, kept while a batch needs it
        if executor.concurrent:
            self.thread = threading.Thread(target=self._run, name="rollout-stage", daemon=True)
            self.thread.start()

    # -- the rollout stage ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self.cond:
                    need = self._need()
                    if need is None:
                        return
                    self.cond.wait_for(lambda: self.latest >= need or self.stopping)  # noqa: B023
                    if self.stopping:
                        return
                self._produce_next(need)
        except BaseException as e:  # the train stage raises it when it takes the batch
            with self.cond:
                self.error = e
                self.cond.notify_all()

    def _done(self) -> int:
        """The steps whose batch is assembled (generated or kept by the checkpoint)."""
        return self.next - 1

    def _need(self) -> int | None:
        """The version the next batch (or round) is generated with (None: every batch is
        generated)."""
        return next_version(self._done(), self.k, self.start, self.steps)

    def _produce_next(self, version: int) -> None:
        self._produce(self.next, version)

    def _produce(self, r: int, version: int) -> None:
        with self.gen:
            self._load(version)
            batch, loader, record = self.produce(r, version)
            result = self.executor.run_stage(batch, self.stages.rollout_items, record, TRACK)
        result.batch[VERSION_KEY] = torch.full((len(result.batch),), version, dtype=torch.long)
        with self.cond:
            self.ready[r], self.loaders[r] = Rollout(r, version, result, loader), loader
            self.next = r + 1
            self._forget()
            self.cond.notify_all()

    def _forget(self) -> None:
        """Drop the exported weights no batch still to generate needs (under `cond`)."""
        need = self._need()
        floor = self.latest if need is None else min(need, self.latest)
        self.weights = {v: w for v, w in self.weights.items() if v >= floor}

    def _load(self, version: int) -> None:
        """Load the weights of update `version` on the rollout pool, unless they are there."""
        if self.loaded == version:
            return
        with self.cond:
            weights = self.weights[version]
        model, pool = self.stages.model, self.stages.rollout_pool
        slices = transfer.sent(self.executor, model, self.train_pool, pool, weights)
        with self.cond:
            self.sync_slices += slices
        self.loaded = version

    def _catch_up(self, step: int) -> None:
        """Without a thread: generate every batch whose weights exist (up to step + k)."""
        while (need := self._need()) is not None and need <= self.latest:
            self._produce_next(need)

    # -- the train stage ------------------------------------------------------------------
    def take(self, step: int) -> tuple[Rollout, dict]:
        """The batch of `step` (waiting for it) and the queue's metrics; raises the rollout
        stage's error (a dead rank named as any other) if it failed."""
        start = time.time()
        if self.thread is None:
            self._catch_up(step)
        with self.cond:
            self.cond.wait_for(lambda: step in self.ready or self.error is not None)
            if step not in self.ready:
                raise self.error
            rollout = self.ready.pop(step)
            queued = len(self.ready)
        metrics = {
            "async/staleness": float(step - 1 - rollout.version),
            "async/weight_version": float(rollout.version),
            "async/queued": float(queued),  # batches still waiting once this one is taken
            "async/wait_s": time.time() - start,  # the train stage idle, waiting for it
        }
        return rollout, metrics

    def export(self, version: int) -> None:
        """After update `version`: its weights, for the rollout pool to load when due."""
        weights = transfer.export(self.executor, self.stages.model, self.train_pool)
        with self.cond:
            self.weights[version], self.latest = weights, version
            self.cond.notify_all()

    @contextlib.contextmanager
    def weights_of(self, version: int):
        """Hold the rollout pool with the weights of update `version` loaded (validation of
        step `version`); the rollout stage loads its own version again afterwards."""
        with self.gen:
            self._load(version)
            yield

    def queued(self, step: int) -> Queued:
        """For a checkpoint after `step`: the batches of steps step+1 .. step+k (waiting for
        them) and the loader's state after the last of them (None: nothing generated yet)."""
        last = min(step + self.k, self.steps)
        if self.thread is None:
            self._catch_up(step)
        with self.cond:
            self.cond.wait_for(lambda: self.next > last or self.error is not None)
            if self.next <= last:
                raise self.error
            kept = [self.ready[r] for r in range(step + 1, last + 1)]
            loader = self.loaders.get(last)
            self.loaders = {r: s for r, s in self.loaders.items() if r >= last}
        return Queued(kept, loader)

    def drain_slices(self) -> list[Slice]:
        """The weight loads on the rollout pool since the last call, for the trace."""
        with self.cond:
            out, self.sync_slices = self.sync_slices, []
        return out

    def close(self) -> None:
        """Stop the rollout stage after its current walk (not waited for: a run that stops
        shuts the pools down, which ends a walk in flight)."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()

    def join(self, timeout: float = JOIN_TIMEOUT_S) -> None:
        """Wait for the rollout stage's thread to end (after `close`, with its pools released:
        a walk in flight fails where it waits), so it reads no more prompts."""
        if self.thread is not None:
            self.thread.join(timeout)
            if self.thread.is_alive():
                raise RuntimeError(
                    f"the rollout stage's thread did not end within {timeout:g} s of its pools "
                    "being released"
                )


def next_version(done: int, k: int, start: int, steps: int) -> int | None:
    """The version of the rollout stage's next batch or round, `done` steps' batches assembled
    (None: every batch of the run is). The floor `start`, the weights the run started (or
    resumed) with, matters only for a run extended past its last step, which refills the queue:
    a resume finds it full."""
    return None if done >= steps else version(done, k, start)


# -- the queue in a checkpoint ------------------------------------------------------------
def entries(queued: Queued) -> dict:
    """The queue's lines in controller.json (its rows go to queue/*.pt): each batch's step,
    version and rollout metrics, and the rounds' counters of partial rollouts."""
    out = {"queue": [_entry(r) for r in queued.batches]}
    if queued.rounds is not None:
        out["rounds"] = {**queued.rounds, "rows": sorted(queued.rows)}
    return out


def _entry(rollout: Rollout) -> dict:
    return {"step": rollout.step, "version": rollout.version, "metrics": rollout.result.metrics}


def save_queue(directory, queued: Queued) -> None:
    """Each queued batch's rows (and the rounds' rows), tensors and JSON (DataProto.save:
    nothing to unpickle)."""
    folder = Path(directory) / "queue"
    parts = {f"step_{r.step:06d}": r.result.batch for r in queued.batches} | queued.rows
    for name, rows in parts.items():
        folder.mkdir(exist_ok=True)
        rows.save(folder / f"{name}.pt")


def load_queue(directory, state: dict) -> Queued:
    """What `save_queue` wrote, as the checkpoint's step left it (controller.json's `state`)."""
    folder, out = Path(directory) / "queue", Queued(loader=state.get("loader"))
    for e in state.get("queue", []):
        batch = DataProto.load(folder / f"step_{e['step']:06d}.pt")
        out.batches.append(Rollout(e["step"], e["version"], StepResult(batch, e["metrics"], [])))
    if "rounds" in state:
        rounds = dict(state["rounds"])
        out.rows = {name: DataProto.load(folder / f"{name}.pt") for name in rounds.pop("rows")}
        out.rounds = rounds
    return out
