"""The DSL, graph checks and compiler on toy graphs with deliberate faults (no torch needed)."""

import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest

from flowrl import testing
from flowrl.errors import GraphErrors
from flowrl.front import compiler, dsl, graph

ROOT = Path(__file__).resolve().parents[3]
TOY = Path(__file__).resolve().parents[2] / "support" / "toy"
GOOD = (TOY / "good.toml.template").read_text()  # a graph of the toy nodes; {toy} is TOY
write = partial(testing.write_graph, toy=TOY)
compile_text = partial(testing.compile_text, toy=TOY)
problems = partial(testing.graph_problems, toy=TOY)


def test_good_graph_compiles_in_order(tmp_path):
    plan = compile_text(tmp_path, GOOD)
    calls = [i.name for i in plan.items if i.kind in ("call", "controller")]
    assert calls == ["generate", "score", "old_logprob", "ref_logprob", "advantage", "update"]
    assert plan.batch.rows == 8  # 2 prompts x 4 samples


def test_state_edge_puts_update_after_every_reader_of_its_model(tmp_path):
    spec = dsl.load(write(tmp_path, GOOD))
    built = graph.build(spec)
    assert built.dag.edges["old_logprob", "update"]["kind"] == "data"
    assert built.dag.edges["generate", "update"]["kind"] == "data"
    assert built.dag.edges["ref_logprob", "update"]["keys"] == ("ref_logprobs",)
    assert not built.pruned


def test_offload_always_moves_parts_around_calls(tmp_path):
    plan = compile_text(tmp_path, GOOD)
    kinds = [(i.kind, i.model, i.parts) for i in plan.items if i.kind in ("reload", "offload")]
    assert kinds[0] == ("reload", "policy", ("weights", "kv_cache"))
    # after generate only the KV cache leaves: old_logprob needs the policy's weights next
    assert kinds[1] == ("offload", "policy", ("kv_cache",))
    # before the update: the policy's weights left for ref_logprob and come back with grads, optim
    assert ("reload", "policy", ("weights", "grads", "optimizer")) in kinds
    assert kinds[-1] == ("offload", "policy", ("weights", "grads", "optimizer"))
    sync = plan.item("sync:policy")
    assert sync.id > plan.item("update").id and sync.id < plan.items[-1].id


def test_offload_never_has_no_moves(tmp_path):
    plan = compile_text(tmp_path, GOOD.replace('offload = "always"', 'offload = "never"'))
    assert not [i for i in plan.items if i.kind in ("reload", "offload")]
    assert plan.item("sync:policy").kind == "sync"


def test_every_call_has_dispatch_before_and_collect_after(tmp_path):
    plan = compile_text(tmp_path, GOOD)
    for item in plan.items:
        if item.kind == "call":
            dispatch, collect = (
                plan.item(f"dispatch:{item.node}"),
                plan.item(f"collect:{item.node}"),
            )
            assert dispatch.id in item.deps and item.id in collect.deps
            assert collect.keys == tuple(
                {"generate": ("responses", "response_mask"), "update": ()}.get(
                    item.node,
                    ("old_logprobs",) if item.node == "old_logprob" else ("ref_logprobs",),
                )
            )


def test_plan_text_is_deterministic_and_readable(tmp_path):
    first = compile_text(tmp_path, GOOD).text()
    second = compile_text(tmp_path, GOOD).text()
    assert first == second
    assert "call       main       generate  (policy, rollout)" in first
    assert "sync       main       policy: weights train -> rollout" in first
    # the controller's score may run while the pool computes log-probs
    assert "score || old_logprob" in first


def test_missing_writer_names_key_and_reader(tmp_path):
    text = GOOD.replace("[nodes.score]", "[nodes.unused]").replace(
        'uses = "{toy}/score.py"', 'uses = "{toy}/score.py"\nrename = {{ scores = "other" }}'
    )
    found = problems(tmp_path, text)
    assert any('reads "scores"' in p.message and p.where == "[nodes.advantage]" for p in found)


