"""run.partial_rollout on the tiny model: a response continued over rounds is the response one
call would sample; Ray (rounds in a thread, the pools at once) equals the local executor (in
turn); a run killed and resumed equals the uninterrupted run. The rounds' logic on a scripted
stage: tests/unit/runtime/test_partial_rounds.py."""

import json

import pytest
import torch
from test_async import comparable, train
from test_kill_resume import starter, steps_logged, whole_and_killed

from flowrl.runtime.partial import TOKEN_VERSION
from flowrl.runtime.pipeline import Pipeline

pytestmark = pytest.mark.slow  # the integration tier: trains, starts Ray or loads models

PARTIAL = {"run.staleness": 1, "run.partial_rollout": 6, "nodes.generate.max_new_tokens": 16}
PARTIAL |= {"nodes.generate.return_logprobs": "true", "nodes.update_policy.tis_cap": 2.0}


def taken_batches(monkeypatch) -> list:
    """Every batch the train stage takes, in step order (recorded as it takes them)."""
    out = []
    take = Pipeline.take

    def recording(self, step):
        rollout, metrics = take(self, step)
        out.append(rollout.result.batch)
        return rollout, metrics

    monkeypatch.setattr(Pipeline, "take", recording)
    return out


def by_prompt(batches) -> dict:
    """prompt ids -> the sorted responses (ids) of its rows, over `batches`."""
    out = {}
    for batch in batches:
        for prompt, pm, response, rm in zip(
            batch["prompts"],
            batch["prompt_mask"],
            batch["responses"],
            batch["response_mask"],
            strict=True,
        ):
            key = tuple(prompt[pm.bool()].tolist())
            out.setdefault(key, []).append(tuple(response[rm.bool()].tolist()))
    return {k: sorted(v) for k, v in out.items()}


def test_a_response_continued_over_rounds_is_the_response_of_one_call(
    tiny_plan, tmp_path, monkeypatch
):
    """Greedy: steps 1 and 2 train on batches generated with the initial weights in both runs
    (staleness 1), so a prompt in both has the same responses, whether its tokens came in
    rounds of 6 (each round a new call from the prompt and the tokens so far) or in one."""
    overrides = {"run.steps": 2, "run.val_size": 0, "nodes.generate.do_sample": "false"}
    taken = taken_batches(monkeypatch)
    whole = {k: v for k, v in PARTIAL.items() if k != "run.partial_rollout"}
    train(tiny_plan("grpo_disaggregated.toml", **overrides, **whole), tmp_path / "whole")
    in_one = by_prompt(taken)
    taken.clear()
    train(tiny_plan("grpo_disaggregated.toml", **overrides, **PARTIAL), tmp_path / "partial")
    for batch in taken:
        assert batch[TOKEN_VERSION][batch["response_mask"].bool()].eq(0).all()
    split = [b["segments"] > 1 for b in taken]
    assert torch.cat(split).any(), "no response took more than one round"
    in_rounds = by_prompt(taken)
    common = in_one.keys() & in_rounds.keys()
    assert common, "no prompt in both runs' first two steps"
    for prompt in common:
        assert in_rounds[prompt] == in_one[prompt]


def test_partial_rollouts_on_ray_equal_local(tiny_plan, tmp_path):
    overrides = {"run.steps": 4, "run.num_cpus": 2, "run.val_every": 2, **PARTIAL}
    plan = tiny_plan("grpo_disaggregated.toml", **overrides)
    train(plan, tmp_path / "local")
    train(plan, tmp_path / "ray", "ray")
    local, ray = comparable(tmp_path / "local"), comparable(tmp_path / "ray")
    assert ray == local  # the rounds read counts, never timing
    assert any(r.get("partial/split_rows", 0) > 0 for r in ray)  # responses were continued
    assert ray[-1]["async/staleness"] >= 1


def test_sigkill_then_resume_with_partial_rollouts(tmp_path):
    """The checkpoint of step 2 keeps the rounds' state (the groups in flight and finished);
    the resumed run equals the uninterrupted one, step for step."""
    extra = {"run.steps": 5, "run.save_every": 2, "run.keep_checkpoints": 10, **PARTIAL}
    start = starter(tmp_path, "grpo_disaggregated.toml", "local", extra)
    run_dir = whole_and_killed(start, tmp_path)
    kept = run_dir / "checkpoints/step_000002"
    state = json.loads((kept / "controller.json").read_text())
    assert state["rounds"]["done"] >= 2 and state["rounds"]["rows"]
    for name in state["rounds"]["rows"]:
        assert (kept / "queue" / f"{name}.pt").is_file()
    resumed = start("killed", "--resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert dict(steps_logged(run_dir / "metrics.jsonl")) == {step: 1 for step in range(6)}
    (reference,) = (tmp_path / "whole").glob("grpo_disaggregated-*")
    assert comparable(run_dir) == comparable(reference)
