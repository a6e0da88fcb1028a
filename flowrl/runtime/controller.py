"""The controller loop: for each step, a prompt batch -> the plan's items -> metrics and logs.

    for step in steps:
        batch = next(loader)                      # prompts, prompt_mask, uid, ground truths
        batch, metrics = executor.run_step(batch) # every plan item, independent ones overlapped
        log(metrics); validate / checkpoint when due

A run directory holds graph.toml (the resolved graph), metrics.jsonl, samples.jsonl,
trace.json (Chrome / Perfetto trace) and checkpoints/step_NNNNNN (written atomically).
"""

import json
import random
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import toml
import torch
from tqdm import tqdm

from flowrl.data import PromptDataset, PromptLoader, make_rows
from flowrl.models import load_tokenizer
from flowrl.nodespec import GREEDY
from flowrl.runtime import checkpoint, faults, make_executor
from flowrl.runtime.trace import Trace


def run(plan, backend: str | None = None, resume: str | None = None) -> Path:
    """Train with a compiled plan (`flowrl.compile`); returns the run directory."""
    backend = backend or plan.spec.run.backend
    run_dir = Path(resume) if resume else _new_run_dir(plan.spec)
    trainer = Trainer(plan, run_dir, backend)
    try:
        trainer.fit(resume=resume is not None)
    finally:
        trainer.close()
    return run_dir


class Trainer:
    def __init__(self, plan, run_dir: Path, backend: str):
        spec = plan.spec
        self.spec, self.plan, self.run_dir = spec, plan, run_dir
        _seed_everything(spec.run.seed)
        policy = _rollout_model(spec)
        self.tokenizer = load_tokenizer(spec.models[policy].path)  # also fills the model cache
        data = spec.data
        rows = make_rows(data.source, "train", data.train_size, spec.run.seed, spec.base_dir)
        self.train_set = PromptDataset(rows, self.tokenizer, data.max_prompt_len)
        self.loader = PromptLoader(self.train_set, data.batch_size, spec.run.seed, data.shuffle)
        self.val_batch = None
        if spec.run.val_size:
            source = data.val_source or data.source
            val_rows = make_rows(
                source, "validation", spec.run.val_size, spec.run.seed, spec.base_dir
            )
            val_set = PromptDataset(
                val_rows[: spec.run.val_size], self.tokenizer, data.max_prompt_len
            )
            self.val_batch = val_set.collate(list(range(len(val_set))))
        self.executor = make_executor(backend, plan, num_cpus=spec.run.num_cpus or None)
        self.trace = Trace()

    def close(self) -> None:
        self.executor.shutdown()

    # -- the loop ----------------------------------------------------------------------------
    def fit(self, resume: bool = False) -> None:
        run = self.spec.run
        self.run_dir.mkdir(parents=True, exist_ok=True)
        start_step = 0
        if resume:
            start_step = self._resume()
        else:
            (self.run_dir / "graph.toml").write_text(toml.dumps(self.spec.raw))
        metrics_file = open(self.run_dir / "metrics.jsonl", "a")
        samples_file = open(self.run_dir / "samples.jsonl", "a")
        if resume:
            metrics_file.write(json.dumps({"event": "resume", "step": start_step}) + "\n")
        elif self.val_batch is not None:
            _log(metrics_file, {"step": 0, **self.validate()})
        bar = tqdm(
            range(start_step + 1, run.steps + 1),
            initial=start_step,
            total=run.steps,
            desc=Path(self.spec.file).stem,
            dynamic_ncols=True,
        )
        for step in bar:
            metrics, batch = self.step(step)
            last = step == run.steps
            if self.val_batch is not None and (
                last or (run.val_every and step % run.val_every == 0)
            ):
                metrics.update(self.validate())
            _log(metrics_file, metrics)
            _log_samples(samples_file, step, batch, run.log_samples)
            faults.point("logged", step)
            if last or (run.save_every and step % run.save_every == 0):
                self.save(step)
            bar.set_postfix(_postfix(metrics))
        metrics_file.close()
        samples_file.close()
        self.trace.write(self.run_dir / "trace.json")

    def step(self, step: int) -> tuple[dict, object]:
        start = time.time()
        batch = next(self.loader)
        batch.meta.update(step=step, seed=self.spec.run.seed)
        batch, metrics, slices = self.executor.run_step(batch)
        seconds = time.time() - start
        self.trace.add(slices, step)
        out = {"step": step, "time_s": seconds, **_batch_metrics(batch), **metrics}
        for name, value in _timings(slices).items():
            out[f"timing_s/{name}"] = value
        tokens = (
            float(batch["prompt_mask"].sum() + batch["response_mask"].sum())
            if "response_mask" in batch
            else 0.0
        )
        out["tokens_per_s"] = tokens / seconds
        return out, batch

    def validate(self) -> dict:
        """Greedy decoding on the validation prompts, scored by the graph's own reward nodes."""
        validation = self.plan.validation
        if not validation.nodes:
            return {}
        greedy = dict.fromkeys(validation.greedy, GREEDY)
        batch = self.val_batch.index(slice(0, len(self.val_batch)))
        batch.meta.update(step=0, seed=self.spec.run.seed)
        out, _, _ = self.executor.run_step(batch, only=set(validation.nodes), overrides=greedy)
        result = {"val/score": float(out["scores"].float().mean())}
        if "response_mask" in out:
            result["val/response_length"] = float(out["response_mask"].sum(-1).float().mean())
        return result

    # -- checkpoints ---------------------------------------------------------------------------
    def save(self, step: int) -> None:
        state = {
            "step": step,
            "loader": self.loader.state_dict(),
            "node_state": self.executor.node_state,
            "rng": _rng_state(),
        }
        with checkpoint.writing(self.run_dir, step, self.spec.run.keep_checkpoints) as directory:
            self.executor.broadcast("save", str(directory))
            torch.save(state, directory / "controller.pt")

    def _resume(self) -> int:
        for temp in checkpoint.remove_temps(self.run_dir):
            print(f"removed {temp}: a checkpoint write that did not finish")
        directory = checkpoint.latest(self.run_dir)
        if directory is None:
            raise SystemExit(
                f"--resume {self.run_dir}: no checkpoint in {self.run_dir}/checkpoints"
            )
        state = torch.load(directory / "controller.pt", weights_only=False)
        self.executor.broadcast("load", str(directory))
        self.executor.sync_rollout_pools()  # a separate rollout copy gets the loaded weights
        self.loader.load_state_dict(state["loader"])
        self.executor.node_state.update(state["node_state"])
        _set_rng_state(state["rng"])
        for name in ("metrics.jsonl", "samples.jsonl"):  # drop steps the resumed run redoes
            _truncate_log(self.run_dir / name, state["step"])
        print(f"resumed from {directory} (step {state['step']})")
        return state["step"]


