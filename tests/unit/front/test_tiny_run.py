"""`flowrl run --tiny` and flowrl.testing.tiny_overrides: any graph on the tiny random model."""

import json
import shutil
from pathlib import Path

import pytest

from flowrl import cli
from flowrl.front import compiler
from flowrl.testing import VARIED_SCORER, run_tiny, tiny_overrides, tiny_plan

ROOT = Path(__file__).resolve().parents[3]
GRAPHS = sorted((ROOT / "graphs").glob("*.toml"))


@pytest.mark.parametrize("graph", GRAPHS, ids=lambda p: p.name)
def test_tiny_overrides_put_every_shipped_graph_on_the_tiny_model(graph, tmp_path):
    spec = compiler.compile_file(graph, tiny_overrides(graph, tmp_path)).spec
    assert {m.path for m in spec.models.values()} == {"tiny"}
    assert all(m.lr == 0.01 for m in spec.models.values() if m.trainable)
    assert (spec.run.steps, spec.run.val_size, spec.data.batch_size) == (2, 4, 2)
    assert spec.run.out_dir == str(tmp_path)
    params = [decl.params for decl in spec.nodes.values()]
    assert all(p.scorer == VARIED_SCORER for p in params if hasattr(p, "scorer"))
    if Path(graph).name == "reward_model.toml":  # the one graph that samples nothing
        assert not any(hasattr(p, "max_new_tokens") for p in params)
    else:
        generate = spec.nodes["generate"].params
        if getattr(generate, "tools", ()):  # an agent: its scripted first turn, answers, a turn
            assert generate.script_first_turn
            assert generate.max_new_tokens > 2 * generate.max_turn_tokens
        elif getattr(generate, "env", ""):  # an environment: its observations and replies
            assert generate.interact_on_cut and generate.max_new_tokens > 3 * 512
        else:
            assert generate.max_new_tokens == 6
        if not getattr(generate, "env", ""):  # an environment's rewards are its own
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


def test_run_tiny_flag_applies_them_and_the_command_line_wins(monkeypatch, tmp_path, capsys):
    import flowrl.runtime.controller as controller

    seen = {}
    (tmp_path / "metrics.jsonl").write_text("")
    monkeypatch.setattr(
        controller, "run", lambda plan, **kw: seen.update(plan=plan, **kw) or tmp_path
    )
    assert cli.main(["run", "grpo", "--tiny", "--backend", "local", "run.steps=5"]) == 0
    assert "tiny run: what was real and what was stubbed" in capsys.readouterr().out
    spec = seen["plan"].spec
    assert {m.path for m in spec.models.values()} == {"tiny"}
    assert spec.run.steps == 5  # tiny says 2; the command line comes after it
    assert seen["backend"] == "local"


@pytest.mark.parametrize("graph", ["ppo.toml", "dapo.toml"])
def test_tiny_mini_batches_shrink_with_the_prompt_batch(graph):
    """ppo: 48 rows in mini-batches of 16 are 3 optimizer steps, and the tiny run's 8 rows keep
    3; dapo: after its refilling filter the rows are the target groups x samples, which the
    tiny run does not shrink, so the mini-batch stays."""
    from flowrl.hooks import MINI_BATCHES

    def steps(plan):
        return {
            node: MINI_BATCHES.updates(decl.params, plan.batch.rows)
            for node, decl in plan.spec.nodes.items()
            if getattr(decl.params, "mini_batch_size", 0)
        }

    full = compiler.compile_file(ROOT / "graphs" / graph)
    tiny = compiler.compile_file(ROOT / "graphs" / graph, tiny_overrides(ROOT / "graphs" / graph))
    assert steps(tiny) == steps(full) and min(steps(full).values()) > 1


