"""`flowrl report RUN_DIR [RUN_DIR ...] [-o OUT]`: the curves of one or more runs as one HTML page.

The page is self-contained (every image a base64 data URI) and its PNGs are written next to it:
score and validation score, KL, entropy, response length, clip fraction, grad norm and learning
rate, several runs on the same axes (one colour per run); per run, a stacked bar of seconds per
plan item per step, and the graph drawn from the run's graph.toml. Metrics are found in
metrics.jsonl by name, or by suffix where a node id prefixes them (`update_policy/grad_norm`).
matplotlib (the `report` extra) is imported only here, with the Agg backend. No torch or ray.
"""

import base64
import html
import json
import sys
from pathlib import Path

import attrs

from flowrl.errors import FlowrlError, GraphErrors
from flowrl.front import dsl, render
from flowrl.front.graph import build

INSTALL = "pip install matplotlib  (or pip install 'flowrl[report]')"
# (file stem, title, metric names, metric suffixes)
CURVES = (
    ("score", "Score (train mean; validation)", ("score/mean", "val/score"), ()),
    ("kl", "KL", (), ("/kl", "/approx_kl", "/kl_loss")),
    ("entropy", "Entropy", (), ("/entropy",)),
    (
        "response_length",
        "Response length (tokens)",
        ("response_length/mean", "val/response_length"),
        (),
    ),
    ("clip_frac", "Clip fraction", (), ("/clip_frac",)),
    ("grad_norm", "Grad norm", (), ("/grad_norm",)),
    ("lr", "Learning rate", (), ("/lr",)),
)
STYLES = ("-", "--", ":", "-.")  # one per metric of a chart; the colour is the run's
TRANSITIONS = ("reload", "offload", "sync", "dispatch", "collect")  # summed by kind


class ReportError(FlowrlError):
    """Something the user can fix: a missing run directory, metrics file or package."""


@attrs.frozen
class Run:
    name: str
    path: Path
    rows: tuple[dict, ...]  # metrics.jsonl rows with a step, events left out

    def keys(self) -> list[str]:
        return sorted({k for row in self.rows for k in row if k != "step"})

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of one metric; a step logged twice keeps its last value."""
        points = {r["step"]: float(r[key]) for r in self.rows if _number(r.get(key))}
        steps = sorted(points)
        return steps, [points[s] for s in steps]


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def load_run(path: str | Path) -> Run:
    path = Path(path)
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise ReportError(f"{path}: no metrics.jsonl (is it a run directory from flowrl run?)")
    rows = []
    for line in metrics.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a torn last line of a killed run
        if "step" in row and "event" not in row:
            rows.append(row)
    return Run(path.name, path, tuple(rows))


def matching(keys, names, suffixes) -> list[str]:
    """The metrics of a chart: exact names first, then those ending with a suffix."""
    found = [k for k in names if k in keys]
    return found + [k for k in keys if k not in found and k.endswith(tuple(suffixes))]


def curve_figure(runs: list[Run], title: str, names=(), suffixes=()):
    """One chart, every run on the same axes (a colour per run, a line style per metric);
    None when no run has any of the metrics."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.4, 3.6), layout="constrained")
    axes = figure.add_subplot()
    colors = [f"C{i % 10}" for i in range(len(runs))]
    for run, color in zip(runs, colors, strict=True):
        for i, key in enumerate(matching(run.keys(), names, suffixes)):
            steps, values = run.series(key)
            label = key if len(runs) == 1 else f"{run.name}: {key}"
            marker = "o" if len(steps) <= 3 or key.startswith("val/") else None
            axes.plot(
                steps, values, STYLES[i % len(STYLES)], color=color, marker=marker, label=label
            )
    if not axes.lines:
        return None
    axes.set(title=title, xlabel="step")
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    return figure


def timing_groups(run: Run) -> dict[str, list[float]]:
    """Seconds per plan item per step (`timing_s/<item>`): a node's call under its name, the
    transitions and dispatch/collect items summed by kind. Lists follow the timed steps."""
    timed = [r for r in run.rows if any(k.startswith("timing_s/") for k in r)]
    groups: dict[str, list[float]] = {}
    for i, row in enumerate(timed):
        for key, value in row.items():
            if not key.startswith("timing_s/"):
                continue
            item = key.removeprefix("timing_s/")
            kind = item.split(":")[0]
            name = kind if kind in TRANSITIONS and ":" in item else item
            groups.setdefault(name, [0.0] * len(timed))[i] += value
    return groups


