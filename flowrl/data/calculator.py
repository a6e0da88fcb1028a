"""A built-in tool task: "What is a * b?" for a 3-digit a and a 2-digit b, with a calculator.

SmolLM2-135M cannot multiply these in its head (0 of 8 greedy); the prompt describes the
`<calc>EXPRESSION</calc>` call and shows one worked example as prior messages (a user question,
the assistant's call, the tool's answer, the assistant's final answer), which is enough for it
to call the tool now and then when sampled: the regime where GRPO learns. Rows follow verl's
multi-turn format (`agent_name`, `extra_info.need_tools_kwargs`); the calculator needs no
per-row state, so no `tools_kwargs`.
Train and validation cut one seeded shuffle of all 81,000 pairs, so they never share a question.
"""

import random

SYSTEM = (
    "You have a calculator. To compute, write <calc>EXPRESSION</calc> and stop; the result "
    "comes back as a tool message. Then answer with just the number."
)
EXAMPLE = [
    {"role": "user", "content": "What is 12 * 34?"},
    {"role": "assistant", "content": "<calc>12*34</calc>"},
    {"role": "tool", "content": "408"},
    {"role": "assistant", "content": "408"},
]
QUESTION = "What is {a} * {b}?"
# the "calculator_tools" source: the tool is shown only by its schema, which the agent node's
# chat template puts in the prompt (tools=); no call format, no worked example
TOOLS_SYSTEM = "Use the calc tool for arithmetic. Then answer with just the number."


def calculator_rows(
    split: str, size: int, seed: int = 0, examples: bool = True, schema_only: bool = False
) -> list[dict]:
    """`size` rows (0 = all) of the split ("train" or "validation"); validation takes the
    first 1024 pairs of the shuffle, train the rest. `examples=False` leaves out the worked
    example (the prompt then only describes the tool); `schema_only=True` neither describes
    the call format nor shows an example: the template's tool block is all the model sees."""
    pairs = [(a, b) for a in range(100, 1000) for b in range(10, 100)]
    random.Random(seed).shuffle(pairs)
    pool = pairs[:1024] if split == "validation" else pairs[1024:]
    size = size or len(pool)
    if size > len(pool):
        raise ValueError(f"calculator {split} split has {len(pool)} questions, {size} asked")
    rows = []
    for i, (a, b) in enumerate(pool[:size]):
        prompt = [{"role": "system", "content": SYSTEM}, *(EXAMPLE if examples else [])]
        if schema_only:
            prompt = [{"role": "system", "content": TOOLS_SYSTEM}]
        rows.append(
            {
                "prompt": [*prompt, {"role": "user", "content": QUESTION.format(a=a, b=b)}],
                "data_source": "calculator",
                "reward_model": {"ground_truth": str(a * b), "style": "rule"},
                "extra_info": {
                    "index": i,
                    "split": split,
                    "agent_name": "tool_agent",
                    "need_tools_kwargs": False,
                },
            }
        )
    return rows
