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


def episode_row(outcome, prompt: list[int]) -> tuple[list[int], list[int], list[float], int]:
    """(response ids, mask, log-probs, segments dropped) of one episode over its row's prompt."""
    if outcome.kind != "ok":
        return [], [], [], 0
    parts = segments(outcome.calls)
    first = parts[0]
    if first.prompt_ids[: len(prompt)] != prompt:
        outcome.kind = "error"
        outcome.error = (
            "the program's first call does not start from the row's prompt: send the row's "
            "messages (row['prompt']) first, as given"
        )
        return [], [], [], 0
    delta = first.prompt_ids[len(prompt) :]
    ids = delta + first.ids
    return ids, [0] * len(delta) + first.mask, [0.0] * len(delta) + first.logprobs, len(parts) - 1


def program_rows(outcomes, prompts: list[list[int]], tokenizer, pad: int, returns: str) -> dict:
    """The node's outputs: responses, masks and log-probs (r, t), response_text and
    rollout_info (r,), and scores (r,) with returns = "reward". rollout_info's `termination`
    is "ok", or "error" / "timeout" for a failed episode (the runtime's failed requests: the
    step log shows the first errors, and a step where most failed is not trained on)."""
    made = [episode_row(o, p) for o, p in zip(outcomes, prompts, strict=True)]
    r = len(made)
    texts, infos = np.empty(r, dtype=object), np.empty(r, dtype=object)
    for k, ((ids, mask, _, dropped), o) in enumerate(zip(made, outcomes, strict=True)):
        texts[k] = o.answer or ""
        versions = sorted({c.version for c in o.calls})
        infos[k] = {
            "termination": {"ok": "stop", "timeout": "timeout"}.get(o.kind, "error"),
            "program_end": o.kind,
            "error": f"{o.kind}: {o.error}" if o.error else "",
            "messages": [_said(c, tokenizer) for c in o.calls],
            "trained_spans": spans(ids, mask, tokenizer),
            "calls": len(o.calls),
            "segments_dropped": dropped,
            "versions": versions,
            "reward": o.reward,
            "seconds": o.seconds,
        }
    tensors = response_tensors([(ids, mask, lps) for ids, mask, lps, _ in made], pad)
    out = {**tensors, "response_text": texts, "rollout_info": infos}
    if returns == "reward":
        out["scores"] = torch.tensor([o.reward or 0.0 for o in outcomes], dtype=torch.float32)
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


def refused(endpoint) -> int:
    """The calls the endpoint has refused so far (every error code)."""
    return sum(v for k, v in endpoint.stats.items() if k.startswith("errors/"))
