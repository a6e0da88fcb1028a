"""The node contract's hooks: a node owns its checks, its optimizer-step count and its optional
reads, so a user's node in its own file, with params named as it likes, gets what a built-in
one gets; one node call checks the writes of every node."""

from functools import partial
from pathlib import Path

import attrs
import pytest
import torch

from flowrl import testing
from flowrl.nodespec import NodeSpec, RolloutParams
from flowrl.protocol import DataProto
from flowrl.runtime.node_call import NodeCall, NodeFailure, call_node
from flowrl.runtime.setup import pool_setups

TOY = Path(__file__).resolve().parents[2] / "support" / "toy"
GOOD = (TOY / "good.toml.template").read_text()  # a graph of the toy nodes; {toy} is TOY
compile_text = partial(testing.compile_text, toy=TOY)
problems = partial(testing.graph_problems, toy=TOY)


CUSTOM = GOOD.replace('uses = "{toy}/train.py"', 'uses = "{toy}/custom_update.py"')


def test_user_node_with_other_param_names_gets_the_batch_check(tmp_path):
    found = problems(tmp_path, CUSTOM, ["nodes.update.minibatch=64"])
    # 2 prompts x 4 samples = 8 rows reach the update
    assert [(p.where, p.message) for p in found] == [
        ("[nodes.update]", "minibatch = 64 exceeds the 8 rows of a step (2 prompts x 4 samples)")
    ]
    assert "minibatch <= 8" in found[0].fix


def test_user_node_gets_the_built_in_schedule_arithmetic(tmp_path):
    custom = compile_text(tmp_path, CUSTOM, ["nodes.update.passes=2", "nodes.update.minibatch=3"])
    builtin_like = compile_text(
        tmp_path, GOOD, ["nodes.update.epochs=2", "nodes.update.mini_batch_size=3"]
    )
    # 8 rows in mini-batches of 3 -> 3 optimizer steps per pass, 2 passes
    assert custom.pools["main"].updates_per_step == {"policy": 6}
    assert builtin_like.pools["main"].updates_per_step == {"policy": 6}
    # the learning-rate schedule spans every optimizer step of the run's 3 training steps
    assert pool_setups(custom)["main"].optimizer_steps == {"policy": 18}
    assert pool_setups(builtin_like)["main"].optimizer_steps == {"policy": 18}


def test_optional_reads_follow_the_params(tmp_path):
    with_kl = compile_text(tmp_path, GOOD)  # the toy update reads ref_logprobs when kl_coef > 0
    assert "ref_logprob" in with_kl.spec.nodes
    without = compile_text(tmp_path, GOOD, ["nodes.update.kl_coef=0"])
    assert "ref_logprob" not in without.spec.nodes  # nothing reads its output: skipped


def test_rollout_params_must_share_the_base():
    @attrs.frozen
    class Plain:
        n: int = 1

    with pytest.raises(ValueError, match="RolloutParams"):
        NodeSpec(("prompts",), ("responses",), Plain, worker=object, mode="rollout")

    @attrs.frozen
    class Shared(RolloutParams):
        pass

    NodeSpec(("prompts",), ("responses",), Shared, worker=object, mode="rollout", rows="repeat")


@attrs.frozen
class NoParams:
    pass


def forgetful(batch, params):
    return {"advantages": batch["scores"]}  # declares bonus too, forgets it


FORGETFUL = NodeSpec(("scores",), ("advantages", "bonus"), NoParams, fn=forgetful)


def test_node_call_names_a_node_that_forgets_a_declared_output():
    batch = DataProto.from_dict({"scores": torch.ones(3)})
    with pytest.raises(NodeFailure, match=r"node shaping returned keys \['advantages'\].*bonus"):
        call = NodeCall("shaping", FORGETFUL, {}, NoParams(), "here")
        call_node(call, batch, lambda b: forgetful(b, None))


def test_node_call_renames_in_and_out():
    batch = DataProto.from_dict({"my_scores": torch.tensor([1.0, 2.0])})
    spec = NodeSpec(("scores",), ("advantages",), NoParams, fn=forgetful)
    rename = {"scores": "my_scores", "advantages": "adv"}
    out = call_node(NodeCall("a", spec, rename, NoParams(), ""), batch, lambda b: forgetful(b, 0))
    out = out.writes
    assert out.keys() == ["adv"]
    torch.testing.assert_close(out["adv"], torch.tensor([1.0, 2.0]))


