"""The trainer's state across processes and failures: a checkpoint written (`save`), loaded
(`_load`: a resume, a recovery), and a recovery from a lost rank (`_recover`: every pool made
again, the newest complete checkpoint or the run's start loaded, the logs cut back; the policy
is flowrl/runtime/recovery.py, docs/recovery.md). `Trainer` (flowrl/runtime/controller.py)
inherits it; the loop decides when each is due.
"""

import contextlib
import json
import time
from pathlib import Path

from tqdm import tqdm

from flowrl.errors import StateError, unstorable
from flowrl.runtime import checkpoint, guards, outcome, rng, step_log
from flowrl.runtime import pipeline as pipelines
from flowrl.runtime import resume as resuming
from flowrl.runtime import steps as step_sources
from flowrl.runtime.node_call import NodeFailure
from flowrl.runtime.recovery import LostWorker, RecoveryStop


class TrainerState:
    """Checkpoints, resume and recovery of a `Trainer` (its executor, feed, step source,
    loggers and samples file, guards and recovery policy)."""

    # -- checkpoints ---------------------------------------------------------------------------
    def save(self, step: int) -> None:
        queued = self.source.checkpoint(step)  # run.staleness's queue, or None
        if queued is None:  # the prompts: the loader's state now
            loader = self.feed.checkpoint(step)
        else:  # or the rollout stage's after the queue, when it has run ahead
            loader = self.feed.checkpoint(step, ahead=queued.loader or self.feed.state())
        state = {  # plain JSON: opening a run directory never unpickles anything
            "step": step,
            "loader": loader,
            "node_state": self.executor.node_state,
            "rng": rng.state(),
        }
        if queued is not None:
            state.update(pipelines.entries(queued))
        text = _state_json(state)  # a state JSON cannot hold stops here, naming its owner
        self.executor.broadcast("node_states")  # so does a model node worker's, on its rank
        keep, graph = self.spec.run.keep_checkpoints, self.spec.raw
        with self._writing(f"the checkpoint of step {step}", step=step):
            with checkpoint.writing(self.run_dir, step, keep, graph) as out:
                if queued is not None:
                    pipelines.save_queue(out, queued)
                self.executor.broadcast("save", str(out))
                (out / "controller.json").write_text(text)

    def _resume(self, directory: Path | None) -> tuple[int, pipelines.Queued]:
        """Load a checkpoint (None: the newest, verified) and cut the logs back to its step.
        Returns its step and what it kept of run.staleness's queue."""
        if directory is None:
            directory = resuming.choose(self.run_dir, None, self.command)
        for temp in checkpoint.remove_temps(self.run_dir):
            print(f"removed {temp}: a checkpoint write that did not finish")
        for newer in checkpoint.set_aside_newer(directory):
            print(f"set {newer.name} aside as {newer}: it is newer than the checkpoint resumed")
        step, queued = self._load(directory)
        print(f"resumed from {directory} (step {step})")
        return step, queued

    def _load(self, directory: Path) -> tuple[int, pipelines.Queued]:
        """Every pool's models and the controller's state from checkpoint `directory`."""
        state = json.loads((directory / "controller.json").read_text())
        self.executor.broadcast("load", str(directory))
        self.executor.sync_rollout_pools()  # a separate rollout copy gets the loaded weights
        queued = pipelines.load_queue(directory, state)
        return self._restore(state), queued

    # -- recovery --------------------------------------------------------------------------
    def _recover(self, lost: LostWorker, step: int) -> tuple[int, pipelines.Queued | None]:
        """Recover from `lost` during `step` (flowrl/runtime/recovery.py): every pool made
        again, the newest complete checkpoint loaded (or the run's start), the logs cut back
        to it; a rank lost again meanwhile is one more recovery. Returns the step it goes on
        after and the queue its checkpoint kept, for a new step source (not started); raises
        RecoveryStop when it may not go on."""
        start, began = time.monotonic(), time.time()
        while True:
            try:
                wait = self.recovery.allow(lost, step)
            except RecoveryStop as e:
                why = f"{e}. {outcome.after_stop(self.run_dir, self, self.command)}"
                raise RecoveryStop(why) from lost
            tqdm.write(f"flowrl: step {step}: {lost}; recovering (after {wait:g} s)")
            try:
                restored, queued, source = self._make_again(wait)
                break
            except LostWorker as again:  # lost while the pools were made or loaded
                lost = again
            except NodeFailure as e:
                raise RecoveryStop(
                    f"{lost}; making the pools again failed: {e}. "
                    f"{outcome.after_stop(self.run_dir, self, self.command)}"
                ) from e
        self.steps_done = restored
        seconds = time.monotonic() - start
        row, said = self.recovery.event(lost, step, restored, source, seconds, began)
        tqdm.write(f"flowrl: {said}")
        with self._writing("metrics.jsonl"):
            self.loggers.log(row)
        return restored, queued

    def _make_again(self, wait: float) -> tuple[int, pipelines.Queued | None, str]:
        """Every rank ended and made again, the newest complete checkpoint (or the run's
        start) loaded: (its step, its queue, where it came from)."""
        self.executor.release()  # every rank ends: calls in flight fail where they wait
        self.source.close()
        self.source.join()  # a rollout stage's thread ends with its failed walk
        time.sleep(wait)
        self.executor.restart(self.spec.run.restart_wait_s)
        self.guards = guards.step_guards(self.spec, self.run_dir, self.command)
        self.source = step_sources.source(self.executor, self.plan, self.feed, self.tokenizer)
        directory = checkpoint.newest_complete(self.run_dir)
        if directory is None:  # before the first checkpoint: the models as they were loaded
            return self._restore(self.start_state), None, "the run's start (no checkpoint yet)"
        for temp in checkpoint.remove_temps(self.run_dir):
            tqdm.write(f"removed {temp}: a checkpoint write that did not finish")
        for newer in checkpoint.set_aside_newer(directory):  # incomplete ones
            tqdm.write(f"set {newer.name} aside as {newer}: it is incomplete")
        restored, queued = self._load(directory)
        return restored, queued, f"checkpoint {directory.name}"

    def _state(self, step: int) -> dict:
        """The controller's state after `step` when no model has changed yet (the start)."""
        return {
            "step": step,
            "loader": self.feed.checkpoint(step),
            "node_state": json.loads(json.dumps(self.executor.node_state)),
            "rng": rng.state(),
        }

    def _restore(self, state: dict) -> int:
        self.feed.load(state["loader"])
        self.executor.node_state.update(json.loads(json.dumps(state["node_state"])))
        rng.set_state(state["rng"])
        self._cut_logs(state["step"])
        return state["step"]

    def _cut_logs(self, step: int) -> None:
        """metrics.jsonl and samples.jsonl back to `step` (a resume or a recovery runs the
        later steps again), their writers reopened."""
        with self._writing("metrics.jsonl and samples.jsonl"):
            reopen = self.loggers is not None
            if reopen:
                self.loggers.rewind()
                close_quietly(self.samples)
            for name in ("metrics.jsonl", "samples.jsonl"):  # drop steps the run redoes
                step_log.truncate_log(self.run_dir / name, step)
            if reopen:
                self.loggers.reopen()
                self.samples = open(self.run_dir / "samples.jsonl", "a")


def close_quietly(file) -> None:
    with contextlib.suppress(OSError):  # a full disk was reported where it happened
        file.close()


def _state_json(state: dict) -> str:
    for node, kept in state["node_state"].items():
        if problem := unstorable(kept):
            raise StateError(
                f"node {node} keeps {problem} in its state, which a checkpoint (JSON) cannot "
                "store: keep numbers, strings, lists and dicts with string keys (a list for a "
                "set or a tuple, float(x) or x.tolist() for a tensor)"
            )
    try:
        return json.dumps(state)
    except (TypeError, ValueError) as e:
        raise StateError(
            f"the checkpoint's state cannot be written as JSON ({e}): keep numbers, strings, "
            "lists and dicts in a node's or a sampler's state"
        ) from e
