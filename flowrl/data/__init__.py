"""Data: the synthetic arithmetic and calculator tasks, verl-format files, prompt batches (the
prompts a step draws: flowrl/samplers.py).

The names below load on first use (flowrl/lazy.py), so that importing a torch-free module of
this package imports no torch.
"""

from flowrl.lazy import exports

__getattr__ = exports(
    __name__,
    {
        "DataError": "flowrl.data.verl_format:DataError",
        "PromptDataset": "flowrl.data.loader:PromptDataset",
        "PromptLoader": "flowrl.data.loader:PromptLoader",
        "arithmetic_rows": "flowrl.data.arithmetic:arithmetic_rows",
        "calculator_rows": "flowrl.data.calculator:calculator_rows",
        "load_rows": "flowrl.data.verl_format:load_rows",
        "make_rows": "flowrl.data.loader:make_rows",
    },
)

__all__ = [
    "DataError",
    "PromptDataset",
    "PromptLoader",
    "arithmetic_rows",
    "calculator_rows",
    "load_rows",
    "make_rows",
]
