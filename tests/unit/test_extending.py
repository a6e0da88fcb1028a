"""The node examples of docs/extending.md, taken from the page, work as the page says."""

import copy
import importlib.util
import inspect
import re
from pathlib import Path

import attrs
import pytest
import torch

from flowrl import refs
from flowrl.engines import TrainEngine
from flowrl.errors import GraphErrors
from flowrl.front import compiler, dsl, registry
from flowrl.hooks import CheckContext
from flowrl.protocol import DataProto
from flowrl.testing import assert_same, tiny_model, tiny_tokenizer, update_rows

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs/extending.md").read_text()


def example(first_line: str) -> str:
    """The ```python block of the page whose first line (or docstring line) is given."""
    blocks = re.findall(r"```python\n(.*?)```", PAGE, flags=re.S)
    return next(b for b in blocks if first_line in b.splitlines()[0:2])


def write_node(tmp_path, first_line, name):
    path = tmp_path / "my_nodes" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(example(first_line))
    return registry.resolve(str(path), tmp_path).spec


def test_the_controller_example_adds_its_bonus(tmp_path):
    spec = write_node(tmp_path, '"""A length bonus on the scores.', "bonus.py")
    rows = DataProto.from_dict(
        {"scores": torch.tensor([1.0, 0.0]), "response_mask": torch.tensor([[1, 1, 0], [1, 0, 0]])}
    )
    out = spec.fn(rows, spec.params(scale=0.5))
    torch.testing.assert_close(out["bonus_scores"], torch.tensor([2.0, 0.5]))


def recording_engine(model):
    """(a TrainEngine on a copy of `model`, the gradients of each of its optimizer steps as
    {parameter name: grad}), so a test can compare them with a loss's formula."""
    grads = []
    engine = TrainEngine(copy.deepcopy(model), tiny_tokenizer(), lr=1e-2, micro_tokens=9)
    step = engine.step

    def record():
        grads.append({n: p.grad.clone() for n, p in engine.module.named_parameters()})
        return step()

    engine.step = record
    return engine, grads


def test_the_custom_loss_example_compiles_and_takes_the_formulas_gradient(tmp_path):
    spec = write_node(tmp_path, "# my_nodes/reinforce_update.py", "reinforce_update.py")
    graph = (ROOT / "graphs/grpo.toml").read_text()
    graph = graph[: graph.index("[nodes.update_policy]")] + (
        '[nodes.update_policy]\nuses = "my_nodes/reinforce_update.py"\nmodel = "policy"\n'
    )
    (tmp_path / "g.toml").write_text(graph)
    plan = compiler.compile_file(tmp_path / "g.toml")
    assert plan.pools["main"].updates_per_step == {"policy": 1}
    assert "ref_logprob" not in plan.spec.nodes  # nothing reads the reference any more

    model, rows = tiny_model(seed=0), update_rows()
    engine, grads = recording_engine(model)
    _, metrics = spec.worker(engine, spec.params())(rows)
    reference = TrainEngine(copy.deepcopy(model), tiny_tokenizer())
    logprobs = reference.forward(rows, grad=True)["logprobs"]
    mask = rows["response_mask"].float()
    loss = -(rows["advantages"] * logprobs * mask).sum() / mask.sum()
    loss.backward()
    expected = {n: p.grad for n, p in reference.module.named_parameters()}
    assert_same(grads[0], expected)  # micro-batches of 9 tokens add up to the whole loss
    assert abs(metrics["pg_loss"] - float(loss.detach())) < 1e-5 and metrics["grad_norm"] > 0


def write_example(tmp_path, first_line, name):
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(example(first_line))
    return path


def toml_example(first_line: str) -> str:
    """The ```toml block of the page whose first line is given."""
    blocks = re.findall(r"```toml\n(.*?)```", PAGE, flags=re.S)
    return next(b for b in blocks if b.startswith(first_line) and "my_" in b)


