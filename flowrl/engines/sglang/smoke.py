"""`python -m flowrl.engines.sglang.smoke --gpu` (`make gpu-smoke`): the sglang rollout backend
on a GPU machine against the real, pinned SGLang, one line per check, a few minutes:

    start         the engine with graphs/grpo_sglang.toml's settings (its policy's model and
                  dtype, the run's seed), verify mode on: the first push is read back
    greedy        greedy SGLang against the hf backend on the same weights: each token SGLang
                  picks is flowrl's argmax (up to bf16 near-ties), log-probs within 0.1
    release x3    three release / resume cycles: memory goes back, outputs are the same after
    push          the weights changed in the trainer, pushed and read back (verify)
    sampled n=8   one sampled generate, n = 8: rows, lengths, and SGLang's log-probs against
                  the trainer's for the same tokens
    two ranks     `flowrl run` of one GRPO step on two GPUs under Ray (skipped with one GPU)

Without a CUDA device or without SGLang it prints why and exits 0: CI never needs it. Exit code
1 when a check fails. docs/scaling.md says what it proves.
"""

import argparse
import importlib.metadata
import importlib.util
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
GRAPH = ROOT / "graphs" / "grpo_sglang.toml"
TIE = 0.05  # bf16 kernels of two engines may order logits this close differently
PACKAGES = ("sglang", "torch", "transformers", "flashinfer-python", "torch-memory-saver")


class Skip(Exception):
    """A check that does not apply on this machine."""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flowrl.engines.sglang.smoke", description=__doc__
    )
    parser.add_argument("--gpu", action="store_true", help="the SGLang checks (needs a GPU)")
    parser.add_argument("--graph", default=str(GRAPH), help="whose model settings to use")
    args = parser.parse_args(argv)
    if not args.gpu:
        parser.error("pass --gpu: the only smoke test so far is the GPU one")
    reason = missing()
    if reason:
        print(f"skip gpu-smoke: {reason}")
        return 0
    state, failed = {"graph": args.graph}, 0
    for name, check in CHECKS:
        start = time.time()
        try:
            status, detail = "ok", check(state)
        except Skip as e:
            status, detail = "skip", str(e)
        except Exception as e:  # one line per check; the run goes on to the next
            status, detail, failed = "FAIL", f"{type(e).__name__}: {e}", failed + 1
        print(f"{status:4}  {name:<12} {time.time() - start:6.1f}s  {detail}", flush=True)
        if status == "FAIL" and name == "start":
            break
    if "rollout" in state:
        state["rollout"].shutdown()
    return 1 if failed else 0


