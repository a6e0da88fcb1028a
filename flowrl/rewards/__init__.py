"""Rule scorers with verl's signature `compute_score(data_source, solution_str, ground_truth,
extra_info)`, returning a float or a dict with "score". Plain Python, no torch."""

import inspect
from pathlib import Path

from flowrl import refs
from flowrl.errors import FlowrlError
from flowrl.rewards import arithmetic, gsm8k

BY_NAME = {"arithmetic": arithmetic.compute_score, "gsm8k": gsm8k.compute_score}
BY_SOURCE = {
    "arithmetic": "arithmetic",
    "calculator": "arithmetic",  # the last integer of the model's own text is a * b
    "gsm8k": "gsm8k",
    "openai/gsm8k": "gsm8k",
}
SIGNATURE = "compute_score(data_source, solution_str, ground_truth, extra_info)"


class ScorerError(FlowrlError, ValueError):
    """A scorer that cannot be found, loaded or used."""


def resolve_scorer(ref: str, base_dir: str | Path = "."):
    """ "auto" (by each row's data_source), a built-in name, "path/to/file.py:function"
    (relative to base_dir) or "package.module:function" (flowrl/refs.py loads those)."""
    if ref == "auto":
        return auto_score
    if ref in BY_NAME:
        return BY_NAME[ref]
    if ":" not in ref:
        raise ScorerError(
            f'unknown scorer "{ref}": use "auto", {", ".join(BY_NAME)}, or '
            '"path/to/file.py:function"'
        )
    function = refs.load(ref, base_dir, "scorer", error=ScorerError)
    if not callable(function):
        raise ScorerError(f'scorer "{ref}" is not a function; expected {SIGNATURE}')
    if len(inspect.signature(function).parameters) < 3:
        raise ScorerError(f'scorer "{ref}" takes too few arguments; expected {SIGNATURE}')
    return function


def auto_score(data_source, solution_str, ground_truth, extra_info=None):
    name = BY_SOURCE.get(str(data_source))
    if name is None:
        raise ScorerError(
            f'no built-in scorer for data_source "{data_source}": set '
            'scorer = "path/to/file.py:compute_score" on the reward node'
        )
    return BY_NAME[name](data_source, solution_str, ground_truth, extra_info)


def score_value(result) -> tuple[float, dict]:
    """A scorer's result as (score, extra metrics)."""
    if isinstance(result, dict):
        if "score" not in result:
            raise ScorerError(f'a scorer returned a dict without "score": {result}')
        extra = {
            k: float(v)
            for k, v in result.items()
            if k != "score" and isinstance(v, int | float | bool)
        }
        return float(result["score"]), extra
    return float(result), {}
