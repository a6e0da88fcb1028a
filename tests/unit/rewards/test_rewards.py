"""Rule scorers and the reward.rule node."""

import numpy as np
import pytest

from flowrl.nodes.reward.rule import Params, run
from flowrl.rewards import ScorerError, arithmetic, gsm8k, resolve_scorer, score_value


@pytest.mark.parametrize(
    "text, truth, score",
    [
        ("64", "64", 1.0),
        ("The answer is 64.", "64", 1.0),
        ("23 + 41 = 64", "64", 1.0),
        ("-3", "-3", 1.0),
        ("1,234", "1234", 1.0),
        ("63 or 64? I think 63", "64", 0.0),
        ("no number", "5", 0.0),
        ("", "5", 0.0),
    ],
)
def test_arithmetic_score(text, truth, score):
    assert arithmetic.compute_score("arithmetic", text, truth) == score


def test_gsm8k_strict_and_flexible():
    assert gsm8k.compute_score("gsm8k", "so #### 1,200", "1200") == 1.0
    assert gsm8k.compute_score("gsm8k", "the answer is 1200", "1200") == 0.0
    assert gsm8k.compute_score("gsm8k", "the answer is 1200", "1200", method="flexible") == 1.0
    assert gsm8k.compute_score("gsm8k", "#### 7", "8", format_score=0.1) == 0.1


def test_auto_dispatches_by_data_source_and_rejects_unknown():
    scorer = resolve_scorer("auto")
    assert scorer("arithmetic", "5", "5", {}) == 1.0
    assert scorer("openai/gsm8k", "#### 5", "5", {}) == 1.0
    with pytest.raises(ScorerError, match='data_source "mine"'):
        scorer("mine", "5", "5", {})


def test_custom_file_scorer_with_dict_result(tmp_path):
    (tmp_path / "s.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': float(solution_str == ground_truth), 'length': len(solution_str)}\n"
    )
    scorer = resolve_scorer(f"{tmp_path}/s.py:compute_score")
    assert score_value(scorer("x", "ab", "ab", {})) == (1.0, {"length": 2.0})
    with pytest.raises(ScorerError, match='s.py has no "missing"'):
        resolve_scorer(f"{tmp_path}/s.py:missing")


def test_rule_node_scores_a_batch():
    batch = {
        "response_text": np.array(["7", "8"], dtype=object),
        "ground_truth": np.array(["7", "7"], dtype=object),
        "data_source": np.array(["arithmetic"] * 2, dtype=object),
        "extra_info": np.array([{}, {}], dtype=object),
    }
    writes, metrics = run(batch, Params())
    assert writes["scores"].tolist() == [1.0, 0.0] and metrics["score"] == 0.5
