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
from flowrl.data import PromptLoader
from flowrl.data.split import prompt_sets
from flowrl.models import load_tokenizer
from flowrl.nodespec import GREEDY
from flowrl.runtime import checkpoint, faults, guards, make_executor, outcome, rng, step_log, stop
from flowrl.runtime import pipeline as pipelines
from flowrl.runtime import resume as resuming
from flowrl.runtime import run_dir as run_dirs
from flowrl.runtime.executor import StepResult
from flowrl.runtime.inputs import Recording
from flowrl.runtime.loggers import Loggers
from flowrl.runtime.partial import PartialPipeline
from flowrl.runtime.refill import refilled_step
from flowrl.runtime.trace import Trace


def run(
    plan,
    backend: str | None = None,
    resume: str | None = None,
    allow_graph_change: bool = False,
    command: str | None = None,
) -> Path:
    """Train with a compiled plan (`flowrl.compile`); returns the run directory.

    Args:
        resume: a run directory, or one of its checkpoints, to continue.
        allow_graph_change: resume even where the graph differs from the run's in a way a
            resume cannot honour (flowrl/runtime/resume.py).
        command: the command line that started this run, for messages (how to resume).
    """
    spec = plan.spec
    command = command or f"flowrl run {spec.file}"
    with stop.stopped_by_signals():
        made = None
        if resume:
            run_dir, asked = run_dirs.resume_target(resume)
        else:  # before any model loads: a name of its own, even for same-second starts
            (run_dir, made), asked = run_dirs.create(spec.run.out_dir, Path(spec.file).stem), None
        lock, trainer = run_dirs.Lock(run_dir), None
        try:
            lock.acquire()
            faults.point("locked", 0)
            if lock.stale:
                print(f"{run_dir}: its lock was left by {lock.stale}, no longer running; taken")
            changes = []
            if resume:
                asked, changes = resuming.prepare(run_dir, asked, spec, allow_graph_change, command)
            trainer = Trainer(plan, run_dir, backend or spec.run.backend, command=command)
            try:
                if resume:  # the models loaded: the resume goes ahead with this graph
                    resuming.record(run_dir, spec, asked, changes)
                trainer.fit(resume=asked if resume else False)
            finally:
                trainer.close()
        except stop.Stopped as e:
            raise e.explain(outcome.after_stop(run_dir, trainer, command)) from None
        finally:
            lock.release()
            if made is not None and (trainer is None or not trainer.started):
                run_dirs.remove(run_dir, made)  # refused or stopped before it began: no trace
    return run_dir


