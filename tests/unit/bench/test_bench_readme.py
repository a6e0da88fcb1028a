"""bench/readme.py: the README's table (the machine, seed 0's values and the range over the
seeds, the run time), the lines `make run` ends with, and a measurement that keeps each run as it
ends and resumes from there."""

import importlib.util
import json
import os
from pathlib import Path

import pytest

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "bench" / "readme.py").exists())
spec = importlib.util.spec_from_file_location("bench_readme", ROOT / "bench" / "readme.py")
readme = importlib.util.module_from_spec(spec)
spec.loader.exec_module(readme)

AVX512 = {
    "cpu": "AMD EPYC",
    "vector": ["avx", "avx2", "fma", "avx512f", "avx512_bf16"],
    "cores": 2,
    "torch": "2.13.0+cpu",
    "torch_cpu_capability": "AVX512",
    "blas": "mkl",
    "mkl": "2024.2",
    "onednn": "3.12.0",
    "threads": 2,
}
AVX2 = {**AVX512, "vector": ["avx", "avx2", "fma"], "torch_cpu_capability": "AVX2"}


def run(seed, mid, end, machine=AVX512, step_s=30.0, wall_s=600.0, load=(1.0, 2.0, 3.0)):
    return {
        "seed": seed,
        "val": {"0": 0.265625, "10": mid, "20": end},
        "median_step_s": step_s,
        "median_item_s": {},
        "tokens_per_s": 80.0,
        "wall_s": wall_s,
        "commit": "abc1234",
        "date": "2026-11-28 15:00",
        "load_1min": {"min": load[0], "median": load[1], "max": load[2], "samples": 3},
        "machine": machine,
    }


def entry(graph, *runs):
    return {
        "graph": graph,
        "steps": 20,
        "backend": "ray",
        "val_every": 10,
        "batch": "12 prompts x 4 samples",
        "runs": {str(r["seed"]): r for r in runs},
    }


ELSEWHERE = {
    "graph": "ppo",
    "seed": 0,
    "commit": "78fcd10",
    "cpu": "AMD EPYC (no AVX-512), 2 cores",
    "command": "make run",
    "val": {"0": 0.265625, "10": 0.53125, "20": 0.625},
    "note": "a fresh machine",
}


def results():
    return {
        "ppo": entry(
            "ppo",
            run(0, 0.625, 0.578125, step_s=34.0, wall_s=720.0),
            run(1, 0.5, 0.640625, step_s=36.0, wall_s=780.0, load=(2.0, 4.0, 6.0)),
            run(2, 0.59375, 0.5625, step_s=35.0, wall_s=750.0),
        ),
        "grpo": entry("grpo", run(0, 0.46875, 0.609375), run(1, 0.4375, 0.609375)),
        "elsewhere": [ELSEWHERE],
    }


def test_cpu_facts_reads_the_model_and_the_vector_extensions_torch_uses():
    cpuinfo = (
        "processor\t: 0\nmodel name\t: AMD EPYC 9654 96-Core Processor\n"
        "flags\t\t: fpu sse2 avx avx2 fma avx512f avx512_bf16 amx_tile\n\n"
        "processor\t: 1\nmodel name\t: AMD EPYC 9654 96-Core Processor\nflags\t\t: fpu\n"
    )
    facts = readme.cpu_facts(cpuinfo)
    assert facts == {
        "cpu": "AMD EPYC 9654 96-Core Processor",
        "vector": ["avx", "avx2", "fma", "avx512f", "avx512_bf16", "amx_tile"],
    }
    assert readme.cpu_facts("") == {"cpu": "unknown", "vector": []}


def test_machine_line_names_avx512_or_its_absence_and_torchs_build():
    assert readme.machine_line(AVX512) == (
        "AMD EPYC (AVX-512: avx512f, avx512_bf16, no AMX; torch's kernels: AVX512), 2 cores, "
        "torch 2.13.0+cpu (MKL 2024.2, oneDNN 3.12.0)"
    )
    assert readme.machine_line(AVX2).startswith(
        "AMD EPYC (no AVX-512, no AMX; torch's kernels: AVX2)"
    )


