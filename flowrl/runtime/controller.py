"""The controller loop: for each step, a prompt batch -> the plan's items -> metrics and logs.

    for step in steps:
        batch = next(loader)                      # prompts, prompt_mask, uid, ground truths
        result = executor.run_step(batch)         # every plan item, independent ones overlapped
        log(result.metrics); validate / checkpoint when due

A run directory holds graph.toml (the resolved graph), run.json (where the graph file was:
its relative paths resolve from there), metrics.jsonl, samples.jsonl, trace.json (Chrome /
Perfetto trace), checkpoints/step_NNNNNN (written atomically), and for `flowrl replay` the
inputs of a failed node call (failures/) and of the nodes in run.save_inputs (inputs/).
"""

import contextlib
import functools
import json
import time
from pathlib import Path

import toml
from tqdm import tqdm

from flowrl.agent.prompt import agent_prompt
from flowrl.data import PromptDataset, PromptLoader
from flowrl.data.split import train_and_validation_rows
from flowrl.models import load_tokenizer
from flowrl.nodespec import GREEDY
from flowrl.runtime import checkpoint, faults, guards, make_executor, rng, step_log
from flowrl.runtime.executor import StepResult
from flowrl.runtime.inputs import Recording
from flowrl.runtime.loggers import Loggers
from flowrl.runtime.refill import refilled_step
from flowrl.runtime.trace import Trace


def run(plan, backend: str | None = None, resume: str | None = None) -> Path:
    """Train with a compiled plan (`flowrl.compile`); returns the run directory."""
    backend = backend or plan.spec.run.backend
    run_dir = Path(resume) if resume else guards.new_run_dir(plan.spec)
    trainer = Trainer(plan, run_dir, backend)
    try:
        trainer.fit(resume=resume is not None)
    finally:
        trainer.close()
    return run_dir