def test_the_rollout_backend_example_runs_from_a_users_file_and_from_a_table_line(
    tmp_path, monkeypatch
):
    from flowrl import backends
    from flowrl.engines import HFRollout, make_rollout
    from flowrl.engines.batch import generate_batch
    from flowrl.engines.rollout import RolloutBackend

    write_example(tmp_path, "# generate_rollout.py", "generate_rollout.py")
    ref = "generate_rollout.py:GenerateRollout"
    model, tokenizer = tiny_model(seed=0), tiny_tokenizer()
    engine = make_rollout(ref, model, tokenizer, "cpu", base_dir=tmp_path)
    assert isinstance(engine, RolloutBackend) and engine.options.use_cache
    for name in ("generate", "run", "release", "offload", "reload", "sync_weights"):
        ours = inspect.signature(getattr(type(engine), name)).parameters
        contract = inspect.signature(getattr(RolloutBackend, name)).parameters
        assert list(ours) == list(contract), name
    ids = torch.randint(3, 60, (3, 5), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # a left-padded prompt
    ids = ids * mask
    greedy = {"n": 2, "max_new_tokens": 6, "do_sample": False}
    ours = generate_batch(engine, ids, mask, **greedy)
    reference = generate_batch(HFRollout(model, tokenizer), ids, mask, **greedy)
    assert ours.keys() == reference.keys()
    for key in ours:  # token for token, masks and padding included
        assert torch.equal(ours[key], reference[key]), key
    # the page's graph lines: by reference, with its option from the graph
    graph = (ROOT / "graphs/grpo.toml").read_text()
    blocks = re.findall(r"```toml\n(.*?)```", PAGE, flags=re.S)
    (models,) = [b for b in blocks if "rollout_options]" in b and "generate_rollout" in b]
    graph = graph.replace(graph[graph.index("[models.policy]") : graph.index("[models.ref]")], "")
    (tmp_path / "g.toml").write_text(models + "\n" + graph)
    config = dsl.load(tmp_path / "g.toml").models["policy"]
    assert config.rollout == ref and config.rollout_options == {"use_cache": False}
    bad = ["models.policy.rollout_options.use_cach=false"]
    with pytest.raises(GraphErrors, match=r'rollout_options\].*unknown key "use_cach"'):
        dsl.load(tmp_path / "g.toml", bad)
    # the page's table line names the same class in a folder of flowrl's
    table = {}
    exec(example("ROLLOUT_BACKENDS = {"), vars(backends) | {"GenerateOptions": object}, table)
    record = table["ROLLOUT_BACKENDS"]["generate"]
    assert record.ref == "flowrl.engines.generate.backend:GenerateRollout" and record.multi_turn
    path = tmp_path / "generate_rollout.py"
    local = backends.Backend(f"{path}:GenerateRollout", multi_turn=True, options=engine.Options)
    monkeypatch.setitem(backends.ROLLOUT_BACKENDS, "generate", local)
    assert dsl.load(ROOT / "graphs/grpo.toml", ["models.policy.rollout=generate"])


def test_the_tool_example_is_called_through_a_session(tmp_path):
    import asyncio

    from flowrl.agent.parsers import ToolCall
    from flowrl.agent.tools.toolbox import Toolbox

    write_example(tmp_path, "# my_tools.py", "my_tools.py")
    box = Toolbox(["calculator", "my_tools.py:word_count"], tmp_path)
    assert box.names[-1] == "word_count"
    (schema,) = [s for s in box.schemas if s["function"]["name"] == "word_count"]
    assert schema["function"]["parameters"]["required"] == ["text"]

    async def call():
        session = box.open({})
        await session.start()
        result = await session.call(ToolCall("word_count", {"text": "one two three"}), 5.0)
        await session.close()
        return result

    assert asyncio.run(call()).text == "3"
    node = toml_example("[nodes.generate]")
    graph = (ROOT / "graphs/grpo_tools.toml").read_text()
    start = graph.index("[nodes.generate]")
    end = graph.index("\n[", start + 1)
    kept = [line for line in graph[start:end].splitlines()[3:] if not line.startswith("tools")]
    (tmp_path / "g.toml").write_text(graph[:start] + node + "\n".join(kept) + "\n" + graph[end:])
    spec = dsl.load(tmp_path / "g.toml")
    assert list(spec.nodes["generate"].params.tools) == ["calculator", "my_tools.py:word_count"]


def test_the_scorer_example_scores_and_is_named_by_path(tmp_path):
    from flowrl.rewards import resolve_scorer, score_value

    write_example(tmp_path, "# my_scorer.py", "my_scorer.py")
    score = resolve_scorer("my_scorer.py:compute_score", tmp_path)
    assert score_value(score("calculator", "so it is 42", "42", {})) == (1.0, {"numbers": 1.0})
    assert score_value(score("calculator", "7 then 41", "42", {})) == (0.0, {"numbers": 2.0})
    graph = (ROOT / "graphs/grpo.toml").read_text()
    block = '[nodes.reward]\nuses = "reward.rule"\n'
    assert block in graph
    (tmp_path / "g.toml").write_text(graph.replace(block, toml_example("[nodes.reward]")))
    plan = compiler.compile_file(tmp_path / "g.toml")  # the node's check resolves the scorer
    assert plan.spec.nodes["reward"].params.scorer == "my_scorer.py:compute_score"


def write_losses(tmp_path, old: str = "", new: str = "") -> Path:
    """The page's my_losses.py in tmp_path (with `old` replaced by `new`), and the page's
    graph line set on graphs/grpo.toml's update node, as tmp_path/g.toml."""
    text = example("# my_losses.py")
    assert old in text
    (tmp_path / "my_losses.py").write_text(text.replace(old, new))
    (line,) = [x for x in example_toml('loss = "my_losses.py:TOPR"').splitlines() if "loss" in x]
    graph = (ROOT / "graphs/grpo.toml").read_text()
    graph = graph.replace('uses = "update.policy"\n', f'uses = "update.policy"\n{line}\n')
    (tmp_path / "g.toml").write_text(graph)
    return tmp_path / "g.toml"


def page_test(tmp_path, name: str):
    """The page's test file `name`.py, written to tmp_path and imported there."""
    test_file = tmp_path / f"{name}.py"
    test_file.write_text(example(f"# {name}.py"))
    module_spec = importlib.util.spec_from_file_location(name, test_file)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def test_the_loss_example_checks_and_its_own_test_passes(tmp_path):
    graph = write_losses(tmp_path)
    plan = compiler.compile_file(graph)
    assert plan.spec.nodes["update_policy"].params.loss == "my_losses.py:TOPR"
    page_test(tmp_path, "test_my_losses").test_topr_tapers_only_negative_rows()


def test_the_loss_example_takes_its_formulas_gradient_in_update_policy(tmp_path):
    from flowrl.nodes.update import policy

    write_losses(tmp_path)
    model, rows = tiny_model(seed=0), update_rows()
    rows.meta["base_dir"] = str(tmp_path)  # as the pool worker passes it
    params = policy.Params(loss="my_losses.py:TOPR", skip_zero_rows=False)
    engine, grads = recording_engine(model)
    _, metrics = policy.PolicyUpdateWorker(engine, params)(rows)
    reference = TrainEngine(copy.deepcopy(model), tiny_tokenizer())
    logprobs = reference.forward(rows, grad=True)["logprobs"]
    mask, adv = rows["response_mask"].float(), rows["advantages"]
    ratio = torch.exp(logprobs.detach() - rows["old_logprobs"])
    weight = torch.where(adv > 0, torch.ones_like(ratio), ratio.clamp(max=1.0))
    loss = -(adv * weight * logprobs * mask).sum() / mask.sum()  # token-mean
    loss.backward()
    expected = {n: p.grad for n, p in reference.module.named_parameters()}
    assert_same(grads[0], expected)
    truncated = ((adv < 0) & (ratio > 1)).float()
    assert metrics["truncated_frac"] == pytest.approx(float((truncated * mask).sum() / mask.sum()))


def write_estimator_and_loss(tmp_path) -> Path:
    """The page's estimator and loss beside graphs/grpo.toml changed as the page says."""
    graph = write_losses(tmp_path)
    (tmp_path / "my_estimators.py").write_text(example("# my_estimators.py"))
    table = example_toml('uses = "my_estimators.py"')
    text = graph.read_text().replace('[nodes.advantage]\nuses = "advantage.grpo"\n', table)
    assert 'uses = "my_estimators.py"' in text
    graph.write_text(text)
    return graph


def test_the_estimator_example_checks_and_its_own_test_passes(tmp_path):
    graph = write_estimator_and_loss(tmp_path)
    assert compiler.compile_file(graph).spec.nodes["advantage"].uses == "my_estimators.py"
    page_test(tmp_path, "test_my_estimators").test_centred_ranks_of_two_groups()
    one_sample = check_problems(graph, "nodes.generate.n=1")
    assert any("compares the samples of each prompt" in p for p in one_sample)


def test_the_estimator_and_loss_examples_run_tiny(tmp_path):
    from flowrl.testing import run_tiny

    run = run_tiny(write_estimator_and_loss(tmp_path), tmp_path / "runs")
    steps = [m for m in run.metrics if "time_s" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert all("update_policy/truncated_frac" in m for m in steps)
    assert any(m["update_policy/grad_norm"] > 0 for m in steps)


def test_the_table_line_of_the_page_makes_the_loss_a_built_in(tmp_path, monkeypatch):
    from flowrl.math import losses
    from flowrl.nodes.update import policy

    write_losses(tmp_path)
    topr = refs.load("my_losses.py:TOPR", tmp_path)
    line = re.search(r"```python\n(    \"topr\": Loss\(.*?\),)\n```", PAGE).group(1)
    entry = eval("{" + line + "}", {"Loss": losses.Loss, "topr": inspect.getmodule(topr.fn)})
    monkeypatch.setattr(losses, "LOSSES", losses.LOSSES | entry)
    monkeypatch.setattr(policy, "LOSSES", losses.LOSSES)
    params = policy.Params(loss="topr")
    assert policy.check(params, context(update_rows())) == []
    refused = policy.check(attrs.evolve(params, tau_pos=2.0), context(update_rows()))
    assert [f.message.split(" = ")[0] for f in refused] == ["tau_pos"]


def check_problems(graph: Path, *overrides) -> list[str]:
    try:
        compiler.compile_file(graph, list(overrides))
    except GraphErrors as e:
        return [f"{p.message} | fix: {p.fix}" for p in e.problems]
    return []


def test_a_misspelled_loss_gets_a_did_you_mean_and_the_way_to_write_your_own(tmp_path):
    (problem,) = check_problems(write_losses(tmp_path), "nodes.update_policy.loss=ppoo")
    assert 'must be one of "ppo", "gspo"' in problem and '"file.py:function"' in problem
    assert 'fix: did you mean "ppo"? Or write your own in a file' in problem
    assert 'loss = "my_losses.py:my_loss"' in problem


@pytest.mark.parametrize(
    ("old", "new", "said"),
    [
        (
            "TOPR = Loss(topr_loss,",
            "TOPR = Loss(lambda logprobs, advantages: 0,",
            r'loss "my_losses.py:TOPR": <lambda> \(.*my_losses.py:\d+\) cannot be called as '
            r"\(logprobs, old_logprobs, .*chunk\).*\| fix: take \(logprobs",
        ),
        (
            'rates=("truncated_frac",))',
            'rates=("truncated_frac",), params=("tau",))',
            r'topr_loss \(.*my_losses.py:9\) declares the param "tau", which update.policy '
            r'does not have \(did you mean "tau_pos"\?\).*fix: a loss reads its node',
        ),
        (
            'rates=("truncated_frac",))',
            'rates="truncated_frac")',
            r"its record's rates = 'truncated_frac' is not a tuple of names",
        ),
        (
            'rates=("truncated_frac",))',
            'rates=("truncated_frac",), agg="token_mean")',
            r'agg = "token_mean" is unknown \| fix: use one of "token-mean"',
        ),
        ("TOPR = Loss(", "TOPX = Loss(", r'my_losses.py has no "TOPR"; define it there'),
    ],
    ids=["signature", "unknown-param", "rates-not-a-tuple", "agg", "missing-name"],
)
def test_a_loss_of_your_own_that_cannot_work_is_refused_at_check(tmp_path, old, new, said):
    (problem,) = check_problems(write_losses(tmp_path, old, new))
    assert re.search(said, problem), problem


@pytest.mark.parametrize(
    ("old", "new", "said"),
    [
        (
            "return chunk.aggregate(loss, response_mask, params.agg), rates",
            "return loss, rates",
            r"topr_loss \(.*my_losses.py:9\) returned a loss of shape \(6, 4\), not a scalar: "
            r"reduce the per-token loss \(b, t\) with chunk.aggregate",
        ),
        (
            'rates = {"truncated_frac"',
            'rates = {"tapered"',
            r"declares the rates \['truncated_frac'\] but returned no value for them: return "
            r"each in its rates dict, or drop it",
        ),
        (
            "return chunk.aggregate(loss, response_mask, params.agg), rates",
            "return chunk.aggregate(loss, response_mask, params.agg), rates | {'kl': 0.0}",
            r"returned the rates \['kl'\], which its record does not declare: declare them, "
            r"Loss\(fn, rates=\('truncated_frac', 'kl'\)\)",
        ),
        (
            "weight * logprobs)",
            "weight * logprobs.detach())",
            r"returned a loss without a gradient: compute it from logprobs",
        ),
        (
            '{"truncated_frac": float(ops.masked_mean(truncated, response_mask))}',
            '{"truncated_frac": truncated}',
            r'returned the rate "truncated_frac" as \(6, 4\), not a number',
        ),
    ],
    ids=["token-loss", "missing-rate", "extra-rate", "no-gradient", "rate-not-a-number"],
)
def test_a_loss_of_your_own_that_returns_the_wrong_thing_is_stopped_at_its_call(
    tmp_path, old, new, said
):
    from flowrl.math.components import ComponentError
    from flowrl.testing import try_loss

    write_losses(tmp_path, old, new)
    with pytest.raises(ComponentError, match=said):
        try_loss("my_losses.py:TOPR", tmp_path)


def test_a_loss_returning_token_losses_stops_the_update_naming_it(tmp_path):
    from flowrl.math.components import ComponentError
    from flowrl.nodes.update import policy

    old = "return chunk.aggregate(loss, response_mask, params.agg), rates"
    write_losses(tmp_path, old, "return loss, rates")
    rows = update_rows()
    rows.meta["base_dir"] = str(tmp_path)
    worker = policy.PolicyUpdateWorker(
        recording_engine(tiny_model(seed=0))[0], policy.Params(loss="my_losses.py:TOPR")
    )
    with pytest.raises(ComponentError, match=r"my_losses.py:9\) returned a loss of shape"):
        worker(rows)


KL = """
import torch


def half_k2(logprobs, ref_logprobs):
    return 0.25 * (logprobs - ref_logprobs) ** 2  # (b, t)


def per_row(logprobs, ref_logprobs):
    return (logprobs - ref_logprobs).sum(-1)  # (b,): wrong
"""


def test_a_kl_kind_of_your_own_is_checked_and_used_by_both_nodes(tmp_path):
    from flowrl.math.components import ComponentError, kl_function
    from flowrl.nodes.reward import kl_penalty

    (tmp_path / "my_kl.py").write_text(KL)
    graph = write_losses(tmp_path)
    assert check_problems(graph, 'nodes.update_policy.kl_loss_kind="my_kl.py:half_k2"') == []
    (problem,) = check_problems(graph, 'nodes.update_policy.kl_loss_kind="my_kl.py:half"')
    assert 'my_kl.py has no "half"' in problem
    (problem,) = check_problems(graph, "nodes.update_policy.kl_loss_kind=k33")
    assert 'fix: did you mean "k3"? Or write your own, kl(logprobs, ref_logprobs)' in problem
    logp, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-2.0, -2.0]])
    torch.testing.assert_close(
        kl_function("my_kl.py:half_k2", tmp_path)(logp, ref), torch.tensor([[0.25, 0.0]])
    )
    with pytest.raises(ComponentError, match=r"per_row \(.*my_kl.py:9\) returned \(1,\) for "):
        kl_function("my_kl.py:per_row", tmp_path)(logp, ref)
    rows = DataProto.from_dict(
        {
            "scores": torch.tensor([1.0]),
            "old_logprobs": logp,
            "ref_logprobs": ref,
            "response_mask": torch.ones(1, 2, dtype=torch.long),
        }
    )
    rows.meta["base_dir"] = str(tmp_path)
    params = kl_penalty.Params(kl_kind="my_kl.py:half_k2", kl_coef=1.0)
    out, metrics = kl_penalty.run(rows, params, {})
    # -beta KL per token, the score on the last: [-0.25, -0.0 + 1.0]
    torch.testing.assert_close(out["token_rewards"], torch.tensor([[-0.25, 1.0]]))
    here = attrs.evolve(context(rows), base_dir=str(tmp_path))
    assert kl_penalty.check(params, here) == []
    (finding,) = kl_penalty.check(attrs.evolve(params, kl_kind="my_kl.py:nope"), here)
    assert 'my_kl.py has no "nope"' in finding.message


