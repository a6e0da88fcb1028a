"""Data: the synthetic arithmetic and calculator tasks, verl-format files, prompt batches."""

from flowrl.data.arithmetic import arithmetic_rows
from flowrl.data.calculator import calculator_rows
from flowrl.data.loader import PromptDataset, PromptLoader, make_rows
from flowrl.data.verl_format import DataError, load_rows

__all__ = [
    "DataError",
    "PromptDataset",
    "PromptLoader",
    "arithmetic_rows",
    "calculator_rows",
    "load_rows",
    "make_rows",
]
