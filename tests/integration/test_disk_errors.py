"""A full disk during a checkpoint write, or a run directory that cannot be written: a clear
error, and the previous checkpoint stays intact."""

import errno

import pytest

from flowrl.runtime.controller import Trainer
from flowrl.runtime.guards import RunDirError

pytestmark = pytest.mark.slow  # the integration tier: trains, starts Ray or loads models


def test_full_disk_during_a_checkpoint_keeps_the_previous_one(tiny_plan, tmp_path):
    plan = tiny_plan("grpo.toml", **{"run.steps": 3, "run.save_every": 1})
    trainer = Trainer(plan, tmp_path / "run", "local")
    broadcast = trainer.executor.broadcast

    def full_at_step_2(method, *args):
        if method == "save" and "step_000002" in args[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return broadcast(method, *args)

    trainer.executor.broadcast = full_at_step_2
    try:
        with pytest.raises(RunDirError, match="No space left on device.*step_000001 is intact"):
            trainer.fit()
    finally:
        trainer.close()
    checkpoints = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000001"]
    assert (checkpoints / "step_000001" / "controller.json").is_file()


def test_unwritable_run_directory_is_a_clear_error(tiny_plan, tmp_path):
    plan = tiny_plan("grpo.toml")
    (tmp_path / "a_file").write_text("not a folder")
    trainer = Trainer(plan, tmp_path / "a_file" / "run", "local")
    try:
        with pytest.raises(RunDirError, match="is not writable.*run.out_dir"):
            trainer.fit()
    finally:
        trainer.close()
