"""What the controller logs each step besides the nodes' own metrics: batch and process
metrics, item timings, the progress bar's numbers, samples.jsonl rows, and the cut of a log
back to a resumed step."""

import json
import os
from pathlib import Path


def batch_metrics(batch) -> dict:
    out = {"rows": len(batch)}
    if len(batch) == 0:  # a filter kept nothing: no update this step
        return out
    if "scores" in batch:
        out["score/mean"] = float(batch["scores"].float().mean())
    if "response_mask" in batch:
        lengths = batch["response_mask"].sum(-1).float()
        out["response_length/mean"] = float(lengths.mean())
        out["response_length/max"] = float(lengths.max())
    return out


def step_metrics(step: int, seconds: float, walked, train_set) -> dict:
    """What metrics.jsonl logs of a step: its walk's metrics (a `StepResult`'s) with the
    batch's, the prompts the data set dropped or repeats, each item's time, tokens per second
    and the process's."""
    batch = walked.batch
    out = {"step": step, "time_s": seconds, **batch_metrics(batch), **walked.metrics}
    out["data/dropped_too_long"] = train_set.filtered  # prompts never trained on
    out["data/duplicates"] = train_set.duplicates
    for name, value in timings(walked.slices).items():
        out[f"timing_s/{name}"] = value
    tokens = (
        float(batch["prompt_mask"].sum() + batch["response_mask"].sum())
        if "response_mask" in batch
        else 0.0
    )
    out["tokens_per_s"] = tokens / seconds
    out.update(process_metrics())
    return out


def process_metrics() -> dict:
    """The controller process's resident memory and open file descriptors (Linux), to see
    leaks in long runs; empty elsewhere."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        fds = len(os.listdir("/proc/self/fd"))
    except (OSError, ValueError, IndexError):
        return {}
    return {"process/rss_mb": pages * os.sysconf("SC_PAGE_SIZE") / 2**20, "process/open_fds": fds}


def timings(slices) -> dict:
    """Seconds per plan item: summed over the item's runs on a track (a refilling step runs
    some items once per prompt batch), then the longest rank's (they run in parallel)."""
    per_track: dict[tuple, float] = {}
    for s in slices:
        per_track[s.name, s.track] = per_track.get((s.name, s.track), 0.0) + s.end - s.start
    out: dict[str, float] = {}
    for (name, _), seconds in per_track.items():
        out[name] = max(out.get(name, 0.0), seconds)
    return out


def postfix(metrics: dict) -> dict:
    keys = {"score/mean": "score", "val/score": "val", "time_s": "s/step", "tokens_per_s": "tok/s"}
    return {short: f"{metrics[k]:.3g}" for k, short in keys.items() if k in metrics}


def truncate_log(path: Path, step: int) -> None:
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


FAILED_SHARE = 0.5  # a step in which more than this share of the requests failed trains not
FAILED_STEP = "failed_requests"  # the batch meta key of such a step: what failed, first error
INFRA = "infra"  # a request whose engine or service failed (flowrl/agent/episode.py)
MIN_GROUP = 2  # rows a group keeps, of those whose infrastructure did not fail, or it goes


def failed_step(batch) -> str:
    """'' unless more than FAILED_SHARE of a multi-turn step's requests failed (ended in an
    error or ran out of time: they train on nothing); then "k of m requests failed; first:
    <the first one's error, with the file:line it came from>"."""
    if "rollout_info" not in batch or len(batch) == 0:
        return ""
    infos = batch["rollout_info"]
    failed = [info for info in infos if info["termination"] in ("error", "timeout", INFRA)]
    if len(failed) <= FAILED_SHARE * len(infos):
        return ""
    first = failed[0].get("error") or "ran out of time (request_timeout_s)"
    return f"{len(failed)} of {len(infos)} requests failed; first: {first}"


