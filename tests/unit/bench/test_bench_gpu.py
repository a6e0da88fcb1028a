"""bench/gpu.py's summary: the keys the GPU issue names, each ratio from one run's own steps,
None where a step did not finish; the model directories prepare built reach the steps."""

import importlib
import importlib.util
import sys
from pathlib import Path

import torch

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
    assert set(summary) == set(gpu.SUMMARY_KEYS)
    assert summary["device"] == "NVIDIA H100 80GB HBM3"
    assert summary["decode_vs_generate"] == 7.5
    assert summary["decode_vs_static_compile"] is None  # its step ran out of time
    assert summary["grpo_vs_trl_small"] == 0.5 and summary["grpo_vs_trl_large"] is None
    assert summary["train_mfu"] == 0.31 and summary["learning_val"] == [0.25, 0.5, 0.5]
    assert summary["steps"]["decode_static"] == "ran past its 120 s"
    table = gpu.markdown(results, summary)
    assert "| 256x512 | 60,000 | - | 8,000 | - |" in table
    assert "| small, skip_zero_rows | 0.90 | 1.80 | 0.500 |" in table


def test_the_directories_prepare_built_reach_the_grpo_shapes():
    shapes = gpu.shapes_of(smoke=False, dirs={"qwen2-0.5b/bfloat16": "/cache/qwen"})
    assert shapes.large.model == "/cache/qwen" and shapes.large.dtype == "bfloat16"
    assert shapes.small.model == "smollm2-135m-instruct"  # the embedded model
    assert (shapes.large.prompts, shapes.large.samples, shapes.large.new_tokens) == (32, 8, 256)
    smoke = gpu.shapes_of(smoke=True, dirs={"small/float32": "/cache/small"})
    assert smoke.small.model == smoke.large.model == "/cache/small"
    assert 'models.policy.path="/cache/small"' in smoke.learning


def test_the_plan_checks_first_and_runs_the_anchor_after_the_small_grpo_pair():
    names = [name for name, _ in gpu.STEPS]
    assert names[:2] == ["prepare", "smoke"]
    assert names.index("decode_static") > max(
        names.index(f"grpo_small_{side}") for side in ("flowrl", "flowrl_noskip", "trl")
    )
    assert gpu.GPU.static_shapes == ((256, 512),) and gpu.GPU.decode_pairs[0] == (256, 512)
    # every key of the summary comes before the steps a short budget may drop
    assert names[-2:] == ["decode_eager", "colocation"]
    assert gpu.GPU.large.micro_rows == 32  # TRL: 8 accumulation steps of 32 rows
    assert gpu.ENV["HF_HUB_OFFLINE"] == "1"


def test_a_step_that_runs_out_of_time_keeps_what_it_printed():
    # the shell's last line replaces it with the sleep: killed at the limit, as a step is
    script = (
        'echo \'RESULT {"64x128": {"tokens_per_s": 5.0}}\'; '
        'echo \'RESULT {"64x128": {"tokens_per_s": 5.0}, "256x128": {}}\'; '
        "echo warming >&2; exec sleep 30"
    )
    record = gpu.run_limited(["sh", "-c", script], limit=1.0)
    assert record["error"] == "ran past its 1 s" and record["partial"]
    assert record["result"] == {"64x128": {"tokens_per_s": 5.0}, "256x128": {}}
    assert "warming" in record["stderr"] and record["s"] < 10
    failed = gpu.run_limited(["sh", "-c", "echo boom >&2; exit 3"], limit=10.0)
    assert failed["error"] == "exit 3" and "result" not in failed and not failed["partial"]
    done = gpu.run_limited(["sh", "-c", "echo 'RESULT {\"a\": 1}'"], limit=10.0)
    assert done["result"] == {"a": 1} and "error" not in done


def test_mfu_counts_a_shared_prompt_once_and_the_head_at_response_tokens():
    from flowrl.protocol import DataProto
    from flowrl.testing import tiny_engine

    gpu_steps = sys.modules.get("gpu_steps") or importlib.import_module("gpu_steps")
    engine = tiny_engine()
    model = engine.module
    prompts = torch.tensor([[0, 5, 6, 7, 8, 9]] * 8 + [[9, 8, 7, 6, 5, 4]] * 8)  # 2 x 8 samples
    rows = DataProto.from_dict(
        {
            "prompts": prompts,
            "prompt_mask": (prompts > 0).long(),
            "responses": torch.randint(3, 50, (16, 5)),
            "response_mask": torch.ones(16, 5, dtype=torch.long),
        }
    )
    flops = gpu_steps.train_flops(engine, model, rows)
    params = sum(p.numel() for p in model.parameters())
    head = model.get_output_embeddings().weight.numel()  # tied to the input embedding
    assert flops["params_body"] == params - head and flops["params_head"] == head
    assert flops["naive"] == 6 * params * (8 * 5 + 8 * 6 + 16 * 5)
    assert engine._share_prompts(rows["prompts"], rows["prompt_mask"], grad=True)
    prompt = 5 + 6  # each distinct prompt's real tokens once
    assert flops["prompt_tokens_done"] == prompt
    assert flops["done"] == 6 * ((params - head) * (prompt + 80) + head * 80)
