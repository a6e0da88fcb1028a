"""`flowrl report` on finished tiny runs, loaded in a headless Chromium: every image of the page
loads with a non-zero size, and two runs share the axes of a chart."""

import html
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from flowrl import report
from flowrl.testing import run_tiny

pytestmark = pytest.mark.slow  # the integration tier: trains, starts Ray or loads models

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None
)
# Injected into a copy of the page: after load, each image's state, written into the DOM.
PROBE = """<script>
window.addEventListener("load", () => {
  const out = document.createElement("pre");
  out.id = "probe";
  out.textContent = JSON.stringify(Array.from(document.images, (i) =>
    [i.alt, i.complete, i.naturalWidth, i.naturalHeight]));
  document.body.appendChild(out);
});
</script>"""


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    return [
        run_tiny(ROOT / "graphs/ppo.toml", out, **{"run.seed": seed, "run.steps": 3}).run_dir
        for seed in (0, 1)
    ]


def images_in_browser(page: Path, scratch: Path) -> list[list]:
    probe = page.with_name("probe.html")
    probe.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
    result = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            f"--user-data-dir={scratch}",
            "--virtual-time-budget=10000",
            "--dump-dom",
            probe.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    found = re.search(r'<pre id="probe">(.*?)</pre>', result.stdout, re.S)
    assert found, result.stderr[-2000:]
    return json.loads(html.unescape(found.group(1)))


@pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium to load the page (apt-get install chromium)"
)
def test_every_image_of_the_report_loads_in_a_browser(two_runs, tmp_path):
    page = report.write_report(two_runs, tmp_path / "report.html")
    images = images_in_browser(page, tmp_path / "chromium")
    # 7 charts (score, KL, entropy, length, clip fraction, grad norm, lr) + per run timing, graph
    assert len(images) == 7 + 2 * 2
    for alt, complete, width, height in images:
        assert complete and width > 0 and height > 0, alt
    pngs = sorted(tmp_path.glob("report-*.png"))
    assert len(pngs) == 7 + 2 and all(p.read_bytes()[:4] == b"\x89PNG" for p in pngs)


def test_two_finished_runs_share_the_axes(two_runs):
    runs = [report.load_run(d) for d in two_runs]
    figures = report.figures(runs)
    assert set(figures) >= {
        "score",
        "kl",
        "entropy",
        "response_length",
        "clip_frac",
        "grad_norm",
        "lr",
    }
    for stem in ("score", "entropy"):
        (axes,) = figures[stem].axes
        labels = [line.get_label() for line in axes.get_lines()]
        for run in runs:  # each run's lines, drawn from its own metrics.jsonl
            mine = [
                line for line in axes.get_lines() if line.get_label().startswith(run.name + ":")
            ]
            assert mine, (stem, labels)
            key = mine[0].get_label().split(": ", 1)[1]
            steps, values = run.series(key)
            assert [tuple(p) for p in mine[0].get_xydata()] == list(zip(steps, values, strict=True))
        assert sorted(t.get_text() for t in axes.get_legend().get_texts()) == sorted(labels)
