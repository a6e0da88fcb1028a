"""Multi-turn rollout speed: the wave engine (tool output appended to the KV cache) against
re-prefilling the whole conversation every turn, on the calculator workload with SmolLM2-135M.

    python bench/multi_turn.py [--prompts 16] [--examples 2] [--repeats 1]

Both run the same requests (flowrl/agent/episode.py: the calculator tool, the tag parser, at
most 3 turns of 24 tokens, 64 in all) greedily through the same wave driver; they differ only
in the turn backend: `WaveRollout` extends one cache, `RePrefill` calls the single-turn
`HFRollout.generate` on every conversation so far. Greedy decoding makes them sample the same
tokens up to float rounding (the share of identical rows is printed). `--examples 2` puts two
worked examples in the prompt so that greedy decoding calls the tool (one example: it mostly
answers without it). Also times single-turn generation (`generate`, unchanged by multi-turn
rollouts) against the agent engine with no tools, on the same prompts.

Prints, and writes bench/results/multi_turn.{json,md}: wall seconds (median of --repeats),
policy tokens per second, turns per request.
"""

import argparse
import asyncio
import concurrent.futures
import json
import statistics
import time
from pathlib import Path

import torch

from flowrl.agent.chat import ChatTokens
from flowrl.agent.driver import run_waves
from flowrl.agent.episode import Episode, Limits
from flowrl.agent.parsers import make_parser
from flowrl.agent.tools import Toolbox
from flowrl.data.calculator import calculator_rows
from flowrl.engines import HFRollout
from flowrl.engines.wave_rollout import WaveRollout
from flowrl.models import load_model

LIMITS = Limits(max_new_tokens=64, max_turn_tokens=24, max_assistant_turns=3, max_obs_tokens=16)
SECOND = [  # a second worked example
    {"role": "user", "content": "What is 56 * 78?"},
    {"role": "assistant", "content": "<calc>56*78</calc>"},
    {"role": "tool", "content": "4368"},
    {"role": "assistant", "content": "4368"},
]


class RePrefill:
    """A turn backend that re-runs each whole conversation every turn: the baseline."""

    def __init__(self, engine: HFRollout, prompt_ids: list[list[int]]):
        self.engine, self.sequences = engine, [list(p) for p in prompt_ids]

    def turn(self, rows, append, limits):
        for i, extra in zip(rows, append, strict=True):
            self.sequences[i] += extra
        width = max(len(self.sequences[i]) for i in rows)
        ids = torch.full((len(rows), width), self.engine.pad)
        mask = torch.zeros_like(ids)
        for k, i in enumerate(rows):
            seq = self.sequences[i]
            ids[k, width - len(seq) :], mask[k, width - len(seq) :] = torch.tensor(seq), 1
        out = self.engine.generate(ids, mask, max_new_tokens=max(limits), do_sample=False)
        turns = []
        for k, (i, limit) in enumerate(zip(rows, limits, strict=True)):
            length = min(int(out["response_mask"][k].sum()), limit)
            sampled = out["responses"][k, :length].tolist()
            self.sequences[i] += sampled
            turns.append((sampled, [0.0] * length))
        return turns


def requests(chat, tokenizer, prompts: int, examples: int, tools):
    rows = calculator_rows("validation", prompts, examples=examples > 0)
    messages = []
    for row in rows:
        prompt = row["prompt"]
        messages.append(prompt[:-1] + (SECOND if examples > 1 else []) + prompt[-1:])
    ids = [chat.encode(m, generation_prompt=True) for m in messages]
    pool = concurrent.futures.ThreadPoolExecutor(4)
    box = Toolbox(tools)
    parser = make_parser("tag", box.names)
    episodes = [Episode(p, chat, parser, box.open({}, pool), LIMITS) for p in ids]
    return ids, episodes


def left_padded(ids: list[list[int]], pad: int):
    width = max(len(x) for x in ids)
    out, mask = torch.full((len(ids), width), pad), torch.zeros(len(ids), width, dtype=torch.long)
    for k, x in enumerate(ids):
        out[k, width - len(x) :], mask[k, width - len(x) :] = torch.tensor(x), 1
    return out, mask


def run(engine, chat, tokenizer, args, backend: str, tools=("calculator",)) -> tuple[float, list]:
    ids, episodes = requests(chat, tokenizer, args.prompts, args.examples, tools)
    start = time.perf_counter()
    if backend == "wave":
        wave = WaveRollout(engine, do_sample=False)
        prompts, mask = left_padded(ids, engine.pad)
        wave.start(prompts, mask, 1, LIMITS.max_new_tokens)
        asyncio.run(run_waves(episodes, wave))
        wave.close()
    else:
        asyncio.run(run_waves(episodes, RePrefill(engine, ids)))
    return time.perf_counter() - start, episodes


