"""The prompts a run trains on, in order, and where their node calls keep their inputs.

Every way of making a step's batch (flowrl/runtime/steps.py) reads its prompts here: a plain
step one batch, a refilling step (DAPO) further batches of the same step, the asynchronous
rollout stage a batch per step or per round, ahead of the train stage and in its own thread
(the loader is then read there alone). A batch's meta seeds its sampling, so the same
(step, round) samples the same responses in a resumed run.

A sampler that learns from results (`[data] sampler`, flowrl/samplers.py) is told each
trained step's rows by its step source (`told`), before the step's weights are exported; the
feed hands them over at fixed points, so its draws do not depend on timing: a plain step's
prompts see the results of every earlier step, a rollout stage's batch generated with the
weights of update v the results of steps up to v (with run.staleness = k, k steps late).
"""

import json
import threading
from pathlib import Path

from flowrl import contracts
from flowrl.errors import unstorable
from flowrl.protocol import DataProto
from flowrl.runtime.inputs import Recording
from flowrl.samplers import SamplerError

DRAWS = "prompts.jsonl"  # in the run directory: each batch's prompts, as drawn (docs/data.md)


class PromptFeed:
    """The prompt loader with the meta every batch carries and the run's input recording.

    Args:
        loader: the `flowrl.data.PromptLoader` of the training prompts.
        batch_meta: what every batch's meta holds (the run's seed, the policy's tokenizer).
        run_dir: the run directory (absolute paths go to the ranks).
        save_inputs: `run.save_inputs`, the nodes whose healthy calls keep their inputs.
        save_inputs_last: `run.save_inputs_last`, for how many steps.
    """

    def __init__(self, loader, batch_meta: dict, run_dir, save_inputs=(), save_inputs_last=1):
        self.loader, self.batch_meta = loader, batch_meta
        self.run_dir = str(run_dir.resolve())
        self.keep, self.keep_last = tuple(save_inputs), save_inputs_last
        # results of trained steps for a learning sampler: step -> (prompt indices, scores)
        self.learns = loader.learns
        self.results: dict[int, tuple[list, list]] = {}
        self.applied = 0  # the sampler has been told the results of the steps up to this one
        # a rollout stage's checkpoint state lags: results it has not seen are kept for it
        self.retain = False
        self.lock = threading.Lock()  # told by the train stage, read by the rollout stage

    def next(self, step: int, round_: int = 0) -> DataProto:
        """The next prompt batch, its meta seeding the sampling of `step` (and `round_`, a
        refilling step's further batches); a learning sampler has seen every earlier step."""
        self._apply(step - 1)
        return self._draw(step, round_)

    def _draw(self, step: int, round_: int = 0) -> DataProto:
        batch = next(self.loader)
        batch.meta.update(self.batch_meta, step=step)
        if round_:
            batch.meta["round"] = round_
        self._record(step, round_, batch)
        return batch

    def _record(self, step: int, round_: int, batch: DataProto) -> None:
        """A line of prompts.jsonl: the sampler's indices and the rows they are; a resumed
        run appends the batches it draws again (the last line of a step and round counts)."""
        if not Path(self.run_dir).is_dir():  # a trainer built without its run directory
            return
        rows = batch["uid"].tolist() if "uid" in batch.keys() else None  # among the set's rows
        indices = getattr(self.loader, "drawn", rows)  # a loader of another kind: its rows
        line = {"step": step, "round": round_, "indices": indices, "rows": rows}
        with open(Path(self.run_dir) / DRAWS, "a") as f:
            f.write(json.dumps(line) + "\n")

    def record(self, step: int, state_step: int, validation: bool = False) -> Recording:
        """Where the node calls of a walk of `step` keep their inputs, seeing the weights after
        update `state_step` (flowrl/runtime/inputs.py); validation keeps only failures."""
        keep = () if validation else self.keep
        return Recording(self.run_dir, step, state_step, keep, self.keep_last, validation)

    def produce(self, number: int, version: int) -> tuple[DataProto, dict, Recording]:
        """The rollout stage's `Producer` (flowrl/runtime/pipeline.py): prompt batch `number`
        (a step's, or a round's), the loader's state after it, and its calls' recording on
        the weights of update `version`."""
        self._apply(version)  # the steps whose update made these weights
        batch = self._draw(number)
        return batch, self.state(), self.record(number, version)

    # -- a learning sampler's results -------------------------------------------------------
    def told(self, step: int, rows: DataProto) -> None:
        """The rows step `step` generated (every prompt index and score), for the sampler;
        a step source calls it before it exports the step's weights."""
        if not self.learns:
            return
        if "scores" not in rows.keys():
            raise ValueError(
                f"data.sampler learns from each row's score, but step {step}'s rows have no "
                '`scores`: add a reward node that writes them, or use sampler = "uniform"'
            )
        with self.lock:
            indices = rows["uid"].tolist()  # a row's number among all rows of the set
            if hasattr(self.loader.dataset, "indices"):  # as kept-prompt indices
                indices = self.loader.dataset.indices(indices)
            self.results[step] = (indices, rows["scores"].float().tolist())

    def _apply(self, upto: int) -> None:
        """Tell the sampler the results of the steps up to `upto` it has not been told."""
        if not self.learns:
            return
        with self.lock:
            for step in sorted(s for s in self.results if self.applied < s <= upto):
                indices, scores = self.results[step]
                self.loader.sampler.update(indices, scores, step)
                self.applied = step
                if not self.retain:
                    del self.results[step]

    def state(self) -> dict:
        """The loader's state for a checkpoint, with the last step whose results the sampler
        was told: {"sampler": its state_dict(), "applied": step}."""
        sampler_state = self.loader.state_dict()
        if problem := unstorable(sampler_state):
            raise SamplerError(
                f"data sampler {contracts.place(type(self.loader.sampler))}: state_dict() "
                f"returned {problem}, which a checkpoint (JSON) cannot store",
                "return numbers, strings, lists and dicts with string keys (a list for a set "
                "or a tuple, int(i) for a numpy integer, .tolist() for an array)",
            )
        with self.lock:
            return {"sampler": sampler_state, "applied": self.applied}

    def checkpoint(self, step: int, ahead: dict | None = None) -> dict:
        """What a checkpoint after `step` keeps of the prompts, in one format: {"sampler",
        "applied", "pending"}: the loader's state now, or `ahead` (a rollout stage's state
        after the prompts it read ahead), with the results told since that state's last
        ones, for the draws still to come."""
        if ahead is None:
            self._apply(step)
            return {**self.state(), "pending": {}}
        ahead = current(ahead)
        with self.lock:  # later checkpoints start from later states: older results can go
            self.results = {s: r for s, r in self.results.items() if s > ahead["applied"]}
            pending = {str(s): r for s, r in self.results.items()}
        return {**ahead, "pending": pending}

    def load(self, state: dict) -> None:
        """Restore the loader (and a learning sampler's pending results) of a checkpoint,
        in this format or an older one."""
        state = current(state)
        try:
            self.loader.load_state_dict(state["sampler"])
        except Exception as e:  # the user's sampler reads its own state back
            raise SamplerError(
                f"data sampler {contracts.place(type(self.loader.sampler))}: "
                f"load_state_dict(the checkpoint's state) failed: {type(e).__name__}: {e}",
                "read back exactly what state_dict() returns (after a JSON round trip: "
                "lists for tuples, string keys)",
            ) from e
        self.applied = state["applied"]
        self.results = {int(s): tuple(r) for s, r in state["pending"].items()}


def current(state: dict) -> dict:
    """A feed state in the one format. Before it, a sampler that ignores results (the uniform
    one) saved its own state alone, and a learning one {"sampler", "applied", "pending"}."""
    if isinstance(state, dict) and "sampler" in state and "applied" in state:
        return {"pending": {}, **state}
    return {"sampler": state, "applied": 0, "pending": {}}
