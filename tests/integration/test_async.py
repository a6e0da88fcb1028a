"""run.staleness on the tiny model: staleness 0 through the pipeline equals the synchronous run
bit for bit; staleness 1 is the same run on Ray (the stages in two threads, the pools at once)
and on the local executor (in turn); a dead rollout rank is named; a resume continues exactly."""

import json

import attrs
import pytest
import torch
from test_pools import calls_by_track

from flowrl.runtime.controller import Trainer
from flowrl.testing import parameters

pytestmark = pytest.mark.slow  # the integration tier: trains, starts Ray or loads models

NOISE = ("time_s", "tokens_per_s", "timing_s/", "process/", "async/wait_s", "async/queued")


def comparable(run_dir) -> list[dict]:
    """metrics.jsonl's step rows without what depends on timing and the machine."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [
        {k: v for k, v in r.items() if not k.startswith(NOISE) and not k.endswith("_per_s")}
        for r in rows
        if "event" not in r
    ]


def train(plan, run_dir, backend="local") -> dict:
    """Fit `plan`; the train pool's policy weights after it (local) or {} (Ray)."""
    trainer = Trainer(plan, run_dir, backend)
    try:
        trainer.fit()
        if backend == "local":
            return parameters(trainer.executor.workers["train"][0], "policy")
        return {}
    finally:
        trainer.close()


def test_staleness_zero_through_the_pipeline_equals_the_synchronous_run(tiny_plan, tmp_path):
    steps = {"run.steps": 4, "run.val_every": 2}
    synchronous = tiny_plan("grpo_disaggregated.toml", **steps)
    staged = tiny_plan("grpo_disaggregated.toml", **steps, **{"run.staleness": 1})
    # the same stages, queue and threads, with the version rule of staleness 0: each batch is
    # generated with the weights of the update just before it, as a synchronous step does
    staged = attrs.evolve(staged, pipeline=attrs.evolve(staged.pipeline, staleness=0))
    expected = train(synchronous, tmp_path / "sync")
    got = train(staged, tmp_path / "staged")
    rows = comparable(tmp_path / "staged")
    assert [r.get("async/staleness") for r in rows] == [None, 0.0, 0.0, 0.0, 0.0]
    assert [{k: v for k, v in r.items() if not k.startswith("async/")} for r in rows] == (
        comparable(tmp_path / "sync")
    )
    assert rows[-1]["update_policy/grad_norm"] > 0  # it trained
    assert expected.keys() == got.keys()
    for key in expected:
        assert torch.equal(expected[key], got[key]), key


def test_staleness_one_on_ray_equals_local_and_overlaps_the_pools(tiny_plan, tmp_path):
    overrides = {"run.steps": 5, "run.staleness": 1, "run.num_cpus": 2, "run.val_every": 2}
    plan = tiny_plan("grpo_disaggregated.toml", **overrides)
    train(plan, tmp_path / "local")
    train(plan, tmp_path / "ray", "ray")
    local, ray = comparable(tmp_path / "local"), comparable(tmp_path / "ray")
    assert ray == local  # the version of every batch depends on its step, never on timing
    # step s trains on a batch from the weights of update s - 2 (the first two: the initial)
    assert [r.get("async/weight_version") for r in ray] == [None, 0.0, 0.0, 1.0, 2.0, 3.0]
    assert [r.get("async/staleness") for r in ray] == [None, 0.0, 1.0, 1.0, 1.0, 1.0]
    tracks = calls_by_track(tmp_path / "ray")
    generates = [(s, e) for n, s, e in tracks["gen/rank0"] if n == "generate"]
    trains = [(s, e) for n, s, e in tracks["train/rank0"]]
    assert len(generates) == 5  # a rollout per step (validations are not in the trace)
    overlapping = [(g, t) for g in generates for t in trains if g[0] < t[1] and t[0] < g[1]]
    assert overlapping, f"the pools never worked at once: {tracks}"
    # on the local executor the stages take turns: nothing overlaps
    tracks = calls_by_track(tmp_path / "local")
    generates = [(s, e) for n, s, e in tracks["gen/rank0"] if n == "generate"]
    trains = [(s, e) for n, s, e in tracks["train/rank0"]]
    assert not [(g, t) for g in generates for t in trains if g[0] < t[1] and t[0] < g[1]]


@pytest.mark.parametrize("restarts", [0, 3])
def test_a_dead_rollout_rank_is_named_and_recovered_from(tiny_plan, tmp_path, restarts):
    """Killed before the rollout stage's first walk: with run.max_restarts = 0 the run stops
    naming the rank; by default the pools are made again and the run finishes."""
    ray = pytest.importorskip("ray")
    from flowrl.runtime.recovery import RecoveryStop

    settings = {"run.staleness": 1, "run.num_cpus": 2, "run.val_size": 0}
    plan = tiny_plan("grpo_disaggregated.toml", **settings, **{"run.max_restarts": restarts})
    trainer = Trainer(plan, tmp_path / "run", "ray")
    try:
        ray.kill(trainer.executor.actors["gen"][0])  # the rollout stage's only rank
        if restarts == 0:
            with pytest.raises(RecoveryStop, match="on pool gen, rank 0: the rank's process died"):
                trainer.fit()
            return
        trainer.fit()
        rows = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
        (event,) = [r for r in rows if r.get("event") == "recovery"]
        assert event["lost"] == "pool gen, rank 0" and event["what"] == "died"
        assert [r["step"] for r in rows if "event" not in r] == [1, 2]
    finally:
        trainer.close()


def test_a_run_extended_past_its_last_step_refills_the_queue(tiny_plan, tmp_path):
    """The checkpoint of the last step keeps no queue (no step is left to train on it): a
    resume with more steps generates from the checkpoint's weights on."""
    first = tiny_plan("grpo_disaggregated.toml", **{"run.steps": 3, "run.staleness": 1})
    train(first, tmp_path / "run")
    assert not (tmp_path / "run/checkpoints/step_000003/queue").exists()
    longer = tiny_plan("grpo_disaggregated.toml", **{"run.steps": 5, "run.staleness": 1})
    trainer = Trainer(longer, tmp_path / "run", "local")
    try:
        trainer.fit(resume=True)
    finally:
        trainer.close()
    rows = comparable(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]  # the end of the first, then 4, 5
    assert [r.get("async/weight_version") for r in rows[-2:]] == [3.0, 3.0]
    assert [r.get("async/staleness") for r in rows[-2:]] == [0.0, 1.0]
