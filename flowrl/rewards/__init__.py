"""Rule scorers with verl's signature `compute_score(data_source, solution_str, ground_truth,
extra_info)`, returning a float or a dict with "score". Plain Python, no torch."""

import importlib.util
import inspect
import sys
from pathlib import Path

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


def resolve_scorer(spec: str, base_dir: str | Path = "."):
    """ "auto" (by each row's data_source), a built-in name, or "path/to/file.py:function"."""
    if spec == "auto":
        return auto_score
    if spec in BY_NAME:
        return BY_NAME[spec]
    file, _, name = spec.rpartition(":")
    if not file.endswith(".py") or not name:
        raise ScorerError(
            f'unknown scorer "{spec}": use "auto", {", ".join(BY_NAME)}, or '
            '"path/to/file.py:function"'
        )
    path = Path(file) if Path(file).is_absolute() else Path(base_dir) / file
    if not path.is_file():
        raise ScorerError(f'scorer file "{path}" not found')
    module_spec = importlib.util.spec_from_file_location(f"flowrl_scorer_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    if str(path.resolve().parent) not in sys.path:  # its sibling modules import, as in tools
        sys.path.append(str(path.resolve().parent))
    module_spec.loader.exec_module(module)
    function = getattr(module, name, None)
    if not callable(function):
        raise ScorerError(f'{path} has no function "{name}"; expected {SIGNATURE}')
    if len(inspect.signature(function).parameters) < 3:
        raise ScorerError(f"{path}:{name} takes too few arguments; expected {SIGNATURE}")
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
