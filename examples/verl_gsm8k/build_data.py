"""Rows in the format of verl's examples/data_preprocess/gsm8k_multiturn_w_tool.py, written to
train.parquet and test.parquet next to this file.

    python examples/verl_gsm8k/build_data.py            # synthetic GSM8K-style questions
    python examples/verl_gsm8k/build_data.py --gsm8k    # the real GSM8K (needs `datasets`
                                                        #   and the hub; not available offline)

The synthetic questions ("A shop sells a boxes of b pencils ...") stand in for GSM8K where it
cannot be downloaded; every field is built the way verl's script builds it.
"""

import argparse
import random
import re
from pathlib import Path

SYSTEM = (
    "You are a math expert. You are given a question and you need to solve it step by step. "
    "Reasoning step by step before any tool call. "
    "You should use the `calc_gsm8k_reward` tool after step by step solving the question, "
    "before generate final answer at least once and refine your answer if necessary. "
    "Put your final answer in the format of `#### <answer>`."
)
INSTRUCTION = "Let's think step by step and output the final answer after `####`."


def verl_row(question: str, answer_raw: str, solution: str, split: str, index: int) -> dict:
    return {
        "data_source": "openai/gsm8k",
        "agent_name": "tool_agent",
        "prompt": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": question + " " + INSTRUCTION},
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": solution},
        "extra_info": {
            "split": split,
            "index": index,
            "answer": answer_raw,
            "question": question,
            "need_tools_kwargs": True,
            "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": solution}}},
            "interaction_kwargs": {"name": "gsm8k", "query": question, "ground_truth": solution},
        },
    }


def synthetic(split: str, size: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for index in range(size):
        a, b, c = rng.randint(2, 20), rng.randint(2, 12), rng.randint(1, 30)
        question = (
            f"A shop sells {a} boxes of {b} pencils and {c} loose pencils. "
            "How many pencils does it sell?"
        )
        product, total = a * b, a * b + c
        answer_raw = (
            f"{a}*{b}=<<{a}*{b}={product}>>{product}; "
            f"{product}+{c}=<<{product}+{c}={total}>>{total}\n#### {total}"
        )
        rows.append(verl_row(question, answer_raw, str(total), split, index))
    return rows


def gsm8k(split: str) -> list[dict]:
    import datasets

    data = datasets.load_dataset("openai/gsm8k", "main")["train" if split == "train" else "test"]
    out = []
    for index, example in enumerate(data):
        solution = re.search("#### (\\-?[0-9\\.\\,]+)", example["answer"]).group(1).replace(",", "")
        out.append(verl_row(example["question"], example["answer"], solution, split, index))
    return out


def main() -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    parser = argparse.ArgumentParser()
    parser.add_argument("--gsm8k", action="store_true")
    parser.add_argument("--out", default=str(Path(__file__).parent))
    args = parser.parse_args()
    for split, size, seed in (("train", 256, 0), ("test", 64, 1)):
        rows = gsm8k(split) if args.gsm8k else synthetic(split, size, seed)
        pq.write_table(pa.Table.from_pylist(rows), Path(args.out) / f"{split}.parquet")


if __name__ == "__main__":
    main()
