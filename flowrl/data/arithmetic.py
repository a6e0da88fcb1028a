"""A built-in synthetic task: "What is a + b?", so the default run needs no files.

Rows follow verl's format. Train and validation splits cut one seeded shuffle of all operand
pairs, so they never share a question.
"""

import random

QUESTION = "What is {a} {op} {b}? Answer with just the number."


def arithmetic_rows(
    split: str, size: int, seed: int = 0, max_operand: int = 50, ops: tuple[str, ...] = ("+",)
) -> list[dict]:
    """`size` rows (0 = all) of the split ("train" or "validation"); validation takes the
    first 1024 pairs of the shuffle (or a quarter, if fewer exist), train the rest."""
    pairs = [
        (a, b, op) for op in ops for a in range(max_operand + 1) for b in range(max_operand + 1)
    ]
    random.Random(seed).shuffle(pairs)
    cut = min(1024, len(pairs) // 4)
    pool = pairs[:cut] if split == "validation" else pairs[cut:]
    size = size or len(pool)  # 0: the whole split
    if size > len(pool):
        raise ValueError(f"arithmetic {split} split has {len(pool)} questions, {size} asked")
    rows = []
    for i, (a, b, op) in enumerate(pool[:size]):
        answer = a + b if op == "+" else a - b
        rows.append(
            {
                "prompt": [{"role": "user", "content": QUESTION.format(a=a, op=op, b=b)}],
                "data_source": "arithmetic",
                "reward_model": {"ground_truth": str(answer), "style": "rule"},
                "extra_info": {"index": i, "split": split},
            }
        )
    return rows
