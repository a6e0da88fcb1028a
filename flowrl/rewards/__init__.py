"""Rule scorers with verl's signature `compute_score(data_source, solution_str, ground_truth,
extra_info)`, returning a float or a dict with "score". Plain Python, no torch."""

import inspect
import math
import numbers
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


class BadValue(ScorerError):
    """A scorer or tool returned something that is not a finite number."""


def finite(value, who: str) -> float:
    """`value` (a score or reward user code returned) as a finite float; raises BadValue
    naming `who` ("scorer my.py:score") and the value. Every number type counts (bool, numpy,
    a one-element tensor); None, text, NaN and infinity do not."""
    if not isinstance(value, numbers.Real) and _one_element(value):
        value = value.item()  # a numpy array or torch tensor of one number
    if isinstance(value, numbers.Real):
        number = float(value)
        if math.isfinite(number):
            return number
        raise BadValue(f"{who} returned {number} (not a finite number)")
    if value is None:
        raise BadValue(f"{who} returned None (does every path of it return a number?)")
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    raise BadValue(f"{who} returned {type(value).__name__} {shown}, not a number")


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


def _one_element(value) -> bool:
    if not hasattr(value, "item"):
        return False
    count = value.numel() if hasattr(value, "numel") else getattr(value, "size", 0)
    return count == 1


def score_value(result, who: str = "the scorer") -> tuple[float, dict]:
    """A scorer's result (a number, or a dict with "score" and more numbers) as (score, extra
    metrics); raises BadValue naming `who` and the value when the score is not a finite
    number. Extra values that are not finite numbers are left out."""
    if isinstance(result, dict):
        if "score" not in result:
            shown = repr(result) if len(repr(result)) <= 80 else repr(result)[:77] + "..."
            raise BadValue(f'{who} returned a dict without "score": {shown}')
        extra = {
            k: float(v)
            for k, v in result.items()
            if k != "score" and isinstance(v, numbers.Real) and math.isfinite(float(v))
        }
        return finite(result["score"], f'{who} ("score")'), extra
    return finite(result, who), {}
