"""How a training step's batch is made: one `StepSource` per way, chosen once per run.

    Walk        the whole plan on the step's prompts (in a critic warm-up, the critic alone)
    Refill      the nodes up to a refilling filter on prompt batches until enough groups are
                kept, then the rest once (DAPO; flowrl/runtime/refill.py)
    Pipelined   run.staleness = k > 0: the batch the rollout stage queued for the step, the
                train stage on it, then the weights exported (flowrl/runtime/pipeline.py;
                with run.partial_rollout the rollout stage works in rounds: partial.py)

`source(...)` picks one from the plan; the trainer's loop (flowrl/runtime/controller.py) then
asks it for each step's batch without knowing which it is.
"""

import contextlib
import functools
from typing import Protocol

from flowrl.runtime.executor import StepResult
from flowrl.runtime.feed import PromptFeed
from flowrl.runtime.partial import PartialPipeline
from flowrl.runtime.pipeline import Pipeline, Queued
from flowrl.runtime.refill import refilled_step


class StepSource(Protocol):
    """What the trainer asks of a way of making a step's batch."""

    def start(self, done: int, queued: Queued | None) -> None:
        """Begin after `done` steps (a resume's checkpoint step), with what its checkpoint
        kept of a queue (`Queued`, or None); before the first `next`."""

    def next(self, step: int) -> StepResult:
        """Step `step`'s walk: the trained batch, its metrics and slices."""

    def checkpoint(self, step: int) -> Queued | None:
        """What a checkpoint after `step` keeps besides the models and the loader's state
        (None: nothing)."""

    def weights_of(self, step: int) -> contextlib.AbstractContextManager:
        """Hold the rollout models with the weights of update `step` (for validation)."""

    def close(self) -> None:
        """Stop what runs beside the loop (a rollout stage's thread)."""

    def join(self) -> None:
        """Wait until what `close` stopped has ended (a recovery: its pools are released)."""


class Walk:
    """The whole plan on the step's prompts; during run.critic_warmup the nodes the warm-up
    runs alone (the plan's `after_warmup` nodes wait)."""

    def __init__(self, executor, plan, feed: PromptFeed):
        self.executor, self.plan, self.feed = executor, plan, feed

    def start(self, done: int, queued: Queued | None) -> None:
        pass

    def next(self, step: int) -> StepResult:
        batch, only = self.feed.next(step), None
        if step <= self.plan.spec.run.critic_warmup:  # the critic alone trains
            only = set(self.plan.spec.nodes) - set(self.plan.after_warmup)
        walked = self.executor.run_step(batch, only=only, record=self.feed.record(step, step - 1))
        self.feed.told(step, walked.seen if walked.seen is not None else walked.batch)
        return walked

    def checkpoint(self, step: int) -> Queued | None:
        return None

    def weights_of(self, step: int) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # the step's own walk synced them

    def close(self) -> None:
        pass

    def join(self) -> None:
        pass


class Refill(Walk):
    """A step that refills through a filter node (`plan.refill`): its further prompt batches
    are rounds 1, 2, ... of the same step, so each samples other responses."""

    def next(self, step: int) -> StepResult:
        first, more = self.feed.next(step), functools.partial(self.feed.next, step)
        record = self.feed.record(step, step - 1)
        walked = refilled_step(self.executor, self.plan.refill, first, more, record)
        self.feed.told(step, walked.seen if walked.seen is not None else walked.batch)
        return walked


class Pipelined:
    """run.staleness = k > 0: the rollout stage runs ahead in a `Pipeline` (or, with
    run.partial_rollout, a `PartialPipeline` of rounds) made by `start`; a step takes its
    queued batch, runs the train stage on it and exports the update for the rollout stage."""

    def __init__(self, executor, plan, feed: PromptFeed, tokenizer):
        self.executor, self.plan, self.feed = executor, plan, feed
        self.tokenizer, self.pipeline = tokenizer, None

    def start(self, done: int, queued: Queued | None) -> None:
        stages, steps = self.plan.pipeline, self.plan.spec.run.steps
        self.feed.retain = True  # a checkpoint's loader state is the rollout stage's, behind
        if stages.partial:  # rounds of partial rollouts
            self.pipeline = PartialPipeline(
                self.executor, stages, self.feed.produce, self.tokenizer, done, steps, queued
            )
        else:  # the rollout stage starts running ahead
            self.pipeline = Pipeline(self.executor, stages, self.feed.produce, done, steps, queued)

    def next(self, step: int) -> StepResult:
        rollout, metrics = self.pipeline.take(step)
        record = self.feed.record(step, step - 1)
        ids = self.plan.pipeline.train_items
        walked = self.executor.run_stage(rollout.result.batch, ids, record)
        self.feed.told(step, walked.batch)  # before the export: batches it makes see them
        self.pipeline.export(step)
        metrics = {**rollout.result.metrics, **walked.metrics, **metrics}
        slices = rollout.result.slices + walked.slices + self.pipeline.drain_slices()
        return StepResult(walked.batch, metrics, slices)

    def checkpoint(self, step: int) -> Queued | None:
        return self.pipeline.queued(step)  # the loader has run ahead: its state after them

    def weights_of(self, step: int) -> contextlib.AbstractContextManager:
        if self.pipeline is None:  # validation before the first step
            return contextlib.nullcontext()
        return self.pipeline.weights_of(step)

    def close(self) -> None:
        if self.pipeline is not None:
            self.pipeline.close()

    def join(self) -> None:
        if self.pipeline is not None:
            self.pipeline.join()


def source(executor, plan, feed: PromptFeed, tokenizer) -> StepSource:
    """The way the plan's steps make their batch: pipelined (run.staleness > 0), refilling
    (a filter with a refill) or a plain walk."""
    if plan.pipeline is not None:
        return Pipelined(executor, plan, feed, tokenizer)
    if plan.refill is not None:
        return Refill(executor, plan, feed)
    return Walk(executor, plan, feed)
