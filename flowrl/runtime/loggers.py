"""Where a run's metrics go: metrics.jsonl always; TensorBoard and Weights & Biases when
`run.loggers` names them.

Every logger gets the same rows under the same names (`score/mean`, `update_policy/grad_norm`,
`timing_s/generate`, ...), with the training step as the x axis. TensorBoard writes event files
to RUN_DIR/tensorboard (`tensorboard --logdir runs`); W&B a run under RUN_DIR/wandb, online or
offline as WANDB_MODE says, in the project WANDB_PROJECT (default "flowrl"). Their packages are
optional extras, imported only when chosen; `flowrl check` names a missing one
(flowrl/front/dsl.py).
"""

import json
import os
from pathlib import Path


class JsonlLogger:
    """RUN_DIR/metrics.jsonl: one JSON object per row, keys sorted; events too (a resume)."""

    def __init__(self, run_dir: Path, spec):
        self.path = run_dir / "metrics.jsonl"
        self.file = open(self.path, "a")

    def reopen(self) -> None:
        """Append to the file again (after it was cut back and replaced: `Loggers.rewind`)."""
        self.close()
        self.file = open(self.path, "a")

    def log(self, row: dict) -> None:
        self.file.write(json.dumps(row, sort_keys=True) + "\n")
        self.file.flush()

    def close(self) -> None:
        try:
            self.file.close()
        except OSError:  # a failed write (full disk) was reported where it happened
            pass


class TensorBoardLogger:
    """Scalars in TensorBoard event files under RUN_DIR/tensorboard."""

    def __init__(self, run_dir: Path, spec):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, row: dict) -> None:
        for name, value in _scalars(row).items():
            self.writer.add_scalar(name, value, global_step=row["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """A W&B run named after the run directory, the resolved graph as its config; a resumed
    run continues the same W&B run (its id is the directory's name)."""

    def __init__(self, run_dir: Path, spec):
        import wandb

        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "flowrl"),
            name=run_dir.name,
            id=run_dir.name.replace(":", "-"),
            resume="allow",
            dir=str(run_dir),
            config=spec.raw,
        )

    def log(self, row: dict) -> None:
        self.run.log(_scalars(row), step=row["step"])

    def close(self) -> None:
        self.run.finish()


LOGGERS = {"jsonl": JsonlLogger, "tensorboard": TensorBoardLogger, "wandb": WandbLogger}


class Loggers:
    """Every logger of a run; jsonl is always among them. Rows without a step (events) go to
    metrics.jsonl only."""

    def __init__(self, names, run_dir: Path, spec):
        names = ["jsonl", *(n for n in names if n != "jsonl")]
        self.loggers = [LOGGERS[name](run_dir, spec) for name in names]
        self.sent = -1  # the last step the other loggers got (they cannot take a step back)
        self.skip_upto = -1  # after a recovery: the steps they have, which run again

    def log(self, row: dict) -> None:
        step = row.get("step")
        again = step is not None and step <= self.skip_upto
        for logger in self.loggers:
            if isinstance(logger, JsonlLogger):
                logger.log(row)
            elif step is not None and "event" not in row and not again:
                logger.log(row)
        if step is not None and "event" not in row:
            self.sent = max(self.sent, step)

    def rewind(self) -> None:
        """Before metrics.jsonl is cut back to an earlier step (a recovery runs later steps
        again): its file is closed (`reopen` opens it again); TensorBoard and W&B keep the
        steps they have and are not sent them again."""
        self.skip_upto = self.sent
        for logger in self.loggers:
            if isinstance(logger, JsonlLogger):
                logger.close()

    def reopen(self) -> None:
        for logger in self.loggers:
            if isinstance(logger, JsonlLogger):
                logger.reopen()

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()


def _scalars(row: dict) -> dict[str, float]:
    """The row's numbers, without the step (the x axis)."""
    return {
        name: float(value)
        for name, value in row.items()
        if name != "step" and isinstance(value, int | float) and not isinstance(value, bool)
    }
