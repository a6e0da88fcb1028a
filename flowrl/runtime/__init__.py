"""The runtime: controller loop, executors (local, Ray), pool workers, checkpoints, trace.

Imports torch; `flowrl check/plan/render` never load this package's modules. An executor is
one module plus one entry in `EXECUTORS` (and its name in `flowrl.front.schema.BACKENDS`, which the
graph file's `run.backend` and the CLI's `--backend` accept).
"""

from flowrl import refs

EXECUTORS = {
    "local": "flowrl.runtime.local_executor:LocalExecutor",
    "ray": "flowrl.runtime.ray_executor:RayExecutor",
}


def make_executor(name: str, plan, num_cpus: int | None = None):
    """The executor called `name`, built for `plan` (its module is imported only now)."""
    if name not in EXECUTORS:
        raise ValueError(f'unknown executor "{name}": use one of {", ".join(EXECUTORS)}')
    return refs.load(EXECUTORS[name], what=f'executor "{name}"')(plan, num_cpus=num_cpus)
