"""bench/equality.py: two runs are the same run when every value both logged is equal; timings
and memory are the machine's and are left out; a metric only one run logs is listed apart."""

import importlib.util
import json
import math
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
spec = importlib.util.spec_from_file_location("equality", ROOT / "bench" / "equality.py")
equality = importlib.util.module_from_spec(spec)
spec.loader.exec_module(equality)


def write(run_dir: Path, rows: list[dict]) -> Path:
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def test_equal_values_with_other_timings_are_one_run_and_a_new_metric_is_listed_apart(tmp_path):
    before = write(
        tmp_path / "a",
        [
            {"step": 0, "val/score": 0.25},
            {"step": 1, "loss": 0.5, "time_s": 3.0, "process/rss_mb": 100, "nan": math.nan},
        ],
    )
    after = write(
        tmp_path / "b",
        [
            {"step": 0, "val/score": 0.25},
            {
                "step": 1,
                "loss": 0.5,
                "time_s": 9.0,
                "process/rss_mb": 120,
                "nan": math.nan,
                "new": 1,
            },
        ],
    )
    out = tmp_path / "eq.json"
    assert equality.main([str(before), str(after), "-o", str(out)]) == 0
    record = json.loads(out.read_text())
    # step, val/score; step, loss, nan: the time and the memory are not compared
    assert record["values_compared"] == 5 and record["equal"] == 5
    assert record["keys_only_after"] == ["new"] and record["val_score"] == {"0": 0.25}


def test_one_different_value_fails_and_is_named(tmp_path, capsys):
    before = write(tmp_path / "a", [{"step": 1, "update/grad_norm": 1.0}])
    after = write(tmp_path / "b", [{"step": 1, "update/grad_norm": 1.0000001}])
    assert equality.main([str(before), str(after)]) == 1
    assert "update/grad_norm: 1.0 -> 1.0000001" in capsys.readouterr().out