def missing() -> str:
    """Why the GPU checks cannot run here ("" when they can)."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False); run it on a GPU machine"
    if importlib.util.find_spec("sglang") is None:
        return 'SGLang is not installed: pip install -e ".[sglang]" (make gpu-smoke does)'
    return ""


def versions() -> str:
    found = []
    for package in PACKAGES:
        try:
            found.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{package} missing")
    return ", ".join(found)


def check_start(state) -> str:
    import torch

    from flowrl.engines.sglang.backend import SGLangRollout
    from flowrl.front.compiler import compile_file
    from flowrl.models import load_model

    plan = compile_file(state["graph"])
    config = plan.spec.models["policy"]
    module, tokenizer = load_model(config.path, dtype=config.dtype)
    module.to("cuda:0").eval()
    free = torch.cuda.mem_get_info()[0]
    rollout = SGLangRollout(
        module, tokenizer, "cuda:0", seed=plan.spec.run.seed, verify=True, where="smoke"
    )
    taken = (free - torch.cuda.mem_get_info()[0]) / 2**30
    state.update(module=module, tokenizer=tokenizer, rollout=rollout, taken=taken)
    state["prompts"] = prompts(tokenizer, 8)
    return f"{config.path} in {config.dtype}, {taken:.1f} GiB taken; {versions()}"


def check_greedy(state) -> str:
    from flowrl.engines.batch import generate_batch
    from flowrl.engines.hf.engine import HFRollout

    module, rollout, (ids, mask) = state["module"], state["rollout"], state["prompts"]
    ours = HFRollout(module, state["tokenizer"], "cuda:0")
    expected = generate_batch(ours, ids, mask, max_new_tokens=32, do_sample=False)
    got = generate_batch(rollout, ids, mask, max_new_tokens=32, do_sample=False, logprobs=True)
    logits = forced(module, ids, mask, got)
    chosen = logits.gather(-1, got["responses"][..., None]).squeeze(-1)
    gap = float(((logits.max(-1).values - chosen) * got["response_mask"]).max())
    delta = float((chosen_logprobs(logits, got) - got["logprobs"]).abs().max())
    same = sum(
        a[m.bool()].tolist() == b[n.bool()].tolist()
        for a, m, b, n in zip(
            expected["responses"],
            expected["response_mask"],
            got["responses"],
            got["response_mask"],
            strict=True,
        )
    )
    assert gap < TIE and delta < 0.1, f"argmax gap {gap:.3f}, log-prob delta {delta:.3f}"
    return f"argmax gap {gap:.3f}, log-prob delta {delta:.3f}, {same}/{len(ids)} rows identical"


def check_release(state) -> str:
    import torch

    from flowrl.engines.batch import generate_batch

    rollout, (ids, mask) = state["rollout"], state["prompts"]
    before = generate_batch(rollout, ids, mask, max_new_tokens=16, do_sample=False)
    freed = []
    for _ in range(3):
        held = torch.cuda.mem_get_info()[0]
        rollout.offload(("weights", "kv_cache"))
        freed.append((torch.cuda.mem_get_info()[0] - held) / 2**30)
        rollout.reload(("weights", "kv_cache"))  # resume, push (read back), flush, KV cache
        after = generate_batch(rollout, ids, mask, max_new_tokens=16, do_sample=False)
        assert torch.equal(after["responses"], before["responses"]), "outputs changed"
    assert min(freed) > 0.5 * state["taken"], f"released only {freed} GiB"
    return f"released {', '.join(f'{f:.1f}' for f in freed)} GiB; outputs the same each time"


def check_push(state) -> str:

    import torch

    module, rollout = state["module"], state["rollout"]
    with torch.no_grad():
        for parameter in module.parameters():  # as an update would: every weight moves
            parameter.add_(torch.randn_like(parameter) * 1e-2)
    rollout.sync_weights(module)  # verify mode: read back and compared, or it raised
    served = rollout.engine.get_weights_by_name("model.embed_tokens.weight", truncate_size=2)
    want = module.get_input_embeddings().weight[:2].float().cpu()
    assert torch.equal(torch.tensor(served), want), "embed_tokens differs after the push"
    return "pushed in a session, every answer success, read back equal"


def check_sampled(state) -> str:
    from flowrl.engines.batch import generate_batch

    module, rollout, (ids, mask) = state["module"], state["rollout"], state["prompts"]
    ids, mask = ids[:2], mask[:2]
    got = generate_batch(rollout, ids, mask, n=8, max_new_tokens=64, temperature=1.0, logprobs=True)
    assert got["responses"].shape[0] == 16, got["responses"].shape
    repeated_ids, repeated_mask = ids.repeat_interleave(8, 0), mask.repeat_interleave(8, 0)
    theirs = chosen_logprobs(forced(module, repeated_ids, repeated_mask, got), got)
    delta = (theirs - got["logprobs"]).abs()[got["response_mask"].bool()]
    mean, worst = float(delta.mean()), float(delta.max())
    assert mean < 0.05, f"mean |log-prob delta| {mean:.3f} (max {worst:.3f})"
    lengths = got["response_mask"].sum(-1).tolist()
    return (
        f"16 rows, lengths {min(lengths)}-{max(lengths)}, |delta| mean {mean:.4f} max {worst:.3f}"
    )


def check_two_ranks(state) -> str:
    import torch

    if torch.cuda.device_count() < 2:
        raise Skip(f"{torch.cuda.device_count()} GPU here; two ranks need two")
    overrides = [
        "pools.main.workers=2",
        "run.steps=1",
        "run.val_size=0",
        "data.batch_size=4",
        "nodes.generate.n=2",
        "nodes.generate.max_new_tokens=16",
    ]
    command = [sys.executable, "-m", "flowrl.cli", "run", state["graph"], *overrides]
    result = subprocess.run(
        [*command, "--backend", "ray"], capture_output=True, text=True, timeout=540
    )
    assert result.returncode == 0, result.stderr[-800:]
    return "one GRPO step on 2 ranks under Ray, each with its own engine"


def prompts(tokenizer, count: int):
    """(ids, mask) of `count` arithmetic validation prompts, chat-formatted, left-padded."""
    from flowrl.data.arithmetic import arithmetic_rows

    texts = [
        tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        for row in arithmetic_rows("validation", count)
    ]
    tokenizer.padding_side = "left"
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return batch["input_ids"], batch["attention_mask"]


def forced(module, ids, mask, out):
    """(b, t, v) float32 logits of `module` at each response position (teacher forcing)."""
    import torch

    sequence = torch.cat([ids, out["responses"]], 1).to("cuda:0")
    attention = torch.cat([mask, out["response_mask"]], 1).to("cuda:0")
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = module(sequence, attention_mask=attention, position_ids=positions).logits
    start, t = ids.shape[1] - 1, out["responses"].shape[1]
    return logits[:, start : start + t].float().cpu()


def chosen_logprobs(logits, out):
    """(b, t) log-probs of the response tokens at temperature 1, 0 past each response."""
    picked = logits.log_softmax(-1).gather(-1, out["responses"][..., None]).squeeze(-1)
    return picked * out["response_mask"]


CHECKS = [
    ("start", check_start),
    ("greedy", check_greedy),
    ("release x3", check_release),
    ("push", check_push),
    ("sampled n=8", check_sampled),
    ("two ranks", check_two_ranks),
]

if __name__ == "__main__":
    sys.exit(main())
