"""Which rows a run trains on and which it validates on (docs/data.md, "Validation").

- `data.val_source` set: validation is the first `run.val_size` rows of that file (or task).
- a built-in task (`arithmetic`, `calculator`): its own validation split, generated apart
  from the training split.
- a data file without `val_source`: `run.val_size` rows of the file are held out, chosen by a
  fixed shuffle (the same for every `run.seed`, so runs with different seeds validate on the
  same rows), and training never sees them. A file too small to hold them out and still fill
  a prompt batch is refused, with the fix. Validating on training rows is never done.
"""

import numpy as np

from flowrl.data.loader import make_rows
from flowrl.data.verl_format import DataError
from flowrl.front.schema import BUILTIN_SOURCES

HOLD_OUT_SEED = 0  # fixed: the held-out rows do not change with run.seed


def train_and_validation_rows(data, val_size: int, seed: int, base_dir) -> tuple[list, list, str]:
    """(training rows, validation rows, one line saying where validation comes from).

    Args:
        data: the graph's `[data]` table (flowrl.front.schema.DataConfig).
        val_size: `run.val_size`, prompts to validate on; 0 = no validation.
        seed: `run.seed` (the built-in tasks generate their rows from it).
        base_dir: where relative data paths resolve (the graph file's folder).
    """
    train = make_rows(data.source, "train", data.train_size, seed, base_dir)
    if not val_size:
        return train, [], ""
    if data.val_source:
        val = make_rows(data.val_source, "validation", val_size, seed, base_dir)[:val_size]
        return train, val, f"validation: {len(val)} rows of {data.val_source} (data.val_source)"
    if data.source in BUILTIN_SOURCES:
        val = make_rows(data.source, "validation", val_size, seed, base_dir)[:val_size]
        return train, val, f"validation: {len(val)} rows of the {data.source} validation split"
    if len(train) < val_size + data.batch_size:
        raise DataError(
            f"{data.source} has {len(train)} rows: holding out run.val_size = {val_size} for "
            f"validation leaves fewer than data.batch_size = {data.batch_size} to train on, and "
            "validating on training rows would measure nothing. Fix: set data.val_source to a "
            "validation file, or lower run.val_size (0 turns validation off)"
        )
    held = np.random.default_rng(HOLD_OUT_SEED).permutation(len(train))[:val_size]
    chosen = set(held.tolist())
    val = [train[i] for i in sorted(chosen)]
    train = [row for i, row in enumerate(train) if i not in chosen]
    note = (
        f"validation: {val_size} rows of {data.source} held out (training uses the other "
        f"{len(train)}); set data.val_source to validate on a file of your own"
    )
    return train, val, note