# -- a user's rollout node gets partial rollouts and its own prompts (toy/sampler.py) -------
SAMPLER = GOOD.replace('uses = "{toy}/gen.py"', 'uses = "{toy}/sampler.py"')
GEN_POOL = '\n[pools.gen]\nworkers = 1\noffload = "never"\n'
PARTIAL = [
    'models.policy.rollout_pool="gen"',
    'models.policy.pool="main"',
    'models.ref.pool="main"',
]
PARTIAL += ["run.staleness=1", "run.partial_rollout=2"]


def test_user_rollout_node_with_other_param_names_gets_partial_rollouts(tmp_path):
    plan = compile_text(
        tmp_path, SAMPLER + GEN_POOL, [*PARTIAL, "nodes.generate.keep_logprobs=true"]
    )
    p = plan.pipeline
    # its `keep_logprobs` (generate's `return_logprobs`) is read through its optional writes
    assert (p.partial, p.generate_node, p.samples, p.logprobs) == (2, "generate", 4, True)
    assert not compile_text(tmp_path, SAMPLER + GEN_POOL, PARTIAL).pipeline.logprobs
    # a rollout node without the hook (toy/gen.py) is refused, with the hook named
    found = problems(tmp_path, GOOD + GEN_POOL, PARTIAL)
    assert [p.where for p in found] == ["[run]"]
    assert "declares how (NodeSpec.continues" in found[0].message
    assert '[nodes.generate] (uses = "' in found[0].message
    assert found[0].fix.startswith("set run.partial_rollout = 0, or give a node file")


def test_a_continuation_must_rebuild_every_write():
    from flowrl.hooks import Continuation

    keep = Continuation(("answer",), lambda rows, tokenizer: {})
    base = {"params": RolloutParams, "worker": object, "mode": "rollout", "rows": "repeat"}
    NodeSpec(("prompts",), ("responses", "response_mask", "answer"), continues=keep, **base)
    with pytest.raises(ValueError, match="writes extra, which neither the rounds"):
        writes = ("responses", "response_mask", "answer", "extra")
        NodeSpec(("prompts",), writes, continues=keep, **base)
    with pytest.raises(ValueError, match='continues is for mode="rollout"'):
        NodeSpec(("responses",), ("scores",), NoParams, fn=forgetful, continues=keep)


def test_user_rollout_node_renders_the_prompts_it_samples_from(tmp_path):
    """The loader asks the node's `prompt` hook (its `banner` param), as it asks the agent
    node's for its tool schemas; without a hook, the tokenizer's chat template."""
    from flowrl.data.split import prompt_renderer, prompt_sets

    tokenizer = testing.tiny_tokenizer()
    spec = compile_text(tmp_path, SAMPLER, ['nodes.generate.banner="Solve: "']).spec
    row = {"prompt": [{"role": "user", "content": "What is 2 + 3?"}]}
    assert prompt_renderer(spec, tokenizer)(row) == "Solve: What is 2 + 3?"
    train, _, _ = prompt_sets(spec, tokenizer)
    first = train.collate([0])
    text = tokenizer.decode(first["prompts"][0][first["prompt_mask"][0].bool()])
    assert text.startswith("Solve: What is ")
    plain = compile_text(tmp_path, GOOD).spec
    assert prompt_renderer(plain, tokenizer) is None


LONG_SCORE = """
import attrs
from flowrl.nodespec import NodeSpec


@attrs.frozen
class Params:
    max_new_tokens: int = 100_000  # a scorer's own setting of that name, not a response cap


def run(batch, params):
    return {"scores": batch["responses"].float().sum(-1)}


SPEC = NodeSpec(reads=("responses",), writes=("scores",), params=Params, fn=run)
"""


def test_the_context_guard_reads_the_response_cap_of_rollout_nodes_only(tmp_path, capsys):
    """A prompt plus the longest response must fit the policy's context: the response caps
    are the rollout nodes' (RolloutParams.max_new_tokens, the user's sampler's here), never
    another node's param that happens to share the name."""
    from flowrl.models.tiny import CONTEXT
    from flowrl.runtime import guards

    (tmp_path / "long_score.py").write_text(LONG_SCORE)
    text = SAMPLER.replace('uses = "{toy}/score.py"', 'uses = "long_score.py"')
    spec = compile_text(tmp_path, text, [f"data.max_prompt_len={CONTEXT - 4}"]).spec
    guards.check_models(spec, "policy", testing.tiny_tokenizer())
    assert "plus max_new_tokens = 8 exceeds the context" in capsys.readouterr().err
    spec = compile_text(tmp_path, text, [f"data.max_prompt_len={CONTEXT - 8}"]).spec
    guards.check_models(spec, "policy", testing.tiny_tokenizer())
    assert "exceeds the context" not in capsys.readouterr().err


