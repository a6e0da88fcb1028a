"""The request engine (flowrl/engines/hf/scheduler.py) on SmolLM2-135M, in one process:
multi-turn rollouts with uneven tools, single-turn sampling, and each request's KV kept
between turns against re-prefilling the conversation.

    python bench/rollout.py multi_turn [--rows 16] [--repeats 3]
    python bench/rollout.py single_turn [--prompts 16] [--n 2] [--repeats 3]
    python bench/rollout.py cache [--rows 16] [--repeats 3]
    (any mode: --threads N torch threads, 1 by default; --own-thread: the engine's loop on a
    thread of its own instead of the caller's; --no-pack: a request back from its tools
    prefilled in a call of its own, not packed into the decode call, flowrl/engines/hf/packed.py)

multi_turn: the calculator prompts; request i's tool answers after a latency fixed per row,
uniform in 0 to 1 s, and request i makes 1 to 4 calls (uniform), both drawn independently
from a seeded generator (`--assign ordered`: latency i / (rows - 1) and 1 + i % 4 calls, so
the slowest tool is also among the most called); the parser calls the tool on each of the
request's first turns, whatever the text (the number of calls is the workload's, not the
model's choice); greedy (`--sample`: temperature 1), at most 24 tokens a turn; the episodes
are flowrl/agent/episode.py's state machine; wall time per rollout, and its model calls
(forward hooks) with the seconds in them.
single_turn: sampled responses (temperature 1, up to --new tokens; `--greedy`: greedy) of
uneven lengths through `generate_batch`; tokens per second, model calls and their seconds.
cache: the multi_turn workload without tool latency, each request's KV kept between turns
(its slot, by request id) against re-prefilling the whole conversation each turn (keep =
False); prompt tokens prefilled and wall time.

The lockstep path before the request contract (waves, a batch decode loop, rebuilt from
commit 617399a) ran beside the engine in multi_turn and single_turn up to commit 78fcd10
(`git show 78fcd10:bench/legacy_rollout.py`); its numbers stay in bench/results/rollout_*.json
and docs/performance.md, "The rollout engine"; this script's own runs are rollout_engine_*.

Prints and writes bench/results/rollout_engine_<mode>.json (every repetition and the medians).
"""

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

import attrs
import torch

from flowrl.agent.chat import ChatTokens
from flowrl.agent.driver import run_requests
from flowrl.agent.episode import Episode, Limits
from flowrl.agent.parsers import user_parser
from flowrl.agent.tools.toolbox import FunctionTool, Toolbox
from flowrl.data.calculator import calculator_rows
from flowrl.engines import HFRollout
from flowrl.engines.batch import generate_batch
from flowrl.engines.rollout import Sampling
from flowrl.engines.threads import run_sync
from flowrl.models import load_model

LIMITS = Limits(
    max_new_tokens=256,
    max_turn_tokens=24,
    max_assistant_turns=5,
    max_obs_tokens=16,
    tool_timeout_s=10.0,
)
SAMPLING = {"value": Sampling(do_sample=False)}


async def wait(seconds: float) -> str:
    """Answer after `seconds` (a tool whose latency is the row's).

    Args:
        seconds: how long the tool takes.
    """
    await asyncio.sleep(seconds)
    return "42"


def calls_first(turns: int, seconds: float):
    """A parser that calls the tool on each of the first `turns` turns, then on none."""
    made = [0]

    def parse(text: str):
        if made[0] >= turns:
            return []
        made[0] += 1
        return [("wait", {"seconds": seconds})]

    return user_parser(parse)


def prompts_of(tokenizer, rows: int) -> list[list[int]]:
    chat = ChatTokens(tokenizer)
    return [chat.encode(r["prompt"], True) for r in calculator_rows("validation", rows)]


def workload(rows: int, assign: str) -> list[tuple[int, float]]:
    """(calls, tool latency in s) per request."""
    if assign == "ordered":
        return [(1 + i % 4, i / max(rows - 1, 1)) for i in range(rows)]
    draw = random.Random(0)
    return [(draw.randint(1, 4), round(draw.random(), 3)) for _ in range(rows)]


