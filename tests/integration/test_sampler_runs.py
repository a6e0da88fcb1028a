"""A data sampler in a run: a user's sampler file draws every step's prompts, is told each
trained step's rows, and a resumed run draws what the uninterrupted one drew: plainly, with
run.staleness (k steps late, whatever the threads' timing) and with refill (told the groups
the filter drops too)."""

import sys

import pytest

from flowrl import refs
from flowrl.runtime.controller import Trainer

pytestmark = pytest.mark.slow  # the integration tier: trains, starts Ray or loads models

# the built-in curriculum, recording what it draws and when it hears of results
RECORDING = """
from flowrl.samplers import PassRateBand


class Recording(PassRateBand):
    log = []  # ("next", the last step it was told of, indices) / ("update", step, rows)

    def __init__(self, size, seed, options=None):
        super().__init__(size, seed, options)
        self.told = 0

    def next(self, batch_size):
        picked = super().next(batch_size)
        Recording.log.append(("next", self.told, picked))
        return picked

    def update(self, indices, scores, step):
        super().update(indices, scores, step)
        self.told = step
        Recording.log.append(("update", step, len(indices)))
"""


class Stop(Exception):
    pass


def sampler_log(tmp_path):
    path = tmp_path / "recording.py"
    if not path.exists():
        path.write_text(RECORDING)
    return refs.load(f"{path}:Recording").log


def run(tiny_plan, tmp_path, graph, name, stop_at=None, resume=False, **extra):
    """Train `graph` with the recording sampler; the log of what it drew and was told."""
    log = sampler_log(tmp_path)
    log.clear()
    options = {"data.sampler": f'"{tmp_path / "recording.py"}:Recording"'}
    options["data.sampler_options.outside"] = 0.2  # the tiny run's scores make a band
    plan = tiny_plan(graph, **options, **extra)
    trainer = Trainer(plan, tmp_path / name, "local")
    if stop_at is not None:
        original = trainer.step

        def step_then_die(step):
            if step == stop_at:
                raise Stop  # as if killed during this step, after the last checkpoint
            return original(step)

        trainer.step = step_then_die
        with pytest.raises(Stop):
            trainer.fit()
        trainer.close()
        return list(log)
    try:
        trainer.fit(resume=resume)
    finally:
        trainer.close()
    return list(log)


def draws(log):
    return [entry[2] for entry in log if entry[0] == "next"]


def test_a_curriculum_run_and_its_resume_draw_the_same_prompts(tiny_plan, tmp_path):
    extra = {"run.steps": 6, "run.save_every": 3}
    straight = run(tiny_plan, tmp_path, "grpo.toml", "a", **extra)
    # each step's prompts come after the results of every earlier step
    nexts = [entry for entry in straight if entry[0] == "next"]
    assert [told for _, told, _ in nexts] == [0, 1, 2, 3, 4, 5]
    updates = [entry for entry in straight if entry[0] == "update"]
    rows = tiny_plan("grpo.toml", **extra).batch.rows  # a step's rows: prompts x samples
    assert [(step, n) for _, step, n in updates] == [(s, rows) for s in range(1, 7)]
    assert run(tiny_plan, tmp_path, "grpo.toml", "b", **extra) == straight  # seeded
    run(tiny_plan, tmp_path, "grpo.toml", "c", stop_at=5, **extra)
    resumed = run(tiny_plan, tmp_path, "grpo.toml", "c", resume=True, **extra)
    assert draws(resumed) == draws(straight)[3:]  # steps 4-6, from the step-3 checkpoint


def test_with_staleness_the_sampler_hears_k_steps_late_and_resumes_exactly(tiny_plan, tmp_path):
    extra = {"run.steps": 6, "run.save_every": 2, "run.staleness": 1}
    straight = run(tiny_plan, tmp_path, "grpo_disaggregated.toml", "a", **extra)
    nexts = [entry for entry in straight if entry[0] == "next"]
    # step s's batch is generated with the weights of update max(s - 2, 0): it has heard of
    # the steps up to there, whatever the two threads' timing
    assert [told for _, told, _ in nexts] == [0, 0, 1, 2, 3, 4]
    again = run(tiny_plan, tmp_path, "grpo_disaggregated.toml", "b", **extra)
    assert draws(again) == draws(straight)
    run(tiny_plan, tmp_path, "grpo_disaggregated.toml", "c", stop_at=4, **extra)
    resumed = run(tiny_plan, tmp_path, "grpo_disaggregated.toml", "c", resume=True, **extra)
    # the step-2 checkpoint kept batch 3 (drawn ahead); the resume draws batches 4-6
    assert draws(resumed) == draws(straight)[3:]


def test_a_refilling_step_draws_its_rounds_from_the_sampler_and_reports_dropped_groups(
    tiny_plan, tmp_path
):
    log = run(tiny_plan, tmp_path, "dapo.toml", "a", **{"run.steps": 3})
    steps = [entry for entry in log if entry[0] == "update"]
    rounds = [entry for entry in log if entry[0] == "next"]
    # a draw per round; steps needed more than one, so the filter dropped groups
    assert len(rounds) > 3
    # told every row the rounds generated, the groups the filter dropped too
    plan = tiny_plan("dapo.toml", **{"run.steps": 3})
    per_round = plan.batch.prompts * plan.batch.samples
    assert all(rows >= per_round for _, _, rows in steps)
    assert sum(rows for _, _, rows in steps) == per_round * len(rounds)


@pytest.fixture(autouse=True)
def _forget_the_recording_module(tmp_path):
    yield
    for name in [n for n in sys.modules if n.startswith(refs.PREFIX) and "recording" in n]:
        del sys.modules[name]


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_the_docs_sampler_from_a_users_file_runs_a_tiny_graph(tmp_path, backend):
    from pathlib import Path

    from flowrl.testing import run_tiny

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
    from test_samplers import docs_sampler

    docs_sampler(tmp_path)
    graph = (Path(__file__).resolve().parents[2] / "graphs/grpo.toml").read_text()
    graph = graph.replace("[data]\n", '[data]\nsampler = "hard_first.py:HardFirst"\n')
    (tmp_path / "g.toml").write_text(graph + "\n[data.sampler_options]\nshare = 0.5\n")
    run = run_tiny(tmp_path / "g.toml", tmp_path / "runs", backend=backend, **{"run.steps": 3})
    assert [m["step"] for m in run.metrics] == [0, 1, 2, 3]
    state = __import__("json").loads(
        (run.run_dir / "checkpoints/step_000003/controller.json").read_text()
    )["loader"]
    assert state["applied"] == 3 and state["sampler"]["drawn"] == 3  # saved with the run
    assert sum(state["sampler"]["fails"]) > 0  # told of the three steps' rows
