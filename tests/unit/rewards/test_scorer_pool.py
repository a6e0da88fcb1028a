"""Scorers that raise, hang or kill their process: each such row gets the fallback score and
is counted; the others are scored; nothing raises and the pool keeps working."""

import time

import numpy as np
import pytest

from flowrl.hooks import CheckContext
from flowrl.nodes.reward.rule import Params, check, run
from flowrl.protocol import DataProto
from flowrl.rewards.pool import ScorerPool, close_all

SCORER = """
import os, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "raise":
        raise ValueError("cannot score " + solution_str)
    if solution_str == "hang":
        time.sleep(600)
    if solution_str == "crash":
        os._exit(3)
    return float(solution_str == ground_truth)
"""


@pytest.fixture
def scorer_file(tmp_path):
    (tmp_path / "flaky.py").write_text(SCORER)
    yield "flaky.py:compute_score", str(tmp_path)
    close_all()


def rows(texts):
    return [("arith", text, "7", {}) for text in texts]


def test_failures_get_none_and_are_counted(scorer_file, capsys):
    scorer, base_dir = scorer_file
    pool = ScorerPool(scorer, base_dir, workers=2, timeout_s=1.0)
    try:
        start = time.monotonic()
        texts = ["7", "raise", "8", "hang", "7", "crash", "7"]
        results, counts = pool.score(rows(texts))
        took = time.monotonic() - start
        assert [r[0] if r else None for r in results] == [1.0, None, 0.0, None, 1.0, None, 1.0]
        assert counts == {"errors": 2, "timeouts": 1}
        assert took < 300  # the hung row cost its timeout, not its 600 s sleep
        # the pool replaced the hung and the crashed process and still scores
        again, counts = pool.score(rows(["7", "8"]))
        assert [r[0] for r in again] == [1.0, 0.0] and counts == {"errors": 0, "timeouts": 0}
    finally:
        pool.close()
    err = capsys.readouterr().err
    for kind in ("error", "timeout", "crash"):  # the first failure of each kind, once
        assert err.count(f"failed ({kind})") == 1
    assert "row 1" in err and "flaky.py" in err and "line 6" in err  # file and line of raise
    assert "pool.py" not in err  # the traceback starts at the scorer's own frames


def test_rule_node_gives_the_fallback_and_reports_counts(scorer_file):
    scorer, base_dir = scorer_file
    texts = ["7", "raise", "crash"]
    batch = DataProto.from_dict(
        {},
        {
            "response_text": np.array(texts, dtype=object),
            "ground_truth": np.array(["7"] * 3, dtype=object),
            "data_source": np.array(["x"] * 3, dtype=object),
            "extra_info": np.array([{}] * 3, dtype=object),
        },
        {"base_dir": base_dir},
    )
    params = Params(scorer=scorer, workers=1, timeout_s=5.0, fallback_score=-1.0)
    writes, metrics = run(batch, params)
    assert writes["scores"].tolist() == [1.0, -1.0, -1.0]
    assert metrics["errors"] == 2 and metrics["timeouts"] == 0


def test_check_resolves_the_scorer_against_the_graph_folder(scorer_file, tmp_path):
    scorer, base_dir = scorer_file
    context = CheckContext("reward", 8, 4, 2, 1, base_dir)
    assert check(Params(scorer=scorer), context) == []
    (problem,) = check(Params(scorer="missing.py:compute_score"), context)
    assert "missing.py" in problem.message and "no file" in problem.message
