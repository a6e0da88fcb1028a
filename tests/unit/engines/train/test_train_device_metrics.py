"""The train engine's GPU-minded paths on the CPU (flowrl/engines/train/, nodes/update/policy.py):
entropy as a metric has no gradient but the same values; with gradients the log-probs stay
where the engine computes (the loss next to them); the policy update reports how far the
rollout's log-probs are from the trainer's whenever they reach it, and the compiler sends them
whenever generate writes them."""

from pathlib import Path

import torch

from flowrl.engines.train.forward import token_logprobs
from flowrl.front import compiler
from flowrl.math import ops
from flowrl.nodes.update import policy
from flowrl.testing import tiny_engine, update_rows

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "graphs" / "grpo.toml").is_file())


def test_entropy_as_a_metric_has_the_same_values_and_no_gradient():
    logits = torch.randn(2, 3, 11, requires_grad=True)
    tokens = torch.randint(0, 11, (2, 3))
    full = token_logprobs(logits, tokens, entropy=True)
    metric = token_logprobs(logits, tokens, entropy="metric")
    assert torch.equal(full["entropy"], metric["entropy"])
    assert full["entropy"].requires_grad and not metric["entropy"].requires_grad
    assert metric["logprobs"].requires_grad
    torch.testing.assert_close(full["logprobs"], metric["logprobs"])


def test_the_engine_keeps_log_probs_where_it_computes_them_only_with_gradients():
    engine = tiny_engine()
    rows = update_rows(b=4)
    with_grad = engine.forward(rows, grad=True)["logprobs"]
    without = engine.forward(rows, grad=False)["logprobs"]
    assert with_grad.requires_grad and with_grad.device == torch.device(engine.device)
    assert without.device.type == "cpu"
    torch.testing.assert_close(with_grad.detach(), without)


def test_a_metric_on_a_device_is_not_read_back():
    assert ops.metric_value(torch.tensor(2.5)) == 2.5 and isinstance(
        ops.metric_value(torch.tensor(2.5)), float
    )
    meta = torch.tensor(2.5, device="meta")  # stands in for a GPU tensor: it has no value
    value = ops.metric_value(meta)
    assert isinstance(value, torch.Tensor) and value.dtype == torch.float64


def test_the_policy_update_compares_the_rollouts_log_probs_with_the_trainers():
    rows = update_rows(b=6)
    engine = tiny_engine()
    # the trainer's log-probs before the update: the rollout's, off by a known amount
    trainer = engine.forward(rows, grad=False)["logprobs"]
    mask = rows["response_mask"].float()
    offset = torch.linspace(0.01, 0.06, 6)[:, None] * mask  # row k off by 0.01 * (k + 1)
    rows["old_logprobs"] = trainer
    rows["rollout_logprobs"] = trainer + offset
    params = policy.Params(skip_zero_rows=False)
    _, metrics = policy.PolicyUpdateWorker(engine, params)(rows)
    expected_mean = float((offset * mask).sum() / mask.sum())
    assert abs(metrics["rollout_logprob_diff_mean"] - expected_mean) < 1e-6
    assert abs(metrics["rollout_logprob_diff_max"] - 0.06) < 1e-6
    rows = rows.select([k for k in rows.keys() if k != "rollout_logprobs"])
    _, metrics = policy.PolicyUpdateWorker(tiny_engine(), params)(rows)
    assert "rollout_logprob_diff_mean" not in metrics


def test_the_update_reads_rollout_logprobs_whenever_generate_writes_them():
    graph = ROOT / "graphs" / "grpo.toml"
    (off,) = [i for i in compiler.compile_file(graph).items if i.name == "dispatch:update_policy"]
    assert "rollout_logprobs" not in off.keys
    plan = compiler.compile_file(graph, ["nodes.generate.return_logprobs=true"])
    (on,) = [i for i in plan.items if i.name == "dispatch:update_policy"]
    assert "rollout_logprobs" in on.keys
