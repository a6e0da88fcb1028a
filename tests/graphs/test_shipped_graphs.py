"""Every file in graphs/ checks and compiles; the checks users rely on hold on the real graphs."""

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from flowrl.cli import main
from flowrl.errors import GraphErrors
from flowrl.front import dsl, registry, schema
from flowrl.front.compiler import compile_file

ROOT = Path(__file__).resolve().parents[2]
GRAPHS = sorted((ROOT / "graphs").glob("*.toml"))


@pytest.mark.parametrize("path", GRAPHS, ids=[p.stem for p in GRAPHS])
def test_graph_checks_and_compiles(path):
    plan = compile_file(path)
    calls = {i.node for i in plan.items if i.kind in ("call", "controller")}
    assert calls == set(dsl.load(path).nodes)


def test_ppo_and_grpo_are_shipped():
    assert {"ppo", "grpo"} <= {p.stem for p in GRAPHS}


@pytest.mark.parametrize("path", GRAPHS, ids=[p.stem for p in GRAPHS])
def test_the_spec_holds_the_files_nodes_models_and_pools(path):
    """What the file says, read with plain tomllib, is what the parsed spec holds: its node
    ids in the file's order, each model on the pool it names (or the only one), and each
    declared pool's offload policy (or the default)."""
    raw = tomllib.loads(path.read_text())
    spec = dsl.load(path)
    assert list(spec.nodes) == list(raw["nodes"])
    pools = list(raw.get("pools", {})) or [schema.DEFAULT_POOL]
    for name, table in raw["models"].items():
        # a model may leave `pool` out when the graph has one pool
        expected = table.get("pool") or (pools[0] if len(pools) == 1 else "")
        assert spec.models[name].pool == expected, name
    for name, table in raw.get("pools", {}).items():
        assert spec.pools[name].offload == table.get("offload", schema.PoolConfig().offload)


def test_ppo_plan_lists_step_in_order_with_transitions():
    plan = compile_file(ROOT / "graphs/ppo.toml")
    text = plan.text()
    order = [i.name for i in plan.items]
    position = order.index
    # rollout first (policy weights + KV cache reloaded before it), the updates last
    assert plan.items[0].kind == "reload" and plan.items[0].parts == ("weights", "kv_cache")
    assert position("generate") < position("old_logprob") < position("update_critic")
    assert position("update_critic") < position("update_policy") < position("sync:policy")
    kinds = [i.kind for i in plan.items]
    assert kinds.count("dispatch") == kinds.count("call") == kinds.count("collect") == 6
    assert "offload" in kinds and "reload" in kinds
    assert "sync       main       policy: weights train -> rollout" in text
    # each model leaves the device when the next call on the pool needs another
    ref_reload = plan.item(next(n for n in order if n.startswith("reload:ref")))
    assert any(
        i.kind == "offload" and i.model == "policy" and i.id < ref_reload.id for i in plan.items
    )


def test_grpo_reads_ref_logprobs_in_the_loss_and_has_no_critic():
    spec = dsl.load(ROOT / "graphs/grpo.toml")
    assert "critic" not in spec.models
    assert "ref_logprobs" in spec.nodes["update_policy"].reads
    assert spec.nodes["advantage"].uses == "advantage.grpo"


def test_deleting_values_names_the_key_and_its_reader(tmp_path):
    text = (ROOT / "graphs/ppo.toml").read_text()
    text = re.sub(r"\[nodes\.values\]\n(.+\n)+?\n", "", text)
    path = tmp_path / "ppo.toml"
    path.write_text(text)
    with pytest.raises(GraphErrors) as info:
        compile_file(path)
    messages = [f"{p.where} {p.message}" for p in info.value.problems]
    assert any('"values"' in m and "[nodes.advantage]" in m for m in messages)


def test_second_writer_of_advantages_names_both(tmp_path):
    path = tmp_path / "ppo.toml"
    path.write_text(
        (ROOT / "graphs/ppo.toml").read_text() + '\n[nodes.advantage2]\nuses = "advantage.gae"\n'
    )
    with pytest.raises(GraphErrors) as info:
        compile_file(path)
    (p,) = [p for p in info.value.problems if '"advantages"' in p.message]
    assert "[nodes.advantage]" in p.message and "[nodes.advantage2]" in p.message