def context(rows):
    return CheckContext("update_policy", len(rows), 1, len(rows), 1, ".")


def grpo_with(tmp_path, table: str, after: str = "[nodes.ref_logprob]") -> Path:
    """graphs/grpo.toml with `table` inserted above `after`, written to tmp_path/g.toml."""
    graph = (ROOT / "graphs/grpo.toml").read_text().replace(after, table + "\n" + after)
    (tmp_path / "g.toml").write_text(graph)
    return tmp_path / "g.toml"


def test_the_filter_example_keeps_the_best_of_each_group(tmp_path):
    spec = write_node(tmp_path, "# my_nodes/top_k.py", "top_k.py")
    rows = DataProto.from_dict(
        {
            "scores": torch.tensor([0.0, 2.0, 1.0, 5.0, 5.0, 3.0]),
            "uid": torch.tensor([7, 7, 7, 9, 9, 9]),
        }
    )
    keep, metrics = spec.fn(rows, spec.params(keep_top=2))
    # uid 7: scores 0, 2, 1 -> rows 1 and 2; uid 9: 5, 5, 3 -> rows 3 and 4 (a tie: both)
    assert keep["keep"].tolist() == [False, True, True, True, True, False]
    assert metrics == {"kept_fraction": pytest.approx(4 / 6)}


