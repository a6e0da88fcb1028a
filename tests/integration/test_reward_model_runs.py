"""The reward-model graphs on the tiny model: train a reward model on preference pairs, export
it as a sequence classifier that transformers loads, and run PPO scored by a reward model."""

from pathlib import Path

import pytest
import torch

from flowrl.testing import run_tiny

pytestmark = pytest.mark.slow  # the integration tier: trains, starts Ray or loads models
ROOT = Path(__file__).resolve().parents[2]


def test_reward_model_graph_trains_and_exports_a_sequence_classifier(tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from flowrl.engines import TrainEngine
    from flowrl.engines.train.sequence_scores import infer_scores
    from flowrl.models import load_model
    from flowrl.models.reward_inputs import templated
    from flowrl.runtime.export import export

    run = run_tiny(ROOT / "graphs/reward_model.toml", tmp_path, **{"run.steps": 3})
    assert [row["step"] for row in run.metrics] == [0, 1, 2, 3]  # step 0: validation
    assert 0.0 <= run.metrics[0]["val/score"] <= 1.0  # held-out pairwise accuracy
    assert all(row["update/grad_norm"] > 0 for row in run.metrics[1:])
    assert "val/score" in run.metrics[-1]
    out = export(run.run_dir, tmp_path / "rm")
    classifier = AutoModelForSequenceClassification.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    chats = [
        [{"role": "user", "content": "What is 1 + 2?"}, {"role": "assistant", "content": "3"}],
        [{"role": "user", "content": "What is 4 + 4?"}, {"role": "assistant", "content": "9!"}],
    ]
    ids, mask = templated(tokenizer, chats)  # left-padded
    module, loaded_tokenizer = load_model(str(out), head="value")
    ours = infer_scores(TrainEngine(module, loaded_tokenizer, trainable=False), ids, mask)
    with torch.no_grad():
        theirs = classifier(ids, attention_mask=mask).logits[:, 0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    assert not torch.equal(ours[0], ours[1])


def test_ppo_rm_trains_the_policy_on_the_tiny_reward_model(tmp_path):
    # the tiny reward model is a fixed random head: its scores vary, so the policy gets a
    # gradient once the critic's warm-up (steps 1-2) is over; the rule still scores (scores)
    run = run_tiny(ROOT / "graphs/ppo_rm.toml", tmp_path, **{"run.steps": 3})
    assert [row["step"] for row in run.metrics] == [0, 1, 2, 3]
    last = run.metrics[-1]
    assert last["update_policy/grad_norm"] > 0
    assert last["reward/score"] != 0.0
    assert "rule/score" in last and "val/score" in last