def test_check_exit_2_and_no_traceback_on_bad_graph(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(
        (ROOT / "graphs/grpo.toml")
        .read_text()
        .replace('uses = "advantage.grpo"', 'uses = "advantage.grp"')
    )
    result = subprocess.run(
        [sys.executable, "-m", "flowrl.cli", "check", str(path)], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert 'did you mean "advantage.grpo"' in result.stderr


BLOCK = (
    "import sys; sys.modules['torch'] = None; sys.modules['ray'] = None\n"
    "from flowrl.cli import main\n"
    "code = main(sys.argv[1:])\n"
    "assert 'torch' not in [m.split('.')[0] for m in sys.modules if sys.modules[m] is not None]\n"
    "sys.exit(code)\n"
)


@pytest.mark.parametrize(
    "command",
    [
        ["check", *map(str, GRAPHS)],
        ["plan", "graphs/ppo.toml"],
        ["render", "graphs/ppo.toml", "-o", "{tmp}/x.dot"],
        ["nodes"],
    ],
)
def test_commands_run_with_torch_and_ray_unimportable(command, tmp_path):
    args = [a.replace("{tmp}", str(tmp_path)) for a in command]
    result = subprocess.run(
        [sys.executable, "-c", BLOCK, *args], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz's dot is not installed")
def test_render_svg_shows_every_node(tmp_path):
    out = tmp_path / "ppo.svg"
    assert main(["render", str(ROOT / "graphs/ppo.toml"), "-o", str(out)]) == 0
    svg = out.read_text()
    for node in dsl.load(ROOT / "graphs/ppo.toml").nodes:
        assert f">{node}</text>" in svg


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz's dot is not installed")
def test_render_plan_svg_shows_transitions_and_dispatch(tmp_path):
    out = tmp_path / "plan.svg"
    assert main(["render", str(ROOT / "graphs/ppo.toml"), "--plan", "-o", str(out)]) == 0
    svg = out.read_text()
    for word in ("reload", "offload", "dispatch", "collect", "sync"):
        assert word in svg


def test_render_without_dot_writes_dot_file_and_says_how(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    out = tmp_path / "ppo.svg"
    assert main(["render", str(ROOT / "graphs/ppo.toml"), "-o", str(out)]) == 1
    assert (tmp_path / "ppo.dot").exists() and not out.exists()
    assert "apt-get install -y graphviz" in capsys.readouterr().err


def test_dot_output_is_deterministic():
    plan = compile_file(ROOT / "graphs/ppo.toml")
    assert plan.to_dot() == compile_file(ROOT / "graphs/ppo.toml").to_dot()
    assert plan.to_json() == compile_file(ROOT / "graphs/ppo.toml").to_json()


def test_keys_glossary_covers_every_key():
    glossary = (ROOT / "docs/keys.md").read_text()
    documented = set(re.findall(r"^\| `(\w+)` \|", glossary, flags=re.M))
    used = set(schema.DATASET_KEYS)
    for name in registry.builtin_names():
        spec = registry.resolve(name).spec
        used |= set(spec.reads) | set(spec.writes)
        used |= set(spec.optional_reads) | set(spec.optional_writes)
    for path in GRAPHS:
        for decl in dsl.load(path).nodes.values():
            used |= set(decl.reads) | set(decl.writes)
    assert used - documented == set(), "add these keys to docs/keys.md"


def test_shipped_graph_found_by_name_from_anywhere(tmp_path, monkeypatch):
    from flowrl.cli import graph_path

    monkeypatch.chdir(tmp_path)
    assert Path(graph_path("ppo")).read_text() == (ROOT / "graphs/ppo.toml").read_text()
    assert Path(graph_path("grpo")).name == "grpo.toml"
    # a path is that file: a missing one is an error, with the shipped graph's bare name as fix
    with pytest.raises(GraphErrors) as info:
        graph_path("graphs/ppo.toml")
    assert 'write "ppo"' in info.value.problems[0].fix
    assert graph_path("nothing.toml") == "nothing.toml"  # left for the loader to report


def test_graph_file_reference_is_current():
    from flowrl.front import reference

    text = reference.DOC.read_text()
    assert reference.refreshed(text) == text, "run: python -m flowrl.front.reference --write"


def test_graph_file_reference_lists_every_rule_and_choice():
    import attrs

    from flowrl.front import reference
    from flowrl.params import describe

    lines = reference.DOC.read_text().splitlines()
    tables = [schema.RunConfig, schema.DataConfig, schema.ModelConfig, schema.PoolConfig]
    tables += [registry.resolve(name).spec.params for name in registry.builtin_names()]
    for cls in tables:
        for field in attrs.fields(attrs.resolve_types(cls)):
            rule = describe(field.validator)
            rows = [line for line in lines if line.startswith(f"| `{field.name}` |")]
            if rule:
                assert any(f"| {rule} |" in row for row in rows), f"{cls}.{field.name}: {rule}"
            else:  # every count has a range; only flags, free numbers and names go without
                assert field.type in (bool, float, str), f"{cls}.{field.name} has no rule"
    for choice in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "STRICT_SPREAD"):
        assert f'"{choice}"' in "\n".join(lines)


def test_flowrl_compile_is_public_and_torch_free():
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['ray'] = None\n"
        "import flowrl\n"
        "plan = flowrl.compile('graphs/ppo.toml', ['run.steps=3'])\n"
        "assert plan.spec.run.steps == 3 and plan.pools['main'].workers == 1\n"
        "assert plan.batch.rows == plan.batch.prompts * plan.batch.samples\n"
        "assert 'torch' not in [m.split('.')[0] for m in sys.modules if sys.modules[m]]\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr


ZOO = ("rloo", "reinforce_pp", "reinforce_pp_baseline", "remax", "dr_grpo", "dapo", "gspo")


def test_the_algorithm_zoo_is_shipped_with_its_papers():
    shipped = {p.stem: p for p in GRAPHS}
    for name in ZOO:
        header = shipped[name].read_text().split("\n[run]")[0]
        assert "arXiv" in header and f"graphs/{name}.toml" in header, name


def uses(name):
    return {n: (d.uses, d.params) for n, d in dsl.load(ROOT / f"graphs/{name}.toml").nodes.items()}


def test_each_zoo_graph_sets_what_its_algorithm_changes():
    assert uses("rloo")["advantage"][0] == "advantage.rloo"
    for name in ("reinforce_pp", "reinforce_pp_baseline"):
        nodes = uses(name)
        assert nodes["token_rewards"][0] == "reward.token_rewards"  # no KL-penalty node
        assert nodes["advantage"][0] == "advantage.reinforce_pp"
        assert nodes["update_policy"][1].kl_loss_coef > 0
    assert uses("reinforce_pp_baseline")["advantage"][1].baseline == "group"
    dr = uses("dr_grpo")
    assert not dr["advantage"][1].scale_by_std
    assert dr["update_policy"][1].agg == "seq-mean-token-sum-norm"
    gspo = uses("gspo")["update_policy"][1]
    assert (gspo.loss, gspo.clip_low, gspo.clip_high) == ("gspo", 3e-4, 4e-4)
    dapo = uses("dapo")
    assert dapo["update_policy"][1].clip_high > dapo["update_policy"][1].clip_low
    assert dapo["update_policy"][1].kl_loss_coef == 0 and dapo["filter"][1].min_groups > 0
    assert dapo["overlong"][0] == "reward.overlong"


def test_remax_scores_a_greedy_response_per_prompt_before_sampling():
    plan = compile_file(ROOT / "graphs/remax.toml")
    greedy = plan.spec.nodes["greedy"].params
    assert not greedy.do_sample and greedy.n == 1
    assert plan.batch.rows_per_node["greedy"] == 4  # the prompts, before the 8 samples each
    assert plan.graph.writers["baseline_scores"] == "greedy_reward"
    names = [i.name for i in plan.items]
    assert names.index("greedy_reward") < names.index("dispatch:generate")
    assert plan.validation.nodes == ("generate", "reward")  # the baseline is not validated


def test_dapo_plan_orders_the_filter_before_every_reader_of_its_rows():
    import networkx as nx

    plan = compile_file(ROOT / "graphs/dapo.toml")
    dag = plan.graph.dag
    before = nx.ancestors(dag, "filter")
    assert before == {"generate", "reward"}
    deps = {i.id: set(i.deps) for i in plan.items}

    def upstream(item_id):
        seen, todo = set(), [item_id]
        while todo:
            for dep in deps[todo.pop()] - seen:
                seen.add(dep)
                todo.append(dep)
        return seen

    filter_id = plan.item("filter").id
    for node in set(plan.spec.nodes) - before - {"filter"}:
        first = plan.item(f"dispatch:{node}" if plan.spec.nodes[node].model else node)
        assert filter_id in upstream(first.id), node
    assert plan.refill.before == ("generate", "reward", "filter")
    text = plan.text()
    assert "refill: generate, reward, filter run on up to 4 prompt batches" in text
    assert plan.batch.rows_per_node["update_policy"] == 32  # 4 groups x 8 samples


def test_nodes_lists_the_keys_that_depend_on_params(capsys):
    assert main(["nodes"]) == 0
    out = capsys.readouterr().out
    generate = out[out.index("\ngenerate  ") : out.index("\nlogprob  ")]
    assert "+ rollout_logprobs (depending on its params)" in generate
    update = out[out.index("\nupdate.policy  ") :]
    assert "+ old_logprobs, ref_logprobs, rollout_logprobs (depending on its params)" in update


@pytest.mark.parametrize("path", GRAPHS, ids=[p.stem for p in GRAPHS])
def test_dispatch_items_hold_the_node_mode_and_the_pool_ranks(path):
    """A dispatch item's `how` is the node's own dispatch mode, never display text (the
    executor compares it); the plan prints ", 1 rank" from `ranks` alone."""
    plan = compile_file(path)
    dispatches = [i for i in plan.items if i.kind == "dispatch"]
    assert dispatches
    for item in dispatches:
        assert item.how == plan.spec.nodes[item.node].spec.dispatch
        assert item.ranks == plan.pools[item.pool].workers
        shown = f"{item.how}, 1 rank" if item.ranks == 1 else item.how
        assert item.describe() == f"{item.node}: {shown} [{', '.join(item.keys)}]"


def test_check_of_every_graph_runs_without_torch_ray_or_transformers():
    """`flowrl check graphs/*.toml` with torch and ray unimportable, multi-turn graphs
    included: tool schemas from type hints and the chat-template check through tokenizers +
    jinja2, so transformers is never imported. Its speed (a second per graph promised; 0.43 s
    for 13 graphs on the 2-core machine) is measured by bench/check_speed.py, not here."""
    code = BLOCK.replace(
        "sys.exit(code)",
        "assert 'transformers' not in sys.modules, 'check imported transformers'\nsys.exit(code)",
    )
    result = subprocess.run(
        [sys.executable, "-c", code, "check", *map(str, GRAPHS)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert "grpo_tools.toml: ok" in result.stdout
