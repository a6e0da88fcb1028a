"""What a pool rank builds itself from: `PoolSetup`, plain data made from the plan alone on the
controller and sent to every rank of the pool (pickled for Ray), so a rank needs neither the
graph file nor the compiler."""

import attrs


@attrs.frozen
class NodeSetup:
    """One node a pool runs, as plain data: the rank resolves `uses` and builds its worker."""

    id: str
    uses: str
    params: dict  # the node's params as a dict (attrs.asdict)
    model: str
    rename: dict  # the node's declared key -> graph key


@attrs.frozen
class PoolSetup:
    """What a rank needs to build itself: plain data, picklable for Ray."""

    pool: str
    device: str
    threads: int
    seed: int
    base_dir: str
    models: dict  # name -> schema.ModelConfig
    optimizer_steps: dict  # trainable model name -> optimizer steps in the whole run
    rollout_models: tuple  # models used in rollout mode (get a rollout engine)
    nodes: tuple  # NodeSetup for every node that runs on this pool
    strategy: str = "ddp"  # "ddp" or "fsdp" (flowrl/engines/train/sharding.py)
    sharded: tuple = ()  # the models fsdp shards here
    collective_timeout_s: float = 0.0  # run.call_timeout_s: a collective fails after it (0: never)


def pool_setups(plan) -> dict[str, PoolSetup]:
    """The PoolSetup of every pool that hosts a model, from the plan alone."""
    spec, out = plan.spec, {}
    after_warmup = {spec.nodes[n].model for n in plan.after_warmup}
    for name, pool in plan.pools.items():
        if not pool.configs:
            continue
        nodes = tuple(
            NodeSetup(n, d.uses, attrs.asdict(d.params), d.model, d.rename)
            for n, d in ((n, spec.nodes[n]) for n in pool.node_ids)
        )
        rollout = tuple(
            sorted({spec.nodes[n].model for n in pool.node_ids if spec.nodes[n].mode == "rollout"})
        )
        steps = {  # a model trained only after the critic warm-up skips its steps
            m: count * (spec.run.steps - (spec.run.critic_warmup if m in after_warmup else 0))
            for m, count in pool.updates_per_step.items()
        }
        out[name] = PoolSetup(
            name,
            pool.device,
            pool.cpus_per_worker,
            spec.run.seed,
            str(spec.base_dir),
            pool.configs,
            steps,
            rollout,
            nodes,
            pool.strategy,
            pool.sharded,
            spec.run.call_timeout_s,
        )
    return out