def test_two_writers_named_together(tmp_path):
    text = GOOD + '\n[nodes.score2]\nuses = "{toy}/score.py"\n'
    (p,) = problems(tmp_path, text)
    assert "[nodes.score]" in p.message and "[nodes.score2]" in p.message


def test_cycle_is_reported_with_its_path(tmp_path):
    # score reads responses; rename generate's input so it needs scores: a loop
    text = GOOD.replace("n = 4", 'n = 4\nrename = {{ prompts = "advantages" }}')
    found = problems(tmp_path, text)
    assert any("cycle" in p.message and "generate" in p.message for p in found)


def test_unknown_uses_suggests_a_name(tmp_path):
    text = GOOD.replace('uses = "{toy}/score.py"', 'uses = "advantage.gea"')
    found = problems(tmp_path, text)
    assert any('unknown node "advantage.gea"' in p.message for p in found)
    assert any('did you mean "advantage.gae"' in p.message for p in found)


def test_unknown_and_mistyped_params_reported_together(tmp_path):
    text = (
        GOOD.replace("scale = ", "x = ")
        .replace(
            '[nodes.score]\nuses = "{toy}/score.py"',
            '[nodes.score]\nuses = "{toy}/score.py"\nscal = 2.0',
        )
        .replace("n = 4", 'n = "four"')
    )
    found = problems(tmp_path, text)
    messages = " | ".join(p.message for p in found)
    assert 'unknown key "scal"' in messages and 'did you mean "scale"' in messages
    assert "\"n\" = 'four' should be an integer" in messages
    assert len(found) == 2


def test_param_validator_error_is_reported(tmp_path):
    text = GOOD.replace('uses = "{toy}/adv.py"', 'uses = "{toy}/adv.py"\nmode = "median"')
    (p,) = problems(tmp_path, text)
    assert p.where == "[nodes.advantage]" and "mode" in p.message


def test_unknown_model_and_pool(tmp_path):
    text = GOOD.replace('model = "ref"', 'model = "reff"').replace(
        'path = "tiny"\n\n[pools', 'path = "tiny"\npool = "gpu"\n\n[pools'
    )
    found = problems(tmp_path, text)
    assert any('unknown model "reff"' in p.message and '"ref"' in p.message for p in found)
    assert any('pool "gpu" is not defined' in p.message for p in found)


def test_rollout_pool_and_node_spanning_errors_name_key_and_fix(tmp_path):
    text = GOOD.replace(
        'trainable = true\npath = "tiny"', 'trainable = true\npath = "tiny"\nrollout_pool = "genn"'
    ).replace("workers = 1", 'workers = 3\nnodes = 2\nplacement = "PACK"')
    found = problems(tmp_path, text)
    where = {p.where: p for p in found}
    assert 'pool "genn" is not defined' in where["[models.policy] rollout_pool"].message
    assert "do not split evenly" in where["[pools.main]"].message
    assert "STRICT_SPREAD" in where["[pools.main] placement"].fix
    found = problems(tmp_path, GOOD.replace("workers = 1", "workers = 1\nnodes = 2"))
    assert [p.fix for p in found] == ["set nodes <= workers"]


def test_rollout_pool_moves_generate_and_sends_weights(tmp_path):
    text = GOOD.replace('path = "tiny"', 'path = "tiny"\npool = "main"').replace(
        'pool = "main"', 'pool = "main"\nrollout_pool = "gen"', 1
    )
    plan = compile_text(tmp_path, text + '\n[pools.gen]\noffload = "never"\n')
    assert plan.item("generate").pool == "gen" and plan.item("update").pool == "main"
    sync = plan.item("sync:policy")
    assert (sync.pool, sync.to_pool) == ("main", "gen")
    assert plan.item("generate").id in _ancestors(plan, sync)  # after this step's generate
    assert "grads" not in plan.pools["gen"].memory_bytes["policy"]


