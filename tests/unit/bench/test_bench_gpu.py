"""bench/gpu.py's summary: the keys the GPU issue names, each ratio from one run's own steps,
None where a step did not finish; the model directories prepare built reach the steps."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench"))
spec = importlib.util.spec_from_file_location("gpu", ROOT / "bench" / "gpu.py")
gpu = sys.modules["gpu"] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
spec.loader.exec_module(gpu)


def done(result):
    return {"result": result, "s": 1.0}


def test_the_summary_takes_each_ratio_from_the_runs_own_steps():
    results = {
        "prepare": done({"device": "NVIDIA H100 80GB HBM3", "dirs": {}}),
        "decode_runner": done({"256x512": {"tokens_per_s": 60_000.0}}),
        "decode_generate": done({"256x512": {"tokens_per_s": 8_000.0}}),
        "decode_static": {"error": "ran past its 120 s", "s": 120.0},
        "grpo_small_flowrl": done({"median_step_s": 0.9}),
        "grpo_small_trl": done({"median_step_s": 1.8}),
        "grpo_large_flowrl": done({"median_step_s": 4.0, "peak_gb": 20.0}),
        "train": done({"mfu": 0.31, "tokens_per_s": 1e5}),
        "learning": done({"val": {"0": 0.25, "10": 0.5, "20": 0.5}, "seconds": 40.0}),
    }
    summary = gpu.summarise(results, smoke=False)
    assert summary["device"] == "NVIDIA H100 80GB HBM3"
    assert summary["decode_vs_generate"] == 7.5
    assert summary["decode_vs_static_compile"] is None  # its step ran out of time
    assert summary["grpo_vs_trl_small"] == 0.5 and summary["grpo_vs_trl_large"] is None
    assert summary["train_mfu"] == 0.31 and summary["learning_val"] == [0.25, 0.5, 0.5]
    assert summary["steps"]["decode_static"] == "ran past its 120 s"
    table = gpu.markdown(results, summary)
    assert "| 256x512 | 60,000 | - | 8,000 | - |" in table
    assert "| small | 0.90 | 1.80 | 0.500 |" in table


def test_the_directories_prepare_built_reach_the_grpo_shapes():
    shapes = gpu.shapes_of(smoke=False, dirs={"qwen2-0.5b/bfloat16": "/cache/qwen"})
    assert shapes.large.model == "/cache/qwen" and shapes.large.dtype == "bfloat16"
    assert shapes.small.model == "smollm2-135m-instruct"  # the embedded model
    assert (shapes.large.prompts, shapes.large.samples, shapes.large.new_tokens) == (32, 8, 256)
    smoke = gpu.shapes_of(smoke=True, dirs={"small/float32": "/cache/small"})
    assert smoke.small.model == smoke.large.model == "/cache/small"
    assert 'models.policy.path="/cache/small"' in smoke.learning
