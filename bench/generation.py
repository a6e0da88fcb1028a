"""Decode-loop throughput: flowrl's HFRollout against `model.generate` on SmolLM2-135M.

    python bench/generation.py [--rows 16] [--new 32] [--repeats 3] [--n 1]
    python bench/generation.py --device cuda --model qwen2-0.5b --dtype bfloat16 --train

`--model` takes a model path (default the embedded SmolLM2) or an architecture of
bench/colocation.py (random weights from a config, no download). `--train` also times the
train engine's forward + backward + AdamW step over the generated rows and reports training
tokens/s and the model FLOP utilisation (6 x parameters x tokens / time / peak, counting the
tokens the model computes: each distinct prompt once, every response token; the peak is a
measured fp32 matmul rate on CPU, 989 TFLOP/s bf16 dense on CUDA, or --peak-tflops).

Both decode the same left-padded, chat-templated arithmetic prompts greedily (so both do the
same work: identical tokens, checked) with a KV cache; `--n 8` instead samples n responses
per prompt (rows / n prompts) in both. Prints the median seconds of `--repeats` runs and new
tokens per second (tokens up to and including each row's EOS).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from flowrl.data.arithmetic import arithmetic_rows
from flowrl.engines import HFRollout
from flowrl.engines.batch import generate_batch
from flowrl.models import load_model

sys.path.insert(0, str(Path(__file__).parent))
from colocation import ARCHS, model_dir  # noqa: E402


def prompts(tokenizer, count: int) -> dict:
    texts = [
        tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        for row in arithmetic_rows("validation", count)
    ]
    tokenizer.padding_side = "left"
    return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)


def new_tokens(responses: torch.Tensor, eos: int) -> int:
    """Tokens up to and including each row's first EOS."""
    is_eos = responses == eos
    after = (is_eos.cumsum(-1) - is_eos.long()) > 0  # positions past the first EOS
    return int((~after).sum())


def timed(fn, repeats: int) -> tuple[float, torch.Tensor]:
    seconds, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--n", type=int, default=1, help="samples per prompt (>1: sampling)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--train", action="store_true", help="also time a training step")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="for MFU; 0 = guess")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = args.model
    if path in ARCHS:
        path = str(model_dir(path))
    model, tokenizer = load_model(path, dtype=args.dtype)
    model.to(args.device)
    batch = prompts(tokenizer, args.rows // args.n)
    ids, mask = batch["input_ids"].to(args.device), batch["attention_mask"].to(args.device)
    sample = args.n > 1
    engine = HFRollout(model, tokenizer, args.device)

    def ours():
        kwargs = dict(n=args.n, max_new_tokens=args.new, do_sample=sample, seed=0)
        return generate_batch(engine, ids, mask, **kwargs)["responses"]

    def theirs():
        torch.manual_seed(0)
        # generation_config may carry sampling defaults (top_k=50 ...): set ours explicitly
        sampling = dict(top_k=0, top_p=1.0, temperature=1.0) if sample else {}
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=args.new,
                do_sample=sample,
                num_return_sequences=args.n,
                pad_token_id=tokenizer.pad_token_id,
                **sampling,
            )
        return out[:, ids.shape[1] :].cpu()

    ours(), theirs()  # warm-up: allocator, kernels
    eos = tokenizer.eos_token_id
    print(
        f"{args.rows} rows ({len(ids)} prompts x {args.n}), <= {args.new} new tokens, prompt "
        f"width {ids.shape[1]}, {args.threads} threads, median of {args.repeats}"
    )
    results = {}
    for name, fn in (("flowrl HFRollout", ours), ("transformers generate", theirs)):
        seconds, out = timed(fn, args.repeats)
        results[name] = out
        tokens = new_tokens(out, eos)
        rate = tokens / seconds
        print(f"  {name:22s} {seconds:6.2f} s  {tokens:4d} tokens  {rate:6.1f} tokens/s")
    if not sample:
        a, b = results.values()
        lengths = [new_tokens(a[i : i + 1], eos) for i in range(len(a))]
        same = all(a[i, :n].tolist() == b[i, :n].tolist() for i, n in enumerate(lengths))
        print(f"  greedy outputs identical: {same}")
    if args.train:
        train_throughput(model, tokenizer, batch, results["flowrl HFRollout"], args)


def train_throughput(model, tokenizer, batch, responses, args) -> None:
    """Forward + backward + AdamW over the generated rows: tokens/s and MFU."""
    from flowrl.engines import TrainEngine
    from flowrl.protocol import DataProto

    eos = tokenizer.eos_token_id
    is_eos = responses == eos
    response_mask = ((is_eos.cumsum(-1) - is_eos.long()) == 0).long()
    n = len(responses) // len(batch["input_ids"])
    rows = DataProto.from_dict(
        {
            "prompts": batch["input_ids"].repeat_interleave(n, 0),
            "prompt_mask": batch["attention_mask"].repeat_interleave(n, 0),
            "responses": responses,
            "response_mask": response_mask,
        }
    )
    engine = TrainEngine(model, tokenizer, lr=1e-6, device=args.device)

    def step():
        out = engine.forward(rows, grad=True)  # on the engine's device
        mask = rows["response_mask"].to(out["logprobs"].device)
        engine.backward((out["logprobs"] * mask).sum() / mask.sum())
        engine.step()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    step()  # warm-up
    seconds, _ = timed(step, args.repeats)
    # the tokens the model computes: each distinct prompt once (the engine shares it over its
    # n samples), plus every response token
    tokens = int(batch["attention_mask"].sum() + response_mask.sum())
    params = sum(p.numel() for p in model.parameters())
    peak, source = args.peak_tflops, "given"
    if not peak and args.device.startswith("cuda"):
        peak, source = 989.0, "H100 bf16 dense"
    elif not peak:
        peak, source = matmul_tflops(args.device), "measured fp32 matmul"
    mfu = 6 * params * tokens / seconds / (peak * 1e12)
    print(
        f"  train step (forward + backward + AdamW): {seconds:.2f} s, {tokens} tokens, "
        f"{tokens / seconds:.0f} tokens/s, MFU {mfu:.1%} of {peak:.3f} TFLOP/s ({source})"
    )


def matmul_tflops(device: str, size: int = 2048) -> float:
    """The machine's fp32 matmul rate: the median of 5 (size x size) @ (size x size)."""
    a, b = torch.randn(size, size, device=device), torch.randn(size, size, device=device)
    a @ b
    seconds, _ = timed(lambda: a @ b, 5)
    return 2 * size**3 / seconds / 1e12


if __name__ == "__main__":
    main()
