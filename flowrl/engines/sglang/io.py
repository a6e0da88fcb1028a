"""What crosses between flowrl and an SGLang engine (flowrl/engines/sglang/backend.py): the
weights pushed (LoRA folded in, in buckets; the few read back in verify mode), a request's
sampling parameters, and SGLang's answer to one request as a `Result`."""

from __future__ import annotations

import copy
import socket
from pathlib import Path

import torch

from flowrl.engines.rollout import Result


def verify_names(module: torch.nn.Module) -> tuple[str, ...]:
    """The parameters verify mode reads back: the first, the last, and the first weight a LoRA
    adapter changes (under its base name), so a push that stopped early or skipped the
    adapted layers shows."""
    names = [n for n, _ in module.named_parameters() if "lora_" not in n]
    adapted = [n.replace(".base_layer.", ".") for n in names if n.endswith(".base_layer.weight")]
    return tuple(dict.fromkeys([names[0], *adapted[:1], names[-1]]))


def sampling_params(max_new_tokens, temperature, top_p, top_k, do_sample, eos) -> dict:
    """flowrl's sampling settings in SGLang's terms: greedy is temperature 0; top_k 0 (off) is
    -1; EOS is a stop token whatever the model config says, as in the `hf` backend."""
    greedy = not do_sample or temperature == 0
    return {
        "max_new_tokens": max_new_tokens,
        "temperature": 0.0 if greedy else float(temperature),
        "top_p": 1.0 if greedy else float(top_p),
        "top_k": top_k if top_k > 0 and not greedy else -1,
        "stop_token_ids": [eos],
    }


def request_result(out: dict, eos: int, logprobs: bool, where: str = "this engine") -> Result:
    """One SGLang output dict -> a `Result`: the ids up to and including the first EOS, their
    log-probs (0.0 without `logprobs`), the finish reason ("stop", "length", "abort"). A
    log-prob list of another length than the ids raises: the rows would be misaligned."""
    finish = (out.get("meta_info", {}).get("finish_reason") or {}).get("type") or "length"
    tokens = [int(x) for x in out["output_ids"]]
    values = [0.0] * len(tokens)
    if logprobs:
        reported = out["meta_info"]["output_token_logprobs"]
        if len(reported) != len(tokens):
            raise RuntimeError(
                f"SGLang on {where} returned {len(tokens)} ids but {len(reported)} log-probs"
            )
        values = [float(entry[0]) for entry in reported]
    if eos in tokens:  # nothing after the first EOS is part of the response
        tokens = tokens[: tokens.index(eos) + 1]
        values = values[: len(tokens)]
    if finish not in ("stop", "length", "abort"):
        finish = "stop" if tokens and tokens[-1] == eos else "length"
    return Result(tokens, values, finish)


def write_model_dir(module: torch.nn.Module, tokenizer, path: Path) -> None:
    """What SGLang loads with dummy weights: the module's config.json (its architecture named,
    EOS the tokenizer's) and the tokenizer files."""
    config = copy.deepcopy(module.config)
    config.architectures = config.architectures or [type(module).__name__]
    config.eos_token_id = tokenizer.eos_token_id
    config.to_json_file(str(path / "config.json"))
    tokenizer.save_pretrained(str(path))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