def test_the_filter_example_in_a_graph_shows_the_rows_after_it(tmp_path, capsys):
    from flowrl.cli import main

    write_node(tmp_path, "# my_nodes/top_k.py", "top_k.py")
    table = example_toml('uses = "my_nodes/top_k.py"')
    graph = grpo_with(tmp_path, table)
    plan = compiler.compile_file(graph)
    assert plan.after("best") == ["ref_logprob", "advantage", "update_policy"]
    assert (
        "after best: ref_logprob, advantage, update_policy receive the rows best keeps: at most 32 "
        "(4 prompts x 8 samples), varying by step"
    ) in plan.text()
    assert not [w for w in plan.warnings if "keep" in w]
    assert main(["check", str(graph)]) == 0
    out = capsys.readouterr().out
    assert "32 rows per step, at most 32 after best" in out
    assert "scores, uid -> (keeps rows: keep)" in out


def test_the_filter_example_trains_on_the_kept_rows(tmp_path):
    """A tiny run (2 prompts x 8 samples): the update receives each prompt's 4 best rows."""
    from flowrl.testing import run_tiny

    write_node(tmp_path, "# my_nodes/top_k.py", "top_k.py")
    graph = grpo_with(tmp_path, example_toml('uses = "my_nodes/top_k.py"'))
    run = run_tiny(graph, tmp_path / "runs", **{"run.save_inputs": '["update_policy"]'})
    assert run.metrics[-1]["best/kept_fraction"] == 0.5
    rows = DataProto.load(run.run_dir / "inputs/step_2_update_policy_rank0/batch.pt")
    prompts = [tuple(p) for p in rows["prompts"].tolist()]  # the update reads no uid
    assert len(rows) == 8 and sorted(prompts.count(p) for p in set(prompts)) == [4, 4]


