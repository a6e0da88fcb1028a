"""The local executor: every pool as one in-process rank running the same worker code as on
Ray, so a step can be stepped through in a debugger and tests need no cluster. A pool with
several workers runs as one rank here, except under fsdp, which refuses (it needs the ranks)."""

from flowrl.runtime.executor import Executor
from flowrl.runtime.node_call import NodeFailure
from flowrl.runtime.pool_worker import PoolWorker
from flowrl.runtime.setup import pool_setups


class LocalExecutor(Executor):
    # one process: run.staleness's stages take turns in one thread (flowrl/runtime/pipeline.py)
    concurrent = False

    def __init__(self, plan, num_cpus: int | None = None):
        super().__init__(plan)
        for name, pool in plan.pools.items():
            if pool.strategy == "fsdp" and pool.workers > 1:
                raise NodeFailure(
                    f'pool {name} shards its models over {pool.workers} ranks (strategy = "fsdp"),'
                    " and the local executor runs one in-process rank per pool: run it with "
                    f"--backend ray (one process per rank), or set pools.{name}.workers=1"
                )
        self.workers = {name: [PoolWorker(setup)] for name, setup in pool_setups(plan).items()}

    def pools(self):
        return list(self.workers)

    def ranks(self, pool):
        return 1

    def submit(self, pool, method, per_rank_args):
        worker = self.workers[pool][0]
        try:
            return [getattr(worker, method)(*per_rank_args[0])]
        except NodeFailure:  # already names the node, where it ran and its batch
            raise
        except Exception as e:
            raise NodeFailure(
                f"{method} {per_rank_args[0][0]} failed on pool {pool}, rank 0: {e}"
            ) from e

    def finished(self, handles):
        return handles

    def results(self, handle):
        return handle

    def shutdown(self):
        for workers in self.workers.values():
            for worker in workers:
                worker.close()