def test_a_user_update_with_its_own_mini_batch_param_is_shrunk(tmp_path):
    """The mini-batch param is the one the node's `MiniBatches` names (here `minibatch`, in
    tests/support/toy/custom_update.py), so the tiny run keeps its optimizer steps and passes the
    node's own check: 16 of ppo's 48 rows would exceed the tiny run's 8."""
    block = 'uses = "update.policy"\nmodel = "policy"\nmini_batch_size = 16'
    text = (ROOT / "graphs/ppo.toml").read_text()
    assert block in text
    toy = Path(__file__).resolve().parents[2] / "support" / "toy" / "custom_update.py"
    graph = tmp_path / "custom.toml"
    graph.write_text(text.replace(block, f'uses = "{toy}"\nmodel = "policy"\nminibatch = 16'))

    def steps(plan):
        decl = plan.spec.nodes["update_policy"]
        return decl.spec.mini_batches.updates(decl.params, plan.batch.rows)

    full = compiler.compile_file(graph)
    tiny = compiler.compile_file(graph, tiny_overrides(graph, tmp_path))
    assert tiny.spec.nodes["update_policy"].params.minibatch < 16 < full.batch.rows
    assert steps(tiny) == steps(full) == 3  # 48 rows in mini-batches of 16


def test_an_agent_graph_scripts_a_first_turn_calling_each_tool(tmp_path):
    """A tool of the user's own (a sibling of the graph) beside the calculator: the tiny
    overrides script the first turn, allow both calls in it, and budget the turn to fit."""
    from flowrl.agent.first_turn import first_turn_text
    from flowrl.agent.tools.toolbox import Toolbox

    (tmp_path / "units.py").write_text(UNIT_TOOL)
    graph = tmp_path / "g.toml"
    graph.write_text(TOOLS_GRAPH)
    out = tiny_overrides(graph)
    turn = first_turn_text(
        Toolbox(["calculator", "units.py:to_metres"], tmp_path).schemas, "hermes"
    )
    assert turn == (
        '<tool_call>\n{"name": "calc", "arguments": {"expression": "1"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "to_metres", "arguments": {"value": 1.0, "unit": "ft"}}\n'
        "</tool_call>"
    )
    assert "nodes.generate.script_first_turn=true" in out
    assert f"nodes.generate.max_turn_tokens={len(turn) + 1}" in out
    assert "nodes.generate.max_parallel_calls=2" in out


UNIT_TOOL = '''
from typing import Literal


def to_metres(value: float, unit: Literal["ft", "in"]) -> str:
    """Convert a length to metres.

    Args:
        value: the length
        unit: its unit
    """
    return str(value * {"ft": 0.3048, "in": 0.0254}[unit])
'''
TOOLS_GRAPH = (
    (ROOT / "graphs/grpo_tools.toml")
    .read_text()
    .replace('tools = ["calculator"]', 'tools = ["calculator", "units.py:to_metres"]')
    .replace('parser = "tag"', 'parser = "hermes"')
)


def test_a_tiny_agent_run_calls_every_tool_and_says_what_was_real(tmp_path):
    (tmp_path / "units.py").write_text(UNIT_TOOL)
    graph = tmp_path / "g.toml"
    graph.write_text(TOOLS_GRAPH)
    run = run_tiny(graph, tmp_path / "runs")
    steps = [m for m in run.metrics if m["step"] > 0]
    for tool in ("calc", "to_metres"):  # every request of every step called it, and got an answer
        assert all(m[f"generate/calls/{tool}"] == 1.0 for m in steps), steps
        assert all(m[f"generate/calls/{tool}/ok"] == 1.0 for m in steps), steps
    sample = json.loads((run.run_dir / "samples.jsonl").read_text().splitlines()[0])
    assert sample["conversation"][1] == {"role": "tool", "content": "1"}  # calc("1")
    assert sample["conversation"][2] == {"role": "tool", "content": "0.3048"}
    lines = run.summary.splitlines()
    assert lines[0] == "tiny run: what was real and what was stubbed"
    assert any(line.startswith("  stubbed  model weights: policy") for line in lines)
    assert "  stubbed  scorer of [nodes.reward]: by response length (varied.py)" in lines
    assert any(
        line.startswith("  real     tool to_metres of [nodes.generate]: 1.00 calls")
        for line in lines
    )


