"""The controller loop: for each step, a prompt batch -> the plan's items -> metrics and logs.

    source = steps.source(executor, plan, feed)   # how a step's batch is made, chosen once
    for step in steps:
        result = source.next(step)                # prompts -> every plan item, independent
                                                  #   ones overlapped (flowrl/runtime/steps.py)
        validate when due; log(result.metrics)
        the guards (failed requests, dead updates: flowrl/runtime/guards.py); save when due
        a rank lost on the way: recover and go on from the restored step; SIGTERM: save,
        stop (checkpoints, resume and recovery: flowrl/runtime/restoring.py)

A run directory holds graph.toml (the resolved graph), run.json (where the graph file was:
its relative paths resolve from there), metrics.jsonl, samples.jsonl, trace.json (Chrome /
Perfetto trace), checkpoints/step_NNNNNN (written atomically), and for `flowrl replay` the
inputs of a failed node call (failures/) and of the nodes in run.save_inputs (inputs/).
"""

import contextlib
import json
import time
from pathlib import Path

import toml
from tqdm import tqdm

from flowrl.data import PromptLoader
from flowrl.data.split import make_sampler, prompt_sets
from flowrl.models import load_tokenizer
from flowrl.nodespec import GREEDY
from flowrl.runtime import faults, guards, make_executor, outcome, rng, step_log, stop
from flowrl.runtime import resume as resuming
from flowrl.runtime import run_dir as run_dirs
from flowrl.runtime import steps as step_sources
from flowrl.runtime.executor import StepResult
from flowrl.runtime.feed import PromptFeed
from flowrl.runtime.loggers import Loggers
from flowrl.runtime.recovery import LostWorker, Recovery
from flowrl.runtime.restoring import TrainerState, close_quietly
from flowrl.runtime.trace import Trace
from flowrl.runtime.weight_check import StaleWeights


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


