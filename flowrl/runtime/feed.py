"""The prompts a run trains on, in order, and where their node calls keep their inputs.

Every way of making a step's batch (flowrl/runtime/steps.py) reads its prompts here: a plain
step one batch, a refilling step (DAPO) further batches of the same step, the asynchronous
rollout stage a batch per step or per round, ahead of the train stage and in its own thread
(the loader is then read there alone). A batch's meta seeds its sampling, so the same
(step, round) samples the same responses in a resumed run.
"""

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

    def next(self, step: int, round_: int = 0) -> DataProto:
        """The next prompt batch, its meta seeding the sampling of `step` (and `round_`, a
        refilling step's further batches)."""
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
        batch = self.next(number)
        return batch, self.loader.state_dict(), self.record(number, version)
