"""Keep what a node call received, so `flowrl replay` can run that call again in-process.

    run_dir/failures/step_<N>_<node>_rank<r>/   a call that raised (always)
    run_dir/inputs/step_<N>_<node>_rank<r>/     a healthy call of a node named in
                                                run.save_inputs (the last run.save_inputs_last
                                                steps)

Each holds `batch.pt` (the DataProto the node received on that rank, graph keys, before its
renames; `DataProto.save`), `call.json` (node, uses, params, rank, world_size, step, the step
whose weights the call saw, and for a failure the error and traceback) and, for a stateful
controller node, `state.pt`. Healthy inputs are written before the call (the node cannot have
changed them); a failure's batch after it raised.

`Recording` is one walk's settings, plain data that travels with each call to the pool ranks;
`Recording.saver(...)` is the `save_to` hook of `flowrl.runtime.node_call.call_node`. Without a
recording (the default of `Executor.run_step`) nothing is copied or written.
"""

import json
import os
import shlex
import shutil
import traceback
from pathlib import Path

import attrs
import torch

FAILURES, INPUTS = "failures", "inputs"
TEMP = ".tmp-"


def directory_name(step: int, node: str, rank: int) -> str:
    return f"step_{step}_{node}_rank{rank}"


def replay_command(run_dir: str, step: int, node: str, rank: int) -> str:
    return f"flowrl replay {shlex.quote(str(run_dir))} --step {step} --node {node} --rank {rank}"


@attrs.frozen
class Recording:
    """What one walk of the plan keeps of its node calls.

    Attributes:
        run_dir: the run directory (absolute: Ray ranks may run in another folder).
        step: the training step, as in metrics.jsonl; names the saved directories.
        state_step: the step after whose update the models are as this walk sees them (a
            training step N sees step N-1's weights; validation after step N sees step N's);
            0 is the initial weights. Replay loads the checkpoint of this step.
        keep: nodes whose inputs are kept when they succeed (run.save_inputs).
        keep_last: how many steps of those are kept (run.save_inputs_last).
        validation: the walk is a validation pass (its params include the greedy changes).
    """

    run_dir: str
    step: int
    state_step: int
    keep: tuple[str, ...] = ()
    keep_last: int = 1
    validation: bool = False

    def saver(self, node: str, uses: str, params, rank: int = 0, world_size: int = 1, state=None):
        """The `save_to` hook of one call of `node` on `rank`."""
        return Saver(self, node, uses, params, rank, world_size, state)


@attrs.frozen
class Saver:
    """Writes one call's inputs: `before` (healthy inputs, if the node is kept), `failed`."""

    recording: Recording
    node: str
    uses: str
    params: object  # the node's params (attrs instance), as the call runs with them
    rank: int
    world_size: int
    state: dict | None = None  # a stateful controller node's state

    def before(self, batch) -> None:
        """Before the call: keep its inputs when run.save_inputs names the node."""
        rec = self.recording
        if self.node not in rec.keep or rec.validation:
            return
        self._write(INPUTS, batch, {})
        self._prune()

    def failed(self, batch, error: BaseException) -> str:
        """After the call raised: save its inputs; returns the message's last lines (where
        they are and the command that replays the call). Never raises: a failure to save must
        not hide the node's own error."""
        rec = self.recording
        trace = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        info = {"error": f"{type(error).__name__}: {error}", "traceback": trace}
        try:
            where = self._write(FAILURES, batch, info)
        except Exception as e:  # e.g. a full disk
            return f"\n  (its inputs could not be saved: {type(e).__name__}: {e})"
        command = replay_command(rec.run_dir, rec.step, self.node, self.rank)
        return f"\n  its inputs: {where}\n  replay it: {command}"

    def _write(self, kind: str, batch, extra: dict) -> Path:
        rec = self.recording
        root = Path(rec.run_dir) / kind
        final = root / directory_name(rec.step, self.node, self.rank)
        temp = root / f"{TEMP}{final.name}-{os.getpid()}"
        shutil.rmtree(temp, ignore_errors=True)
        temp.mkdir(parents=True)
        batch.save(temp / "batch.pt")
        if self.state is not None:
            torch.save(self.state, temp / "state.pt")
        info = {
            "node": self.node,
            "uses": self.uses,
            "params": attrs.asdict(self.params),
            "rank": self.rank,
            "world_size": self.world_size,
            "step": rec.step,
            "state_step": rec.state_step,
            "validation": rec.validation,
            **extra,
        }
        (temp / "call.json").write_text(json.dumps(info, indent=2, default=repr) + "\n")
        if final.exists():  # the same step run again (after a resume)
            shutil.rmtree(final)
        os.rename(temp, final)
        return final

    def _prune(self) -> None:
        """Drop this node's and rank's inputs older than the last `keep_last` steps (each rank
        prunes only its own, so ranks never race on a directory)."""
        rec = self.recording
        suffix = f"_{self.node}_rank{self.rank}"
        for path in (Path(rec.run_dir) / INPUTS).glob(f"step_*{suffix}"):
            step = path.name[len("step_") : -len(suffix)]
            if step.isdigit() and int(step) <= rec.step - rec.keep_last:
                shutil.rmtree(path, ignore_errors=True)


def find(run_dir, step: int, node: str, rank: int) -> Path:
    """The saved inputs of a call: failures/ first, then inputs/. Raises FileNotFoundError
    listing what the run directory holds."""
    name = directory_name(step, node, rank)
    for kind in (FAILURES, INPUTS):
        path = Path(run_dir) / kind / name
        if (path / "call.json").is_file():
            return path
    saved = sorted(
        f"{kind}/{p.name}"
        for kind in (FAILURES, INPUTS)
        for p in (Path(run_dir) / kind).glob("step_*")
        if (p / "call.json").is_file()
    )
    listing = ", ".join(saved) if saved else "none"
    raise FileNotFoundError(
        f"no saved inputs of node {node} at step {step} on rank {rank} in {run_dir} "
        f"(saved: {listing}); a run keeps a failed call's inputs, and those of the nodes in "
        f"run.save_inputs for the last run.save_inputs_last steps"
    )