def test_a_filter_that_declares_writes_is_refused(tmp_path):
    node = tmp_path / "bad_filter.py"
    node.write_text(example("# my_nodes/top_k.py").replace("writes=()", 'writes=("keep",)'))
    graph = grpo_with(tmp_path, '[nodes.best]\nuses = "bad_filter.py"\n')
    with pytest.raises(GraphErrors, match="a filter returns only its keep mask"):
        compiler.compile_file(graph)


def example_toml(first_line: str) -> str:
    """The ```toml block of the page that contains `first_line`."""
    blocks = re.findall(r"```toml\n(.*?)```", PAGE, flags=re.S)
    return next(b for b in blocks if first_line in b)


@pytest.mark.parametrize(
    "keep", [torch.tensor([1, 0, 1]), torch.tensor([True, False]), [True, False, True]]
)
def test_a_keep_that_is_not_a_bool_mask_over_the_rows_stops_the_call(tmp_path, keep):
    from flowrl.runtime.node_call import NodeCall, NodeFailure, call_node

    spec = write_node(tmp_path, "# my_nodes/top_k.py", "top_k.py")
    rows = DataProto.from_dict({"scores": torch.zeros(3), "uid": torch.tensor([0, 0, 1])})
    call = NodeCall("best", spec, {}, spec.params(), "on the controller")
    with pytest.raises(NodeFailure, match=r"keep must be a torch.bool tensor of shape \(3,\)"):
        call_node(call, rows, lambda batch: {"keep": keep})


def test_a_bad_loss_and_a_bad_kl_kind_are_both_reported(tmp_path):
    graph = write_losses(tmp_path, "TOPR = Loss(", "TOPX = Loss(")
    found = check_problems(graph, 'nodes.update_policy.kl_loss_kind="my_kl.py:half"')
    assert len(found) == 2
    assert 'has no "TOPR"' in found[0] and 'KL kind "my_kl.py:half": no file' in found[1]
