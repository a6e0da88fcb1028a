"""The Ray executor: each pool a placement group, one PoolWorker actor per rank.

Ranks of a multi-rank pool form a torch.distributed group (gloo on CPU, nccl on GPU) for
data-parallel (ddp) or sharded (fsdp) training. Calls are submitted without waiting, so
independent items overlap.
"""

import os
import socket

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from flowrl.runtime.executor import Executor
from flowrl.runtime.node_call import NodeFailure
from flowrl.runtime.pool_worker import PoolWorker
from flowrl.runtime.setup import pool_setups

READY_TIMEOUT_S = 120


class RayExecutor(Executor):
    def __init__(self, plan, num_cpus: int | None = None):
        super().__init__(plan)
        if not ray.is_initialized():
            _start_ray(num_cpus)
        actor_class = ray.remote(PoolWorker)
        self.groups, self.actors = {}, {}
        for name, setup in pool_setups(plan).items():
            pool = plan.pools[name]
            groups = pool.bundles  # the ranks of each placement bundle (compiler.placement)
            gpus = pool.devices_per_worker if pool.device == "cuda" else 0
            bundles = [
                {"CPU": pool.cpus_per_worker * len(g), **({"GPU": gpus * len(g)} if gpus else {})}
                for g in groups
            ]
            bundle_of = {rank: k for k, g in enumerate(groups) for rank in g}
            group = placement_group(bundles, strategy=pool.placement)
            ready, _ = ray.wait([group.ready()], timeout=READY_TIMEOUT_S)
            if not ready:
                remove_placement_group(group)
                raise NodeFailure(
                    f"pool {name} needs {len(bundles)} x {bundles[0]} ({pool.placement}) but "
                    f"Ray has {ray.available_resources()}: lower pools.{name}.workers, "
                    f"cpus_per_worker or nodes, or raise run.num_cpus"
                )
            # rank 0 hosts the process group's store: an address and free port on its node
            url = "tcp://{}:{}".format(*_endpoint(group, bundle_of[0])) if pool.workers > 1 else ""
            self.groups[name] = group
            self.actors[name] = [
                actor_class.options(
                    num_cpus=pool.cpus_per_worker,
                    num_gpus=gpus,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        group, placement_group_bundle_index=bundle_of[rank]
                    ),
                ).remote(setup, rank, pool.workers, url)
                for rank in range(pool.workers)
            ]
        for name in self.actors:  # wait until every rank has loaded its models
            self.results([a.apply.remote(_rank) for a in self.actors[name]], pool=name)

    def pools(self):
        return list(self.actors)

    def ranks(self, pool):
        return len(self.actors[pool])

    def submit(self, pool, method, per_rank_args):
        refs = [
            getattr(actor, method).remote(*args)
            for actor, args in zip(self.actors[pool], per_rank_args, strict=True)
        ]
        first = per_rank_args[0][0] if per_rank_args[0] else ""
        return _Handle(pool, method, getattr(first, "__name__", first), refs)

    def rank0_output(self, handle):
        return handle.refs[0]  # Ray resolves it where it is passed: no copy via the driver

    def finished(self, handles):
        refs = [r for h in handles for r in h.refs]
        while True:
            ready = [
                h for h in handles if not ray.wait(h.refs, num_returns=len(h.refs), timeout=0)[1]
            ]
            if ready:
                return ready
            ray.wait(refs, num_returns=1)

    def results(self, handle, pool: str | None = None):
        refs = handle.refs if isinstance(handle, _Handle) else handle
        pool = handle.pool if isinstance(handle, _Handle) else pool
        out = []
        for rank, ref in enumerate(refs):
            try:
                out.append(ray.get(ref))
            except Exception as e:
                what = f"{handle.method} {handle.name}" if isinstance(handle, _Handle) else "start"
                raise NodeFailure(f"{what} failed on pool {pool}, rank {rank}: {_reason(e)}") from e
        return out

    def shutdown(self):
        closing = [actor.close.remote() for actors in self.actors.values() for actor in actors]
        try:  # each rollout backend releases what it made (a server, temp folders)
            ray.get(closing, timeout=60)
        except Exception as e:  # noqa: BLE001 (a dead actor cannot close; the rest did)
            print(f"flowrl: warning: closing the rollout backends: {_reason(e)}")
        for name, actors in self.actors.items():
            for actor in actors:
                ray.kill(actor)
            remove_placement_group(self.groups[name])
        ray.shutdown()


def _start_ray(num_cpus: int | None) -> None:
    """A new Ray instance of this process's own, bound to the loopback address, without the
    dashboard; or, when RAY_ADDRESS is set, the cluster it names (docs/scaling.md)."""
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True, configure_logging=False)
        return
    ray.init(
        address="local",  # never attach to another Ray instance found on the machine
        num_cpus=num_cpus,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=True,
        configure_logging=False,
    )


def _rank(worker) -> int:
    """A rank's number: answered once the rank has built itself (`PoolWorker.apply`)."""
    return worker.rank


class _Handle:
    def __init__(self, pool, method, name, refs):
        self.pool, self.method, self.name, self.refs = pool, method, name, refs


def _reason(error: Exception) -> str:
    if isinstance(error, ray.exceptions.RayActorError):
        if getattr(error, "actor_init_failed", False):  # its __init__ raised: the last line
            return str(error).strip().splitlines()[-1]  # is "<Error>: <its message>"
        return "the rank's process died (killed, or out of memory)"
    cause = getattr(error, "cause", None)
    return f"{type(cause).__name__}: {cause}" if cause else str(error)


def _endpoint(group, bundle: int) -> tuple[str, int]:
    """(IP, a free TCP port) on the node of a placement bundle, found by a task run there."""
    task = ray.remote(num_cpus=0)(_node_endpoint).options(
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=bundle
        )
    )
    return ray.get(task.remote())


def _node_endpoint() -> tuple[str, int]:
    with socket.socket() as s:
        s.bind(("", 0))
        return ray.util.get_node_ip_address(), s.getsockname()[1]
