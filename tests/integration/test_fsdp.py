"""strategy = "fsdp" over 2 Ray ranks (gloo on CPU) on the tiny model: the update equals the
1-rank update, each rank holds half, the rollout copy and the rollout pool get the whole
weights, a 2-rank checkpoint resumes on 1 rank and exports as a Hugging Face directory."""

import shutil

import pytest
import toml
import torch
from conftest import fixed_batch

from flowrl.engines import HFRollout
from flowrl.engines.batch import generate_batch
from flowrl.runtime import checkpoint
from flowrl.runtime.controller import Trainer
from flowrl.runtime.export import export
from flowrl.runtime.local_executor import LocalExecutor
from flowrl.testing import (
    local_bytes,
    on_ranks,
    parameters,
    rollout_parameters,
    tiny_model,
    tiny_tokenizer,
)

pytestmark = pytest.mark.slow  # the integration tier: trains, starts Ray or loads models

ray = pytest.importorskip("ray")

LR = 1e-4
# clipping binds (the tiny model's gradient norm is about 1.5), so the global norm must be right
SETTINGS = {"models.policy.lr": LR, "models.policy.grad_clip": 0.05, "run.num_cpus": 2}
FSDP = {"pools.main.strategy": "fsdp", "models.policy.micro_tokens": 24}


def on_all_ranks(executor, method, *args) -> list:
    """Each rank's result of a PoolWorker method (collectives need every rank called)."""
    return executor.results(executor.submit("main", method, [args] * executor.ranks("main")))


def assert_close_to(params: dict, expected: dict, atol: float) -> None:
    assert params.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(params[key], value, atol=atol, rtol=0)


