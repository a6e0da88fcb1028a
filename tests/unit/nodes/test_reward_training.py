"""Training a reward model: preference rows, the Bradley-Terry update, pairwise accuracy, and
`flowrl check` on a reward model whose tokenizer is not the policy's."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from test_reward_model import classifier_dir, other_tokenizer

from flowrl.data import load_rows, make_rows
from flowrl.data.preferences import preference_row
from flowrl.engines import TrainEngine
from flowrl.errors import GraphErrors
from flowrl.front.compiler import compile_file
from flowrl.models.tiny import tiny_model, tiny_tokenizer
from flowrl.nodes.reward import pairwise
from flowrl.nodes.update import reward_model as update
from flowrl.protocol import DataProto
from flowrl.rewards.arithmetic import compute_score

ROOT = Path(__file__).resolve().parents[3]


def test_bradley_terry_loss_by_hand():
    loss, metrics = update.bradley_terry_loss(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0]))
    # -log sigmoid(1) - log sigmoid(0) = 0.3133 + 0.6931
    assert float(loss) == pytest.approx(math.log1p(math.exp(-1)) + math.log(2), rel=1e-6)
    assert metrics == {"accuracy": 1.5, "margin": 1.0}  # a tie counts a half
    centred, _ = update.bradley_terry_loss(torch.tensor([1.0]), torch.tensor([0.0]), center=0.5)
    assert float(centred) == pytest.approx(math.log1p(math.exp(-1)) + 0.5 * 1.0, rel=1e-6)


def test_pair_accuracy_counts_ties_as_half():
    got = pairwise.pair_accuracy(torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0.0, 0.0, 3.0]))
    assert got.tolist() == [1.0, 0.5, 0.0]


def test_arithmetic_pairs_are_right_and_wrong_answers_in_one_wording():
    train = make_rows("arithmetic_preferences", "train", 50, seed=0)
    held_out = make_rows("arithmetic_preferences", "validation", 50, seed=0)
    for row in train:
        truth = row["reward_model"]["ground_truth"]
        chosen = row["extra_info"]["chosen"][0]["content"]
        rejected = row["extra_info"]["rejected"][0]["content"]
        assert compute_score("arithmetic", chosen, truth) == 1.0
        assert compute_score("arithmetic", rejected, truth) == 0.0
        # the same sentence around the number: only the answer tells them apart
        assert chosen.rsplit(" ", 1)[:-1] == rejected.rsplit(" ", 1)[:-1]
    questions = {json.dumps(r["prompt"]) for r in train}
    assert not questions & {json.dumps(r["prompt"]) for r in held_out}


def test_trl_and_verl_preference_rows_map_to_flowrl_rows(tmp_path):
    trl_implicit = {  # TRL: whole conversations, the shared first message is the prompt
        "chosen": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
        "rejected": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Go"}],
    }
    verl = {"prompt": "Hi", "chosen": "Hello", "rejected": "Go", "data_source": "hh"}
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (trl_implicit, verl)) + "\n")
    rows = load_rows(path)
    for row in rows:
        assert row["prompt"] == [{"role": "user", "content": "Hi"}]
        assert row["extra_info"]["chosen"] == [{"role": "assistant", "content": "Hello"}]
        assert row["extra_info"]["rejected"] == [{"role": "assistant", "content": "Go"}]
    assert rows[1]["data_source"] == "hh"
    with pytest.raises(ValueError, match='"chosen" and "rejected" must each'):
        preference_row({"prompt": "Hi", "chosen": 3, "rejected": "x"}, "pairs.jsonl, row 0")


def pair_batch(rows):
    raw, extra = np.empty(len(rows), dtype=object), np.empty(len(rows), dtype=object)
    raw[:] = [r["prompt"] for r in rows]
    extra[:] = [r["extra_info"] for r in rows]
    return DataProto.from_dict(
        {"uid": torch.arange(len(rows))}, {"raw_prompt": raw, "extra_info": extra}
    )


def test_update_learns_the_pairs_and_micro_batches_do_not_change_the_gradient():
    batch = pair_batch(make_rows("arithmetic_preferences", "train", 6, seed=0))

    def engine(micro_tokens):
        model = tiny_model(head="value", seed=2)
        return TrainEngine(model, tiny_tokenizer(), lr=0.01, micro_tokens=micro_tokens)

    whole, split = engine(10**6), engine(64)  # 64 tokens: one pair per micro-batch
    a = update.RewardModelUpdateWorker(whole, update.Params())(batch)[1]
    b = update.RewardModelUpdateWorker(split, update.Params())(batch)[1]
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    assert a["bt_loss"] == pytest.approx(b["bt_loss"], rel=1e-5)
    worker = update.RewardModelUpdateWorker(whole, update.Params(epochs=10))
    worker(batch)
    after = pairwise.PairwiseAccuracyWorker(whole, pairwise.Params())(batch)
    assert after[0]["scores"].tolist() == [1.0] * 6  # chosen now scores above rejected
    assert after[1]["margin"] > 0


def reward_graph(tmp_path, reward_dir, **node):
    """graphs/ppo_rm.toml on the tiny policy, scored by the reward model in `reward_dir`."""
    text = (ROOT / "graphs/ppo_rm.toml").read_text()
    for name in ("policy", "ref", "critic"):
        text = text.replace(f"[models.{name}]\npath = ", f'[models.{name}]\npath = "tiny"\n#')
    text = text.replace('path = "reward_model"', f'path = "{reward_dir}"')
    extra = "".join(f"{k} = {json.dumps(v)}\n" for k, v in node.items())
    text = text.replace('uses = "reward.model"\n', f'uses = "reward.model"\n{extra}')
    text = text.replace("retemplate = true", "")
    graph = tmp_path / "graph.toml"
    graph.write_text(text)
    return graph


def test_check_refuses_a_tokenizer_mismatch_it_cannot_resolve(tmp_path):
    other = tmp_path / "other"
    classifier_dir(other, other_tokenizer())
    compile_file(reward_graph(tmp_path, other))  # its own tokenizer and template: ok
    with pytest.raises(GraphErrors, match="different vocabularies") as error:
        compile_file(reward_graph(tmp_path, other, tokenizer="policy"))
    assert 'remove tokenizer = "policy"' in str(error.value)
    bare = tmp_path / "bare"
    classifier_dir(bare, other_tokenizer(template=None))
    with pytest.raises(GraphErrors, match="no chat template") as error:
        compile_file(reward_graph(tmp_path, bare))
    assert "chat_template.jinja" in str(error.value)
    same = tmp_path / "same"
    classifier_dir(same, tiny_tokenizer())  # the policy's vocabulary: ids pass through
    compile_file(reward_graph(tmp_path, same, tokenizer="policy"))


def test_mix_weighs_a_reward_model_and_a_rule():
    from flowrl.nodes.reward import mix

    rm, rule = torch.tensor([1.0, 3.0]), torch.tensor([1.0, 0.0])
    got = mix.mixed_scores(rm, rule, rm_weight=0.5, rule_weight=2.0, rm_center=False)
    assert got.tolist() == [2.5, 1.5]  # 0.5 * 1 + 2 * 1, 0.5 * 3 + 0
    centred = mix.mixed_scores(rm, rule, rm_weight=1.0, rule_weight=1.0, rm_center=True)
    assert centred.tolist() == [0.0, 1.0]  # rm minus its mean 2: -1 + 1, 1 + 0
