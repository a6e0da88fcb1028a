"""`flowrl report` on hand-written run directories: which metrics each chart draws, several runs
on the same axes, the timing stack, and the errors a user can act on."""

import json
import sys
from pathlib import Path

import pytest
import toml

from flowrl import report
from flowrl.cli import main
from flowrl.front import dsl
from flowrl.testing import tiny_overrides

ROOT = Path(__file__).resolve().parents[2]


def make_run(path: Path, score: list[float], val: dict[int, float]) -> Path:
    """A run directory as `flowrl run` leaves it: graph.toml and metrics.jsonl, with a
    validation row at step 0, a resume event and a torn last line."""
    path.mkdir(parents=True)
    spec = dsl.load(ROOT / "graphs/ppo.toml", tiny_overrides(ROOT / "graphs/ppo.toml"))
    (path / "graph.toml").write_text(toml.dumps(spec.raw))
    rows = [{"step": 0, "val/score": val[0]}]
    for step, value in enumerate(score, start=1):
        row = {"step": step, "score/mean": value, "time_s": 0.5}
        row |= {"update_policy/grad_norm": 2.0 * step, "update_critic/grad_norm": 1.0}
        row |= {"update_policy/clip_frac": 0.1, "update_policy/clip_frac_lower": 0.9}
        row |= {"timing_s/generate": 0.25, "timing_s/reload:policy:1": 0.125}
        row |= {"timing_s/reload:ref:7": 0.0625, "timing_s/update_policy": 0.125}
        row |= {"val/score": val[step]} if step in val else {}
        rows.append(row)
    lines = [json.dumps(r) for r in rows[:2]] + ['{"event": "resume", "step": 1}']
    lines += [json.dumps(r) for r in rows[2:]] + ['{"step": 9, "score/me']
    (path / "metrics.jsonl").write_text("\n".join(lines))
    return path


def lines_of(figure) -> dict[str, list[tuple[float, float]]]:
    (axes,) = figure.axes
    return {line.get_label(): [tuple(p) for p in line.get_xydata()] for line in axes.get_lines()}


def test_one_run_charts_pick_metrics_by_name_and_suffix(tmp_path):
    run = report.load_run(make_run(tmp_path / "a", [0.0, 0.5, 1.0], {0: 0.1, 3: 0.7}))
    assert [r["step"] for r in run.rows] == [0, 1, 2, 3]  # no event, no torn line
    figures = report.figures([run])
    assert set(figures) == {"score", "clip_frac", "grad_norm", "timing-a"}  # nothing else logged
    assert lines_of(figures["score"]) == {
        "score/mean": [(1, 0.0), (2, 0.5), (3, 1.0)],
        "val/score": [(0, 0.1), (3, 0.7)],
    }
    assert set(lines_of(figures["grad_norm"])) == {
        "update_policy/grad_norm",
        "update_critic/grad_norm",
    }
    assert set(lines_of(figures["clip_frac"])) == {"update_policy/clip_frac"}  # not ..._lower


def test_two_runs_share_the_axes_with_a_legend_entry_per_run(tmp_path):
    a = make_run(tmp_path / "a", [0.0, 0.5, 1.0], {0: 0.1, 3: 0.7})
    b = make_run(tmp_path / "b", [0.25, 0.25], {0: 0.2, 2: 0.3})
    figures = report.figures([report.load_run(a), report.load_run(b)])
    score = figures["score"]
    assert len(score.axes) == 1
    assert lines_of(score) == {
        "a: score/mean": [(1, 0.0), (2, 0.5), (3, 1.0)],
        "a: val/score": [(0, 0.1), (3, 0.7)],
        "b: score/mean": [(1, 0.25), (2, 0.25)],
        "b: val/score": [(0, 0.2), (2, 0.3)],
    }
    legend = [t.get_text() for t in score.axes[0].get_legend().get_texts()]
    assert sorted(legend) == sorted(lines_of(score))
    colors = {
        label.split(":")[0]: line.get_color()
        for label, line in zip(lines_of(score), score.axes[0].get_lines(), strict=True)
    }
    assert colors["a"] != colors["b"]  # a colour per run
    assert {"timing-a", "timing-b"} <= set(figures)


def test_timing_stacks_items_and_sums_transitions_by_kind(tmp_path):
    run = report.load_run(make_run(tmp_path / "a", [0.0, 0.5], {0: 0.1}))
    assert report.timing_groups(run) == {
        "generate": [0.25, 0.25],
        "reload": [0.1875, 0.1875],  # reload:policy:1 + reload:ref:7
        "update_policy": [0.125, 0.125],
    }
    (axes,) = report.timing_figure(run).axes
    tops = sorted({round(p.get_y() + p.get_height(), 6) for p in axes.patches})
    assert tops[-1] == pytest.approx(0.5625)  # 0.25 + 0.1875 + 0.125, the whole stack


def test_write_report_writes_pngs_beside_a_self_contained_page(tmp_path):
    a = make_run(tmp_path / "a", [0.0, 0.5, 1.0], {0: 0.1, 3: 0.7})
    assert main(["report", str(a)]) == 0
    page = (a / "report.html").read_text()
    pngs = sorted(p.name for p in a.glob("report-*.png"))
    assert pngs == [f"report-{s}.png" for s in ("clip_frac", "grad_norm", "score", "timing-a")]
    assert page.count('src="data:image/png;base64,') == len(pngs)
    assert page.count('src="data:image/svg+xml;base64,') == 1  # the graph
    assert 'src="http' not in page and "<link" not in page  # nothing fetched from elsewhere


def test_errors_name_the_fix(tmp_path, monkeypatch, capsys):
    assert main(["report", str(tmp_path)]) == 1
    assert "no metrics.jsonl" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    assert main(["report", str(make_run(tmp_path / "a", [0.0], {0: 0.0}))]) == 1
    assert "pip install matplotlib" in capsys.readouterr().err
