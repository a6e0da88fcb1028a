"""run.loggers: a 2-step tiny run writes TensorBoard event files and an offline W&B run holding
the metric names of metrics.jsonl."""

import json
import struct
from pathlib import Path

import pytest

from flowrl.runtime.controller import Trainer

pytestmark = pytest.mark.slow  # the integration tier: trains, starts Ray or loads models

BLOCK = 32768  # the .wandb file is a LevelDB-style log of protobuf records in 32 KiB blocks
FULL, LAST = 1, 4


def wandb_records(path: Path) -> list[bytes]:
    """The records of an offline .wandb file: a 7-byte file header (':W&B', magic, version),
    then chunks with a 7-byte header (crc32, length, type) that never straddle a block."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, parts, records = 7, b"", []
    while pos + 7 <= len(data):
        room = BLOCK - pos % BLOCK
        if room < 7:  # the rest of a block too small for a header is padding
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (FULL, LAST):
            records.append(parts)
            parts = b""
    return records


def wandb_history(run_dir: Path) -> dict[int, dict]:
    """step -> {metric: value} from the offline W&B run under run_dir/wandb."""
    from wandb.proto import wandb_internal_pb2

    (file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    history = {}
    for raw in wandb_records(file):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") != "history":
            continue
        items = record.history.item
        row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
        history[row.pop("_step")] = {k: v for k, v in row.items() if not k.startswith("_")}
    return history


def tensorboard_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (directory,) = {p.parent for p in run_dir.glob("tensorboard/events.out.tfevents.*")}
    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def test_tensorboard_and_offline_wandb_get_every_metric(tiny_plan, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    plan = tiny_plan("grpo.toml", **{"run.loggers": '["jsonl", "tensorboard", "wandb"]'})
    trainer = Trainer(plan, tmp_path / "run", "local")
    try:
        trainer.fit()
    finally:
        trainer.close()
    run_dir = tmp_path / "run"
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    names = {k for r in rows for k in r} - {"step"}
    assert {"score/mean", "val/score", "update_policy/grad_norm", "timing_s/generate"} <= names

    scalars = tensorboard_scalars(run_dir)
    assert set(scalars) == names
    assert scalars["val/score"].keys() == {0, 2}  # validation at the start and the end
    for row in rows:
        for name, value in row.items():
            if name != "step":
                assert scalars[name][row["step"]] == pytest.approx(value, rel=1e-6), name

    history = wandb_history(run_dir)
    assert set(history) == {0, 1, 2}
    assert {k for h in history.values() for k in h} == names
    for row in rows:
        logged = history[row["step"]]
        assert logged == pytest.approx({k: v for k, v in row.items() if k != "step"}), row["step"]
