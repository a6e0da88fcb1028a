"""Between a batch and an agent program's episodes (nodes/agent_program.py): the rows handed
to the program, and the episodes' recorded calls as the node's response tensors.

An episode's row keeps the dataset's prompt as `prompts`; its response is every call from
that prompt on (record.segments): completions trained, the tokens between calls attended to.
Its first call must start from the row's prompt (the program sends the row's messages first,
as given); a call that rewrites the history starts a segment the row cannot hold: counted,
not trained. A failed episode trains on nothing (mask all 0).
"""

from __future__ import annotations

import numpy as np
import torch

from flowrl.agent.rows import response_tensors
from flowrl.serve.programs import KINDS
from flowrl.serve.record import segments


def rows_for(batch, n: int) -> tuple[list[dict], list[list[int]]]:
    """(the program's rows, each row's prompt ids): n per batch row, row 0's first."""
    prompts, mask = batch["prompts"], batch["prompt_mask"]
    infos = batch["extra_info"] if "extra_info" in batch else [None] * len(prompts)
    messages = batch["raw_prompt"] if "raw_prompt" in batch else [()] * len(prompts)
    rows, ids = [], []
    for i in range(len(prompts)):
        prompt = prompts[i][mask[i].bool()].tolist()
        extra = infos[i] if isinstance(infos[i], dict) else {}
        for j in range(n):
            rows.append(
                {"prompt": list(messages[i] or ()), "extra_info": extra, "index": i, "sample": j}
            )
            ids.append(prompt)
    return rows, ids


def episode_rows(outcome, prompt: list[int], slots: int = 1) -> tuple[list[tuple], int]:
    """([(response ids, mask, log-probs)] * slots, segments dropped) of one episode over its
    row's prompt: its segments (record.segments) in order, each as the row's prompt followed
    by the rest of the segment's prompt (attended to, mask 0) and its calls; `slots` rows, the
    ones past its segments empty. A segment whose prompt does not start with the row's (the
    history rewrote the row's own messages) cannot be held, nor can segments past `slots`:
    both are counted dropped. A failed episode: every row empty."""
    empty = ([], [], [])
    if outcome.kind != "ok":
        return [empty] * slots, 0
    parts = segments(outcome.calls)
    if parts[0].prompt_ids[: len(prompt)] != prompt:
        outcome.kind = "error"
        outcome.error = (
            "the program's first call does not start from the row's prompt: send the row's "
            "messages (row['prompt']) first, as given"
        )
        return [empty] * slots, 0
    rows = []
    for part in parts:
        if len(rows) == slots or part.prompt_ids[: len(prompt)] != prompt:
            continue
        delta = part.prompt_ids[len(prompt) :]
        zeros = [0] * len(delta)
        rows.append((delta + part.ids, zeros + part.mask, [0.0] * len(delta) + part.logprobs))
    dropped = len(parts) - len(rows)
    return rows + [empty] * (slots - len(rows)), dropped


def program_rows(
    outcomes, prompts: list[list[int]], tokenizer, pad: int, returns: str, slots: int = 1
) -> dict:
    """The node's outputs, `slots` rows per episode (its segments, then empty rows): responses,
    masks and log-probs (r, t), response_text and rollout_info (r,), scores (r,) with returns =
    "reward", and with slots > 1 `episode_share` (r,), 1 / slots: each row's share of its
    episode, so the advantage nodes that read it (grpo, rloo) take group statistics over
    episodes. Every row of an episode carries its answer, reward and how it ended, so a row
    statistic counts each episode `slots` times alike. rollout_info's `termination` is "ok", or
    "error" / "timeout" for a failed episode (the runtime's failed requests: the step log shows
    the first errors, and a step where most failed is not trained on)."""
    made = [episode_rows(o, p, slots) for o, p in zip(outcomes, prompts, strict=True)]
    r = len(made) * slots
    texts, infos = np.empty(r, dtype=object), np.empty(r, dtype=object)
    rows = []
    for k, ((parts, dropped), o) in enumerate(zip(made, outcomes, strict=True)):
        versions = sorted({c.version for c in o.calls})
        held = sum(bool(ids) for ids, _, _ in parts)
        for j, (ids, mask, lps) in enumerate(parts):
            rows.append((ids, mask, lps))
            texts[k * slots + j] = o.answer or ""
            infos[k * slots + j] = {
                "termination": {"ok": "stop", "timeout": "timeout"}.get(o.kind, "error"),
                "program_end": o.kind,
                "error": f"{o.kind}: {o.error}" if o.error else "",
                "messages": [_said(c, tokenizer) for c in o.calls],
                "trained_spans": spans(ids, mask, tokenizer),
                "calls": len(o.calls),
                "segment": j,
                "segments_held": held,
                "segments_dropped": dropped,
                "versions": versions,
                "reward": o.reward,
                "seconds": o.seconds,
            }
    out = {**response_tensors(rows, pad), "response_text": texts, "rollout_info": infos}
    if returns == "reward":
        rewards = [o.reward or 0.0 for o in outcomes for _ in range(slots)]
        out["scores"] = torch.tensor(rewards, dtype=torch.float32)
    if slots > 1:
        out["episode_share"] = torch.full((r,), 1.0 / slots)
    return out


def _said(call, tokenizer) -> dict:
    return {
        "role": "assistant",
        "content": tokenizer.decode(call.completion_ids, skip_special_tokens=True),
    }


def spans(ids: list[int], mask: list[int], tokenizer) -> list[tuple[str, bool]]:
    """The response as runs of text, each trained or not (the step log marks the trained)."""
    out, start = [], 0
    for k in range(1, len(ids) + 1):
        if k == len(ids) or mask[k] != mask[start]:
            out.append((tokenizer.decode(ids[start:k]), bool(mask[start])))
            start = k
    return out


def program_metrics(outcomes, refused: int) -> dict:
    """Shares of episodes by how they ended, calls per episode, the share of episodes whose
    calls span more than one policy version and the largest span, the calls the endpoint refused
    during the rollout (`refused`: a wrong key, a bad request; the runtime logs failed
    episodes' first errors and skips a step where most failed)."""
    count = max(len(outcomes), 1)
    out = {f"episodes/{kind}": sum(o.kind == kind for o in outcomes) / count for kind in KINDS}
    out["calls_per_episode"] = sum(len(o.calls) for o in outcomes) / count
    out["episode_seconds_max"] = max((o.seconds for o in outcomes), default=0.0)
    # staleness inside an episode: a weight sync between its calls (run.staleness)
    spans = [
        max(c.version for c in o.calls) - min(c.version for c in o.calls)
        for o in outcomes
        if o.calls
    ]
    out["episodes_across_versions"] = sum(s > 0 for s in spans) / count
    out["version_span_max"] = float(max(spans, default=0))
    out["refused_calls"] = float(refused)
    return out


def segment_metrics(out: dict) -> dict:
    """Segments per episode (a history rewrite starts one) and those not trained (past
    max_segments, or rewriting the row's own prompt), averaged over episodes."""
    firsts = [i for i in out["rollout_info"] if i["segment"] == 0]
    count = max(len(firsts), 1)
    return {
        "segments_per_episode": sum(i["segments_held"] + i["segments_dropped"] for i in firsts)
        / count,
        "segments_dropped": sum(i["segments_dropped"] for i in firsts) / count,
    }


def refused(endpoint) -> int:
    """The calls the endpoint has refused so far (every error code)."""
    return sum(v for k, v in endpoint.stats.items() if k.startswith("errors/"))