ASSIGN = {"value": "random"}


def episodes_of(tokenizer, ids: list[list[int]], latency: bool) -> list[Episode]:
    chat, box = ChatTokens(tokenizer), Toolbox([])
    box.tools, box.names = [FunctionTool(wait)], ["wait"]
    out = []
    for prompt, (calls, seconds) in zip(ids, workload(len(ids), ASSIGN["value"]), strict=True):
        parser = calls_first(calls, seconds if latency else 0.0)
        out.append(Episode(prompt, chat, parser, box.open({}), LIMITS))
    return out


def left_padded(ids: list[list[int]], pad: int):
    width = max(len(x) for x in ids)
    out, mask = torch.full((len(ids), width), pad), torch.zeros(len(ids), width, dtype=torch.long)
    for k, x in enumerate(ids):
        out[k, width - len(x) :], mask[k, width - len(x) :] = torch.tensor(x), 1
    return out, mask


class OwnThread:
    """The engine with its batching loop on a thread of its own, as before the caller's
    thread ran it (`--own-thread`): its `run` is a fresh event loop, as `RolloutBase.run`."""

    def __init__(self, engine):
        self.engine, self.tokenizer = engine, engine.tokenizer

    def run(self, coroutine):
        return run_sync(coroutine)

    async def generate(self, request):
        return await self.engine.generate(request)

    def release(self, request_id):
        self.engine.release(request_id)


ENGINE = {"wrap": lambda engine: engine, "packs": True}


class Forgetful:
    """The engine with every turn re-prefilled: no request keeps its KV."""

    def __init__(self, engine):
        self.engine = engine
        self.run = engine.run  # the engine's loop on the caller's thread, as without this

    async def generate(self, request):
        return await self.engine.generate(attrs.evolve(request, keep=False))

    def release(self, request_id):
        self.engine.release(request_id)


def requests(model, tokenizer, ids, latency=True, keep=True, seed=0) -> tuple[float, list]:
    episodes = episodes_of(tokenizer, ids, latency)
    start = time.perf_counter()
    engine = HFRollout(model, tokenizer)
    engine.runner.packs = engine.runner.packs and ENGINE["packs"]
    backend = ENGINE["wrap"](engine)
    backend = backend if keep else Forgetful(backend)
    seeds = [seed * 1000 + k for k in range(len(episodes))]
    backend.run(run_requests(episodes, backend, SAMPLING["value"], seeds))
    seconds = time.perf_counter() - start
    engine.idle()
    return seconds, episodes, dict(engine.scheduler.batch.counts)


def describe(episodes) -> dict:
    return {
        "policy_tokens": sum(sum(e.mask) for e in episodes),
        "tool_calls": sum(len(e.calls) for e in episodes),
        "turns_per_request": round(sum(len(e.turn_texts) for e in episodes) / len(episodes), 2),
        "reasons": sorted({e.reason for e in episodes}),
    }


class CallClock:
    """The model calls of a rollout and the seconds spent in them (forward hooks: on the CPU a
    call is synchronous, so its wall time is its compute)."""

    def __init__(self, model):
        self.calls, self.seconds, self.started = 0, 0.0, 0.0
        self.hooks = [
            model.register_forward_pre_hook(self._pre),
            model.register_forward_hook(self._post),
        ]

    def _pre(self, module, args):
        self.started = time.perf_counter()

    def _post(self, module, args, out):
        self.calls += 1
        self.seconds += time.perf_counter() - self.started

    def take(self) -> tuple[int, float]:
        out, self.calls, self.seconds = (self.calls, round(self.seconds, 3)), 0, 0.0
        return out

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()


def multi_turn(model, tokenizer, args) -> dict:
    ids = prompts_of(tokenizer, args.rows)
    seconds, calls, tokens, clock = [], [], [], CallClock(model)
    for rep in range(args.repeats):
        took, episodes, counts = requests(model, tokenizer, ids, seed=rep)
        seconds.append(took)
        calls.append(clock.take())
        tokens.append(sum(sum(e.mask) for e in episodes))
    clock.close()
    return {
        "requests_s": seconds,
        "requests_median_s": statistics.median(seconds),
        "model_calls_s": calls,  # (model calls, seconds in them) per repetition
        "median_model_s": statistics.median(s for _, s in calls),
        "policy_tokens_per_repeat": tokens,
        "workload_calls_latency": workload(len(ids), ASSIGN["value"]),
        "requests": describe(episodes),
        "requests_model_calls": counts,
    }