def test_table_shows_the_machine_seed_0_the_range_over_the_seeds_and_the_run_time():
    text = readme.table(results())
    lines = text.splitlines()
    assert lines[0].startswith("Measured on " + readme.machine_line(AVX512) + ".")
    assert "1-minute load average during the runs: 1.0-6.0, median 2.0" in lines[0]
    rows = [x for x in lines if x.startswith("| `")]
    assert [r.split("`")[1] for r in rows] == ["grpo.toml", "ppo.toml"]  # GRAPHS' order
    ppo = [c.strip() for c in rows[1].strip("|").split("|")]
    assert ppo[3] == "0.266 -> 0.625 -> 0.578"  # seed 0, not the first seed by value
    assert ppo[4] == "0, 1, 2"
    assert ppo[5] == "0.266 -> 0.500-0.625 -> 0.562-0.641"  # one value where all seeds agree
    assert ppo[6] == "35.0 s"  # medians over the seeds
    assert ppo[7] == "12.5 min"
    assert ppo[8] == "abc1234, 2026-11-28, ray executor"
    grpo = [c.strip() for c in rows[0].strip("|").split("|")]
    assert grpo[5] == "0.266 -> 0.438-0.469 -> 0.609"
    # 3 x ppo (720 + 780 + 750 s) + 2 x grpo (600 s each) = 57.5 min
    assert "The 5 runs took 58 min in all" in text
    assert (
        "On AMD EPYC (no AVX-512), 2 cores, `make run` (seed 0) at 78fcd10 gave "
        "0.266 -> 0.531 -> 0.625 (a fresh machine)." in text
    )


def test_table_says_when_the_machine_was_busy_and_names_every_machine():
    busy = results()
    busy["grpo"]["runs"]["0"] = run(0, 0.5, 0.6, machine=AVX2)
    first = readme.table(busy).splitlines()[0]
    assert readme.machine_line(AVX512) in first and readme.machine_line(AVX2) in first
    assert "median 2.0." in first  # the runs' medians 2, 4, 2, 2, 2: below 1.2 x 2 cores
    for graph in ("ppo", "grpo"):
        for r in busy[graph]["runs"].values():
            r["load_1min"]["median"] = 3.0
    first = readme.table(busy).splitlines()[0]
    assert "median 3.0 (shared with other jobs: times are longer than on a free machine)" in first
    assert "shared" not in readme.table({"ppo": entry("ppo", run(0, 0.5, 0.6))})


def test_table_skips_rows_of_the_one_seed_layout_and_marks_a_missing_seed_0():
    old = {"grpo": {"graph": "grpo", "val": {"0": 0.3}}, "ppo": entry("ppo", run(1, 0.5, 0.6))}
    rows = [x for x in readme.table(old).splitlines() if x.startswith("| `")]
    assert len(rows) == 1 and "(seed 1) 0.266 -> 0.500 -> 0.600" in rows[0]
    assert readme.table({}).startswith("(no runs measured yet")


def test_seed_range_uses_the_steps_every_seed_reached():
    short = run(1, 0.5, 0.6)
    del short["val"]["20"]
    assert readme.seed_range({0: run(0, 0.25, 0.75), 1: short}) == [
        (0, 0.265625, 0.265625),
        (10, 0.25, 0.5),
    ]


def mine(mid, end, start=0.265625):
    return {"0": start, "10": mid, "20": end}


def test_compare_on_the_readmes_machine_with_its_values_is_as_expected():
    text = readme.compare_text(results(), "ppo", mine(0.625, 0.578125), AVX512)
    lines = text.splitlines()
    assert lines[0] == (
        f"README's graphs/ppo.toml row: abc1234, 2026-11-28, on {readme.machine_line(AVX512)}"
    )
    assert lines[1] == (
        "  seed 0: 0.266 -> 0.625 -> 0.578; seeds 0, 1, 2 range: "
        "0.266 -> 0.500-0.625 -> 0.562-0.641"
    )
    assert lines[2] == (
        "  seed 0 on AMD EPYC (no AVX-512), 2 cores (78fcd10): 0.266 -> 0.531 -> 0.625"
    )
    assert lines[3] == f"this run, on {readme.machine_line(AVX512)}: 0.266 -> 0.625 -> 0.578"
    assert lines[4:] == ["  the same values as the README's seed 0 on this machine: as expected"]