def timed(fn, repeats: int):
    seconds, out = [], None
    for _ in range(repeats):
        elapsed, out = fn()
        seconds.append(elapsed)
    return statistics.median(seconds), out


def summary(seconds: float, episodes) -> dict:
    policy = sum(sum(e.mask) for e in episodes)
    turns = [len(e.turn_texts) for e in episodes]
    return {
        "seconds": round(seconds, 2),
        "policy_tokens_per_s": round(policy / seconds, 1),
        "turns_per_request": round(sum(turns) / len(turns), 2),
        "call_rate": round(sum(len(e.calls) > 0 for e in episodes) / len(episodes), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--examples", type=int, default=2, choices=[0, 1, 2])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default="smollm2-135m-instruct", help='"tiny": a smoke test')
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "multi_turn"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    engine, chat = HFRollout(model, tokenizer), ChatTokens(tokenizer)
    results = {
        "prompts": args.prompts,
        "examples": args.examples,
        "repeats": args.repeats,
        "limits": str(LIMITS),
    }
    wave_s, wave = timed(lambda: run(engine, chat, tokenizer, args, "wave"), args.repeats)
    again_s, again = timed(lambda: run(engine, chat, tokenizer, args, "reprefill"), args.repeats)
    results["wave"], results["reprefill"] = summary(wave_s, wave), summary(again_s, again)
    results["speedup"] = round(again_s / wave_s, 2)
    results["same_rows"] = sum(a.ids == b.ids for a, b in zip(wave, again, strict=True)) / len(wave)
    # single turn: today's generate against the agent engine without tools
    ids, _ = requests(chat, tokenizer, args.prompts, args.examples, ())
    prompts, mask = left_padded(ids, engine.pad)

    def generate():
        start = time.perf_counter()
        engine.generate(prompts, mask, max_new_tokens=LIMITS.max_turn_tokens, do_sample=False)
        return time.perf_counter() - start, None

    single_s, _ = timed(generate, args.repeats)
    one_turn = Limits(max_new_tokens=LIMITS.max_turn_tokens, max_assistant_turns=1)

    def agent_single():
        _, episodes = requests(chat, tokenizer, args.prompts, args.examples, ())
        episodes = [Episode(e.prompt_ids, chat, e.parser, e.session, one_turn) for e in episodes]
        start = time.perf_counter()
        wave = WaveRollout(engine, do_sample=False)
        wave.start(prompts, mask, 1, one_turn.max_new_tokens)
        asyncio.run(run_waves(episodes, wave))
        wave.close()
        return time.perf_counter() - start, episodes

    agent_s, _ = timed(agent_single, args.repeats)
    results["single_turn"] = {
        "generate_s": round(single_s, 2),
        "agent_no_tools_s": round(agent_s, 2),
        "ratio": round(agent_s / single_s, 2),
    }
    text = json.dumps(results, indent=2)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(text + "\n")
    Path(args.out + ".md").write_text(markdown(results))


def markdown(r: dict) -> str:
    rows = [
        "| backend | wall s | policy tokens/s | turns/request | call rate |",
        "|---|---|---|---|---|",
    ]
    for name in ("wave", "reprefill"):
        s = r[name]
        rows.append(
            f"| {name} | {s['seconds']} | {s['policy_tokens_per_s']} | "
            f"{s['turns_per_request']} | {s['call_rate']} |"
        )
    single = r["single_turn"]
    return (
        f"# Multi-turn rollout: cache extension vs re-prefill\n\n"
        f"`python bench/multi_turn.py --prompts {r['prompts']} --examples {r['examples']} "
        f"--repeats {r.get('repeats', 1)}` (SmolLM2-135M, greedy, {r['limits']}; wall seconds: "
        "the median of the repeats)\n\n" + "\n".join(rows) + "\n\n"
        f"Re-prefill / wave wall time: **{r['speedup']}x**; "
        f"identical rows: {r['same_rows']:.0%}.\n\n"
        f"Single turn, same prompts, 24 tokens: generate {single['generate_s']} s, agent engine "
        f"without tools {single['agent_no_tools_s']} s (ratio {single['ratio']}).\n"
    )


if __name__ == "__main__":
    main()
