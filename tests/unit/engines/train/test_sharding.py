"""The fsdp train engine on one rank, in this process (a 1-rank gloo group): it computes what
the plain engine computes. Two ranks: tests/integration/test_fsdp.py."""

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from flowrl.cli import load_plan
from flowrl.engines import TrainEngine
from flowrl.engines.train.forward import decoder_layers
from flowrl.nodes.update import policy
from flowrl.runtime.local_executor import LocalExecutor
from flowrl.runtime.node_call import NodeFailure
from flowrl.testing import tiny_model, tiny_tokenizer, update_batch

torch.set_num_threads(1)


def batch(seed=0):
    return update_batch(b=6, seed=seed)


@pytest.fixture(scope="module")
def group():
    """A process group of this process alone, as the pool worker makes for fsdp on 1 rank."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.group.WORLD


def engine(model, strategy="ddp", group=None, **kwargs):
    return TrainEngine(
        copy.deepcopy(model), tiny_tokenizer(), lr=1e-2, strategy=strategy, group=group, **kwargs
    )


def whole(engine) -> dict:
    return engine.sharding.full_state(engine.module, 0, everywhere=True)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_fsdp_on_one_rank_updates_like_ddp(group, checkpointing):
    model = tiny_model(seed=0)
    plain = engine(model)
    sharded = engine(model, "fsdp", group, micro_tokens=16, activation_checkpointing=checkpointing)
    assert all(isinstance(p, DTensor) for p in sharded.module.parameters())
    params = policy.Params(kl_loss_coef=0.0)
    _, expected = policy.PolicyUpdateWorker(plain, params)(batch())
    _, got = policy.PolicyUpdateWorker(sharded, params)(batch())  # several micro-batches
    for key in ("pg_loss", "grad_norm", "entropy"):
        assert got[key] == pytest.approx(expected[key], rel=1e-5), key
    after = whole(sharded)
    for name, value in plain.module.state_dict().items():
        # AdamW's first step moves each weight by about lr = 1e-2 (m / sqrt(v) ~ sign of the
        # gradient): summing micro-batches in another order moves that by far less than 1e-5
        torch.testing.assert_close(after[name], value, rtol=0, atol=1e-5)
    assert not torch.equal(after["model.norm.weight"], model.state_dict()["model.norm.weight"])


def test_fsdp_inference_gives_back_the_gathered_root(group):
    sharded = engine(tiny_model(seed=0), "fsdp", group, trainable=False)
    rows = batch()
    expected = engine(tiny_model(seed=0), trainable=False).infer(rows)["logprobs"]
    torch.testing.assert_close(sharded.infer(rows)["logprobs"], expected)
    # the embeddings (in the root's group) are shards again, not the gathered whole
    assert isinstance(sharded.module.model.embed_tokens.weight, DTensor)
    critic = tiny_model(head="value", seed=1)
    torch.nn.init.normal_(critic.value_head.weight)
    expected = engine(critic, trainable=False).infer(rows)["values"]
    torch.testing.assert_close(engine(critic, "fsdp", group).infer(rows)["values"], expected)


def test_fsdp_engine_feeds_a_rollout_copy_and_moves_its_shards(group):
    model = tiny_model(seed=0)
    sharded = engine(model, "fsdp", group)
    policy.PolicyUpdateWorker(sharded, policy.Params())(batch())
    copy_for_rollout = tiny_model(seed=5)  # other weights, as a stale copy would have
    sharded.copy_weights_to(copy_for_rollout)
    trained = whole(sharded)
    for name, value in copy_for_rollout.state_dict().items():
        assert torch.equal(value, trained[name]), name
    sharded.offload(("weights", "grads", "optimizer"))
    assert sharded.resident == set()
    sharded.reload(("weights", "grads", "optimizer"))
    assert all(isinstance(p, DTensor) for p in sharded.module.parameters())
    for name, value in whole(sharded).items():
        assert torch.equal(value, trained[name]), name


def test_activation_checkpointing_recomputes_layers_for_the_same_gradients():
    model, rows = tiny_model(seed=0), batch()
    grads = []
    for checkpointing in (False, True):
        e = engine(model, activation_checkpointing=checkpointing)
        calls = []
        for layer in decoder_layers(e.module):
            layer.self_attn.register_forward_pre_hook(lambda *_, calls=calls: calls.append(1))
        out = e.forward(rows, grad=True)["logprobs"]
        out.sum().backward()
        grads.append({n: p.grad.clone() for n, p in e.module.named_parameters()})
        # 2 layers: one attention call each, and one more each when recomputed in backward
        assert len(calls) == (4 if checkpointing else 2)
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad)


def test_local_executor_refuses_fsdp_over_several_ranks():
    graph = str(Path(__file__).resolve().parents[4] / "graphs" / "grpo.toml")
    overrides = ['models.policy.path="tiny"', 'models.ref.path="tiny"', "pools.main.workers=2"]
    plan = load_plan(graph, [*overrides, 'pools.main.strategy="fsdp"'])
    with pytest.raises(NodeFailure, match="--backend ray"):
        LocalExecutor(plan)


def test_passes_makes_up_to_the_busiest_ranks_count(group, monkeypatch):
    """engine.passes: under fsdp a rank with fewer chunks than the busiest rank runs padding
    passes after its own (every pass is a collective); under ddp the chunks come back as given."""
    rows = batch()
    chunks = [rows.index(slice(0, 3)), rows.index(slice(3, 6))]
    assert engine(tiny_model(), trainable=False).passes(chunks) is chunks
    sharded = engine(tiny_model(seed=0), "fsdp", group, trainable=False)
    # as if another rank of the pool had 5 chunks: the all-reduce gives the most over ranks
    monkeypatch.setattr(sharded, "_all_reduce", lambda value, op: 5.0)
    seen = [len(sharded.forward(c, grad=False)["logprobs"]) for c in sharded.passes(chunks)]
    assert seen == [3, 3]  # the caller sees its own chunks only
    assert sharded.forwards == 5  # and 3 padding passes ran after them