def test_compare_on_the_readmes_machine_with_other_values_says_something_differs():
    text = readme.compare_text(results(), "ppo", mine(0.5, 0.6), AVX512)
    assert "the same CPU model, extensions and torch as the README's row, other values" in text


def test_compare_on_a_known_other_cpu_names_that_cpus_values():
    text = readme.compare_text(results(), "ppo", mine(0.53125, 0.625), AVX2)
    assert text.splitlines()[-1] == (
        "  the same values as seed 0 measured on AMD EPYC (no AVX-512), 2 cores: as expected there"
    )


def test_compare_on_another_cpu_explains_why_and_checks_the_shape():
    text = readme.compare_text(results(), "ppo", mine(0.40625, 0.59375), AVX2)
    lines = text.splitlines()
    assert lines[-3].startswith("  another CPU model (or torch) than the README's row")
    assert "vector units and BLAS paths" in lines[-3] and "RL amplifies it" in lines[-3]
    assert lines[-2] == "  learning from the base model's 0.266, as on every CPU measured"
    assert lines[-1] == "  outside the README's seed range: step 10 (0.406)"
    flat = readme.compare_text(results(), "ppo", mine(0.25, 0.25), AVX2).splitlines()
    assert flat[-2].startswith("  no higher than the base model's 0.266 at step 20")
    assert flat[-1] == "  outside the README's seed range: step 10 (0.250), step 20 (0.250)"


def test_compare_with_another_start_points_to_the_install_not_the_cpu():
    for machine in (AVX512, AVX2):
        last = readme.compare_text(results(), "ppo", mine(0.5, 0.6, start=0.1), machine)
        assert last.splitlines()[-1].startswith("  step 0 is 0.100, not 0.266")
        assert "broken install" in last


def test_compare_without_measurements_or_scores_says_so():
    assert readme.compare_text(results(), "dapo", None, AVX2) == (
        "bench/readme.py: no measured runs of graphs/dapo.toml to compare with"
    )
    unmeasured = {"ppo": {"graph": "ppo", "val": {"0": 0.3}}, "elsewhere": [ELSEWHERE]}
    assert readme.compare_text(unmeasured, "ppo", mine(0.5, 0.6), AVX2).splitlines() == [
        "bench/readme.py: no measured runs of graphs/ppo.toml to compare with",
        "  seed 0 on AMD EPYC (no AVX-512), 2 cores (78fcd10): 0.266 -> 0.531 -> 0.625",
        f"this run, on {readme.machine_line(AVX2)}: 0.266 -> 0.500 -> 0.600",
    ]
    text = readme.compare_text(results(), "ppo", None, AVX2)
    assert text.splitlines()[-1] == "this run: no validation scores found to compare"


def test_compare_reads_the_newest_run_of_the_graph(tmp_path, monkeypatch, capsys):
    for name, end, mtime in (
        ("ppo-20261128-100000", 0.5, 100),
        ("ppo-20261128-110000", 0.625, 200),
    ):
        (tmp_path / "runs" / name).mkdir(parents=True)
        rows = [{"step": 0, "val/score": 0.265625}, {"step": 1, "loss": 1.0}]
        rows += [{"step": 10, "val/score": 0.53125}, {"step": 20, "val/score": end}]
        metrics = tmp_path / "runs" / name / "metrics.jsonl"
        metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.utime(tmp_path / "runs" / name, (mtime, mtime))
    for other in ("grpo-20261128-120000", "ppo-lora-20261128-120000"):  # newer, other graphs'
        (tmp_path / "runs" / other).mkdir()
        (tmp_path / "runs" / other / "metrics.jsonl").write_text('{"step": 0, "val/score": 0.5}\n')
    results_file = tmp_path / "readme.json"
    results_file.write_text(json.dumps(results()))
    monkeypatch.setattr(readme, "ROOT", tmp_path)
    monkeypatch.setattr(readme, "RESULTS", results_file)
    monkeypatch.setattr(readme, "machine", lambda: AVX2)
    readme.main(["--compare", "graphs/ppo.toml"])
    out = capsys.readouterr().out
    assert "runs/ppo-20261128-110000:" in out
    assert "this run, on AMD EPYC (no AVX-512" in out and "0.266 -> 0.531 -> 0.625" in out
    assert "as expected there" in out


