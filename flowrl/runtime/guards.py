"""What stops a run by name: checks before any model loads (devices, packages, a writable run
directory, models that can work together) and the step guards, which watch each logged step and
end a run cleanly with its cause (`StepGuard`: failed requests, updates that do nothing, zero
gradients; signals: runtime/stop.py; run directories: runtime/run_dir.py)."""

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import attrs
import torch

from flowrl.backends import ROLLOUT_BACKENDS, missing_package
from flowrl.errors import FlowrlError
from flowrl.nodespec import RolloutParams
from flowrl.runtime import step_log
from flowrl.runtime.run_dir import RunDirError

if TYPE_CHECKING:
    from flowrl.runtime.executor import StepResult


class UpdatesStop(FlowrlError, RuntimeError):
    """A run whose updates did nothing for run.max_nonfinite_steps steps in a row (a non-finite
    loss or gradient norm, or a gradient of 0 over rows with a learning signal), or whose
    weights became non-finite."""


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
        if users and all(d.spec.own_tokenizer for d in users):
            continue  # its nodes write the text again with its own tokenizer (reward.model)
        differences = tokenizer_differences(tokenizer, load_tokenizer(other.path))
        if differences:
            raise ModelMismatch(
                f'{spec.file}: [models.{name}] path = "{other.path}" has another tokenizer '
                f'than the policy [models.{policy}] ("{config.path}"): '
                f"{'; '.join(differences)}. It reads the policy's token ids, so it must share "
                f"its tokenizer: use a model of the same family (e.g. the policy's own path)"
            )


# -- step guards ---------------------------------------------------------------------------


class StepGuard(Protocol):
    """One condition the trainer's loop watches after each logged step. The loop asks each
    guard in turn, `observe` then `check`, and writes a checkpoint when it is due and every
    guard's `may_save` holds; a further watch (a lost worker, ...) is one more class in
    `step_guards`, not a branch of the loop."""

    def observe(self, step: int, result: "StepResult") -> list[dict]:
        """Count this step; returns the events to log (each with a "said" line for the
        console, which the loop takes out before it logs the event)."""
        ...

    def check(self, step: int) -> None:
        """Raise this guard's stop (a FlowrlError naming the cause, the step and what to do)
        when the run must end at `step`."""
        ...

    @property
    def may_save(self) -> bool:
        """Whether a checkpoint written now would be a good one (False: keep the last)."""
        ...


def step_guards(spec, run_dir: Path, command: str) -> list[StepGuard]:
    """The guards of a run, in the order the loop asks them."""
    return [FailedRequests(spec, run_dir), DeadUpdates(spec, run_dir, command), ZeroGradients()]


@attrs.define
class FailedRequests:
    """Shows each step's failed requests (the first few with their rows) and stops the run
    after run.max_failed_steps steps in a row that trained on nothing (most requests failed,
    so the walk passed the update over, or no response kept a token)."""

    spec: object
    run_dir: Path
    streak: int = 0  # steps in a row that trained on nothing
    lines: list = attrs.Factory(list)  # the last step's first failures, with their rows
    why: str = ""  # why the last step trained on nothing

    def observe(self, step: int, result: "StepResult") -> list[dict]:
        batch = result.batch
        failed = step_log.failed_requests(batch)
        self.lines = step_log.failure_lines(batch, failed)
        nothing = step_log.trained_nothing(batch)
        self.streak = self.streak + 1 if nothing else 0
        self.why = step_log.nothing_trained(batch, self.lines) if nothing else ""
        if not failed:
            return []
        said = step_log.failure_report(step, batch, failed, self.lines)
        return [{"event": "failed_requests", "step": step, "count": len(failed), "said": said}]

    def check(self, step: int) -> None:
        if self.streak >= self.spec.run.max_failed_steps:
            file = self.spec.file
            raise FailedStepsStop(
                f"{self.streak} steps in a row (up to step {step}) trained on nothing: "
                + self.why
                + f"\nFix the tools or rows (flowrl check {file}), then replay with "
                f"flowrl run {file} --resume {self.run_dir} "
                "(run.max_failed_steps sets how many are tolerated)"
            )

    @property
    def may_save(self) -> bool:
        return True  # a step passed over changed no weights: its checkpoint is as good


@attrs.define
class DeadUpdates:
    """Watches each step's update metrics for train nodes whose updates do nothing:

    - a non-finite loss or gradient norm (`<node>/nonfinite_skipped`: the engine skipped the
      optimizer step, weights unchanged);
    - a gradient norm of exactly 0 while the node says its rows had a learning signal
      (`<node>/signal_rows` > 0: update.policy's share of rows with a non-zero advantage): the
      weights no longer respond to the loss, as after a far too large learning rate. A zero
      gradient over rows without signal (GRPO when every group's scores are equal) is a
      legitimately empty update and does not count (`ZeroGradients` warns of a run of them);
    - weights that became non-finite (`<node>/nonfinite_weights`): nothing recovers, so the
      run stops at once.

    A run of such steps is a `streak`; the run stops when it reaches run.max_nonfinite_steps
    (or at the last step, or at non-finite weights), and no checkpoint is written during a
    streak, so the last good one is kept and the stop names it."""

    spec: object
    run_dir: Path
    command: str  # the command line that started the run, for the way to resume
    streak: int = 0
    began: int = 0
    fatal: bool = False
    causes: dict = attrs.Factory(dict)  # node -> why its updates did nothing (latest step)

    def observe(self, step: int, result: "StepResult") -> list[dict]:
        metrics = result.metrics
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

    def check(self, step: int) -> None:
        run = self.spec.run
        if self.streak >= run.max_nonfinite_steps or self.fatal:
            raise self._stop(step)
        if step == run.steps and self.streak:  # a run does not end "done" on dead updates
            raise self._stop(step)

    @property
    def may_save(self) -> bool:
        return not self.streak  # none while updates do nothing: the last good one is kept

    def _stop(self, step: int) -> UpdatesStop:
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
        run_dir, command = self.run_dir, self.command
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


STUCK_STEPS = 3  # steps of gradient norm 0 before a warning


@attrs.define
class ZeroGradients:
    """Warns of a node whose gradient norm stayed exactly 0 for STUCK_STEPS steps in a row,
    once per node: with a learning signal `DeadUpdates` stops the run, without one (every
    reward within a group the same) the run goes on learning nothing. Never stops a run."""

    zero_steps: dict = attrs.Factory(dict)  # node -> steps in a row so far (-1 once said)

    def observe(self, step: int, result: "StepResult") -> list[dict]:
        events = []
        for key, value in result.metrics.items():
            node = key.rpartition("/")[0]
            count = self.zero_steps.get(node, 0)
            if not key.endswith("/grad_norm") or count < 0:
                continue
            self.zero_steps[node] = count + 1 if value == 0.0 else 0
            if self.zero_steps[node] == STUCK_STEPS:
                self.zero_steps[node] = -1
                message = (
                    f"step {step}: the gradient norm of {node} has been 0 for {STUCK_STEPS} "
                    "steps in a row: nothing is learned. Either the learning rate is far too "
                    "large (check [models] lr) or every reward within a group is the same (the "
                    "advantages are 0: check the scorer, score/mean and its spread)"
                )
                said = f"warning: {message}"
                events.append({"event": "warning", "step": step, "message": message, "said": said})
        return events

    def check(self, step: int) -> None:
        pass  # a warning only

    @property
    def may_save(self) -> bool:
        return True