def test_the_summary_names_a_reward_model_and_a_kept_scorer(tmp_path):
    from flowrl.front.tiny_run import summary

    plan = tiny_plan(ROOT / "graphs/grpo.toml", tmp_path, scorer=None)
    assert "  real     scorer of [nodes.reward]: auto" in summary(plan.spec, []).splitlines()
    text = (ROOT / "graphs/grpo.toml").read_text()
    text = text.replace(
        '[nodes.reward]\nuses = "reward.rule"',
        '[models.rm]\nhead = "value"\n\n[nodes.reward]\nuses = "reward.model"\nmodel = "rm"',
    )
    (tmp_path / "g.toml").write_text(text)
    lines = summary(tiny_plan(tmp_path / "g.toml", tmp_path).spec, []).splitlines()
    assert "  stubbed  reward model of [nodes.reward]: rm, random weights" in lines


def test_no_script_for_a_parser_of_ones_own_or_a_tool_that_does_not_load(tmp_path):
    """A custom parser's format is unknown, and a missing tool is `flowrl check`'s to report:
    the tiny overrides leave such agent nodes unscripted rather than fail."""
    (tmp_path / "parse.py").write_text("def parse(text):\n    return []\n")
    for tools, parser in (('["calculator"]', '"parse.py:parse"'), ('["nope.py:f"]', '"hermes"')):
        text = TOOLS_GRAPH.replace(
            'tools = ["calculator", "units.py:to_metres"]', f"tools = {tools}"
        )
        graph = tmp_path / "g.toml"
        graph.write_text(text.replace('parser = "hermes"', f"parser = {parser}"))
        assert not [o for o in tiny_overrides(graph) if "script_first_turn" in o]


def test_the_verl_example_keeps_its_prompts_under_tiny(tmp_path, monkeypatch):
    """examples/verl_gsm8k templates its prompts with Qwen2.5's tool block: 1024 tokens of a
    real tokenizer, ~1360 characters, which the tiny tokenizer spends as ~1360 tokens. The
    tiny run leaves room for them: no row is dropped, the tool block is in every prompt."""
    from flowrl.data.loader import PromptDataset
    from flowrl.data.split import prompt_renderer, train_and_validation_rows
    from flowrl.models.tiny import tiny_tokenizer

    example = tmp_path / "examples" / "verl_gsm8k"
    shutil.copytree(ROOT / "examples" / "verl_gsm8k", example)
    shutil.copytree(ROOT / "graphs" / "chat_templates", tmp_path / "graphs" / "chat_templates")
    monkeypatch.syspath_prepend(str(example))
    import build_data

    monkeypatch.setattr("sys.argv", ["build_data.py", "--out", str(example)])
    build_data.main()
    graph = example / "graph.toml"
    spec = compiler.compile_file(graph, tiny_overrides(graph, tmp_path)).spec
    tokenizer = tiny_tokenizer()
    rows, _, _ = train_and_validation_rows(spec.data, spec.run.val_size, 0, spec.base_dir)
    render = prompt_renderer(spec, tokenizer)
    dataset = PromptDataset(rows, tokenizer, spec.data.max_prompt_len, render)
    assert dataset.filtered == 0 and len(dataset) == len(rows)
    assert "# Tools" in render(rows[0]) and len(render(rows[0])) > 1024


JUDGE = '''
class JudgeInteraction:
    """verl's BaseInteraction shape: never satisfied, so it answers every turn it is asked."""

    def __init__(self, config):
        self.name = config["name"]

    async def start_interaction(self, instance_id=None, **kwargs):
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        return False, "Try again, and show your work.", 0.0, {}


class PatientInteraction(JudgeInteraction):
    pass


def reply(messages, **kwargs):
    return False, "Again.", 0.0
'''
INTERACTIONS_YAML = """interaction:
  - name: judge
    class_name: judge.JudgeInteraction
  - class_name: judge.PatientInteraction
"""


