"""The reward-model measurement of docs/algorithms.md ("Reward models"), from run directories.

    flowrl run graphs/reward_model.toml                        # RM_RUN
    flowrl export RM_RUN -o reward_model
    flowrl run graphs/ppo_rm.toml                              # PPO_RUN
    python bench/reward_model.py --rm-run RM_RUN --ppo-run PPO_RUN \
        --json bench/results/reward_model.json

From the reward model's run: its held-out pairwise accuracy (`val/score`) at each validation
and its training loss. From the PPO run: greedy validation accuracy judged by the arithmetic
rule (`val/score`) at each validation, and per step the mean reward-model score of the policy's
samples (`reward/score`) beside the rule's mean score of the same samples (`rule/score`): if
the reward-model score rises while the rule's does not, the policy found what the reward model
gets wrong (reward hacking). `--baseline` adds the rule-scored PPO defaults (a result list as
bench/algorithms.py --json writes, the entry with the PPO run's seed).
"""

import argparse
import json
import statistics
from pathlib import Path

import toml


def metrics(run_dir: Path) -> list[dict]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def validations(rows: list[dict]) -> dict:
    return {str(r["step"]): r["val/score"] for r in rows if "val/score" in r}


def reward_model_summary(run_dir: Path) -> dict:
    rows = metrics(run_dir)
    trained = [r for r in rows if "update/bt_loss" in r]
    return {
        "run_dir": str(run_dir),
        "steps": max((r["step"] for r in rows), default=0),
        "val_pairwise_accuracy": validations(rows),
        "bt_loss_first_last": [trained[0]["update/bt_loss"], trained[-1]["update/bt_loss"]],
        "median_step_s": statistics.median(r["time_s"] for r in trained),
    }


def transformers_accuracy(directory: Path, pairs: int, seed: int) -> dict:
    """The held-out pairwise accuracy of an exported reward model computed by transformers
    alone (AutoModelForSequenceClassification on each templated conversation, no padding),
    on the same pairs the graph validates on: it should equal the run's last val/score."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from flowrl.data import make_rows

    model = AutoModelForSequenceClassification.from_pretrained(directory).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)

    def score(chat) -> float:
        ids = tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
        with torch.no_grad():
            return float(model(torch.tensor([ids])).logits[0, 0])

    rows = make_rows("arithmetic_preferences", "validation", pairs, seed)
    right = 0.0
    for row in rows:
        chosen = score(row["prompt"] + row["extra_info"]["chosen"])
        rejected = score(row["prompt"] + row["extra_info"]["rejected"])
        right += 1.0 if chosen > rejected else 0.5 if chosen == rejected else 0.0
    return {"directory": str(directory), "pairs": len(rows), "accuracy": right / len(rows)}


def correlation(xs: list[float], ys: list[float]) -> float | None:
    if len(xs) < 3 or statistics.pstdev(xs) == 0 or statistics.pstdev(ys) == 0:
        return None
    return statistics.correlation(xs, ys)


def ppo_summary(run_dir: Path) -> dict:
    rows = metrics(run_dir)
    steps = [r for r in rows if "reward/score" in r and "rule/score" in r]
    rm = [r["reward/score"] for r in steps]
    rule = [r["rule/score"] for r in steps]
    third = max(len(steps) // 3, 1)
    return {
        "run_dir": str(run_dir),
        "steps": max((r["step"] for r in rows), default=0),
        "val_rule_accuracy": validations(rows),
        "per_step": [
            {"step": r["step"], "rm_score": r["reward/score"], "rule_score": r["rule/score"]}
            for r in steps
        ],
        # the drift: how each mean moved from the first third of the run to the last third
        "rm_score_first_last_third": [statistics.mean(rm[:third]), statistics.mean(rm[-third:])],
        "rule_score_first_last_third": [
            statistics.mean(rule[:third]),
            statistics.mean(rule[-third:]),
        ],
        "step_correlation_rm_rule": correlation(rm, rule),
        "median_step_s": statistics.median(r["time_s"] for r in steps) if steps else None,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rm-run", type=Path, required=True)
    parser.add_argument("--ppo-run", type=Path)
    parser.add_argument("--baseline", type=Path, help="bench/algorithms.py --json results")
    parser.add_argument(
        "--export", type=Path, help="the exported reward model: transformers' own accuracy"
    )
    parser.add_argument("--json", type=Path, help="write the summary here")
    parser.add_argument("--note", default="", help="conditions, kept in the summary")
    args = parser.parse_args(argv)
    out = {"note": args.note, "reward_model": reward_model_summary(args.rm_run)}
    if args.export:
        run = toml.loads((args.rm_run / "graph.toml").read_text())["run"]
        out["transformers_check"] = transformers_accuracy(
            args.export, run.get("val_size", 128), run.get("seed", 0)
        )
    if args.ppo_run:
        out["ppo_rm"] = ppo_summary(args.ppo_run)
    if args.baseline:
        seed = 0
        if args.ppo_run:
            seed = toml.loads((args.ppo_run / "graph.toml").read_text())["run"].get("seed", 0)
        results = json.loads(args.baseline.read_text())
        base = next((r for r in results if r.get("seed", 0) == seed), None)
        out["ppo_rule_baseline"] = base and {"source": str(args.baseline), "val": base["val"]}
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