@pytest.fixture
def measuring(tmp_path, monkeypatch):
    """main() with the runs faked: each call of run_one is recorded; a seed in `fail` raises."""
    doc = tmp_path / "README.md"
    doc.write_text(f"# x\n\nbefore\n\n{readme.BEGIN}\n\nold table\n\n{readme.END}\n\nafter\n")
    results_file = tmp_path / "readme.json"
    calls, fail = [], set()

    def run_one(graph, seed):
        if (graph, seed) in fail:
            raise RuntimeError("the run failed")
        calls.append((graph, seed))
        return {k: v for k, v in run(seed, 0.5, 0.6).items() if k != "machine"}

    monkeypatch.setattr(readme, "README", doc)
    monkeypatch.setattr(readme, "RESULTS", results_file)
    monkeypatch.setattr(readme, "machine", lambda: AVX512)
    monkeypatch.setattr(
        readme, "describe", lambda g: {k: v for k, v in entry(g).items() if k != "runs"}
    )
    monkeypatch.setattr(readme, "run_one", run_one)
    return doc, results_file, calls, fail


def test_each_run_is_saved_as_it_ends_and_resume_goes_on_from_there(measuring):
    doc, results_file, calls, fail = measuring
    fail.add(("ppo", 1))
    with pytest.raises(RuntimeError):
        readme.main(["--graphs", "ppo,grpo", "--seeds", "0,1", "--write"])
    assert calls == [("ppo", 0), ("grpo", 0)]  # seed 0 of every graph first
    saved = json.loads(results_file.read_text())
    assert set(saved["ppo"]["runs"]) == {"0"} and set(saved["grpo"]["runs"]) == {"0"}
    assert saved["ppo"]["runs"]["0"]["machine"] == AVX512
    text = doc.read_text()
    assert "old table" not in text and "0.266 -> 0.500 -> 0.600" in text
    assert text.startswith("# x\n\nbefore\n\n") and text.endswith(f"{readme.END}\n\nafter\n")

    fail.clear()
    calls.clear()
    readme.main(["--graphs", "ppo,grpo", "--seeds", "0,1", "--resume", "--write"])
    assert calls == [("ppo", 1), ("grpo", 1)]
    saved = json.loads(results_file.read_text())
    assert list(saved["ppo"]["runs"]) == ["0", "1"]
    calls.clear()
    readme.main(["--graphs", "ppo", "--seeds", "0", "--write"])  # without --resume: again
    assert calls == [("ppo", 0)]


def test_table_option_writes_the_saved_results_without_running(measuring):
    doc, results_file, calls, _ = measuring
    results_file.write_text(json.dumps(results()))
    readme.main(["--table", "--write"])
    assert calls == []
    assert readme.table(results()) in doc.read_text()


def test_a_row_keeps_one_machines_runs(measuring, monkeypatch):
    _, results_file, calls, _ = measuring
    results_file.write_text(json.dumps(results()))
    readme.main(["--graphs", "ppo", "--seeds", "1", "--resume", "--write"])
    assert calls == []  # seed 1 is measured on this machine already
    monkeypatch.setattr(readme, "machine", lambda: AVX2)
    readme.main(["--graphs", "ppo", "--seeds", "1", "--resume", "--write"])
    assert calls == [("ppo", 1)]
    saved = json.loads(results_file.read_text())
    assert list(saved["ppo"]["runs"]) == ["1"] and saved["ppo"]["runs"]["1"]["machine"] == AVX2
    assert list(saved["grpo"]["runs"]) == ["0", "1"]  # another graph's row stays as it was