def single_turn(model, tokenizer, args) -> dict:
    ids = prompts_of(tokenizer, args.prompts)
    prompts, mask = left_padded(ids, tokenizer.pad_token_id or tokenizer.eos_token_id)
    kwargs = dict(n=args.n, max_new_tokens=args.new, temperature=1.0, do_sample=not args.greedy)
    runs, calls, clock = [], [], CallClock(model)
    for rep in range(args.repeats):
        start = time.perf_counter()
        engine = ENGINE["wrap"](HFRollout(model, tokenizer))
        out = generate_batch(engine, prompts, mask, seed=rep, **kwargs)
        runs.append((time.perf_counter() - start, int(out["response_mask"].sum())))
        calls.append(clock.take())
        lengths = out["response_mask"].sum(-1).tolist()
    clock.close()
    rate = [round(t / s, 1) for s, t in runs]
    return {
        "model_calls_s": calls,
        "requests_s_tokens": runs,
        "requests_tokens_per_s": rate,
        "requests_median_tokens_per_s": statistics.median(rate),
        "last_lengths": lengths,
    }


def cache(model, tokenizer, args) -> dict:
    ids = prompts_of(tokenizer, args.rows)
    kept, again = [], []
    for _ in range(args.repeats):
        seconds, episodes, counts = requests(model, tokenizer, ids, latency=False)
        kept.append((seconds, counts["prefill_tokens"]))
        seconds, _, counts = requests(model, tokenizer, ids, latency=False, keep=False)
        again.append((seconds, counts["prefill_tokens"]))
    median = [statistics.median(s for s, _ in runs) for runs in (kept, again)]
    return {
        "kept_s_prefilled": kept,
        "reprefill_s_prefilled": again,
        "kept_median_s": median[0],
        "reprefill_median_s": median[1],
        "speedup": round(median[1] / median[0], 2),
        "prefilled_tokens": {"kept": kept[-1][1], "reprefill": again[-1][1]},
        "workload": describe(episodes),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["multi_turn", "single_turn", "cache"])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--assign", choices=["random", "ordered"], default="random")
    parser.add_argument("--sample", action="store_true", help="multi_turn: temperature 1")
    parser.add_argument("--greedy", action="store_true", help="single_turn: greedy")
    parser.add_argument(
        "--own-thread", action="store_true", help="the engine's loop on a thread of its own"
    )
    parser.add_argument("--no-pack", action="store_true", help="no packed model calls")
    parser.add_argument("--model", default="smollm2-135m-instruct", help='"tiny": a smoke test')
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ASSIGN["value"] = args.assign
    if args.own_thread:
        ENGINE["wrap"] = OwnThread
    ENGINE["packs"] = not args.no_pack
    if args.sample:
        SAMPLING["value"] = Sampling(temperature=1.0)
    model, tokenizer = load_model(args.model)
    model.eval()
    run = {"multi_turn": multi_turn, "single_turn": single_turn, "cache": cache}[args.mode]
    result = {"mode": args.mode, "args": vars(args), "limits": str(LIMITS)}
    result.update(run(model, tokenizer, args))
    text = json.dumps(result, indent=1)
    print(text)
    if args.model != "tiny":
        suffix = ("_" + args.assign if args.mode == "multi_turn" else "") + (
            "_sampled" if args.sample else ""
        )
        suffix += "_greedy" if args.greedy else ""
        suffix += f"_{args.threads}threads" if args.threads != 1 else ""
        suffix += "_own_thread" if args.own_thread else ""
        suffix += "_no_pack" if args.no_pack else ""
        # rollout_<mode>*.json are the runs beside the old path: kept as they are
        Path(args.out, f"rollout_engine_{args.mode}{suffix}.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