class Trainer:
    def __init__(self, plan, run_dir: Path, backend: str, command: str | None = None):
        guards.check_devices(plan)
        guards.check_packages(plan)
        spec = plan.spec
        self.spec, self.plan, self.run_dir = spec, plan, run_dir
        self.command = command or f"flowrl run {spec.file}"
        self.started, self.steps_done = False, 0  # for the message of a stopped run
        self.zero_steps: dict[str, int] = {}  # node -> steps in a row of gradient norm 0
        self.updates = guards.DeadUpdates(plan.spec)  # steps in a row whose updates did nothing
        rng.seed_everything(spec.run.seed)
        policy = _rollout_model(spec)
        self.tokenizer = load_tokenizer(spec.models[policy].path)  # also fills the model cache
        guards.check_models(spec, policy, self.tokenizer)
        # a reward model with its own tokenizer compares vocabularies with it (reward.model)
        self.batch_meta = {"seed": spec.run.seed, "policy_tokenizer": spec.models[policy].path}
        render = agent_prompt(spec, self.tokenizer)  # an agent node's prompts show its tools
        self.train_set, self.val_batch, _ = prompt_sets(spec, self.tokenizer, render)
        self.loader = PromptLoader(
            self.train_set, spec.data.batch_size, spec.run.seed, spec.data.shuffle
        )
        self.executor = make_executor(backend, plan, num_cpus=spec.run.num_cpus or None)
        self.trace = Trace()
        self.pipeline, self.queued = None, None  # run.staleness > 0: the stages' queue

    def close(self) -> None:
        from flowrl.rewards.pool import close_all

        if self.pipeline is not None:
            self.pipeline.close()
        self.executor.shutdown()
        close_all()  # scorer processes

    # -- the loop ----------------------------------------------------------------------------
    def fit(self, resume: bool | Path = False) -> None:
        """Train from step 0, or with `resume` (True: the newest checkpoint, or a checkpoint
        directory) from a checkpoint, to run.steps."""
        guards.writable(self.run_dir)
        self.started, start_step = True, 0
        if resume:
            start_step = self._resume(None if resume is True else Path(resume))
        else:
            with self._writing("graph.toml and run.json"):
                self._write_run_files()
        self.steps_done = start_step
        with contextlib.ExitStack() as stack:
            with self._writing("metrics.jsonl"):
                loggers = Loggers(self.spec.run.loggers, self.run_dir, self.spec)
                stack.callback(loggers.close)
                samples_file = open(self.run_dir / "samples.jsonl", "a")
                stack.callback(_close_quietly, samples_file)
            stack.callback(self._write_trace)  # also when stopped: what the steps did
            if resume:
                with self._writing("metrics.jsonl"):
                    loggers.log({"event": "resume", "step": start_step})
            elif self.val_batch is not None:
                scores = self.validate(0)
                with self._writing("metrics.jsonl"):
                    loggers.log({"step": 0, **scores})
            stages, steps = self.plan.pipeline, self.spec.run.steps
            if stages is not None and stages.partial:  # rounds of partial rollouts
                self.pipeline = PartialPipeline(
                    self.executor,
                    stages,
                    self._round,
                    self.tokenizer,
                    start_step,
                    steps,
                    self.queued,
                )
            elif stages is not None:  # the rollout stage starts running ahead
                self.pipeline = pipelines.Pipeline(
                    self.executor, stages, self._rollout, start_step, steps, self.queued
                )
            self._loop(start_step, loggers, samples_file)

    def _write_run_files(self) -> None:
        (self.run_dir / "graph.toml").write_text(toml.dumps(self.spec.raw))
        source = {"graph": str(Path(self.spec.file).resolve())}
        source["base_dir"] = str(Path(self.spec.base_dir).resolve())
        source["command"] = self.command
        (self.run_dir / "run.json").write_text(json.dumps(source, indent=2) + "\n")

    def _write_trace(self) -> None:
        with contextlib.suppress(OSError):  # a full disk was reported where it happened
            self.trace.write(self.run_dir / "trace.json")

    @contextlib.contextmanager
    def _writing(self, what: str, step: int | None = None):
        """Turn a failed write (a full disk, a file or folder made read-only) into a RunDirError
        naming what, where and the last intact checkpoint."""
        try:
            yield
        except Exception as e:
            if step is None and not isinstance(e, OSError):
                raise
            raise guards.RunDirError(outcome.failed_write(self, what, e)) from e

    def _loop(self, start_step: int, loggers: Loggers, samples_file) -> None:
        run, failed_steps = self.spec.run, 0
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
            with self._writing("metrics.jsonl and samples.jsonl"):
                loggers.log(metrics)  # metrics.jsonl, and TensorBoard / W&B when chosen
                step_log.log_samples(samples_file, step, batch, run.log_samples)
            self.steps_done = step
            failed_steps = self._failures(step, batch, loggers, failed_steps)
            faults.point("logged", step)
            for event in self.updates.observe(step, metrics):  # updates that did nothing
                tqdm.write(event.pop("said"))
                loggers.log(event)
            dead = self.updates.streak
            if dead >= run.max_nonfinite_steps or self.updates.fatal or (last and dead):
                raise self.updates.stop(step, self.run_dir, self.command)
            if message := step_log.stuck(self.zero_steps, step, metrics):
                tqdm.write(f"warning: {message}")
                with self._writing("metrics.jsonl"):
                    loggers.log({"event": "warning", "step": step, "message": message})
            if (last or (run.save_every and step % run.save_every == 0)) and not dead:
                self.save(step)  # none while updates do nothing: the last good one is kept
            bar.set_postfix(step_log.postfix(metrics))

    def _failures(self, step: int, batch, loggers: Loggers, failed_steps: int) -> int:
        """Show this step's failed requests (the first few with their rows); stop after
        run.max_failed_steps steps in a row that trained on nothing. Returns that count."""
        failed = step_log.failed_requests(batch)
        lines = step_log.failure_lines(batch, failed)
        if failed:
            loggers.log({"event": "failed_requests", "step": step, "count": len(failed)})
            tqdm.write(step_log.failure_report(step, batch, failed, lines))
        failed_steps = failed_steps + 1 if step_log.trained_nothing(batch) else 0
        if failed_steps >= self.spec.run.max_failed_steps:
            raise guards.FailedStepsStop(
                f"{failed_steps} steps in a row (up to step {step}) trained on nothing: "
                + step_log.nothing_trained(batch, lines)
                + f"\nFix the tools or rows (flowrl check {self.spec.file}), then replay with "
                f"flowrl run {self.spec.file} --resume {self.run_dir} "
                "(run.max_failed_steps sets how many are tolerated)"
            )
        return failed_steps

    def step(self, step: int) -> StepResult:
        """One training step: the walk's StepResult, its metrics completed with the step's
        timings, throughput and process metrics (what metrics.jsonl logs)."""
        start = time.time()
        run = self.spec.run
        record = self._record(step, step - 1, keep=tuple(run.save_inputs))
        if self.pipeline is not None:
            walked = self._pipelined(step, record)
        elif self.plan.refill is not None:  # a filter that samples more prompts (DAPO)
            batch = self._prompts(step)
            more = functools.partial(self._prompts, step)
            walked = refilled_step(self.executor, self.plan.refill, batch, more, record)
        else:
            batch, only = self._prompts(step), None
            if step <= run.critic_warmup:  # the critic alone trains
                only = set(self.spec.nodes) - set(self.plan.after_warmup)
            walked = self.executor.run_step(batch, only=only, record=record)
        batch, metrics, slices = walked.batch, walked.metrics, walked.slices
        seconds = time.time() - start
        self.trace.add(slices, step)
        out = {"step": step, "time_s": seconds, **step_log.batch_metrics(batch), **metrics}
        out["data/dropped_too_long"] = self.train_set.filtered  # prompts never trained on
        out["data/duplicates"] = self.train_set.duplicates
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

    def _pipelined(self, step: int, record: Recording) -> StepResult:
        """The train stage on the queued batch of `step`, then the weights exported for the
        rollout stage (run.staleness > 0, flowrl/runtime/pipeline.py)."""
        rollout, metrics = self.pipeline.take(step)
        ids = self.plan.pipeline.train_items
        walked = self.executor.run_stage(rollout.result.batch, ids, record)
        self.pipeline.export(step)
        metrics = {**rollout.result.metrics, **walked.metrics, **metrics}
        slices = rollout.result.slices + walked.slices + self.pipeline.drain_slices()
        return StepResult(walked.batch, metrics, slices)

    def _rollout(self, step: int) -> tuple[StepResult, dict]:
        """The rollout stage of `step` on its prompts, and the loader's state after them (in
        the rollout stage's thread: the loader is read there alone while the pipeline runs)."""
        batch = self._prompts(step)
        loader = self.loader.state_dict()
        record = self._record(step, step - 1, keep=tuple(self.spec.run.save_inputs))
        ids = self.plan.pipeline.rollout_items
        return self.executor.run_stage(batch, ids, record, "controller/rollout stage"), loader

    def _round(self, r: int, version: int) -> tuple:
        """Round r of partial rollouts, on the weights of update `version`: its prompts, the
        loader's state after them and where its node calls keep their inputs (in the rollout
        stage's thread, as `_rollout`)."""
        batch = self._prompts(r)
        record = self._record(r, version, keep=tuple(self.spec.run.save_inputs))
        return batch, self.loader.state_dict(), record

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
        held = self.pipeline.weights_of(step) if self.pipeline else contextlib.nullcontext()
        with held:  # the rollout pool, with this step's weights
            walked = self.executor.run_step(
                batch, only=set(validation.nodes), param_changes=greedy, record=record
            )
        out, metrics = walked.batch, walked.metrics
        result = {"val/score": float(out["scores"].float().mean())}
        for key, value in metrics.items():  # failed scorer calls count in validation too
            if key.endswith(("/errors", "/timeouts")):
                result[f"val/{key}"] = value
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
        queued = pipelines.Queued()
        if self.pipeline is not None:  # the loader has run ahead: its state after the queue
            queued = self.pipeline.queued(step)
            state["loader"] = queued.loader or state["loader"]
            state.update(pipelines.entries(queued))
        keep, graph = self.spec.run.keep_checkpoints, self.spec.raw
        with self._writing(f"the checkpoint of step {step}", step=step):
            with checkpoint.writing(self.run_dir, step, keep, graph) as out:
                pipelines.save_queue(out, queued)
                self.executor.broadcast("save", str(out))
                (out / "controller.json").write_text(_state_json(state))

    def _resume(self, directory: Path | None) -> int:
        """Load a checkpoint (None: the newest, verified) and cut the logs back to its step."""
        if directory is None:
            directory = resuming.choose(self.run_dir, None, self.command)
        for temp in checkpoint.remove_temps(self.run_dir):
            print(f"removed {temp}: a checkpoint write that did not finish")
        for newer in checkpoint.set_aside_newer(directory):
            print(f"set {newer.name} aside as {newer}: it is newer than the checkpoint resumed")
        state = json.loads((directory / "controller.json").read_text())
        self.executor.broadcast("load", str(directory))
        self.executor.sync_rollout_pools()  # a separate rollout copy gets the loaded weights
        self.loader.load_state_dict(state["loader"])
        self.queued = pipelines.load_queue(directory, state)
        self.executor.node_state.update(state["node_state"])
        rng.set_state(state["rng"])
        with self._writing("metrics.jsonl and samples.jsonl"):
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


def _close_quietly(file) -> None:
    with contextlib.suppress(OSError):  # a full disk was reported where it happened
        file.close()


def _state_json(state: dict) -> str:
    try:
        return json.dumps(state)
    except TypeError as e:
        raise TypeError(
            f"a stateful node keeps a value a checkpoint cannot store ({e}): keep numbers, "
            "strings, lists and dicts in its state"
        ) from e
