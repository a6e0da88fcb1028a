"""The front end's node hooks, `correction` and `tiny`: a user's node in its own file, with
params named as it likes, gets the off-policy correction check of `run.staleness` and its own
overrides in a tiny run, as the built-in update.policy and agent nodes do. Nothing here reads
a param by its built-in name."""

from pathlib import Path

import attrs
import pytest

from flowrl.front.compiler import compile_file
from flowrl.front.tiny_run import summary, tiny_overrides
from flowrl.hooks import TruncatedIS
from flowrl.nodespec import NodeSpec
from flowrl.testing import tiny_plan

GRAPHS = Path(__file__).resolve().parents[3] / "graphs"
DISAGGREGATED = (GRAPHS / "grpo_disaggregated.toml").read_text()
BUILTIN_UPDATE = 'uses = "update.policy"\nmodel = "policy"\nkl_loss_coef = 0.001\non_policy = true'

# A user's policy update: its IS cap is `is_limit`, and `reuse_own` plays on_policy's part.
USER_UPDATE = """
import attrs

from flowrl.hooks import TruncatedIS
from flowrl.nodespec import NodeSpec


@attrs.frozen
class Params:
    is_limit: float = 0.0  # truncated importance-sampling cap; 0 = off
    reuse_own: bool = True  # old log-probs = this forward's (old_logprobs not read)


class Worker:
    def __init__(self, engine, params):
        self.params = params


SPEC = NodeSpec(
    reads=("responses", "response_mask", "advantages"),
    writes=(),
    params=Params,
    worker=Worker,
    mode="train",
    head="lm",
    optional_reads={
        "old_logprobs": lambda p: not p.reuse_own,
        "rollout_logprobs": lambda p: p.is_limit > 0,
    },
    correction={correction},
)
"""
WORDS = """lambda params, reads, node: (
        f"clipped ratio in {node}" if "rollout_logprobs" in reads and params.is_limit else ""
    )"""


def user_graph(tmp_path, correction='TruncatedIS(cap="is_limit")') -> Path:
    (tmp_path / "my_update.py").write_text(USER_UPDATE.replace("{correction}", correction))
    text = DISAGGREGATED.replace(BUILTIN_UPDATE, 'uses = "my_update.py"\nmodel = "policy"')
    assert text != DISAGGREGATED
    graph = tmp_path / "g.toml"
    graph.write_text(text)
    return graph


def staleness_warnings(plan) -> list[str]:
    return [w for w in plan.warnings if "staleness" in w]


def test_a_user_update_with_its_own_cap_name_passes_the_correction_check(tmp_path):
    graph = user_graph(tmp_path)
    on = [
        "run.staleness=1",
        "nodes.generate.return_logprobs=true",
        "nodes.update_policy.is_limit=2",
    ]
    plan = compile_file(graph, on)
    assert plan.pipeline.correction == (
        "truncated importance sampling in update_policy (is_limit = 2, rollout_logprobs)"
    )
    assert not staleness_warnings(plan)
    assert "off-policy correction: truncated importance sampling in update_policy" in plan.text()


def test_the_warning_names_the_users_own_params(tmp_path):
    plan = compile_file(user_graph(tmp_path), ["run.staleness=1"])
    assert plan.pipeline.correction == ""
    (warning,) = staleness_warnings(plan)
    # the cap from the TruncatedIS hook; the switches from the nodes' optional reads / writes
    assert warning.endswith(
        "no off-policy correction: set nodes.update_policy.is_limit (e.g. 2.0) with "
        "nodes.generate.return_logprobs = true (truncated importance sampling), or recompute "
        "old_logprobs with a logprob node on policy and nodes.update_policy.reuse_own = false"
    )


def test_a_plain_function_hook_says_its_own_words(tmp_path):
    graph = user_graph(tmp_path, correction=WORDS)
    on = [
        "run.staleness=1",
        "nodes.generate.return_logprobs=true",
        "nodes.update_policy.is_limit=2",
    ]
    assert compile_file(graph, on).pipeline.correction == "clipped ratio in update_policy"
    (warning,) = staleness_warnings(compile_file(graph, ["run.staleness=1"]))
    # no TruncatedIS: the warning offers only what the declarations show, recomputed old_logprobs
    assert warning.endswith(
        "recompute old_logprobs with a logprob node on policy and "
        "nodes.update_policy.reuse_own = false"
    )
    assert "is_limit" not in warning


def test_without_a_hook_an_update_gets_no_correction_and_a_fix_that_says_how(tmp_path):
    graph = user_graph(tmp_path, correction="None")
    on = [
        "run.staleness=1",
        "nodes.generate.return_logprobs=true",
        "nodes.update_policy.is_limit=2",
    ]
    plan = compile_file(graph, on)
    assert plan.pipeline.correction == ""  # reads rollout_logprobs, but declares no correction
    (warning,) = staleness_warnings(plan)
    assert "tis_cap" not in warning and "on_policy" not in warning