def _ancestors(plan, item) -> set:
    seen, todo = set(), list(item.deps)
    while todo:
        i = todo.pop()
        if i not in seen:
            seen.add(i)
            todo += list(plan.items[i - 1].deps)
    return seen


def test_training_a_frozen_model_is_an_error(tmp_path):
    text = GOOD.replace('model = "policy"\n"""', 'model = "ref"\n"""')
    text = text.replace(
        '[nodes.update]\nuses = "{toy}/train.py"\nmodel = "policy"',
        '[nodes.update]\nuses = "{toy}/train.py"\nmodel = "ref"',
    )
    found = problems(tmp_path, text)
    assert any('trains model "ref", which is frozen' in p.message for p in found)


def test_group_node_needs_several_samples(tmp_path):
    found = problems(tmp_path, GOOD, ["nodes.generate.n=1"])
    assert any("1 sample" in p.message and p.where == "[nodes.advantage]" for p in found)


def test_mini_batch_larger_than_step_is_an_error(tmp_path):
    found = problems(tmp_path, GOOD, ["nodes.update.mini_batch_size=64"])
    assert any("exceeds the 8 rows" in p.message for p in found)


def test_overrides_are_validated(tmp_path):
    found = problems(tmp_path, GOOD, ["run.stepz=5", "nodes.advantag.eps=0.1", "bad"])
    messages = [p.message for p in found]
    assert any('unknown key "stepz" (from the command line)' in m for m in messages)
    assert any("no [nodes.advantag]" in m and 'did you mean "advantage"' in m for m in messages)
    assert any("is not table.key=value" in m for m in messages)


def test_override_changes_value(tmp_path):
    spec = dsl.load(write(tmp_path, GOOD), ["run.steps=50", "nodes.generate.n=8"])
    assert spec.run.steps == 50 and spec.nodes["generate"].params.n == 8


def test_toml_syntax_error_names_line(tmp_path):
    (p,) = problems(tmp_path, GOOD.replace("steps = 3", "steps = = 3"))
    assert p.where.startswith("line ") and "not valid TOML" in p.message


def test_node_whose_outputs_nobody_reads_is_skipped_with_its_model(tmp_path):
    spec = dsl.load(write(tmp_path, GOOD), ["nodes.update.kl_coef=0"])
    built = graph.build(spec)
    assert built.pruned == ("ref_logprob",)
    assert "ref_logprob" not in built.order and "ref" not in built.spec.models
    plan = compiler.compile_graph(built)
    assert not [i for i in plan.items if i.node == "ref_logprob" or i.model == "ref"]
    assert any(
        '[nodes.ref_logprob] is skipped: no node reads "ref_logprobs"' in w
        and "model ref is not loaded" in w
        for w in plan.warnings
    )


def test_skipping_reaches_a_fixed_point_but_keeps_updates(tmp_path):
    # ref_adv reads ref_logprobs and writes kl_adv, which nothing reads: both go
    extra = (
        '[nodes.ref_adv]\nuses = "{toy}/adv.py"\n'
        'rename = {{ scores = "ref_logprobs", advantages = "kl_adv" }}\n'
    )
    built = graph.build(dsl.load(write(tmp_path, GOOD + extra), ["nodes.update.kl_coef=0"]))
    assert built.pruned == ("ref_logprob", "ref_adv")
    assert "update" in built.order and "old_logprob" in built.order


def test_auto_offload_decides_from_memory(tmp_path):
    text = GOOD.replace('offload = "always"', 'offload = "auto"\ndevice = "cuda"')
    roomy = compile_text(
        tmp_path, text.replace('device = "cuda"', 'device = "cuda"\ndevice_memory_gb = 80.0')
    )
    assert roomy.pools["main"].offload == "never"
    big = text.replace('path = "tiny"', 'path = "tiny"\nn_params = 7_000_000_000')
    cramped = compile_text(
        tmp_path, big.replace('device = "cuda"', 'device = "cuda"\ndevice_memory_gb = 24.0')
    )
    assert cramped.pools["main"].offload == "always"


