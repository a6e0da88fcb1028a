"""Graphs and plans as DOT, and DOT as SVG, PNG or PDF through graphviz's `dot`.

The graph view draws one box per node, clustered by the pool that runs it (controller nodes
apart), top to bottom in step order: each node one row below the last node it waits for. Edges
carry their keys; state edges are dashed. The keys every model node reads (prompts, masks,
responses) are listed once, in a note beside the dataset, rather than on an edge into every
model node; `all_keys=True` draws every edge. Output is sorted, so it can be compared to a
golden file. No torch or ray here.
"""

import shutil
import subprocess
from pathlib import Path

import networkx as nx

FORMATS = {".svg": "svg", ".png": "png", ".pdf": "pdf", ".dot": "dot"}  # by output extension
NO_DOT = (
    "graphviz's `dot` is not installed; install it with `apt-get install -y graphviz` "
    "(Debian/Ubuntu) or `brew install graphviz` (macOS)"
)


class RenderError(Exception):
    """No `dot`, or `dot` failed: the message says which and what to do."""


def dot_escape(text: str) -> str:
    return str(text).replace("\\", "\\\\").replace('"', '\\"')


def levels(dag: nx.DiGraph) -> dict:
    """node -> its row: 0 for a node that waits for nothing, else one below the lowest of
    the nodes it waits for (the longest path to it)."""
    out = {}
    for node in nx.topological_sort(dag):
        out[node] = max((out[p] + 1 for p in dag.predecessors(node)), default=0)
    return out


def rank_lines(rows: dict) -> list[str]:
    """`{rank=same; ...}` per row, so a picture reads top to bottom in step order (with
    `newrank=true`, these hold across pool clusters too)."""
    by_row: dict[int, list[str]] = {}
    for node, row in rows.items():
        by_row.setdefault(row, []).append(f'"{dot_escape(node)}";')
    return [f"  {{rank=same; {' '.join(sorted(by_row[r]))}}}" for r in sorted(by_row)]


def shared_keys(graph) -> dict[str, str]:
    """key -> its writer ("dataset" or a node), for the keys that every model node reads,
    except the node that writes them, and that at least two model nodes read."""
    spec = graph.spec
    model_nodes = [n for n, d in spec.nodes.items() if d.model]
    out = {}
    for key, writer in graph.writers.items():
        readers = [n for n in model_nodes if key in spec.nodes[n].reads]
        if len(readers) >= 2 and set(readers) | {writer} >= set(model_nodes):
            out[key] = writer
    return out


def graph_dot(graph, all_keys: bool = False) -> str:
    """The step's dataflow: one box per node, clustered by pool; edges labelled with keys.
    Edges into model nodes leave out the shared keys (listed in a note) unless `all_keys`."""
    spec = graph.spec
    lines = [
        f'digraph "{dot_escape(Path(spec.file).stem)}" {{',
        "  rankdir=TB; newrank=true;",
        '  node [shape=box, style="rounded,filled", fontname="Helvetica"];',
        '  edge [fontname="Helvetica", fontsize=10];',
        '  "dataset" [shape=cylinder, fillcolor="#eeeeee"];',
    ]
    shared = {} if all_keys else shared_keys(graph)
    rows = {"dataset": -1, **levels(graph.dag)}
    if shared:
        lines.append(f'  "shared keys" [shape=note, fillcolor="#ffffff", label="{_note(shared)}"];')
        rows["shared keys"] = -1
    lines += _boxes(spec)
    lines += rank_lines(rows)
    from_dataset = {
        (node, key)
        for node, decl in spec.nodes.items()
        for key in decl.reads
        if graph.writers.get(key) == "dataset"
    }
    edges = [("dataset", n, k) for n, k in from_dataset]
    for source, target, data in graph.dag.edges(data=True):
        if data["kind"] == "data":
            edges += [(source, target, key) for key in data["keys"]]
    labels: dict[tuple[str, str], list[str]] = {}
    for source, target, key in edges:
        if not (key in shared and spec.nodes[target].model):
            labels.setdefault((source, target), []).append(key)
    for (source, target), keys in sorted(labels.items()):
        label = dot_escape(", ".join(sorted(keys)))
        lines.append(f'  "{dot_escape(source)}" -> "{dot_escape(target)}" [label="{label}"];')
    for source, target in _row_links(graph.dag, rows, set(labels)):
        lines.append(f'  "{dot_escape(source)}" -> "{dot_escape(target)}" [style=invis];')
    for source, target in sorted(graph.dag.edges):
        kind = graph.dag.edges[source, target]["kind"]
        if kind != "data":  # "state": after the model's readers; "rows": after a row change
            why = "model state" if kind == "state" else "rows"
            lines.append(
                f'  "{dot_escape(source)}" -> "{dot_escape(target)}" '
                f'[style=dashed, label="{why}", color="#999999"];'
            )
    lines.append("}")
    return "\n".join(lines) + "\n"


