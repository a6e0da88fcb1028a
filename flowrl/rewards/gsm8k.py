"""GSM8K scoring: the answer follows "####" (strict), or is the last number (flexible)."""

import re

from flowrl.rewards.arithmetic import last_integer

STRICT = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


def extract_answer(text: str, method: str = "strict") -> str | None:
    found = STRICT.findall(text)
    if found:
        return found[-1].replace(",", "")
    if method == "flexible":
        value = last_integer(text)
        return None if value is None else str(value)
    return None


def compute_score(
    data_source,
    solution_str,
    ground_truth,
    extra_info=None,
    method="strict",
    format_score=0.0,
    score=1.0,
) -> float:
    answer = extract_answer(solution_str, method)
    if answer is None:
        return 0.0
    truth = str(ground_truth).replace(",", "").strip()
    try:
        return score if float(answer) == float(truth) else format_score
    except ValueError:
        return score if answer == truth else format_score