def test_the_builtin_update_answers_through_its_hook():
    from flowrl.nodes.update.policy import SPEC, Params

    assert SPEC.correction == TruncatedIS(cap="tis_cap")
    reads = ("advantages", "rollout_logprobs")
    assert SPEC.correction(Params(tis_cap=2.0), reads, "u") == (
        "truncated importance sampling in u (tis_cap = 2, rollout_logprobs)"
    )
    assert SPEC.correction(Params(tis_cap=2.0), ("advantages",), "u") == ""
    assert SPEC.correction(Params(), reads, "u") == ""


@attrs.frozen
class Cap:
    cap: float = 0.0


def test_the_correction_hook_is_checked_where_it_is_declared():
    with pytest.raises(ValueError, match="names no param"):
        NodeSpec((), (), Cap, worker=object, mode="train", correction=TruncatedIS("tis_cap"))
    with pytest.raises(ValueError, match='correction is for mode="train"'):
        NodeSpec((), (), Cap, fn=print, correction=TruncatedIS("cap"))


# A user's agent-like rollout node: its tools are `helpers`, its scripted turn `call_first`.
USER_AGENT = """
import attrs

from flowrl.hooks import TinyNode
from flowrl.nodespec import NodeSpec, RolloutParams


@attrs.frozen
class Params(RolloutParams):
    helpers: tuple[str, ...] = ("lookup", "sum")
    call_first: bool = False  # the first turn calls every helper
    turn_budget: int = 64
    partner: str = "partner.py:reply"


class Worker:
    def __init__(self, engine, params):
        self.params = params


def tiny(params, base_dir):
    return TinyNode(
        {"call_first": True, "turn_budget": 7 * len(params.helpers)},
        tools=params.helpers,
        scripted=params.call_first,
        real={"partner": params.partner},
    )


SPEC = NodeSpec(
    reads=("prompts", "prompt_mask"),
    writes=("responses", "response_mask", "response_attention"),
    params=Params,
    worker=Worker,
    mode="rollout",
    head="lm",
    rows="repeat",
    tiny=tiny,
)
"""
# A user's reward model node, which says what its model is in a tiny run.
USER_RM = """
import attrs

from flowrl.hooks import TinyNode
from flowrl.nodespec import NodeSpec


@attrs.frozen
class Params:
    pass


class Worker:
    def __init__(self, engine, params):
        self.params = params


SPEC = NodeSpec(
    reads=("prompts", "prompt_mask", "responses", "response_mask"),
    writes=("scores",),
    params=Params,
    worker=Worker,
    mode="inference",
    head="value",
    tiny=lambda params, base_dir: TinyNode(model_role="preference model"),
)
"""


def user_nodes_graph(tmp_path) -> Path:
    (tmp_path / "my_agent.py").write_text(USER_AGENT)
    (tmp_path / "my_rm.py").write_text(USER_RM)
    text = (GRAPHS / "grpo.toml").read_text()
    swapped = text.replace('uses = "generate"', 'uses = "my_agent.py"').replace(
        '[nodes.reward]\nuses = "reward.rule"',
        '[models.rm]\nhead = "value"\n\n[nodes.reward]\nuses = "my_rm.py"\nmodel = "rm"',
    )
    assert swapped.count("my_") == 2
    graph = tmp_path / "g.toml"
    graph.write_text(swapped)
    return graph


def test_a_user_agent_like_node_gets_its_own_tiny_overrides(tmp_path):
    graph = user_nodes_graph(tmp_path)
    overrides = tiny_overrides(graph)
    ours = ["nodes.generate.call_first=true", "nodes.generate.turn_budget=14"]
    assert set(ours) <= set(overrides)
    # after the rollout node's generic response cap, so a hook may set its own budget
    assert overrides.index(ours[0]) > overrides.index("nodes.generate.max_new_tokens=6")
    params = tiny_plan(graph, tmp_path).spec.nodes["generate"].params
    assert (params.call_first, params.turn_budget) == (True, 14)


def test_the_tiny_summary_reports_what_the_hooks_say(tmp_path):
    spec = tiny_plan(user_nodes_graph(tmp_path), tmp_path).spec
    metrics = [{"step": 1, "generate/calls/lookup": 1.0, "generate/calls/lookup/ok": 0.5}]
    lines = summary(spec, metrics).splitlines()
    assert (
        "  real     tool lookup of [nodes.generate]: 1.00 calls per request, 0.50 answered "
        "(first turn scripted, placeholder arguments)"
    ) in lines
    assert (
        "  NOT RUN  tool sum of [nodes.generate]: never called "
        "(first turn scripted, placeholder arguments)"
    ) in lines
    assert "  real     partner of [nodes.generate]: partner.py:reply" in lines
    assert "  stubbed  preference model of [nodes.reward]: rm, random weights" in lines