def interaction_graph(folder, interaction_line: str, tools: str = "[]") -> Path:
    """grpo_tools.toml with `interaction_line` on its agent node and `tools` as its tools."""
    (folder / "judge.py").write_text(JUDGE)
    (folder / "interaction.yaml").write_text(INTERACTIONS_YAML)
    text = (ROOT / "graphs/grpo_tools.toml").read_text()
    text = text.replace('tools = ["calculator"]', f"tools = {tools}\n{interaction_line}")
    graph = folder / "g.toml"
    graph.write_text(text)
    return graph


def last(overrides: list[str], key: str) -> str:
    """The value the last override of `key` sets (a later override wins)."""
    return [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == key][-1]


def test_an_agent_with_an_interaction_gets_room_for_two_replies(tmp_path):
    """The random policy's turns are cut, so the tiny run lets the interaction answer cut
    turns, and sizes the turns and the budget for two replies: a sampled turn, a reply, a
    turn, a reply, and the turn verl's limit ends the request after."""
    from flowrl.agent.tiny_setup import REPLY_TOKENS, TURN_TOKENS

    out = tiny_overrides(interaction_graph(tmp_path, 'interaction = "judge.py:reply"'))
    node = "nodes.generate."
    assert last(out, node + "interact_on_cut") == "true"
    assert last(out, node + "max_assistant_turns") == "3"
    assert last(out, node + "max_turn_tokens") == str(TURN_TOKENS)
    assert last(out, node + "max_new_tokens") == str(3 * TURN_TOKENS + 2 * REPLY_TOKENS)
    # with a tool, its scripted round comes first: one more turn, the tool's answer budgeted
    graph = interaction_graph(tmp_path, 'interaction_config = "interaction.yaml"', '["calculator"]')
    out = tiny_overrides(graph)
    turn = int(last(out, node + "max_turn_tokens"))
    assert last(out, node + "script_first_turn") == "true"
    assert last(out, node + "max_assistant_turns") == "4"
    answer = 16 + 32  # the graph's max_obs_tokens and a tool message's template
    assert last(out, node + "max_new_tokens") == str(4 * turn + answer + 2 * REPLY_TOKENS)


def test_the_summary_lists_interactions_from_every_source(tmp_path):
    from flowrl.front.tiny_run import summary

    def lines(interaction_line, metrics):
        plan = tiny_plan(interaction_graph(tmp_path, interaction_line), tmp_path)
        return [line for line in summary(plan.spec, metrics).splitlines() if "interaction" in line]

    metrics = [{"step": 1, "generate/interactions/judge": 2.0}, {"step": 2}]
    assert lines('interaction_config = "interaction.yaml"', metrics) == [
        "  real     interaction judge of [nodes.generate]: 2.00 replies per request, to the "
        "random policy's cut turns (interaction.yaml: judge.JudgeInteraction)",
        "  NOT RUN  interaction patient of [nodes.generate]: never answered "
        "(interaction.yaml: judge.PatientInteraction)",
    ]
    (line,) = lines('interaction = "judge.py:JudgeInteraction"', metrics)
    assert (
        line.startswith("  real     interaction judge of") and "(judge.py:JudgeInteraction)" in line
    )
    metrics = [{"step": 1, "generate/interactions/reply": 1.5}]
    (line,) = lines('interaction = "judge.py:reply"', metrics)
    assert "interaction reply of [nodes.generate]: 1.50 replies per request" in line


def test_a_graphs_smaller_validation_stays_in_the_tiny_run(tmp_path):
    """--tiny validates on 4 prompts, fewer when the graph asks (0: off): a data source of a
    few rows (a verifiers taskset) must not be emptied by the tiny run's hold-out."""
    graph = ROOT / "graphs/grpo.toml"
    for asked, expected in ((0, 0), (2, 2), (32, 4)):
        text = graph.read_text().replace("val_size = ", f"val_size = {asked}  # was ", 1)
        (tmp_path / "g.toml").write_text(text)
        spec = compiler.compile_file(tmp_path / "g.toml", tiny_overrides(tmp_path / "g.toml")).spec
        assert spec.run.val_size == expected, asked