# -- helpers ---------------------------------------------------------------------------------


def _new_run_dir(spec) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path(spec.run.out_dir) / f"{Path(spec.file).stem}-{stamp}"
    path, k = base, 1
    while path.exists():
        path, k = Path(f"{base}-{k}"), k + 1
    return path


def _rollout_model(spec) -> str:
    for decl in spec.nodes.values():
        if decl.mode == "rollout":
            return decl.model
    return next(iter(spec.models))


def _batch_metrics(batch) -> dict:
    out = {}
    if "scores" in batch:
        out["score/mean"] = float(batch["scores"].float().mean())
    if "response_mask" in batch:
        lengths = batch["response_mask"].sum(-1).float()
        out["response_length/mean"] = float(lengths.mean())
        out["response_length/max"] = float(lengths.max())
    out["rows"] = len(batch)
    return out


def _timings(slices) -> dict:
    """Seconds per plan item: the longest rank's run (they run in parallel)."""
    out = {}
    for s in slices:
        out[s.name] = max(out.get(s.name, 0.0), s.end - s.start)
    return out


def _postfix(metrics: dict) -> dict:
    keys = {"score/mean": "score", "val/score": "val", "time_s": "s/step", "tokens_per_s": "tok/s"}
    return {short: f"{metrics[k]:.3g}" for k, short in keys.items() if k in metrics}


def _log(file, metrics: dict) -> None:
    file.write(json.dumps(metrics, sort_keys=True) + "\n")
    file.flush()


def _truncate_log(path: Path, step: int) -> None:
    """Keep the rows of `path` (JSON lines) up to `step`, and events; a torn last line (the
    writer was killed mid-write) goes too. Replaced atomically, so a kill here loses nothing."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if "event" in row or row.get("step", 0) <= step:
            kept.append(line + "\n")
    temp = path.with_name(path.name + ".tmp")
    temp.write_text("".join(kept))
    temp.replace(path)


def _log_samples(file, step: int, batch, count: int) -> None:
    for i in range(min(count, len(batch))):
        row = {"step": step}
        for key in ("prompt_text", "response_text", "ground_truth"):
            if key in batch:
                row[key] = str(batch[key][i])
        if "scores" in batch:
            row["score"] = float(batch["scores"][i])
        if "rollout_info" in batch:  # a multi-turn row: the conversation, trained spans in [[ ]]
            info = batch["rollout_info"][i]
            row["termination"] = info["termination"]
            row["conversation"] = info["messages"]
            row["response_marked"] = "".join(
                f"[[{text}]]" if trained else text for text, trained in info["trained_spans"]
            )
        file.write(json.dumps(row) + "\n")
    file.flush()


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _rng_state() -> dict:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
