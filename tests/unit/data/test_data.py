"""Datasets: the synthetic task, verl-format files, left-padded batches, resumable order."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flowrl.data import DataError, PromptDataset, PromptLoader, arithmetic_rows, load_rows
from flowrl.front.schema import DATASET_KEYS
from flowrl.testing import tiny_tokenizer


def question(row):
    return row["prompt"][0]["content"]


def test_arithmetic_splits_are_deterministic_and_disjoint():
    train, val = arithmetic_rows("train", 0, seed=1), arithmetic_rows("validation", 0, seed=1)
    assert train == arithmetic_rows("train", 0, seed=1)
    assert not {question(r) for r in train} & {question(r) for r in val}
    a, b = map(int, question(train[0]).split("?")[0].removeprefix("What is ").split(" + "))
    assert train[0]["reward_model"]["ground_truth"] == str(a + b)


def rows_of(n):
    return [
        {
            "prompt": [{"role": "user", "content": f"q{i}"}],
            "data_source": "gsm8k",
            "reward_model": {"ground_truth": str(i)},
            "extra_info": {"i": i},
        }
        for i in range(n)
    ]


def test_parquet_and_jsonl_round_trip(tmp_path):
    pq.write_table(pa.Table.from_pylist(rows_of(3)), tmp_path / "d.parquet")
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows_of(3)))
    for name in ("d.parquet", "d.jsonl"):
        loaded = load_rows(tmp_path / name)
        assert [r["reward_model"]["ground_truth"] for r in loaded] == ["0", "1", "2"]
        assert loaded[1]["prompt"] == [{"role": "user", "content": "q1"}]


def test_bad_row_names_file_row_and_key(tmp_path):
    bad = rows_of(2)
    del bad[1]["reward_model"]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in bad))
    where = r"d\.jsonl, line 2, column \"reward_model\": None; it must hold \"ground_truth\""
    with pytest.raises(DataError, match=where):
        load_rows(tmp_path / "d.jsonl")


def test_batches_are_left_padded_and_long_prompts_dropped():
    rows = rows_of(3) + [{**rows_of(1)[0], "prompt": [{"role": "user", "content": "x" * 500}]}]
    data = PromptDataset(rows, tiny_tokenizer(), max_prompt_len=64)
    assert len(data) == 3 and data.filtered == 1
    batch = data.collate([0, 1, 2])
    mask = batch["prompt_mask"]
    assert mask[:, -1].all()  # every prompt ends in the last column
    assert batch["uid"].tolist() == [0, 1, 2]
    assert list(batch["ground_truth"]) == ["0", "1", "2"]
    text = tiny_tokenizer().decode(batch["prompts"][0][mask[0].bool()])
    assert text.endswith("<|im_start|>assistant\n") and "q0" in text


def test_loader_resumes_exactly():
    data = PromptDataset(rows_of(10), tiny_tokenizer(), 64)
    first = PromptLoader(data, 3, seed=0)
    straight = [next(first)["uid"].tolist() for _ in range(7)]  # crosses two epochs
    second = PromptLoader(data, 3, seed=0)
    for _ in range(4):
        next(second)
    state = second.state_dict()
    resumed = PromptLoader(data, 3, seed=0)
    resumed.load_state_dict(state)
    assert [next(resumed)["uid"].tolist() for _ in range(3)] == straight[4:]


def test_batch_larger_than_dataset_is_a_clear_error():
    message = "batch_size = 20, but only 10 prompts remain .*lower data.batch_size to 10"
    with pytest.raises(DataError, match=message):
        PromptLoader(PromptDataset(rows_of(10), tiny_tokenizer(), 64), 20, seed=0)


def test_batch_holds_exactly_the_dataset_keys():
    batch = PromptDataset(rows_of(3), tiny_tokenizer(), 64).collate([0, 2])
    assert sorted(batch.keys()) == sorted(DATASET_KEYS)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (b'{"a": 1}\n\n{"a": 2,\n', r"d\.jsonl, line 3, column 9: not valid JSON"),
        (b'{"a": 1}\n[1, 2]\n', r"d\.jsonl, line 2: a row must be a JSON object"),
        (b'{"a": 1}\n{"a": "\xff"}\n', r"d\.jsonl, line 2: not UTF-8 text"),
    ],
)
def test_malformed_jsonl_line_names_file_and_line(tmp_path, text, expected):
    (tmp_path / "d.jsonl").write_bytes(text)
    with pytest.raises(DataError, match=expected):
        load_rows(tmp_path / "d.jsonl")


def test_jsonl_with_byte_order_mark_loads(tmp_path):
    (tmp_path / "d.jsonl").write_bytes(b"\xef\xbb\xbf" + json.dumps(rows_of(1)[0]).encode())
    assert load_rows(tmp_path / "d.jsonl")[0]["reward_model"]["ground_truth"] == "0"


def test_calculator_rows_are_verl_multi_turn_rows_with_disjoint_splits():
    from flowrl.data import calculator_rows

    train, val = calculator_rows("train", 50, seed=2), calculator_rows("validation", 0, seed=2)
    assert train == calculator_rows("train", 50, seed=2) and len(val) == 1024
    row = train[0]
    question = row["prompt"][-1]["content"]
    a, b = map(int, question.removeprefix("What is ").removesuffix("?").split(" * "))
    assert 100 <= a <= 999 and 10 <= b <= 99
    assert row["reward_model"]["ground_truth"] == str(a * b)
    roles = [m["role"] for m in row["prompt"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "user"]  # one example
    assert row["prompt"][2]["content"] == "<calc>12*34</calc>"
    assert row["extra_info"]["agent_name"] == "tool_agent"
    assert calculator_rows("train", 1, examples=False)[0]["prompt"][0]["role"] == "system"
    assert len(calculator_rows("train", 1, examples=False)[0]["prompt"]) == 2
    assert not {r["prompt"][-1]["content"] for r in train} & {
        r["prompt"][-1]["content"] for r in val
    }


def test_verl_agent_name_is_kept_in_extra_info_and_raw_prompt_reaches_the_batch(tmp_path):
    rows = rows_of(2)
    rows[0]["agent_name"] = "tool_agent"
    rows[0]["extra_info"]["tools_kwargs"] = {"t": {"create_kwargs": {"x": 1}}}
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    loaded = load_rows(tmp_path / "d.jsonl")
    assert loaded[0]["extra_info"]["agent_name"] == "tool_agent"
    assert loaded[0]["extra_info"]["tools_kwargs"] == {"t": {"create_kwargs": {"x": 1}}}
    assert "agent_name" not in loaded[1]["extra_info"]
    batch = PromptDataset(loaded, tiny_tokenizer(), max_prompt_len=64).collate([0, 1])
    assert list(batch["raw_prompt"]) == [r["prompt"] for r in loaded]


# -- which rows validate (flowrl/data/split.py) ----------------------------------------------


def verl_file(path, count: int):
    rows = [
        {"prompt": f"Q{i}?", "data_source": "mine", "reward_model": {"ground_truth": str(i)}}
        for i in range(count)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_file_without_val_source_holds_out_rows_training_never_sees(tmp_path):
    from flowrl.data.split import train_and_validation_rows
    from flowrl.front.schema import DataConfig

    verl_file(tmp_path / "train.jsonl", 100)
    data = DataConfig(source="train.jsonl", batch_size=4)
    train, val, note = train_and_validation_rows(data, 10, 0, tmp_path)
    truths = lambda rows: {r["reward_model"]["ground_truth"] for r in rows}  # noqa: E731
    assert len(val) == 10 and len(train) == 90 and not truths(train) & truths(val)
    assert "10 rows of train.jsonl held out (training uses the other 90)" in note
    _, val_seed_1, _ = train_and_validation_rows(data, 10, 1, tmp_path)
    assert truths(val_seed_1) == truths(val)  # the same rows whatever run.seed
    assert truths(val) != {str(i) for i in range(10)}  # not simply the file's first rows


def test_a_file_too_small_to_hold_out_is_refused_with_the_fix(tmp_path):
    from flowrl.data.split import train_and_validation_rows
    from flowrl.front.schema import DataConfig

    verl_file(tmp_path / "train.jsonl", 66)
    data = DataConfig(source="train.jsonl", batch_size=4)
    with pytest.raises(DataError, match="66 rows: holding out run.val_size = 64") as info:
        train_and_validation_rows(data, 64, 0, tmp_path)
    assert "set data.val_source" in str(info.value)
    train, val, _ = train_and_validation_rows(data, 0, 0, tmp_path)  # validation off
    assert len(train) == 66 and val == []


def test_val_source_and_built_in_tasks_keep_their_own_validation(tmp_path):
    from flowrl.data.split import train_and_validation_rows
    from flowrl.front.schema import DataConfig

    verl_file(tmp_path / "train.jsonl", 20)
    verl_file(tmp_path / "val.jsonl", 5)
    data = DataConfig(source="train.jsonl", val_source="val.jsonl", batch_size=4)
    train, val, note = train_and_validation_rows(data, 64, 0, tmp_path)
    assert len(train) == 20 and len(val) == 5 and "val.jsonl (data.val_source)" in note
    data = DataConfig(source="arithmetic", batch_size=4, train_size=32)
    train, val, _ = train_and_validation_rows(data, 8, 0, tmp_path)
    questions = lambda rows: {r["prompt"][-1]["content"] for r in rows}  # noqa: E731
    assert len(train) == 32 and len(val) == 8 and not questions(train) & questions(val)


def test_the_rows_of_docs_data_md_load(tmp_path, monkeypatch):
    """The JSONL row and the parquet script of docs/data.md, through the loader."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[3] / "docs/data.md").read_text()
    line = re.search(r"```json\n(.*?)\n```", page, flags=re.S)[1]
    (tmp_path / "one.jsonl").write_text(line + "\n")
    (row,) = load_rows(tmp_path / "one.jsonl")
    assert row["reward_model"]["ground_truth"] == "42" and row["prompt"][1]["role"] == "user"
    assert row["extra_info"] == {"index": 0, "split": "train"}
    script = re.search(r"```python\n(.*?)```", page, flags=re.S)[1]
    monkeypatch.chdir(tmp_path)
    exec(script, {})
    rows = load_rows(tmp_path / "train.parquet")
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["3", "7", "11", "15"]
    batch = PromptDataset(rows, tiny_tokenizer(), 256).collate([0, 1])
    assert batch["data_source"].tolist() == ["arithmetic", "arithmetic"]


def test_val_source_naming_the_training_file_is_refused_at_check(tmp_path):
    from pathlib import Path

    from flowrl.errors import GraphErrors
    from flowrl.front import compiler

    verl_file(tmp_path / "train.jsonl", 100)
    graph = (Path(__file__).resolve().parents[3] / "graphs/grpo.toml").read_text()
    graph = graph.replace(
        'source = "arithmetic"', 'source = "train.jsonl"\nval_source = "./train.jsonl"'
    )
    (tmp_path / "g.toml").write_text(graph)
    with pytest.raises(GraphErrors) as info:
        compiler.compile_file(tmp_path / "g.toml")
    (problem,) = info.value.problems
    assert problem.where == "[data] val_source" and "names the training file" in problem.message
    assert "leave val_source out" in problem.fix
