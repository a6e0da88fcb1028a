"""DataProto: every row operation keeps tensor and non-tensor columns aligned."""

import pickle

import numpy as np
import pytest
import torch

from flowrl.protocol import DataProto


def batch(rows=5):
    return DataProto.from_dict(
        {"ids": torch.arange(rows), "mask": torch.ones(rows, 2, dtype=torch.bfloat16)},
        {"text": [f"row{i}" for i in range(rows)], "info": [{"i": i} for i in range(rows)]},
        {"step": 3},
    )


def aligned(dp):
    return all(dp["text"][k] == f"row{int(dp['ids'][k])}" for k in range(len(dp))) and all(
        dp["info"][k]["i"] == int(dp["ids"][k]) for k in range(len(dp))
    )


def test_from_dict_rejects_ragged_columns():
    with pytest.raises(ValueError, match='"text" has 2 rows'):
        DataProto.from_dict({"ids": torch.arange(3)}, {"text": ["a", "b"]})


def test_lists_of_dicts_stay_one_object_per_row():
    dp = batch()
    assert dp["info"].shape == (5,) and dp["info"][2] == {"i": 2}


@pytest.mark.parametrize(
    "idx",
    [
        [4, 0, 2],
        slice(1, 4),
        np.array([3, 1]),
        torch.tensor([True, False, True, False, True]),
        torch.tensor([2, 2]),
    ],
)
def test_index_keeps_alignment(idx):
    assert aligned(batch().index(idx))


def test_chunk_uneven_and_more_parts_than_rows():
    parts = batch(5).chunk(3)
    assert [len(p) for p in parts] == [2, 2, 1] and all(aligned(p) for p in parts)
    parts = batch(2).chunk(4)
    assert [len(p) for p in parts] == [1, 1, 0, 0]
    assert len(DataProto.concat(parts)) == 2


def test_split_last_part_smaller():
    parts = batch(5).split(2)
    assert [len(p) for p in parts] == [2, 2, 1] and all(aligned(p) for p in parts)


def test_repeat_interleaved_and_tiled():
    dp = batch(3)
    assert dp.repeat(2)["ids"].tolist() == [0, 0, 1, 1, 2, 2]
    assert list(dp.repeat(2, interleave=False)["text"]) == ["row0", "row1", "row2"] * 2
    assert aligned(dp.repeat(3))


def test_concat_round_trip_and_key_check():
    dp = batch(5)
    back = DataProto.concat(dp.chunk(3))
    assert back["ids"].tolist() == dp["ids"].tolist() and aligned(back)
    with pytest.raises(ValueError, match="keys differ"):
        DataProto.concat([dp, dp.select(["ids"])])


def test_select_and_pop():
    dp = batch()
    assert dp.select(["ids", "text"]).keys() == ["ids", "text"]
    with pytest.raises(KeyError, match="nope"):
        dp.select(["nope"])
    popped = dp.pop(["text"])
    assert "text" not in dp and list(popped["text"])[0] == "row0"


def test_union_adds_columns_and_rejects_conflicts():
    dp = batch(3)
    merged = dp.union(DataProto.from_dict({"scores": torch.ones(3)}, {"text": dp["text"]}))
    assert "scores" in merged and aligned(merged)
    with pytest.raises(ValueError, match="ids"):
        dp.union(DataProto.from_dict({"ids": torch.zeros(3, dtype=torch.long)}))


def test_pickle_round_trip_exact_including_bfloat16():
    dp = batch()
    dp["mask"] = torch.randn(5, 2).to(torch.bfloat16)
    back = pickle.loads(pickle.dumps(dp))
    assert back["mask"].dtype == torch.bfloat16 and torch.equal(back["mask"], dp["mask"])
    assert aligned(back) and back.meta == {"step": 3}
    empty = pickle.loads(pickle.dumps(dp.index(slice(0, 0))))
    assert len(empty) == 0 and empty.keys() == dp.keys()


def test_save_and_load(tmp_path):
    dp = batch()
    dp.save(tmp_path / "b.pt")
    back = DataProto.load(tmp_path / "b.pt")
    assert torch.equal(back["ids"], dp["ids"]) and aligned(back)


def test_set_column_checks_length():
    dp = batch(3)
    dp["extra"] = torch.zeros(3)
    with pytest.raises(ValueError, match='"bad" has 2 rows'):
        dp["bad"] = torch.zeros(2)
