"""`flowrl render`: the format follows the extension; shared keys drawn once; top to bottom in
step order; controller items outside the pool boxes of the plan. Layout is read back from
graphviz's own JSON output."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from flowrl.cli import main
from flowrl.front import compiler, render

ROOT = Path(__file__).resolve().parents[3]
PPO = str(ROOT / "graphs/ppo.toml")
GRAPHS = sorted((ROOT / "graphs").glob("*.toml"))
needs_dot = pytest.mark.skipif(
    shutil.which("dot") is None, reason="graphviz's dot is not installed"
)
EDGE = re.compile(r'^\s*"([^"]+)" -> "([^"]+)" \[(.*)\];$', re.M)


def edges(dot: str) -> dict[tuple[str, str], list[str]]:
    """(source, target) -> keys on its label, for the drawn edges (not invisible ones)."""
    out = {}
    for source, target, attributes in EDGE.findall(dot):
        if "style=invis" in attributes:
            continue
        label = re.search(r'label="([^"]*)"', attributes)
        out[(source, target)] = label.group(1).split(", ") if label else []
    return out


def layout(dot: str) -> tuple[dict, dict]:
    """({node: (x, depth)}, {cluster: (x0, depth0, x1, depth1)}): depth grows downwards."""
    data = json.loads(
        subprocess.run(
            ["dot", "-Tjson"], input=dot, text=True, capture_output=True, check=True
        ).stdout
    )
    top = float(data["bb"].split(",")[3])
    nodes, clusters = {}, {}
    for obj in data["objects"]:
        if "pos" in obj:
            x, y = map(float, obj["pos"].split(","))
            nodes[obj["name"]] = (x, top - y)
        elif obj["name"].startswith("cluster") and "bb" in obj:
            x0, y0, x1, y1 = map(float, obj["bb"].split(","))
            clusters[obj["name"]] = (x0, top - y1, x1, top - y0)
    return nodes, clusters


@needs_dot
@pytest.mark.parametrize(
    "suffix, magic", [(".png", b"\x89PNG\r\n\x1a\n"), (".pdf", b"%PDF-"), (".svg", b"<?xml")]
)
def test_output_format_follows_the_extension(tmp_path, suffix, magic):
    out = tmp_path / f"x{suffix}"
    assert main(["render", PPO, "-o", str(out)]) == 0
    assert out.read_bytes().startswith(magic)
    assert main(["render", PPO, "--plan", "-o", str(out)]) == 0
    assert out.read_bytes().startswith(magic)


def test_unknown_extension_is_an_error_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "x.jpg"
    assert main(["render", PPO, "-o", str(out)]) == 1
    assert not list(tmp_path.iterdir())
    err = capsys.readouterr().err
    assert "x.jpg" in err and ".svg, .png, .pdf, .dot" in err


def test_shared_keys_are_drawn_once_and_all_keys_draws_every_edge():
    built = compiler.compile_file(PPO).graph
    assert render.shared_keys(built) == {
        "prompts": "dataset",
        "prompt_mask": "dataset",
        "responses": "generate",
        "response_mask": "generate",
        "response_attention": "generate",
    }
    every = edges(render.graph_dot(built, all_keys=True))
    default_dot = render.graph_dot(built)
    default = edges(default_dot)
    assert len(every) == 24 and len(default) == 13  # the default drops 11 of the 24 edges
    assert default_dot.count("->") <= 14  # with the invisible edges that keep the rows
    note = re.search(r'"shared keys" \[.*label="([^"]*)"', default_dot).group(1)
    for node, decl in built.spec.nodes.items():
        for key in decl.reads:
            writer = built.writers[key]
            assert key in every[(writer, node)], (writer, node, key)  # --all-keys: every read
            if decl.model and key in render.shared_keys(built):
                assert key in note and key not in default.get((writer, node), [])
            else:
                assert key in default[(writer, node)], (writer, node, key)


@needs_dot
@pytest.mark.parametrize("graph", GRAPHS, ids=lambda p: p.name)
def test_graph_reads_top_to_bottom_in_step_order(graph):
    built = compiler.compile_file(graph).graph
    nodes, _ = layout(render.graph_dot(built))
    for source, target in built.dag.edges:
        assert nodes[source][1] < nodes[target][1], (source, target)
    first = min(nodes[n][1] for n in built.spec.nodes)
    assert nodes["dataset"][1] < first


@needs_dot
@pytest.mark.parametrize("graph", GRAPHS, ids=lambda p: p.name)
def test_plan_in_step_order_with_controller_items_outside_pool_boxes(graph):
    plan = compiler.compile_file(graph)
    nodes, clusters = layout(plan.to_dot())
    for item in plan.items:
        for dep in item.deps:
            assert nodes[str(dep)][1] < nodes[str(item.id)][1], (dep, item.id)
    pools = [box for name, box in clusters.items() if name != "cluster_(controller)"]
    assert len(pools) == len(plan.pools)
    for item in plan.items:
        x, depth = nodes[str(item.id)]
        inside = [x0 <= x <= x1 and d0 <= depth <= d1 for x0, d0, x1, d1 in pools]
        assert any(inside) == (item.pool is not None), item.name
