"""Which rows a run trains on and which it validates on (docs/data.md, "Validation").

- `data.val_source` set: validation is the first `run.val_size` rows of that file (or task).
- a built-in task (`arithmetic`, `calculator`): its own validation split, generated apart
  from the training split.
- a data file without `val_source`: `run.val_size` rows of the file are held out, chosen by a
  fixed shuffle (the same for every `run.seed`, so runs with different seeds validate on the
  same rows), and training never sees them. A file too small to hold them out and still fill
  a prompt batch is refused, with the fix. Validating on training rows is never done.
"""

import sys

import attrs
import numpy as np

from flowrl.data.loader import PromptDataset, make_rows
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


def prompt_renderer(spec, tokenizer):
    """`row -> prompt text` from the graph's node with a `NodeSpec.prompt` hook (the agent
    node's: its tools in the prompt), or None: the tokenizer's chat template."""
    for decl in spec.nodes.values():
        if decl.spec.prompt is not None:
            return decl.spec.prompt(decl.params, str(spec.base_dir), tokenizer)
    return None


def prompt_sets(spec, tokenizer) -> tuple[PromptDataset, object, list[str]]:
    """(the training prompts, the validation batch or None, notes) of a graph's [data]: each
    file checked (flowrl/data/verl_format.py), each prompt rendered as the node that samples
    from it asks (`prompt_renderer`); where validation comes from, and what was dropped or
    repeated, said on stderr and returned as notes."""
    data, render = spec.data, prompt_renderer(spec, tokenizer)
    rows, val_rows, note = train_and_validation_rows(
        data, spec.run.val_size, spec.run.seed, spec.base_dir
    )  # never validates on training rows
    train = PromptDataset(rows, tokenizer, data.max_prompt_len, render, source=data.source)
    notes, val_batch = [train.summary()], None
    if val_rows:
        source = data.val_source or data.source
        val_set = PromptDataset(val_rows, tokenizer, data.max_prompt_len, render, source=source)
        if not len(val_set):
            raise DataError(f"validation: {val_set.summary()}: raise data.max_prompt_len")
        val_batch = val_set.collate(list(range(len(val_set))))
        notes += [note, f"validation {val_set.summary()}"]
    for line in notes:
        repeated = "repeat an earlier one" in line
        print(f"flowrl: {'warning: ' if repeated else ''}data: {line}", file=sys.stderr)
    return train, val_batch, notes


def make_sampler(spec, size: int):
    """The sampler `[data] sampler` names over `size` prompts, with its checked options and the
    run's seed (`[data] shuffle = false` sets the uniform sampler's `shuffle` option)."""
    from flowrl.front.sections import sampler_options

    cls, options = sampler_options(spec.data, spec.base_dir)
    if spec.data.sampler == "uniform" and not spec.data.shuffle:
        options = attrs.evolve(options, shuffle=False)
    return cls(size, spec.run.seed, options)