def infra_rows(batch) -> tuple[list[int], int]:
    """The rows a multi-turn batch leaves out: those whose request ended in "infra" (what it
    ran on failed), and the rest of a group (rows of one `uid`) left with fewer than
    MIN_GROUP rows by them, where groups have several rows; and how many groups went."""
    infos = batch["rollout_info"]
    failed = {i for i, info in enumerate(infos) if info["termination"] == INFRA}
    if not failed:
        return [], 0
    if "uid" not in batch:
        return sorted(failed), 0
    members: dict[int, list[int]] = {}
    for i, uid in enumerate(batch["uid"].tolist()):
        members.setdefault(uid, []).append(i)
    out, dropped = set(failed), 0
    if max(len(rows) for rows in members.values()) > 1:  # groups: n samples of a prompt
        for rows in members.values():
            kept = [i for i in rows if i not in failed]
            if len(kept) < len(rows) and len(kept) < MIN_GROUP:
                out |= set(kept)
                dropped += 1
    return sorted(out), dropped


def failed_requests(batch) -> list[int]:
    """Rows of a multi-turn batch whose request failed (an error, a timeout, a tool that
    could not be released): their text goes to samples.jsonl and the first few to the log."""
    if "rollout_info" not in batch:
        return []
    infos = batch["rollout_info"]
    return [
        i
        for i, info in enumerate(infos)
        if info.get("error") or info.get("release_errors") or info["termination"] == "timeout"
    ]


def failure_lines(batch, rows: list[int], count: int = 3) -> list[str]:
    """The first `count` failed requests, each with its row (uid, prompt) and error."""
    out = []
    for i in rows[:count]:
        info = batch["rollout_info"][i]
        error = info.get("error") or "; ".join(info.get("release_errors") or []) or "timed out"
        prompt = str(batch["prompt_text"][i])[-120:] if "prompt_text" in batch else ""
        uid = int(batch["uid"][i]) if "uid" in batch else i
        out.append(f"  request {i} (row uid {uid}, {info['termination']}): {error} | {prompt!r}")
    return out


def failure_report(step: int, batch, failed: list[int], lines: list[str]) -> str:
    """The log's lines about a step's failed requests: how many, and whether the step's update
    was passed over (most failed) or trained on the rest."""
    head = batch.meta.get(FAILED_STEP) or f"{len(failed)} of {len(batch)} requests failed"
    skipped = "; the step's update was skipped" if batch.meta.get(FAILED_STEP) else ""
    return f"step {step}: {head}{skipped}\n" + "\n".join(lines)


def nothing_trained(batch, lines: list[str]) -> str:
    """Why the last step trained on nothing, its first errors after it."""
    why = batch.meta.get(FAILED_STEP)
    if why:
        return f"{why}. The first, with their rows:\n" + "\n".join(lines)
    return "every request failed or had no sampled token. First failures:\n" + (
        "\n".join(lines) or "  (none failed: every response was empty)"
    )


def trained_nothing(batch) -> bool:
    """A step whose update learned nothing: most of its requests failed (the walk passed the
    update over), or its rollouts gave no trained token (every response cut to nothing)."""
    if batch.meta.get(FAILED_STEP):
        return True
    return "response_mask" in batch and int(batch["response_mask"].sum()) == 0


def log_samples(file, step: int, batch, count: int) -> None:
    failed = failed_requests(batch)
    for i in sorted(set(range(min(count, len(batch)))) | set(failed)):
        row = {"step": step}
        for key in ("prompt_text", "response_text", "ground_truth"):
            if key in batch:
                row[key] = str(batch[key][i])
        if "scores" in batch:
            row["score"] = float(batch["scores"][i])
        if "rollout_info" in batch:  # a multi-turn row: the conversation, trained spans in [[ ]]
            info = batch["rollout_info"][i]
            row["termination"] = info["termination"]
            if info.get("error") or info.get("release_errors"):
                row["error"] = info.get("error") or "; ".join(info["release_errors"])
            row["conversation"] = info["messages"]
            row["response_marked"] = "".join(
                f"[[{text}]]" if trained else text for text, trained in info["trained_spans"]
            )
        file.write(json.dumps(row) + "\n")
    file.flush()
