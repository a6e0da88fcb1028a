"""Score for the arithmetic task: 1.0 if the last integer in the response is the answer."""

import re

NUMBER = re.compile(r"-?\d[\d,]*")


def last_integer(text: str) -> int | None:
    found = NUMBER.findall(text)
    if not found:
        return None
    try:
        return int(found[-1].replace(",", "").rstrip(","))
    except ValueError:
        return None


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    value = last_integer(solution_str)
    return float(value is not None and value == int(str(ground_truth).strip()))
