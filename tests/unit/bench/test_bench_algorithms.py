"""bench/algorithms.py's table: one row per graph in the doc's order, the mean over seeds then
each seed's value, written between the doc's markers and nowhere else."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
spec = importlib.util.spec_from_file_location("algorithms", ROOT / "bench" / "algorithms.py")
algorithms = importlib.util.module_from_spec(spec)
spec.loader.exec_module(algorithms)


def result(graph, seed, start, middle, end, step_s):
    return {
        "graph": graph,
        "seed": seed,
        "steps": 20,
        "middle_step": 10,
        "val_start": start,
        "val_middle": middle,
        "val_end": end,
        "median_step_s": step_s,
    }


def test_table_rows_follow_the_algorithm_order_with_means_over_seeds():
    results = [
        result("dapo", 0, 0.25, 0.5, 0.75, 10.0),
        result("grpo", 0, 0.25, None, 0.5, 4.0),
        result("grpo", 1, 0.5, 0.5, 0.75, 6.0),
        result("dapo", 1, 0.25, 0.25, 0.25, 12.0),
    ]
    text = algorithms.table(results, "python bench/algorithms.py", "local")
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert rows[0] == "| graph | val step 0 | val step 10 | val step 20 | median step (s) |"
    # grpo comes before dapo; a missing value is left out of the mean and shown as "-"
    assert rows[1] == (
        "| grpo | 0.375 (0.250, 0.500) | 0.500 (-, 0.500) | 0.625 (0.500, 0.750) | 5.0 |"
    )
    assert rows[2].startswith("| dapo | 0.250 (0.250, 0.250) | 0.375 (0.500, 0.250) |")
    assert "seeds 0, 1" in text and "local executor" in text


def test_the_header_names_the_commit_each_row_was_measured_at():
    first = [
        result(g, s, 0.25, 0.5, 0.75, 4.0) | {"date": "2026-11-28", "commit": "abc1234"}
        for g in ("grpo", "dapo")
        for s in (0, 1)
    ]
    again = [
        r | {"command": "python bench/algorithms.py --graphs dapo --merge", "commit": "def5678"}
        for r in first
        if r["graph"] == "dapo"
    ]
    text = algorithms.table(algorithms.merged(first, again), "python bench/algorithms.py", "local")
    assert "2026-11-28 at abc1234)" in text.splitlines()[0]
    assert text.splitlines()[-1] == (
        "The dapo row was measured again with "
        "`python bench/algorithms.py --graphs dapo --merge` (2026-11-28 at def5678)."
    )


def test_write_doc_replaces_only_the_measured_part(tmp_path, monkeypatch):
    doc = tmp_path / "algorithms.md"
    doc.write_text(f"# Algorithms\nkept\n{algorithms.BEGIN}\nold table\n{algorithms.END}\ntail\n")
    monkeypatch.setattr(algorithms, "DOC", doc)
    algorithms.write_doc("new table")
    assert doc.read_text() == (
        f"# Algorithms\nkept\n{algorithms.BEGIN}\n\nnew table\n\n{algorithms.END}\ntail\n"
    )


def test_the_doc_has_the_markers_and_a_row_per_shipped_graph():
    text = (ROOT / "docs" / "algorithms.md").read_text()
    assert algorithms.BEGIN in text and algorithms.END in text
    for path in (ROOT / "graphs").glob("*.toml"):
        assert f"| `{path.name}` |" in text, path.name
    assert set(algorithms.ALGORITHMS) <= {p.stem for p in (ROOT / "graphs").glob("*.toml")}


def test_merge_replaces_the_graphs_run_again_and_the_table_says_with_what():
    old = [
        {**result("ppo", 0, 0.25, 0.0, 0.25, 30.0), "command": "make algorithms", "date": "d1"},
        {**result("ppo", 1, 0.25, 0.5, 0.5, 30.0), "command": "make algorithms", "date": "d1"},
        {**result("grpo", 0, 0.25, 0.5, 0.75, 10.0), "command": "make algorithms", "date": "d1"},
        {**result("grpo", 1, 0.25, 0.5, 0.75, 10.0), "command": "make algorithms", "date": "d1"},
    ]
    new = [
        {**result("ppo", 0, 0.25, 0.5, 0.75, 40.0), "command": "again --merge", "date": "d2"},
        {**result("ppo", 1, 0.5, 0.5, 0.75, 40.0), "command": "again --merge", "date": "d2"},
    ]
    results = algorithms.merged(old, new)
    assert [(r["graph"], r["seed"], r["date"]) for r in results] == [
        ("ppo", 0, "d2"),
        ("ppo", 1, "d2"),
        ("grpo", 0, "d1"),
        ("grpo", 1, "d1"),
    ]
    text = algorithms.table(results, "unused", "local")
    assert text.startswith("Measured with `make algorithms` (local executor")
    assert "| ppo | 0.375 (0.250, 0.500) | 0.500 (0.500, 0.500) |" in text
    assert "The ppo row was measured again with `again --merge` (d2)." in text
    assert "grpo row was measured again" not in text


def test_merge_refuses_another_step_budget():
    old = [result("grpo", 0, 0.25, 0.5, 0.75, 10.0)]
    new = [{**result("ppo", 0, 0.25, 0.5, 0.75, 40.0), "steps": 10}]
    with pytest.raises(SystemExit, match="give --steps 20"):
        algorithms.merged(old, new)