def test_two_fsdp_ranks_update_like_one_and_resume_on_one(tiny_plan, tmp_path):
    from flowrl.runtime.ray_executor import RayExecutor

    first, second = fixed_batch(), fixed_batch(rows=5, t=6)
    plan1 = tiny_plan("grpo.toml", **SETTINGS)
    local = LocalExecutor(plan1).workers["main"][0]
    before = parameters(local, "policy")
    one = local.call("update_policy", first).metrics
    expected = parameters(local, "policy")

    plan2 = tiny_plan("grpo.toml", **SETTINGS, **FSDP, **{"pools.main.workers": 2})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "graph.toml").write_text(toml.dumps(plan2.spec.raw))
    executor = RayExecutor(plan2, num_cpus=2)
    try:
        handle = executor.submit(
            "main", "call", [("update_policy", c, None) for c in first.chunk(2)]
        )
        results = executor.results(handle)  # 7 rows: 4 and 3, in 2 and 1 micro-batches
        for key in ("pg_loss", "kl_loss", "grad_norm"):
            assert results[0].metrics[key] == pytest.approx(one[key], rel=1e-4), key
            assert results[1].metrics[key] == results[0].metrics[key]
        trained = on_ranks(executor, "main", parameters, "policy")[0]
        # AdamW's first step is about lr * sign(grad): equal up to a sign flip at rounding level
        assert_close_to(trained, expected, atol=2 * LR)
        assert any(not torch.equal(before[k], v) for k, v in trained.items())

        # each rank holds half of the weights and of the AdamW moments (measured on its shards)
        held = on_ranks(executor, "main", local_bytes, "policy")
        total = sum(v.numel() * v.element_size() for k, v in trained.items() if "lm_head" not in k)
        assert sum(h["weights"] for h in held) == total
        assert sum(h["optimizer"] for h in held) == 2 * total  # two moments per weight
        for h in held:
            assert 0.45 * total < h["weights"] < 0.55 * total
            assert 0.9 * total < h["optimizer"] < 1.1 * total

        # the sync gathers the shards into each rank's unsharded rollout copy
        on_all_ranks(executor, "transition", "sync", "policy", ())
        for copy in on_ranks(executor, "main", rollout_parameters, "policy"):
            assert_close_to(copy, trained, atol=0)
        # a rollout pool gets the whole state from rank 0
        exported, other = (r.value for r in on_all_ranks(executor, "export_weights", "policy"))
        assert_close_to(exported, trained, atol=0)
        assert other is None

        with checkpoint.writing(run_dir, 1, keep=2) as directory:
            executor.broadcast("save", str(directory))
        handle = executor.submit(
            "main", "call", [("update_policy", c, None) for c in second.chunk(2)]
        )
        two_ranks = executor.results(handle)[0].metrics
        continued = on_ranks(executor, "main", parameters, "policy")[0]
    finally:
        executor.shutdown()
    saved = checkpoint.latest(run_dir) / "pool-main"
    names = sorted(p.name for p in saved.iterdir())
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "engines.json"]

    # the 2-rank checkpoint on 1 rank: the same weights, then the same next update
    plan_one = tiny_plan("grpo.toml", **SETTINGS, **FSDP)
    resumed = LocalExecutor(plan_one).workers["main"][0]
    resumed.load(str(checkpoint.latest(run_dir)))
    assert_close_to(parameters(resumed, "policy"), trained, atol=0)
    one_rank = resumed.call("update_policy", second).metrics
    assert one_rank["grad_norm"] == pytest.approx(two_ranks["grad_norm"], rel=1e-4)
    assert one_rank["pg_loss"] == pytest.approx(two_ranks["pg_loss"], rel=1e-4)
    # a second AdamW step from the loaded moments; without them it would differ by ~lr
    assert_close_to(parameters(resumed, "policy"), continued, atol=LR / 10)

    # the export loads with transformers alone and decodes greedily as the trained weights do
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = export(run_dir, tmp_path / "hf", step=1)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert_close_to(dict(model.state_dict()), trained, atol=0)
    reference = tiny_model()
    reference.load_state_dict(trained)
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.padding_side = "left"
    prompts = tokenizer(["1+2=", "33+4="], padding=True, return_tensors="pt")
    ids, mask = prompts["input_ids"], prompts["attention_mask"]
    ours = generate_batch(
        HFRollout(reference, tiny_tokenizer()), ids, mask, max_new_tokens=8, do_sample=False
    )
    theirs = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=8,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
    )[:, ids.shape[1] :]
    # both pad after EOS with the pad id and stop when every row has ended
    assert ours["response_mask"].sum() > 0 and torch.equal(ours["responses"], theirs)


def test_grpo_runs_on_two_fsdp_ranks_and_resumes_on_one(tiny_plan, tmp_path):
    extra = {**FSDP, "run.save_every": 1, "run.num_cpus": 2}
    plan = tiny_plan("grpo.toml", **extra, **{"pools.main.workers": 2})
    trainer = Trainer(plan, tmp_path / "two", "ray")
    try:
        trainer.fit()
        weights = on_ranks(trainer.executor, "main", parameters, "policy")[0]
        # after the last update the sync refreshed every rank's rollout copy
        for copy in on_ranks(trainer.executor, "main", rollout_parameters, "policy"):
            assert_close_to(copy, weights, atol=0)
    finally:
        trainer.close()
    steps = [r["step"] for r in map(eval_json, (tmp_path / "two/metrics.jsonl").open())]
    assert steps == [0, 1, 2]

    # continue the run from its step-1 checkpoint with one rank
    shutil.copytree(tmp_path / "two", tmp_path / "one")
    shutil.rmtree(tmp_path / "one/checkpoints/step_000002")
    plan_one = tiny_plan("grpo.toml", **extra)
    resumed = Trainer(plan_one, tmp_path / "one", "local")
    resumed.fit(resume=True)
    rows = [eval_json(line) for line in (tmp_path / "one/metrics.jsonl").open()]
    assert [r.get("step") for r in rows if "event" not in r] == [0, 1, 2]
    assert rows[-1]["update_policy/grad_norm"] > 0
    assert checkpoint.latest(tmp_path / "one").name == "step_000002"


def eval_json(line: str) -> dict:
    import json

    return json.loads(line)