def timing_figure(run: Run):
    """A stacked bar per step of the seconds of each plan item, the step's wall time as a
    line (items that overlap make a bar taller than the step); None without timings."""
    from matplotlib.figure import Figure

    groups = timing_groups(run)
    if not groups:
        return None
    steps = [r["step"] for r in run.rows if any(k.startswith("timing_s/") for k in r)]
    figure = Figure(figsize=(6.4, 3.6), layout="constrained")
    axes = figure.add_subplot()
    bottom = [0.0] * len(steps)
    for i, (name, seconds) in enumerate(sorted(groups.items(), key=lambda g: -sum(g[1]))):
        axes.bar(
            steps, seconds, bottom=bottom, label=name, color=f"C{i % 10}", hatch="/" * (i // 10)
        )
        bottom = [b + s for b, s in zip(bottom, seconds, strict=True)]
    wall = run.series("time_s")
    if wall[0]:
        axes.plot(*wall, "k.-", label="step wall time")
    axes.set(title=f"{run.name}: seconds per plan item", xlabel="step", ylabel="s")
    handles, labels = axes.get_legend_handles_labels()  # reversed: top of legend = top of bar
    axes.legend(
        handles[::-1],
        labels[::-1],
        fontsize="x-small",
        ncols=2,
        loc="upper left",
        bbox_to_anchor=(1, 1),
    )
    return figure


def graph_svg(run: Run) -> tuple[bytes | None, str]:
    """(SVG of the run's graph, "") or (None, why not)."""
    source = run.path / "run.json"  # relative paths resolve from the graph's own folder
    base_dir = json.loads(source.read_text())["base_dir"] if source.is_file() else ""
    try:
        spec = dsl.load(run.path / "graph.toml", [], base_dir)
        return render.run_dot(render.graph_dot(build(spec)), "svg"), ""
    except GraphErrors as e:
        return None, f"{run.path / 'graph.toml'} does not compile here: {e.problems[0]}"
    except render.RenderError as e:
        return None, f"graph not drawn: {e}"


def figures(runs: list[Run]) -> dict[str, object]:
    """File stem -> matplotlib Figure, for the charts that have data."""
    out = {}
    for stem, title, names, suffixes in CURVES:
        out[stem] = curve_figure(runs, title, names, suffixes)
    for run in runs:
        out[f"timing-{run.name}"] = timing_figure(run)
    return {stem: figure for stem, figure in out.items() if figure is not None}


def write_report(run_dirs, out: str | Path | None = None) -> Path:
    """Write the page (default: RUN_DIR/report.html for one run, ./report.html for several)
    and its PNG and SVG files beside it; returns the page's path."""
    try:
        import matplotlib
    except ImportError:
        raise ReportError(f"flowrl report needs matplotlib: {INSTALL}") from None
    matplotlib.use("Agg")  # no display: files only
    runs = [load_run(d) for d in run_dirs]
    if len({r.name for r in runs}) < len(runs):  # the same name in two places: full paths
        runs = [attrs.evolve(r, name=str(r.path)) for r in runs]
    out = Path(out) if out else (runs[0].path if len(runs) == 1 else Path(".")) / "report.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    sections = []
    for stem, figure in figures(runs).items():
        png = out.with_name(f"{out.stem}-{_file_name(stem)}.png")
        figure.savefig(png, dpi=100)
        sections.append(_image(png.read_bytes(), "image/png", png.name))
    for run in runs:
        svg, note = graph_svg(run)
        if svg is None:
            sections.append(f"<p class='note'>{html.escape(note)}</p>")
            continue
        file = out.with_name(f"{out.stem}-graph-{_file_name(run.name)}.svg")
        file.write_bytes(svg)
        sections.append(
            f"<h2>{html.escape(run.name)}: graph</h2>" + _image(svg, "image/svg+xml", file.name)
        )
    out.write_text(_page(runs, sections))
    return out


def _file_name(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


def _image(data: bytes, mime: str, name: str) -> str:
    encoded = base64.b64encode(data).decode()
    return f'<figure><img src="data:{mime};base64,{encoded}" alt="{html.escape(name)}"></figure>'


def _page(runs: list[Run], sections: list[str]) -> str:
    rows = "".join(
        f"<tr><td>{html.escape(r.name)}</td><td>{html.escape(str(r.path))}</td>"
        f"<td>{max((x['step'] for x in r.rows), default=0)}</td>"
        f"<td>{_last(r, 'score/mean')}</td><td>{_last(r, 'val/score')}</td></tr>"
        for r in runs
    )
    style = (
        "body{font-family:sans-serif;margin:2em}img{max-width:100%}"
        "figure{display:inline-block;margin:0.5em;max-width:46em;vertical-align:top}"
        "td,th{padding:0.2em 1em;text-align:left}.note{color:#a33}"
    )
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>flowrl report</title>"
        f"<style>{style}</style></head><body><h1>flowrl report</h1><table>"
        "<tr><th>run</th><th>directory</th><th>steps</th><th>last score</th>"
        f"<th>last val. score</th></tr>{rows}</table>{''.join(sections)}</body></html>\n"
    )


def _last(run: Run, key: str) -> str:
    steps, values = run.series(key)
    return f"{values[-1]:.3g}" if values else "-"


def command(args) -> int:
    """The `flowrl report` subcommand."""
    try:
        out = write_report(args.run_dirs, args.output)
    except ReportError as e:
        print(f"flowrl: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0
