"""The Ray executor: each pool a placement group, one PoolWorker actor per rank.

Ranks of a multi-rank pool form a torch.distributed group (gloo on CPU, nccl on GPU) for
data-parallel (ddp) or sharded (fsdp) training. Calls are submitted without waiting, so
independent items overlap.
"""

import os
import socket
import time

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from flowrl.runtime import faults
from flowrl.runtime.executor import Executor
from flowrl.runtime.node_call import NodeFailure
from flowrl.runtime.pool_worker import PoolWorker
from flowrl.runtime.recovery import LostWorker
from flowrl.runtime.setup import pool_setups

READY_TIMEOUT_S = 120
PEER_WAIT_S = 10.0
# words of a collective's error on a rank whose peer is gone (gloo, nccl)
PEER_WORDS = ("connection", "peer", "socket", "gloo", "nccl", "timed out", "broken pipe")
# Ray's errors of a rank that is gone (its process, its node or the objects it held), as
# opposed to an error its code raised (RayTaskError)
INFRASTRUCTURE = (
    ray.exceptions.RayActorError,  # ActorDiedError, ActorUnavailableError
    ray.exceptions.NodeDiedError,
    ray.exceptions.WorkerCrashedError,
    ray.exceptions.ObjectLostError,  # OwnerDiedError, ObjectFetchTimedOutError, ...
    ray.exceptions.LocalRayletDiedError,
    ray.exceptions.OutOfMemoryError,  # killed by Ray's memory monitor
)


