"""Preference pairs for training a reward model: one prompt, a chosen and a rejected response.

flowrl's preference row is a verl row whose `extra_info` holds the pair, so it travels through
the same loader and batch keys as any prompt (reward.pairwise and update.reward_model read it):

    {"prompt": [{"role": "user", "content": "What is 2 + 3?"}],
     "data_source": "arithmetic",
     "reward_model": {"ground_truth": "", "style": "preference"},
     "extra_info": {"chosen": [{"role": "assistant", "content": "5"}],
                    "rejected": [{"role": "assistant", "content": "6"}]}}

A data file may instead give `chosen` and `rejected` at the top level, as verl's reward-model
datasets (`prompt`, `chosen`, `rejected` strings) and TRL's preference datasets do (strings, or
lists of messages; TRL's "implicit prompt" form, without `prompt`, keeps the shared first
messages of the two conversations as the prompt). `preference_row` turns those into the above.
"""

import random

from flowrl.data.arithmetic import arithmetic_rows


def preference_row(row: dict, where: str) -> dict:
    """A TRL / verl preference row (top-level `chosen`, `rejected`) -> flowrl's form."""
    chosen, rejected = _messages(row.get("chosen"), where), _messages(row.get("rejected"), where)
    prompt = row.get("prompt")
    if prompt is None:  # TRL's implicit prompt: the messages both conversations share
        shared = 0
        while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
            shared += 1
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    extra = {**(row.get("extra_info") or {}), "chosen": chosen, "rejected": rejected}
    return {
        "prompt": prompt,
        "data_source": row.get("data_source") or "preference",
        "reward_model": {"ground_truth": "", "style": "preference"},
        "extra_info": extra,
    }


def _messages(value, where: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        return [dict(m) for m in value]
    raise ValueError(
        f'{where}: "chosen" and "rejected" must each be a response string or a list of '
        '{"role", "content"} messages'
    )


FORMS = ("{n}", "The answer is {n}.", "{a} + {b} = {n}", "{a} + {b} is {n}.")


def wrong_answer(a: int, b: int, rng: random.Random) -> int:
    """A plausible mistake on a + b: off by one or ten, one operand alone, or a digit slip."""
    right = a + b
    options = [right + 1, right - 1, right + 10, right - 10, a, b, abs(a - b), right * 10 % 100]
    options = [n for n in options if n != right and n >= 0]
    return rng.choice(options)


def arithmetic_preference_rows(split: str, size: int, seed: int = 0) -> list[dict]:
    """The arithmetic task's questions with a right (chosen) and a wrong (rejected) answer in
    the same wording; validation questions are the arithmetic validation split's, so a reward
    model is judged on questions it never saw."""
    rng = random.Random(f"preferences-{split}-{seed}")
    rows = []
    for row in arithmetic_rows(split, size, seed):
        a, b = (int(x) for x in row["prompt"][0]["content"].split("?")[0].split()[-3::2])
        form = rng.choice(FORMS)
        answer = {"chosen": int(row["reward_model"]["ground_truth"])}
        answer["rejected"] = wrong_answer(a, b, rng)
        pair = {
            k: [{"role": "assistant", "content": form.format(a=a, b=b, n=n)}]
            for k, n in answer.items()
        }
        extra = {**row["extra_info"], **pair}
        rows.append({**row, "reward_model": {**row["reward_model"], "style": "preference"}})
        rows[-1]["extra_info"] = extra
    return rows
