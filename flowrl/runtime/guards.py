"""What stops a run by name: checks before any model loads (devices, packages, a writable run
directory) and the errors that end a run cleanly (updates that do nothing: `DeadUpdates`;
signals: runtime/stop.py; run directories: runtime/run_dir.py)."""

import os
import sys
from pathlib import Path

import attrs
import torch

from flowrl.backends import ROLLOUT_BACKENDS, missing_package
from flowrl.errors import FlowrlError
from flowrl.nodespec import RolloutParams
from flowrl.runtime.run_dir import RunDirError  # noqa: F401 (its home was here)
from flowrl.runtime.stop import Stopped  # noqa: F401


class UpdatesStop(FlowrlError, RuntimeError):
    """A run whose updates did nothing for run.max_nonfinite_steps steps in a row (a non-finite
    loss or gradient norm, or a gradient of 0 over rows with a learning signal), or whose
    weights became non-finite."""


NonFiniteStop = UpdatesStop  # its name while it stopped non-finite steps only


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


@attrs.define
class DeadUpdates:
    """Watches each step's update metrics for train nodes whose updates do nothing:

    - a non-finite loss or gradient norm (`<node>/nonfinite_skipped`: the engine skipped the
      optimizer step, weights unchanged);
    - a gradient norm of exactly 0 while the node says its rows had a learning signal
      (`<node>/signal_rows` > 0: update.policy's share of rows with a non-zero advantage): the
      weights no longer respond to the loss, as after a far too large learning rate. A zero
      gradient over rows without signal (GRPO when every group's scores are equal) is a
      legitimately empty update and does not count;
    - weights that became non-finite (`<node>/nonfinite_weights`): nothing recovers, so the
      run stops at once.

    A run of such steps is a `streak`; the controller stops the run when it reaches
    run.max_nonfinite_steps (or at the last step, or at non-finite weights) with `stop`, and
    writes no checkpoint during a streak, so the last good one is kept."""

    spec: object
    streak: int = 0
    began: int = 0
    fatal: bool = False
    causes: dict = attrs.Factory(dict)  # node -> why its updates did nothing (latest step)

    def observe(self, step: int, metrics: dict) -> list[dict]:
        """Count this step; returns the events to log (each with a "said" line for the log)."""
        causes, events = {}, []
        for node in sorted({k.rpartition("/")[0] for k in metrics if k.endswith("/grad_norm")}):
            cause = _dead_update(metrics, node)
            if cause:
                causes[node] = cause
        if not causes:
            self.streak, self.causes = 0, {}
            return []
        self.began = self.began if self.streak else step
        self.streak, self.causes = self.streak + 1, causes
        self.fatal = any(c.startswith("its weights") for c in causes.values())
        nonfinite = sorted(n for n, c in causes.items() if "non-finite" in c)
        if nonfinite:
            events.append({"event": "nonfinite", "step": step, "nodes": nonfinite})
        others = sorted(set(causes) - set(nonfinite))
        if others:
            events.append({"event": "no_gradient", "step": step, "nodes": others})
        for event in events:
            event["said"] = f"step {step}: " + "; ".join(
                f"{n}: {causes[n]}" for n in event["nodes"]
            )
        return events

    def stop(self, step: int, run_dir: Path, command: str) -> UpdatesStop:
        """The error that ends the run: the cause, the step it began, and what to resume."""
        from flowrl.runtime import checkpoint

        nodes = ", ".join(sorted(self.causes))
        span = f"from step {self.began} to step {step}" if step > self.began else f"at step {step}"
        lines = [
            f"the updates of {nodes} did nothing {span} ({self.streak} step"
            f"{'s' * (self.streak > 1)} in a row): "
            + "; ".join(f"{n}: {c}" for n, c in sorted(self.causes.items()))
            + "."
        ]
        models = self._models()
        if models:
            rates = ", ".join(f"[models.{m}] lr = {self.spec.models[m].lr:g}" for m in models)
            lines.append(f"The usual cause is a learning rate far too large ({rates}).")
        lower = " with a lower " + ", ".join(f"models.{m}.lr" for m in models) if models else ""
        # the weights that gave the first such step came from the update before it
        last_good = self.began - (1 if self.fatal else 2)
        good = [c for c in checkpoint.checkpoints(run_dir) if checkpoint.step_of(c) <= last_good]
        good = [c for c in good if not checkpoint.problems(c)]
        if good:
            lines.append(
                f"No checkpoint was written from step {self.began} on; the last before the "
                f"update that began it is {good[-1]}: resume from it{lower}: {command} --resume "
                f"{good[-1]} --allow-graph-change"
            )
        else:
            lines.append(
                f"No checkpoint from before the update that began it (step {last_good + 1}) "
                f"was kept: start again{lower}: {command}"
            )
        lines.append("(run.max_nonfinite_steps sets how many such steps in a row are tolerated)")
        return UpdatesStop(" ".join(lines))

    def _models(self) -> list[str]:
        """The trained models of the nodes whose updates did nothing."""
        nodes = [self.spec.nodes[n] for n in self.causes if n in self.spec.nodes]
        return sorted({d.model for d in nodes if d.model})


def _dead_update(metrics: dict, node: str) -> str:
    """Why `node`'s update of this step did nothing ('' when it did something)."""
    if metrics.get(f"{node}/nonfinite_weights", 0) > 0:
        return "its weights became non-finite in this step's update"
    if metrics.get(f"{node}/nonfinite_skipped", 0) > 0:
        return "a non-finite loss or gradient norm (the optimizer step was skipped)"
    signal = metrics.get(f"{node}/signal_rows", 0.0)
    if metrics[f"{node}/grad_norm"] == 0.0 and signal > 0:
        return (
            f"a gradient norm of 0 although {signal:.0%} of its rows had a non-zero advantage: "
            "its weights no longer respond to the loss"
        )
    return ""