class RayExecutor(Executor):
    restartable = True  # a lost rank is made again (flowrl/runtime/recovery.py)

    def __init__(self, plan, num_cpus: int | None = None):
        super().__init__(plan)
        if not ray.is_initialized():
            _start_ray(num_cpus)
        run = plan.spec.run
        self.call_timeout_s = run.call_timeout_s or None  # 0: wait as long as it takes
        self.groups, self.actors, self.hosts = {}, {}, {}
        for attempt in range(run.max_restarts + 1):  # a rank lost while the models load
            try:
                self._build(READY_TIMEOUT_S)
                break
            except LostWorker as lost:
                if attempt == run.max_restarts:
                    raise
                print(f"flowrl: making the pools: {lost}; making them again", flush=True)
                self.release()

    def _build(self, wait_s: float) -> None:
        """Every pool's placement group (waiting up to `wait_s` for Ray's room) and ranks, each
        rank's models loaded."""
        actor_class = ray.remote(PoolWorker)
        for name, setup in pool_setups(self.plan).items():
            pool = self.plan.pools[name]
            groups = pool.bundles  # the ranks of each placement bundle (compiler.placement)
            gpus = pool.devices_per_worker if pool.device == "cuda" else 0
            bundles = [
                {"CPU": pool.cpus_per_worker * len(g), **({"GPU": gpus * len(g)} if gpus else {})}
                for g in groups
            ]
            bundle_of = {rank: k for k, g in enumerate(groups) for rank in g}
            group = placement_group(bundles, strategy=pool.placement)
            ready, _ = ray.wait([group.ready()], timeout=wait_s)
            if not ready:
                remove_placement_group(group)
                raise NodeFailure(
                    f"pool {name} needs {len(bundles)} x {bundles[0]} ({pool.placement}) but "
                    f"Ray has {ray.available_resources()} (waited {wait_s:.0f} s): lower "
                    f"pools.{name}.workers, cpus_per_worker or nodes, or raise run.num_cpus"
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
            started = self.results([a.apply.remote(_host) for a in self.actors[name]], pool=name)
            self.hosts[name] = [where for where, _ in started]

    def restart(self, wait_s: float) -> None:
        """Make every pool's ranks again (after `release`), waiting up to `wait_s` for room."""
        self.groups, self.actors, self.hosts = {}, {}, {}
        self._build(wait_s)

    def release(self) -> None:
        """End every rank (the lost, the hung and the healthy) and free its placement; Ray
        stays up for `restart`."""
        for actors in self.actors.values():
            for actor in actors:
                ray.kill(actor, no_restart=True)
        for group in self.groups.values():
            remove_placement_group(group)
        self.groups, self.actors = {}, {}

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
        """The handles whose every rank answered, or one of whose ranks failed (its other
        ranks may wait forever in a collective with it); a LostWorker when no call of any
        handle answers within run.call_timeout_s."""
        refs = [r for h in handles for r in h.refs]
        waited_since = time.monotonic()
        while True:
            ready = [h for h in handles if _settled(h)]
            if ready:
                return ready
            timeout = None
            if self.call_timeout_s:
                timeout = max(0.0, waited_since + self.call_timeout_s - time.monotonic())
            done, _ = ray.wait(refs, num_returns=1, timeout=timeout)
            if done:
                refs = [r for r in refs if r not in done]
                waited_since = time.monotonic()
            elif timeout is not None:
                raise self._no_answer(handles)

    def _no_answer(self, handles) -> LostWorker:
        """The first rank that has not answered, as a LostWorker."""
        for h in handles:
            _, waiting = ray.wait(h.refs, num_returns=len(h.refs), timeout=0)
            if waiting:
                rank = h.refs.index(waiting[0])
                return LostWorker(
                    f"{f'{h.method} {h.name}'.strip()} on pool {h.pool}, rank {rank} did not "
                    "answer within "
                    f"run.call_timeout_s = {self.call_timeout_s:g} s; the controller waited on "
                    "it",
                    h.pool,
                    rank,
                    "no answer",
                    self._where(h.pool, rank),
                )
        raise AssertionError("a timed-out wait with every call answered")

    def results(self, handle, pool: str | None = None):
        refs = handle.refs if isinstance(handle, _Handle) else handle
        pool = handle.pool if isinstance(handle, _Handle) else pool
        what = f"{handle.method} {handle.name}".strip() if isinstance(handle, _Handle) else "start"
        out = []
        for rank, ref in enumerate(refs):
            try:
                out.append(ray.get(ref, timeout=self.call_timeout_s))
            except Exception as e:
                lost = self._lost(pool, rank, e, what) or self._lost_rank(pool, e, what)
                if lost is not None:
                    raise lost from e
                raise NodeFailure(f"{what} failed on pool {pool}, rank {rank}: {_reason(e)}") from e
        return out

    def _lost(self, pool: str, rank: int, error: Exception, what: str) -> LostWorker | None:
        """`error` as a LostWorker when it is an infrastructure fault of rank `rank`."""
        if isinstance(error, ray.exceptions.GetTimeoutError):
            return LostWorker(
                f"{what} on pool {pool}, rank {rank} did not answer within run.call_timeout_s "
                f"= {self.call_timeout_s:g} s; the controller waited on it",
                pool,
                rank,
                "no answer",
                self._where(pool, rank),
            )
        if not isinstance(error, INFRASTRUCTURE) or getattr(error, "actor_init_failed", False):
            return None  # the node's own error, or a rank whose set-up raised
        # the call's rank may have failed for another's loss (its weights, its argument's
        # owner): the rank the cluster has as dead is the one lost
        gone = self._dead_rank() or (pool, rank)
        where = self._where(*gone)
        what_happened = "node lost" if self._node_gone(*gone) else "died"
        text = f"{what} failed on pool {pool}, rank {rank}: {_reason(error)}"
        if gone != (pool, rank):
            text += f"; the rank gone is pool {gone[0]}, rank {gone[1]}"
        if what_happened == "node lost":
            where += "; its node left the cluster"
        return LostWorker(f"{text} ({where})", *gone, what_happened, self._where(*gone))

    def _dead_rank(self) -> tuple[str, int] | None:
        """The first rank, of any pool, that the cluster has as dead."""
        for name, actors in self.actors.items():
            for rank, actor in enumerate(actors):
                if _actor_state(actor) == "DEAD":
                    return name, rank
        return None

    def _lost_rank(self, pool: str, error: Exception, what: str) -> LostWorker | None:
        """A rank that is gone, when a rank of `pool` failed with `error` that is not Ray's (a
        collective whose peer died fails on the survivors, often before Ray has marked the
        peer dead: then it is asked again for up to PEER_WAIT_S)."""
        if len(self.actors.get(pool, [])) < 2:
            return None
        peer = any(word in str(error).lower() for word in PEER_WORDS)
        until = time.monotonic() + (PEER_WAIT_S if peer else 0)
        while (gone := self._dead_rank()) is None and time.monotonic() < until:
            time.sleep(0.5)
        return None if gone is None else self._lost(*gone, ray.exceptions.ActorDiedError(), what)

    def _where(self, pool: str, rank: int) -> str:
        hosts = self.hosts.get(pool) or []
        return hosts[rank]["text"] if rank < len(hosts) else "not started"

    def _node_gone(self, pool: str, rank: int) -> bool:
        hosts = self.hosts.get(pool) or []
        if rank >= len(hosts):
            return False
        try:
            alive = {n["NodeID"]: n["Alive"] for n in ray.nodes()}
        except Exception:  # noqa: BLE001 (the GCS may be busy: say "died")
            return False
        return not alive.get(hosts[rank]["node_id"], False)

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
    if address:  # the cluster's ranks do not inherit this process's environment: a test's
        # fault points (flowrl/runtime/faults.py) go to them through the job's
        env = {k: os.environ[k] for k in (faults.VARIABLE, faults.ONCE) if k in os.environ}
        runtime_env = {"env_vars": env} if env else None
        ray.init(
            address=address, log_to_driver=True, configure_logging=False, runtime_env=runtime_env
        )
        return
    ray.init(
        address="local",  # never attach to another Ray instance found on the machine
        num_cpus=num_cpus,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=True,
        configure_logging=False,
    )


def _host(worker) -> tuple[dict, int]:
    """Where a rank runs (its node, host and process), answered once the rank has built
    itself (`PoolWorker.apply`); with its rank."""
    ip, pid = ray.util.get_node_ip_address(), os.getpid()
    node = ray.get_runtime_context().get_node_id()
    return {"node_id": node, "text": f"host {ip}, pid {pid}, node {node[:8]}"}, worker.rank


def _actor_state(actor) -> str:
    """ALIVE, RESTARTING, DEAD, ... as the cluster's control store (GCS) has it; "" if it
    cannot say."""
    from ray._private import state  # the GCS's tables: no dashboard needed

    try:
        entry = state.actors(actor_id=actor._actor_id.hex())
    except Exception:  # noqa: BLE001 (the GCS busy or gone: it cannot say)
        return ""
    return (entry or {}).get("State", "")


def _settled(handle) -> bool:
    """Every rank of the handle answered, or one of those that did failed."""
    done, waiting = ray.wait(handle.refs, num_returns=len(handle.refs), timeout=0)
    if not waiting:
        return True
    for ref in done:
        if ref in handle.checked:
            continue
        try:
            ray.get(ref, timeout=0)
        except Exception:  # noqa: BLE001 (results() says what it was)
            return True
        handle.checked.add(ref)
    return False


class _Handle:
    def __init__(self, pool, method, name, refs):
        self.pool, self.method, self.name, self.refs = pool, method, name, refs
        self.checked = set()  # refs whose answer was read and was not an error


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
