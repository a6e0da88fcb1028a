"""The runtime: controller loop, executors (local, Ray), pool workers, checkpoints, trace.

Imports torch; `flowrl check/plan/render` never load this package's modules. An executor is
one module plus one line in `EXECUTORS` (flowrl/backends.py, torch-free: the graph check reads
the names there).
"""

from flowrl import refs
from flowrl.backends import EXECUTORS


def make_executor(name: str, plan, num_cpus: int | None = None):
    """The executor called `name`, built for `plan` (its module is imported only now)."""
    if name not in EXECUTORS:
        raise ValueError(f'unknown executor "{name}": use one of {", ".join(EXECUTORS)}')
    return refs.load(EXECUTORS[name], what=f'executor "{name}"')(plan, num_cpus=num_cpus)