def test_cli_exits_2_without_traceback(tmp_path):
    path = write(tmp_path, GOOD.replace("n = 4", 'n = "x"'))
    result = subprocess.run(
        [sys.executable, "-m", "flowrl.cli", "check", str(path)], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert (
        "Traceback" not in result.stderr and '"n"' in result.stderr and str(path) in result.stderr
    )


def test_every_kind_of_error_is_reported_at_once(tmp_path):
    """A data-file error (the file's own check), a wiring error and a node's own check hook
    (an agent's tool that does not exist) in one graph: one check reports all three."""
    text = (ROOT / "graphs/grpo_tools.toml").read_text()
    text = text.replace('source = "calculator"', 'source = "missing.jsonl"')
    text = text.replace('tools = ["calculator"]', 'tools = ["calculator", "nope.py:f"]')
    text = text.replace(
        'uses = "advantage.grpo"', 'uses = "advantage.grpo"\nrename = { scores = "bonus" }'
    )
    (tmp_path / "g.toml").write_text(text)
    with pytest.raises(GraphErrors) as info:
        compiler.compile_file(tmp_path / "g.toml")
    messages = [p.message for p in info.value.problems]
    assert len(messages) == 3, messages
    assert "no such data file" in messages[0]
    assert any('reads "bonus", which no node writes' in m for m in messages)
    assert any('tool "nope.py:f": no file' in m for m in messages)


def test_a_table_that_cannot_be_built_stops_the_later_checks_only(tmp_path):
    """A node whose params are wrong has no spec to wire: its own problem is reported, and no
    later error about the keys it would have written."""
    text = (ROOT / "graphs/grpo.toml").read_text().replace("n = 8", 'n = "eight"')
    (tmp_path / "g.toml").write_text(text)
    with pytest.raises(GraphErrors) as info:
        compiler.compile_file(tmp_path / "g.toml")
    assert len(info.value.problems) == 1 and '"n"' in info.value.problems[0].message


def test_only_an_optional_write_nobody_reads_is_warned_about():
    """A node's own writes are its contract: the agent's rollout_logprobs, ReMax's renamed
    greedy responses give no warning; generate's rollout_logprobs, turned on by
    return_logprobs with no reader, would: the policy update reads them whenever they are
    written (its rollout_logprob_diff_* metrics), so grpo.toml gives none either."""
    for name in ("grpo_tools", "remax"):
        plan = compiler.compile_file(ROOT / f"graphs/{name}.toml")
        assert not [w for w in plan.warnings if "no node reads" in w], plan.warnings
    plan = compiler.compile_file(ROOT / "graphs/grpo.toml", ["nodes.generate.return_logprobs=true"])
    assert not [w for w in plan.warnings if "no node reads" in w]
    (dispatch,) = [i for i in plan.items if i.name == "dispatch:update_policy"]
    assert "rollout_logprobs" in dispatch.keys


def test_nodes_above_a_node_that_cannot_be_built_still_get_their_own_checks(tmp_path):
    """A wrong param on the update node leaves no spec to wire; the agent above it in the
    file still has its tools checked (its rows do not depend on the update)."""
    text = (ROOT / "graphs/grpo_tools.toml").read_text()
    text = text.replace('tools = ["calculator"]', 'tools = ["calculator", "nope.py:f"]')
    text = text.replace("kl_loss_coef = 0.0", 'kl_loss_coef = "zero"')
    (tmp_path / "g.toml").write_text(text)
    with pytest.raises(GraphErrors) as info:
        compiler.compile_file(tmp_path / "g.toml")
    where = [(p.where, p.message) for p in info.value.problems]
    assert len(where) == 2, where
    assert where[0][0] == "[nodes.update_policy]" and "kl_loss_coef" in where[0][1]
    assert where[1][0] == "[nodes.generate]" and 'tool "nope.py:f": no file' in where[1][1]