class Trainer:
    def __init__(self, plan, run_dir: Path, backend: str):
        guards.check_devices(plan)
        guards.check_packages(plan)
        spec = plan.spec
        self.spec, self.plan, self.run_dir = spec, plan, run_dir
        rng.seed_everything(spec.run.seed)
        policy = _rollout_model(spec)
        self.tokenizer = load_tokenizer(spec.models[policy].path)  # also fills the model cache
        # a reward model with its own tokenizer compares vocabularies with it (reward.model)
        self.batch_meta = {"seed": spec.run.seed, "policy_tokenizer": spec.models[policy].path}
        data = spec.data
        rows, val_rows, note = train_and_validation_rows(
            data, spec.run.val_size, spec.run.seed, spec.base_dir
        )  # never validates on training rows (flowrl/data/split.py)
        render = agent_prompt(spec, self.tokenizer)  # an agent node's prompts show its tools
        self.train_set = PromptDataset(rows, self.tokenizer, data.max_prompt_len, render)
        self.loader = PromptLoader(self.train_set, data.batch_size, spec.run.seed, data.shuffle)
        self.val_batch = None
        if val_rows:
            print(note)
            val_set = PromptDataset(val_rows, self.tokenizer, data.max_prompt_len, render)
            self.val_batch = val_set.collate(list(range(len(val_set))))
        self.executor = make_executor(backend, plan, num_cpus=spec.run.num_cpus or None)
        self.trace = Trace()

    def close(self) -> None:
        from flowrl.rewards.pool import close_all

        self.executor.shutdown()
        close_all()  # scorer processes

    # -- the loop ----------------------------------------------------------------------------
    def fit(self, resume: bool = False) -> None:
        guards.writable(self.run_dir)
        start_step = 0
        if resume:
            start_step = self._resume()
        else:
            (self.run_dir / "graph.toml").write_text(toml.dumps(self.spec.raw))
            source = {"graph": str(Path(self.spec.file).resolve())}
            source["base_dir"] = str(Path(self.spec.base_dir).resolve())
            (self.run_dir / "run.json").write_text(json.dumps(source, indent=2) + "\n")
        with (
            contextlib.closing(Loggers(self.spec.run.loggers, self.run_dir, self.spec)) as loggers,
            open(self.run_dir / "samples.jsonl", "a") as samples_file,
            guards.stopped_by_signals(self.spec.file, self.run_dir),
        ):
            if resume:
                loggers.log({"event": "resume", "step": start_step})
            elif self.val_batch is not None:
                loggers.log({"step": 0, **self.validate(0)})
            self._loop(start_step, loggers, samples_file)
        self.trace.write(self.run_dir / "trace.json")

    def _loop(self, start_step: int, loggers: Loggers, samples_file) -> None:
        run, nonfinite, failed_steps = self.spec.run, 0, 0
        bar = tqdm(
            range(start_step + 1, run.steps + 1),
            initial=start_step,
            total=run.steps,
            desc=Path(self.spec.file).stem,
            dynamic_ncols=True,
        )
        for step in bar:
            result = self.step(step)
            metrics, batch = result.metrics, result.batch
            last = step == run.steps
            if self.val_batch is not None and (
                last or (run.val_every and step % run.val_every == 0)
            ):
                metrics.update(self.validate(step))
            loggers.log(metrics)  # metrics.jsonl, and TensorBoard / W&B when chosen
            step_log.log_samples(samples_file, step, batch, run.log_samples)
            failed_steps = self._failures(step, batch, loggers, failed_steps)
            faults.point("logged", step)
            skipped = sorted(
                k.rpartition("/")[0]
                for k, v in metrics.items()
                if k.endswith("/nonfinite_skipped") and v > 0
            )
            nonfinite = nonfinite + 1 if skipped else 0
            if skipped:
                event = {"event": "nonfinite", "step": step, "nodes": skipped}
                loggers.log(event)
                tqdm.write(
                    f"step {step}: a loss or gradient norm of {', '.join(skipped)} was not "
                    "finite; the optimizer step was skipped (weights unchanged)"
                )
            if nonfinite >= run.max_nonfinite_steps:
                raise guards.NonFiniteStop(
                    f"{nonfinite} steps in a row (up to step {step}) had a non-finite loss or "
                    f"gradient norm in {', '.join(skipped)}; stopping. Lower the learning rate "
                    "or check the rewards, then resume: flowrl run "
                    f"{self.spec.file} --resume {self.run_dir} (run.max_nonfinite_steps "
                    "sets how many are tolerated)"
                )
            if last or (run.save_every and step % run.save_every == 0):
                self.save(step)
            bar.set_postfix(step_log.postfix(metrics))

    def _failures(self, step: int, batch, loggers: Loggers, failed_steps: int) -> int:
        """Show this step's failed requests (the first few with their rows); stop after
        run.max_failed_steps steps in a row that trained on nothing. Returns that count."""
        failed = step_log.failed_requests(batch)
        lines = step_log.failure_lines(batch, failed)
        if failed:
            loggers.log({"event": "failed_requests", "step": step, "count": len(failed)})
            tqdm.write(
                f"step {step}: {len(failed)} of {len(batch)} requests failed\n" + "\n".join(lines)
            )
        failed_steps = failed_steps + 1 if step_log.trained_nothing(batch) else 0
        if failed_steps >= self.spec.run.max_failed_steps:
            raise guards.FailedStepsStop(
                f"{failed_steps} steps in a row (up to step {step}) trained on nothing: every "
                "request failed or had no sampled token. First failures:\n"
                + ("\n".join(lines) or "  (none failed: every response was empty)")
                + f"\nFix the tools or rows (flowrl check {self.spec.file}), then replay with "
                f"flowrl run {self.spec.file} --resume {self.run_dir} "
                "(run.max_failed_steps sets how many are tolerated)"
            )
        return failed_steps

    def step(self, step: int) -> StepResult:
        """One training step: the walk's StepResult, its metrics completed with the step's
        timings, throughput and process metrics (what metrics.jsonl logs)."""
        start = time.time()
        batch = self._prompts(step)
        run = self.spec.run
        record = self._record(step, step - 1, keep=tuple(run.save_inputs))
        if self.plan.refill is not None:  # a filter that samples more prompts (DAPO)
            more = functools.partial(self._prompts, step)
            walked = refilled_step(self.executor, self.plan.refill, batch, more, record)
        else:
            only = None
            if step <= run.critic_warmup:  # the critic alone trains
                only = set(self.spec.nodes) - set(self.plan.after_warmup)
            walked = self.executor.run_step(batch, only=only, record=record)
        batch, metrics, slices = walked.batch, walked.metrics, walked.slices
        seconds = time.time() - start
        self.trace.add(slices, step)
        out = {"step": step, "time_s": seconds, **step_log.batch_metrics(batch), **metrics}
        for name, value in step_log.timings(slices).items():
            out[f"timing_s/{name}"] = value
        tokens = (
            float(batch["prompt_mask"].sum() + batch["response_mask"].sum())
            if "response_mask" in batch
            else 0.0
        )
        out["tokens_per_s"] = tokens / seconds
        out.update(step_log.process_metrics())
        return StepResult(batch, out, slices)

    def _prompts(self, step: int, round_: int = 0):
        """The next prompt batch, with the meta that seeds its sampling."""
        batch = next(self.loader)
        batch.meta.update(self.batch_meta, step=step)
        if round_:
            batch.meta["round"] = round_
        return batch

    def _record(self, step: int, state_step: int, keep=(), validation=False) -> Recording:
        """Where this walk's node calls keep their inputs (flowrl/runtime/inputs.py)."""
        run_dir = str(self.run_dir.resolve())
        last = self.spec.run.save_inputs_last
        return Recording(run_dir, step, state_step, keep, last, validation)

    def validate(self, step: int = 0) -> dict:
        """Greedy decoding on the validation prompts, scored by the graph's own reward nodes;
        `step`: the training steps done (names a failed call's saved inputs)."""
        validation = self.plan.validation
        if not validation.nodes:
            return {}
        greedy = dict.fromkeys(validation.greedy, GREEDY)
        batch = self.val_batch.index(slice(0, len(self.val_batch)))
        batch.meta.update(self.batch_meta, step=0)
        record = self._record(step, step, validation=True)
        out = self.executor.run_step(
            batch, only=set(validation.nodes), param_changes=greedy, record=record
        ).batch
        result = {"val/score": float(out["scores"].float().mean())}
        if "response_mask" in out:
            result["val/response_length"] = float(out["response_mask"].sum(-1).float().mean())
        return result

    # -- checkpoints ---------------------------------------------------------------------------
    def save(self, step: int) -> None:
        state = {  # plain JSON: opening a run directory never unpickles anything
            "step": step,
            "loader": self.loader.state_dict(),
            "node_state": self.executor.node_state,
            "rng": rng.state(),
        }
        try:
            with checkpoint.writing(self.run_dir, step, self.spec.run.keep_checkpoints) as out:
                self.executor.broadcast("save", str(out))
                (out / "controller.json").write_text(_state_json(state))
        except OSError as e:  # a full disk or a folder made read-only during the run
            previous = checkpoint.latest(self.run_dir)
            raise guards.RunDirError(
                f"the checkpoint of step {step} could not be written under {self.run_dir} "
                f"({e.strerror or e}); "
                + (f"{previous} is intact" if previous else "no earlier checkpoint exists")
                + f". Free space, then resume: flowrl run {self.spec.file} --resume {self.run_dir}"
            ) from e

    def _resume(self) -> int:
        for temp in checkpoint.remove_temps(self.run_dir):
            print(f"removed {temp}: a checkpoint write that did not finish")
        directory = checkpoint.latest(self.run_dir)
        if directory is None:
            raise SystemExit(
                f"--resume {self.run_dir}: no checkpoint in {self.run_dir}/checkpoints"
            )
        state = json.loads((directory / "controller.json").read_text())
        self.executor.broadcast("load", str(directory))
        self.executor.sync_rollout_pools()  # a separate rollout copy gets the loaded weights
        self.loader.load_state_dict(state["loader"])
        self.executor.node_state.update(state["node_state"])
        rng.set_state(state["rng"])
        for name in ("metrics.jsonl", "samples.jsonl"):  # drop steps the resumed run redoes
            step_log.truncate_log(self.run_dir / name, state["step"])
        print(f"resumed from {directory} (step {state['step']})")
        return state["step"]


# -- helpers ---------------------------------------------------------------------------------


def _rollout_model(spec) -> str:
    for decl in spec.nodes.values():
        if decl.mode == "rollout":
            return decl.model
    return next(iter(spec.models))


def _state_json(state: dict) -> str:
    try:
        return json.dumps(state)
    except TypeError as e:
        raise TypeError(
            f"a stateful node keeps a value a checkpoint cannot store ({e}): keep numbers, "
            "strings, lists and dicts in its state"
        ) from e
