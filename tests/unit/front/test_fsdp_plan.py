"""What `strategy = "fsdp"` compiles to: per-rank memory, the rollout copy's transitions, the
renamed placement setting. No model is loaded."""

from pathlib import Path

import pytest

from flowrl.cli import load_plan, main
from flowrl.errors import GraphErrors
from flowrl.front import memory, schema

GRAPHS = Path(__file__).resolve().parents[3] / "graphs"
GB = 1024**3


def plan_of(graph: str, **overrides):
    return load_plan(str(GRAPHS / graph), [f"{k}={v}" for k, v in overrides.items()])


def test_seven_billion_on_eight_ranks_holds_an_eighth_of_each_part():
    seven_b = 7_000_000_000
    plan = plan_of(
        "grpo.toml",
        **{
            "models.policy.n_params": seven_b,
            "models.ref.n_params": seven_b,
            "models.policy.param_dtype": '"bfloat16"',
            "pools.main.workers": 8,
            "pools.main.device": '"cuda"',
            "pools.main.strategy": '"fsdp"',
        },
    )
    main_pool = plan.pools["main"]
    policy = main_pool.memory_bytes["policy"]
    # fp32 weights 28 GB, grads 28 GB, AdamW's two fp32 moments 56 GB: an eighth each per rank
    assert policy["weights"] == seven_b * 4 / 8
    assert policy["grads"] == seven_b * 4 / 8
    assert policy["optimizer"] == seven_b * 8 / 8
    # generating needs the whole weights, in the bf16 the passes compute in
    assert policy["rollout_weights"] == seven_b * 2
    assert main_pool.memory_bytes["ref"] == {"weights": seven_b * 4 / 8}
    assert main_pool.sharded == ("policy", "ref")
    text = plan.text()
    assert "main: 8 worker(s) x cuda, fsdp, offload=" in text and "sizes per rank" in text
    assert "trainable, fsdp over 8 ranks; weights 3.26 GB, grads 3.26 GB, optimizer 6.52 GB" in text


def test_ddp_keeps_whole_parts_and_a_rank_caches_only_its_rows():
    ddp = plan_of("grpo.toml", **{"pools.main.workers": 2})
    one = plan_of("grpo.toml")
    two, single = ddp.pools["main"].memory_bytes["policy"], one.pools["main"].memory_bytes["policy"]
    assert two["weights"] == single["weights"] == 134_515_008 * 4
    assert "rollout_weights" not in two
    # 32 rows over 2 ranks: each rank's KV cache holds 16 rows
    assert two["kv_cache"] * 2 == single["kv_cache"]
    assert ddp.pools["main"].strategy == "ddp" and ddp.pools["main"].sharded == ()


def test_sharded_model_generates_from_its_rollout_copy():
    plan = plan_of("grpo.toml", **{"pools.main.workers": 2, "pools.main.strategy": '"fsdp"'})
    moves = [(i.kind, i.model, i.parts) for i in plan.items if i.kind in ("reload", "offload")]
    # generate needs the unsharded copy and the cache, not the shards; the update the shards
    assert moves[0] == ("reload", "policy", ("rollout_weights", "kv_cache"))
    assert moves[1] == ("offload", "policy", ("rollout_weights", "kv_cache"))
    assert ("reload", "policy", ("weights", "grads", "optimizer")) in moves


def test_a_pool_that_only_generates_is_not_sharded():
    plan = plan_of(
        "grpo_disaggregated.toml",
        **{"pools.gen.strategy": '"fsdp"', "pools.train.strategy": '"fsdp"'},
    )
    assert plan.pools["gen"].sharded == ()
    assert plan.pools["train"].sharded == ("policy", "ref")
    assert "rollout_weights" not in plan.pools["gen"].memory_bytes["policy"]


def test_param_dtype_off_cuda_is_a_warning():
    plan = plan_of("grpo.toml", **{"models.policy.param_dtype": '"bfloat16"'})
    assert any("param_dtype = 'bfloat16' applies on cuda" in w for w in plan.warnings)
    config = plan.pools["main"].configs["policy"]
    assert memory.compute_dtype(config, "cpu", sharded=True) == "float32"
    assert memory.compute_dtype(config, "cuda", sharded=True) == "bfloat16"


def test_strategy_is_a_training_strategy_and_placement_is_apart():
    with pytest.raises(GraphErrors, match='must be one of "ddp", "fsdp"'):
        plan_of("grpo.toml", **{"pools.main.strategy": '"zero3"'})
    assert schema.PoolConfig(placement="SPREAD").strategy == "ddp"


def test_flowrl_plan_prints_per_rank_memory_under_fsdp(capsys):
    graph = str(GRAPHS / "grpo.toml")
    assert main(["plan", graph, "pools.main.workers=2", 'pools.main.strategy="fsdp"']) == 0
    out = capsys.readouterr().out
    # SmolLM2-135M: 134.5 M parameters, fp32 0.50 GB, halved per rank
    assert "main: 2 worker(s) x cpu, fsdp" in out
    assert "trainable, fsdp over 2 ranks; weights 0.25 GB, grads 0.25 GB, optimizer 0.50 GB" in out
    assert "reload     main       policy: rollout_weights, kv_cache" in out


def test_scaling_doc_table_is_the_estimate():
    doc = (GRAPHS.parent / "docs" / "scaling.md").read_text()
    assert memory.scaling_table() in doc  # regenerate: python -c "...print(scaling_table())"
    # a 7B model on 8 ranks: 3.26 + 3.26 + 6.52 GB of shards, 13.04 GB of bf16 rollout copy and
    # 3.26 GB of reference shards resident; the peak is the update's shards (or the copy)
    resident, peak = memory.grpo_per_rank(7e9, 8)
    assert resident == 7e9 * (4 + 4 + 8 + 4) / 8 + 7e9 * 2 and peak == 7e9 * 2
    assert memory.grpo_per_rank(7e9, 8, "ddp") == (7e9 * 20, 7e9 * 16)


def test_lora_on_a_sharded_pool_is_an_error():
    graph = str(GRAPHS.parent / "examples" / "grpo_lora.toml")
    load_plan(graph, [])  # fine under ddp
    with pytest.raises(GraphErrors, match='whose strategy is "fsdp", is not supported'):
        load_plan(graph, ['pools.main.strategy="fsdp"'])
