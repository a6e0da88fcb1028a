"""The tables of backends: the executors a run may use and the rollout backends a model may
use, as the front end knows them, without importing any.

`run.backend` (or `flowrl run --backend`) names an executor in `EXECUTORS`: how a plan's pool
calls reach the ranks (flowrl/runtime/executor.py). Adding one is one module plus one line
there; its module is imported only when a run starts.

A graph picks a rollout backend per model with `rollout = "<name>"` in `[models.<name>]`: a
`Backend` record in `ROLLOUT_BACKENDS`. The record
says where the class is (imported only when a pool builds it: flowrl/engines/rollout.py has
the contract and `make_rollout`), the one kind of pool device it runs on, the optional
package it needs and how to install that, and whether it serves multi-turn rollouts (the
agent node). `flowrl check` reads all of it here, where neither torch nor the package need be
installed. Adding a backend is one module plus one line in `ROLLOUT_BACKENDS`
(docs/extending.md).
"""

from __future__ import annotations

import importlib.util

import attrs


@attrs.frozen
class Backend:
    """One rollout backend's record.

    Attributes:
        ref: "package.module:Class" of the class (flowrl/refs.py loads it).
        device: the only pool device it runs on ("cuda"), or None for any.
        package: the package it imports that flowrl does not install ("" = none).
        install: the command that installs `package`.
        multi_turn: it serves a conversation turn by turn (requests with a request id,
            its earlier turns' KV reused: flowrl/engines/rollout.py), as the agent node
            needs; without it `uses = "agent"` is refused.
    """

    ref: str
    device: str | None = None
    package: str = ""
    install: str = ""
    multi_turn: bool = False


# run.backend -> "package.module:Class" of its executor, the default first
EXECUTORS = {
    "ray": "flowrl.runtime.ray_executor:RayExecutor",
    "local": "flowrl.runtime.local_executor:LocalExecutor",
}

ROLLOUT_BACKENDS = {
    # flowrl's own continuous-batching engine (CPU and CUDA)
    "hf": Backend("flowrl.engines.hf_rollout:HFRollout", multi_turn=True),
    # an in-process SGLang engine (GPU); earlier turns come from its radix prefix cache
    "sglang": Backend(
        "flowrl.engines.sglang_backend:SGLangRollout",
        device="cuda",
        package="sglang",
        install='pip install -e ".[sglang]" in a checkout, or pip install "flowrl[sglang]"',
        multi_turn=True,
    ),
}


def backend(name: str) -> Backend:
    """The record of backend `name`; ValueError naming the backends there are."""
    if name not in ROLLOUT_BACKENDS:
        choices = ", ".join(f'"{n}"' for n in sorted(ROLLOUT_BACKENDS))
        raise ValueError(f'unknown rollout backend "{name}"; the backends are: {choices}')
    return ROLLOUT_BACKENDS[name]


def missing_package(name: str) -> str:
    """The package backend `name` needs when it is not installed here, else "". Looked up with
    importlib.util.find_spec, which finds a package without importing it."""
    record = ROLLOUT_BACKENDS.get(name)
    package = record.package if record else ""
    return package if package and importlib.util.find_spec(package) is None else ""


def multi_turn_names() -> list[str]:
    """The backends that serve the agent node, for a fix text."""
    return [name for name, b in ROLLOUT_BACKENDS.items() if b.multi_turn]
