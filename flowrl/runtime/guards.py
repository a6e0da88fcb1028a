"""What stops a run by name: checks before any model loads (devices, packages, a writable run
directory) and the errors that end a run cleanly (non-finite steps; signals: runtime/stop.py;
run directories: runtime/run_dir.py)."""

import os
import sys
from pathlib import Path

import torch

from flowrl.backends import ROLLOUT_BACKENDS, missing_package
from flowrl.errors import FlowrlError
from flowrl.nodespec import RolloutParams
from flowrl.runtime.run_dir import RunDirError  # noqa: F401 (its home was here)
from flowrl.runtime.stop import Stopped  # noqa: F401


class NonFiniteStop(FlowrlError, RuntimeError):
    """Too many steps in a row had a non-finite loss or gradient norm."""


class FailedStepsStop(FlowrlError, RuntimeError):
    """Too many steps in a row trained on nothing (every request failed)."""


class DeviceError(FlowrlError, RuntimeError):
    """A pool asks for a device this machine does not have."""


def check_devices(plan) -> None:
    """A CUDA pool on a machine without CUDA fails here, by name, before any model loads (on a
    Ray cluster, RAY_ADDRESS set, the cluster's GPUs count instead: Ray places the pool)."""
    if os.environ.get("RAY_ADDRESS") or torch.cuda.is_available():
        return
    for name, pool in plan.pools.items():
        if pool.device == "cuda":
            raise DeviceError(
                f'{plan.file}: [pools.{name}] device = "cuda", but this machine has no CUDA '
                'device: set device = "cpu" (e.g. pools.'
                f'{name}.device="cpu" on the command line), or run where GPUs are'
            )


class MissingPackage(FlowrlError, RuntimeError):
    """A graph picks a rollout backend whose package is not installed."""


def check_packages(plan) -> None:
    """A rollout backend whose package is not installed (sglang) fails here, by name, before
    any model loads (on a Ray cluster, RAY_ADDRESS set, the workers' packages count: skipped)."""
    if os.environ.get("RAY_ADDRESS"):
        return
    for name in sorted({d.model for d in plan.spec.nodes.values() if d.mode == "rollout"}):
        backend = plan.spec.models[name].rollout
        if package := missing_package(backend):
            raise MissingPackage(
                f'{plan.file}: [models.{name}] rollout = "{backend}" needs the {package} '
                f"package, which is not installed: {ROLLOUT_BACKENDS[backend].install}"
            )


def writable(run_dir: Path) -> None:
    """Create the run directory and check it takes files, before any model loads."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise RunDirError(
            f"run directory {run_dir} is not writable ({e.strerror}): set run.out_dir to a "
            "folder you can write, or free space"
        ) from e


class ModelMismatch(FlowrlError, ValueError):
    """Models that cannot work together, or with the data: found before any loads on a pool."""


def check_models(spec, policy: str, tokenizer) -> None:
    """Before any model loads on a pool: a prompt must fit the policy's context (with its
    response, or a warning says so), and every other model, fed the policy's token ids, must
    share its tokenizer (flowrl.models.loading.tokenizer_differences; a node that retokenizes
    for its own model can use that function for its own check)."""
    from flowrl.models.loading import context_length, load_tokenizer, tokenizer_differences

    config = spec.models[policy]
    context = context_length(config.path)
    longest = max(
        (
            d.params.max_new_tokens
            for d in spec.nodes.values()
            if isinstance(d.params, RolloutParams)
        ),
        default=0,
    )  # the response cap of every rollout node
    if context and spec.data.max_prompt_len > context:
        raise ModelMismatch(
            f"{spec.file}: data.max_prompt_len = {spec.data.max_prompt_len} exceeds the context "
            f"of [models.{policy}] ({context} tokens, its max_position_embeddings): a prompt that "
            f"long cannot be generated on. Set data.max_prompt_len to at most "
            f"{max(context - longest, 1)} (longer prompts are dropped, and counted)"
        )
    if context and spec.data.max_prompt_len + longest > context:
        print(
            f"flowrl: warning: data.max_prompt_len = {spec.data.max_prompt_len} plus "
            f"max_new_tokens = {longest} exceeds the context of [models.{policy}] ({context} "
            "tokens): the longest prompts leave less room to respond",
            file=sys.stderr,
        )
    for name, other in spec.models.items():
        users = [d for d in spec.nodes.values() if d.model == name]
        if name == policy or other.path == config.path:
            continue
        if users and all(hasattr(d.params, "tokenizer") for d in users):
            continue  # its nodes write the text again with its own tokenizer (reward.model)
        differences = tokenizer_differences(tokenizer, load_tokenizer(other.path))
        if differences:
            raise ModelMismatch(
                f'{spec.file}: [models.{name}] path = "{other.path}" has another tokenizer '
                f'than the policy [models.{policy}] ("{config.path}"): '
                f"{'; '.join(differences)}. It reads the policy's token ids, so it must share "
                f"its tokenizer: use a model of the same family (e.g. the policy's own path)"
            )
