"""Prompts -> token batches: chat templating, over-long prompt filtering, a resumable loader."""

from pathlib import Path

import numpy as np
import torch

from flowrl.data.arithmetic import arithmetic_rows
from flowrl.data.calculator import calculator_rows
from flowrl.data.preferences import arithmetic_preference_rows
from flowrl.data.verl_format import DataError, load_rows
from flowrl.front.schema import DATASET_KEYS
from flowrl.protocol import DataProto


def make_rows(source: str, split: str, size: int, seed: int, base_dir=".") -> list[dict]:
    """ "arithmetic", "calculator" or "arithmetic_preferences" -> a built-in task; else a data
    file relative to base_dir."""
    if source == "arithmetic":
        return arithmetic_rows(split, size, seed)
    if source == "calculator":
        return calculator_rows(split, size, seed)
    if source == "arithmetic_preferences":  # pairs for a reward model (data/preferences.py)
        return arithmetic_preference_rows(split, size, seed)
    if source == "calculator_tools":  # the tool shown by its schema only
        return calculator_rows(split, size, seed, schema_only=True)
    path = Path(source) if Path(source).is_absolute() else Path(base_dir) / source
    return load_rows(path)


class PromptDataset:
    """Tokenized prompts; rows longer than max_prompt_len tokens are dropped (`filtered`).
    `render(row) -> text` replaces the plain chat template (an agent node's prompts carry its
    tools: flowrl/agent/prompt.py)."""

    def __init__(self, rows: list[dict], tokenizer, max_prompt_len: int, render=None):
        self.tokenizer = tokenizer
        self.pad = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )
        self.items = []
        for index, row in enumerate(rows):
            text = (
                render(row)
                if render
                else tokenizer.apply_chat_template(
                    row["prompt"], add_generation_prompt=True, tokenize=False
                )
            )
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) <= max_prompt_len:
                self.items.append((index, text, ids, row))
        self.filtered = len(rows) - len(self.items)

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
    """Endless batches over epochs, reshuffled per epoch from the seed; resumable exactly."""

    def __init__(self, dataset: PromptDataset, batch_size: int, seed: int, shuffle: bool = True):
        if batch_size > len(dataset):
            raise DataError(
                f"data.batch_size = {batch_size} but only {len(dataset)} prompts "
                f"remain ({dataset.filtered} longer than max_prompt_len were dropped)"
                ": lower batch_size or raise data.max_prompt_len"
            )
        self.dataset, self.batch_size, self.seed, self.shuffle = dataset, batch_size, seed, shuffle
        self.epoch, self.position = 0, 0

    def __len__(self) -> int:
        return len(self.dataset) // self.batch_size

    def _order(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.dataset))
        return np.random.default_rng(self.seed + self.epoch).permutation(len(self.dataset))

    def __iter__(self):
        return self

    def __next__(self) -> DataProto:
        if self.position >= len(self):
            self.epoch, self.position = self.epoch + 1, 0
        start = self.position * self.batch_size
        self.position += 1
        return self.dataset.collate(self._order()[start : start + self.batch_size].tolist())

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
