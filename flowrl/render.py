"""Graphs and plans as DOT, and DOT as SVG through graphviz's `dot`.

The graph view clusters nodes by the pool that runs them (controller nodes apart), labels data
edges with their keys and dashes state edges. Output is sorted, so it can be compared to a
golden file. No torch or ray here.
"""

import shutil
import subprocess
from pathlib import Path

INSTALL_HINT = (
    "graphviz's `dot` is not installed; install it with `apt-get install -y graphviz` "
    "(Debian/Ubuntu) or `brew install graphviz` (macOS), then run "
    "`dot -Tsvg {dot} -o {svg}`"
)


def dot_escape(text: str) -> str:
    return str(text).replace("\\", "\\\\").replace('"', '\\"')


def graph_dot(graph) -> str:
    """The step's dataflow: one box per node, clustered by pool; edges labelled with keys."""
    spec = graph.spec
    lines = [
        f'digraph "{dot_escape(Path(spec.file).stem)}" {{',
        "  rankdir=TB;",
        '  node [shape=box, style="rounded,filled", fontname="Helvetica"];',
        '  edge [fontname="Helvetica", fontsize=10];',
        '  "dataset" [shape=cylinder, fillcolor="#eeeeee"];',
    ]
    by_pool: dict[str, list[str]] = {}
    for node in spec.nodes:
        pool = spec.pool_of(node) or ""
        by_pool.setdefault(pool, []).append(node)
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
    from_dataset: dict[str, list[str]] = {}
    for node, decl in spec.nodes.items():
        for key in decl.reads:
            if graph.writers.get(key) == "dataset":
                from_dataset.setdefault(node, []).append(key)
    for node in sorted(from_dataset):
        keys = dot_escape(", ".join(sorted(from_dataset[node])))
        lines.append(f'  "dataset" -> "{dot_escape(node)}" [label="{keys}"];')
    for source, target in sorted(graph.dag.edges):
        data = graph.dag.edges[source, target]
        if data["kind"] == "data":
            keys = dot_escape(", ".join(data["keys"]))
            lines.append(f'  "{dot_escape(source)}" -> "{dot_escape(target)}" [label="{keys}"];')
        else:
            why = "model state" if data["kind"] == "state" else "rows"
            lines.append(
                f'  "{dot_escape(source)}" -> "{dot_escape(target)}" '
                f'[style=dashed, label="{why}", color="#999999"];'
            )
    lines.append("}")
    return "\n".join(lines) + "\n"


def write_svg(dot_text: str, out: str | Path) -> tuple[bool, str]:
    """Write `out` as SVG; without graphviz, write the .dot beside it. Returns (ok, message)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    dot_file = out.with_suffix(".dot")
    if shutil.which("dot") is None:
        dot_file.write_text(dot_text)
        return False, f"wrote {dot_file}; " + INSTALL_HINT.format(dot=dot_file, svg=out)
    result = subprocess.run(
        ["dot", "-Tsvg", "-o", str(out)], input=dot_text, text=True, capture_output=True
    )
    if result.returncode != 0:
        dot_file.write_text(dot_text)
        return False, f"dot failed ({result.stderr.strip()}); the DOT source is in {dot_file}"
    return True, f"wrote {out}"
