"""Prompts -> token batches: chat templating, over-long prompt filtering, a resumable loader."""

from pathlib import Path

import torch

from flowrl.data.arithmetic import arithmetic_rows
from flowrl.data.calculator import calculator_rows
from flowrl.data.preferences import arithmetic_preference_rows
from flowrl.data.verl_format import DataError, load_rows
from flowrl.front.schema import DATASET_KEYS
from flowrl.protocol import DataProto
from flowrl.samplers import UniformOptions, UniformSampler, checked_draw


def make_rows(source: str, split: str, size: int, seed: int, base_dir=".") -> list[dict]:
    """ "arithmetic", "calculator" or "arithmetic_preferences" -> a built-in task;
    "verifiers:<file.py or id>" -> a verifiers environment's tasks; else a data file relative
    to base_dir."""
    if source == "arithmetic":
        return arithmetic_rows(split, size, seed)
    if source == "calculator":
        return calculator_rows(split, size, seed)
    if source == "arithmetic_preferences":  # pairs for a reward model (data/preferences.py)
        return arithmetic_preference_rows(split, size, seed)
    if source == "calculator_tools":  # the tool shown by its schema only
        return calculator_rows(split, size, seed, schema_only=True)
    if source.startswith("verifiers:"):  # a verifiers environment's tasks
        from flowrl.serve.verifiers_envs import task_rows

        return task_rows(source, base_dir)
    path = Path(source) if Path(source).is_absolute() else Path(base_dir) / source
    return load_rows(path)


class PromptDataset:
    """Tokenized prompts; rows longer than max_prompt_len tokens are dropped (counted in
    `filtered`), rows equal to an earlier one in prompt and ground truth are counted in
    `duplicates` (kept: a data set may repeat a prompt on purpose). `render(row) -> text`
    replaces the plain chat template (an agent node's prompts carry its tools:
    flowrl/agent/prompt.py); `source` names the rows' file in messages."""

    def __init__(
        self, rows: list[dict], tokenizer, max_prompt_len: int, render=None, source: str = "data"
    ):
        self.tokenizer, self.source, self.max_prompt_len = tokenizer, source, max_prompt_len
        self.pad = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )
        self.items, self.longest, seen = [], 0, set()
        for index, row in enumerate(rows):
            try:
                text = (
                    render(row)
                    if render
                    else tokenizer.apply_chat_template(
                        row["prompt"], add_generation_prompt=True, tokenize=False
                    )
                )
            except Exception as e:  # the template rejects the messages (roles, order)
                raise DataError(
                    f"{source}, row {index}: the tokenizer's chat template rejects its prompt "
                    f"({type(e).__name__}: {e}); fix the messages' roles or order"
                ) from None
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            self.longest = max(self.longest, len(ids))
            if len(ids) <= max_prompt_len:
                self.items.append((index, text, ids, row))
            seen.add((text, str(row["reward_model"]["ground_truth"])))
        self.rows, self.filtered = len(rows), len(rows) - len(self.items)
        self.positions = {index: k for k, (index, *_) in enumerate(self.items)}
        self.duplicates = len(rows) - len(seen)

    def indices(self, uids) -> list[int]:
        """The dataset indices (of kept prompts, what a sampler draws) of rows' `uid`s (their
        numbers among all rows: they differ once an over-long prompt was dropped)."""
        return [self.positions[int(uid)] for uid in uids]

    def summary(self) -> str:
        """One line for the run's first output: what was kept, dropped and repeated."""
        text = f"{self.source}: {len(self)} of {self.rows} prompts kept"
        if self.filtered:
            text += (
                f"; {self.filtered} dropped as longer than data.max_prompt_len = "
                f"{self.max_prompt_len} tokens (the longest has {self.longest})"
            )
        if self.duplicates:
            text += f"; {self.duplicates} rows repeat an earlier one (prompt and ground truth)"
        return text

    def __len__(self) -> int:
        return len(self.items)

    def collate(self, indices) -> DataProto:
        items = [self.items[i] for i in indices]
        width = max((len(ids) for _, _, ids, _ in items), default=0)
        prompts = torch.full((len(items), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(items), width), dtype=torch.long)
        for row, (_, _, ids, _) in enumerate(items):  # left padding: prompts end together
            prompts[row, width - len(ids) :] = torch.tensor(ids)
            mask[row, width - len(ids) :] = 1
        batch = DataProto.from_dict(
            {
                "prompts": prompts,
                "prompt_mask": mask,
                "uid": torch.tensor([index for index, _, _, _ in items], dtype=torch.long),
            },
            {
                "prompt_text": [text for _, text, _, _ in items],
                "raw_prompt": [row["prompt"] for *_, row in items],
                "ground_truth": [row["reward_model"]["ground_truth"] for *_, row in items],
                "data_source": [row["data_source"] for *_, row in items],
                "extra_info": [row.get("extra_info", {}) for *_, row in items],
            },
        )
        # the graph check wires reads of these keys to the dataset: they must match exactly
        assert batch.keys() == sorted(DATASET_KEYS), batch.keys()
        return batch


class PromptLoader:
    """Endless batches of the prompts a sampler draws (flowrl/samplers.py; default every
    prompt once an epoch, reshuffled per epoch from the seed); resumable exactly."""

    def __init__(
        self, dataset: PromptDataset, batch_size: int, seed: int, shuffle=True, sampler=None
    ):
        if batch_size > len(dataset):
            if len(dataset) == 0 and dataset.rows:
                raise DataError(
                    f"{dataset.source}: all {dataset.rows} prompts are longer than "
                    f"data.max_prompt_len = {dataset.max_prompt_len} tokens (the longest has "
                    f"{dataset.longest}): raise data.max_prompt_len"
                )
            raise DataError(
                f"{dataset.source}: data.batch_size = {batch_size}, but only {len(dataset)} "
                f"prompts remain ({dataset.filtered} of {dataset.rows} dropped as longer than "
                f"data.max_prompt_len = {dataset.max_prompt_len}): lower data.batch_size to "
                f"{max(len(dataset), 1)} or less, or add rows"
                + (", or raise data.max_prompt_len" if dataset.filtered else "")
            )
        self.dataset, self.batch_size = dataset, batch_size
        self.drawn: list[int] = []  # the indices of the last batch
        self.sampler = sampler or UniformSampler(len(dataset), seed, UniformOptions(shuffle))

    def __len__(self) -> int:
        return len(self.dataset) // self.batch_size

    @property
    def learns(self) -> bool:
        """The sampler chooses prompts from results (the uniform one ignores them)."""
        return bool(getattr(self.sampler, "learns", True))

    def __iter__(self):
        return self

    def __next__(self) -> DataProto:
        drawn = self.sampler.next(self.batch_size)
        self.drawn = checked_draw(self.sampler, drawn, self.batch_size, len(self.dataset))
        return self.dataset.collate(self.drawn)

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)