def test_a_stateful_node_whose_run_takes_two_arguments_is_refused_with_the_fix():
    def run(batch, params):
        return {"advantages": batch["scores"]}

    with pytest.raises(
        ValueError,
        match=r"calls fn\(batch, params, state\), but \S*run \(.*:\d+\) is run\(batch, params\)",
    ):
        NodeSpec(("scores",), ("advantages",), NoParams, fn=run, stateful=True)
    with pytest.raises(ValueError, match="give it a third parameter, state"):
        NodeSpec(("scores",), ("advantages",), NoParams, fn=run, stateful=True)
    with pytest.raises(ValueError, match="or set stateful=True to get a state dict"):
        NodeSpec(("scores",), ("advantages",), NoParams, fn=lambda b, p, s: {})
    NodeSpec(("scores",), ("advantages",), NoParams, fn=lambda b, p, s=None: {}, stateful=True)


def test_a_refill_that_names_no_param_is_refused_with_a_did_you_mean():
    from flowrl.hooks import Refill

    @attrs.frozen
    class Counts:
        min_groups: int = 2
        max_rounds: int = 3

    def keep(batch, params):
        return {"keep": torch.ones(len(batch["scores"]), dtype=torch.bool)}

    with pytest.raises(ValueError, match=r'Refill\(groups="min_group"\).*"min_groups"\?'):
        NodeSpec(("scores",), (), Counts, fn=keep, rows="filter", refill=Refill("min_group"))


def test_a_check_hook_that_raises_is_a_finding_naming_it():
    from flowrl.hooks import CheckContext

    def check(params, context):
        return [context.rows_per_prompt]  # no such field

    spec = NodeSpec(("scores",), ("advantages",), NoParams, fn=forgetful, check=check)
    (finding,) = spec.findings(NoParams(), CheckContext("a", 8, 4, 2, 1, "."))
    assert finding.message.startswith("its check hook ")
    assert "check (" in finding.message and "raised AttributeError" in finding.message
    assert finding.fix.startswith("fix that function")


@pytest.mark.parametrize(
    ("state", "said"),
    [
        ({"seen": {1, 2}}, "state['seen'] = {1, 2} (a set)"),
        ({"coef": torch.tensor(0.5)}, "state['coef'] = tensor(0.5000) (a Tensor)"),
        ({"by_uid": {3: 1.0}}, "the key 3 (int) in state['by_uid']"),
        ({"pairs": [[1, 2], (3, 4)]}, "state['pairs'][1] = (3, 4) (a tuple)"),
    ],
)
def test_node_state_a_checkpoint_cannot_store_stops_the_first_call(state, said):
    from flowrl.runtime.node_call import ControllerFn

    def keep(batch, params, kept):
        kept.update(state)
        return {"advantages": batch["scores"]}

    spec = NodeSpec(("scores",), ("advantages",), NoParams, fn=keep, stateful=True)
    call = NodeCall("shaping", spec, {}, NoParams(), "on the controller")
    batch = DataProto.from_dict({"scores": torch.ones(2)})
    with pytest.raises(NodeFailure, match="node shaping failed on the controller") as raised:
        call_node(call, batch, ControllerFn(spec, NoParams(), {}))
    assert f"its state holds {said}, which a checkpoint (JSON) cannot store" in str(raised.value)


def test_node_state_of_json_values_passes():
    from flowrl.runtime.node_call import ControllerFn

    def keep(batch, params, kept):
        kept.update({"coef": 0.1, "seen": [1, 2], "by_uid": {"3": [1.0, None]}, "on": True})
        return {"advantages": batch["scores"]}

    spec = NodeSpec(("scores",), ("advantages",), NoParams, fn=keep, stateful=True)
    call = NodeCall("shaping", spec, {}, NoParams(), "on the controller")
    state = {}
    call_node(call, DataProto.from_dict({"scores": torch.ones(2)}), ControllerFn(spec, None, state))
    assert state["by_uid"] == {"3": [1.0, None]}
