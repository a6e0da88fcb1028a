"""`flowrl run --tiny` and flowrl.testing.tiny_overrides: any graph on the tiny random model."""

from pathlib import Path

import pytest

from flowrl import cli
from flowrl.front import compiler
from flowrl.testing import VARIED_SCORER, tiny_overrides

ROOT = Path(__file__).resolve().parents[2]
GRAPHS = sorted((ROOT / "graphs").glob("*.toml"))


@pytest.mark.parametrize("graph", GRAPHS, ids=lambda p: p.name)
def test_tiny_overrides_put_every_shipped_graph_on_the_tiny_model(graph, tmp_path):
    spec = compiler.compile_file(graph, tiny_overrides(graph, tmp_path)).spec
    assert {m.path for m in spec.models.values()} == {"tiny"}
    assert all(m.lr == 0.01 for m in spec.models.values() if m.trainable)
    assert (spec.run.steps, spec.run.val_size, spec.data.batch_size) == (2, 4, 2)
    assert spec.run.out_dir == str(tmp_path)
    params = [decl.params for decl in spec.nodes.values()]
    assert all(p.max_new_tokens == 6 for p in params if hasattr(p, "max_new_tokens"))
    assert all(p.scorer == VARIED_SCORER for p in params if hasattr(p, "scorer"))
    if Path(graph).name != "reward_model.toml":  # the one graph that samples nothing
        assert spec.nodes["generate"].params.max_new_tokens == 6
        assert any(hasattr(p, "scorer") for p in params)
    assert all(p.cpus_per_worker == 1 for p in spec.pools.values())


def test_tiny_overrides_fit_a_graph_without_pools_and_names_of_its_own(tmp_path):
    """Nodes found by their params, not by the shipped graphs' node ids; a graph that
    declares no [pools] gets no pool override (which would name an undeclared pool)."""
    text = (ROOT / "graphs/grpo.toml").read_text()
    pools = '[pools.main]\nworkers = 1\ncpus_per_worker = 2\noffload = "always"\n'
    assert pools in text
    text = text.replace(pools, "")
    text = text.replace("[nodes.generate]", "[nodes.sample]").replace("[nodes.reward]", "[nodes.r]")
    graph = tmp_path / "mine.toml"
    graph.write_text(text)
    spec = compiler.compile_file(graph, tiny_overrides(graph)).spec
    assert spec.nodes["sample"].params.max_new_tokens == 6
    assert spec.nodes["r"].params.scorer == VARIED_SCORER
    assert spec.run.out_dir == "runs"  # out_dir None keeps the graph's
    assert not any(o.startswith("pools.") for o in tiny_overrides(graph))


def test_scorer_none_keeps_the_graphs_scorer(tmp_path):
    graph = ROOT / "graphs/grpo.toml"
    spec = compiler.compile_file(graph, tiny_overrides(graph, scorer=None)).spec
    assert spec.nodes["reward"].params.scorer == "auto"


def test_run_tiny_flag_applies_them_and_the_command_line_wins(monkeypatch):
    import flowrl.runtime.controller as controller

    seen = {}
    monkeypatch.setattr(controller, "run", lambda plan, **kw: seen.update(plan=plan, **kw))
    assert cli.main(["run", "grpo", "--tiny", "--backend", "local", "run.steps=5"]) == 0
    spec = seen["plan"].spec
    assert {m.path for m in spec.models.values()} == {"tiny"}
    assert spec.run.steps == 5  # tiny says 2; the command line comes after it
    assert seen["backend"] == "local"


@pytest.mark.parametrize("graph", ["ppo.toml", "dapo.toml"])
def test_tiny_mini_batches_shrink_with_the_prompt_batch(graph):
    """ppo: 48 rows in mini-batches of 16 are 3 optimizer steps, and the tiny run's 8 rows keep
    3; dapo: after its refilling filter the rows are the target groups x samples, which the
    tiny run does not shrink, so the mini-batch stays."""
    from flowrl.nodespec import MINI_BATCHES

    def steps(plan):
        return {
            node: MINI_BATCHES.updates(decl.params, plan.batch.rows)
            for node, decl in plan.spec.nodes.items()
            if getattr(decl.params, "mini_batch_size", 0)
        }

    full = compiler.compile_file(ROOT / "graphs" / graph)
    tiny = compiler.compile_file(ROOT / "graphs" / graph, tiny_overrides(ROOT / "graphs" / graph))
    assert steps(tiny) == steps(full) and min(steps(full).values()) > 1