class Trainer(TrainerState):
    """One run's loop over its steps, with its guards (failed requests, updates that do
    nothing, zero gradients: flowrl/runtime/guards.py), validation, logs and checkpoints; how
    each step's batch is made is its `StepSource` (flowrl/runtime/steps.py)."""

    def __init__(self, plan, run_dir: Path, backend: str, command: str | None = None):
        guards.check_devices(plan)
        guards.check_packages(plan)
        spec = plan.spec
        self.spec, self.plan, self.run_dir = spec, plan, run_dir
        self.stale_weights = StaleWeights(spec)
        self.command = command or f"flowrl run {spec.file}"
        self.started, self.steps_done = False, 0  # for the message of a stopped run
        self.guards = guards.step_guards(spec, run_dir, self.command)  # what can stop a step
        rng.seed_everything(spec.run.seed)
        policy = _rollout_model(spec)
        self.tokenizer = load_tokenizer(spec.models[policy].path)  # also fills the model cache
        guards.check_models(spec, policy, self.tokenizer)
        # a reward model with its own tokenizer compares vocabularies with it (reward.model)
        batch_meta = {"seed": spec.run.seed, "policy_tokenizer": spec.models[policy].path}
        self.train_set, self.val_batch, _ = prompt_sets(spec, self.tokenizer)
        self.loader = PromptLoader(
            self.train_set,
            spec.data.batch_size,
            spec.run.seed,
            spec.data.shuffle,
            sampler=make_sampler(spec, len(self.train_set)),
        )
        run = spec.run
        self.feed = PromptFeed(
            self.loader, batch_meta, run_dir, run.save_inputs, run.save_inputs_last
        )
        self.executor = make_executor(backend, plan, num_cpus=spec.run.num_cpus or None)
        self.source = step_sources.source(self.executor, plan, self.feed, self.tokenizer)
        self.trace = Trace()
        restarts = run.max_restarts if getattr(self.executor, "restartable", False) else 0
        self.recovery = Recovery(restarts, run.restart_backoff_s)
        self.start_state = None  # what a recovery before the first checkpoint goes back to
        self.loggers = self.samples = None

    def close(self) -> None:
        from flowrl.rewards.pool import close_all

        self.source.close()
        self.executor.shutdown()
        close_all()  # scorer processes

    # -- the loop ----------------------------------------------------------------------------
    def fit(self, resume: bool | Path = False) -> None:
        """Train from step 0, or with `resume` (True: the newest checkpoint, or a checkpoint
        directory) from a checkpoint, to run.steps."""
        guards.writable(self.run_dir)
        self.started, start_step, queued = True, 0, None
        if not resume:
            with self._writing("graph.toml and run.json"):
                self._write_run_files()
        with contextlib.ExitStack() as stack:
            with self._writing("metrics.jsonl"):
                self.loggers = Loggers(self.spec.run.loggers, self.run_dir, self.spec)
                stack.callback(lambda: self.loggers.close())
                self.samples = open(self.run_dir / "samples.jsonl", "a")
                stack.callback(lambda: close_quietly(self.samples))
            stack.callback(self._write_trace)  # also when stopped: what the steps did
            if resume:
                try:
                    start_step, queued = self._resume(None if resume is True else Path(resume))
                except LostWorker as lost:  # a rank lost while loading: made again, loaded
                    start_step, queued = self._recover(lost, 0)
                self.steps_done = start_step
                with self._writing("metrics.jsonl"):
                    self.loggers.log({"event": "resume", "step": start_step})
            else:  # a recovery before the first checkpoint goes back to the run's start
                self.start_state = self._state(0)
                if self.val_batch is not None:
                    scores = self._validate_start()
                    with self._writing("metrics.jsonl"):
                        self.loggers.log({"step": 0, **scores})
                    self.start_state = self._state(0)  # validation's draws included
            self.source.start(start_step, queued)  # a rollout stage starts running ahead
            self._loop(start_step)

    def _validate_start(self) -> dict:
        """Validation before the first step, again after a recovery if a rank was lost."""
        while True:
            try:
                return self.validate(0)
            except LostWorker as lost:
                self._recover(lost, 0)

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
            if isinstance(e, LostWorker) or (step is None and not isinstance(e, OSError)):
                raise  # a lost rank is recovered from, not a failed write
            raise run_dirs.RunDirError(outcome.failed_write(self, what, e)) from e

    def _loop(self, start_step: int) -> None:
        run = self.spec.run
        bar = tqdm(
            initial=start_step, total=run.steps, desc=Path(self.spec.file).stem, dynamic_ncols=True
        )
        step = start_step + 1
        with stop.preemptible(run.term_grace_s) as preemption:
            while step <= run.steps:
                try:
                    saved = self._one_step(step, bar)
                except LostWorker as lost:  # a rank is gone: from the last checkpoint again
                    restored, queued = self._recover(lost, step)
                    self.source.start(restored, queued)
                    step = restored + 1
                    bar.n = restored
                    bar.refresh()
                    continue
                if preemption.requested:  # SIGTERM: a checkpoint at this safe point, then stop
                    if not saved:
                        self.save(step)
                    raise stop.Stopped("SIGTERM")
                step += 1
        bar.close()

    def _one_step(self, step: int, bar) -> bool:
        """Step `step`: its walk, validation when due, logs, guards and checkpoint; whether a
        checkpoint was written."""
        run = self.spec.run
        result = self.step(step)
        if self.val_batch is not None and self._due(step, run.val_every):
            result.metrics.update(self.validate(step))
        with self._writing("metrics.jsonl and samples.jsonl"):
            self.loggers.log(result.metrics)  # metrics.jsonl, and TensorBoard / W&B when chosen
            step_log.log_samples(self.samples, step, result.batch, run.log_samples)
        self.steps_done = step
        faults.point("logged", step)
        self._guard(step, result, self.loggers)
        saved = self._due(step, run.save_every) and all(g.may_save for g in self.guards)
        if saved:
            self.save(step)  # none while a guard says no: the last good one is kept
        self.recovery.finished(step)
        bar.update(1)
        bar.set_postfix(step_log.postfix(result.metrics))
        return saved

    def _due(self, step: int, every: int) -> bool:
        """Whether something done every `every` steps (0: only at the end) is due."""
        return step == self.spec.run.steps or bool(every and step % every == 0)

    def _guard(self, step: int, result: StepResult, loggers: Loggers) -> None:
        """Each guard's events of this step to the console and the log; a guard's stop ends
        the run here (flowrl/runtime/guards.py)."""
        for guard in self.guards:
            for event in guard.observe(step, result):
                tqdm.write(event.pop("said"))
                with self._writing("metrics.jsonl"):
                    loggers.log(event)
            guard.check(step)

    def step(self, step: int) -> StepResult:
        """One training step: the walk's StepResult, its metrics completed with the step's
        timings, throughput and process metrics (what metrics.jsonl logs)."""
        start = time.time()
        walked = self.source.next(step)
        seconds = time.time() - start
        self.trace.add(walked.slices, step)
        out = step_log.step_metrics(step, seconds, walked, self.train_set)
        out.update(self.stale_weights.observe(step, walked.batch))
        return StepResult(walked.batch, out, walked.slices)

    def validate(self, step: int = 0) -> dict:
        """Greedy decoding on the validation prompts, scored by the graph's own reward nodes;
        `step`: the training steps done (names a failed call's saved inputs)."""
        validation = self.plan.validation
        if not validation.nodes:
            return {}
        greedy = dict.fromkeys(validation.greedy, GREEDY)
        batch = self.val_batch.index(slice(0, len(self.val_batch)))
        batch.meta.update(self.feed.batch_meta, step=0)
        record = self.feed.record(step, step, validation=True)
        with self.source.weights_of(step):  # the rollout pool, with this step's weights
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


# -- helpers ---------------------------------------------------------------------------------


def _rollout_model(spec) -> str:
    for decl in spec.nodes.values():
        if decl.mode == "rollout":
            return decl.model
    return next(iter(spec.models))
