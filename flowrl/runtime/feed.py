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

import threading

from flowrl.protocol import DataProto
from flowrl.runtime.inputs import Recording


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
        return batch

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
            self.results[step] = (rows["uid"].tolist(), rows["scores"].float().tolist())

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
        """The loader's state for a checkpoint (a learning sampler's with the last step whose
        results it was told)."""
        if not self.learns:
            return self.loader.state_dict()
        with self.lock:
            return {"sampler": self.loader.state_dict(), "applied": self.applied}

    def checkpoint(self, step: int, ahead: dict | None = None) -> dict:
        """What a checkpoint after `step` keeps of the prompts: the loader's state now, or
        `ahead` (a rollout stage's state after the prompts it read ahead), with the results
        told since that state's last ones, for the draws still to come."""
        if not self.learns:
            return ahead or self.loader.state_dict()
        if ahead is None:
            self._apply(step)
            return {**self.state(), "pending": {}}
        with self.lock:  # later checkpoints start from later states: older results can go
            self.results = {s: r for s, r in self.results.items() if s > ahead["applied"]}
            pending = {str(s): r for s, r in self.results.items()}
        return {**ahead, "pending": pending}

    def load(self, state: dict) -> None:
        """Restore the loader (and a learning sampler's pending results) of a checkpoint."""
        if not self.learns:
            self.loader.load_state_dict(state)
            return
        self.loader.load_state_dict(state["sampler"])
        self.applied = state["applied"]
        self.results = {int(s): tuple(r) for s, r in state["pending"].items()}