def _row_links(dag: nx.DiGraph, rows: dict, drawn: set) -> list[tuple[str, str]]:
    """Invisible edges that keep row r below row r - 1 where no drawn edge does (rank=same
    only groups a row; the edges order them): one per such row, from a node it waits for."""
    out = []
    for row in range(max(rows.values()) + 1):
        members = sorted(n for n, r in rows.items() if r == row)
        if any(rows.get(s) == row - 1 for s, t in drawn if t in members):
            continue
        target = members[0]
        above = sorted(p for p in dag.predecessors(target) if rows[p] == row - 1) or ["dataset"]
        out.append((above[0], target))
    return out


def _note(shared: dict[str, str]) -> str:
    """The note's label: the shared keys by writer, left-aligned (`\\l` ends a line)."""
    by_writer: dict[str, list[str]] = {}
    for key, writer in shared.items():
        by_writer.setdefault(writer, []).append(key)
    lines = ["read by every model node", "(--all-keys draws these edges):"]
    for writer in sorted(by_writer, key=lambda w: (w != "dataset", w)):
        lines.append(f"{', '.join(sorted(by_writer[writer]))}  from {writer}")
    return "".join(dot_escape(line) + "\\l" for line in lines)


def _boxes(spec) -> list[str]:
    by_pool: dict[str, list[str]] = {}
    for node in spec.nodes:
        by_pool.setdefault(spec.pool_of(node) or "", []).append(node)
    lines = []
    for pool in sorted(by_pool):
        indent = "  "
        if pool:
            lines.append(f'  subgraph "cluster_{dot_escape(pool)}" {{')
            lines.append(f'    label="pool {dot_escape(pool)}"; style=dashed;')
            indent = "    "
        for node in sorted(by_pool[pool]):
            decl = spec.nodes[node]
            label = dot_escape(node)
            if decl.uses != node:
                label += f"\\n{dot_escape(decl.uses)}"
            if decl.model:
                label += f"\\n{dot_escape(decl.model)} ({decl.mode})"
            color = "#cfe2f3" if decl.model else "#fff2cc"
            lines.append(f'{indent}"{dot_escape(node)}" [label="{label}", fillcolor="{color}"];')
        if pool:
            lines.append("  }")
    return lines


def run_dot(dot_text: str, fmt: str) -> bytes:
    """`dot_text` drawn by graphviz as `fmt` ("svg", "png", "pdf"); raises RenderError."""
    if shutil.which("dot") is None:
        raise RenderError(NO_DOT)
    result = subprocess.run(["dot", f"-T{fmt}"], input=dot_text.encode(), capture_output=True)
    if result.returncode != 0:
        raise RenderError(f"dot failed ({result.stderr.decode().strip()})")
    return result.stdout


def write(dot_text: str, out: str | Path) -> tuple[bool, str]:
    """Write `out` in the format its extension names (.svg, .png, .pdf or .dot); when graphviz
    is missing or fails, write the .dot beside it. Returns (ok, message)."""
    out = Path(out)
    fmt = FORMATS.get(out.suffix.lower())
    if fmt is None:
        return False, (
            f'cannot write "{out}": the output format follows the file extension, '
            f"one of {', '.join(FORMATS)}"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "dot":
        out.write_text(dot_text)
        return True, f"wrote {out}"
    dot_file = out.with_suffix(".dot")
    if shutil.which("dot") is None:
        dot_file.write_text(dot_text)
        return False, f"wrote {dot_file}; {NO_DOT}, then run `dot -T{fmt} {dot_file} -o {out}`"
    try:
        out.write_bytes(run_dot(dot_text, fmt))
    except RenderError as e:
        dot_file.write_text(dot_text)
        return False, f"{e}; the DOT source is in {dot_file}"
    return True, f"wrote {out}"
