"""GraphSpec -> a checked networkx DAG of the step.

Edges come from names, never from lists of wires:
- data edges: a node that reads key k runs after the one node that writes k (or k comes from
  the dataset);
- state edges: a node that trains model M runs after every other node of the step that uses M,
  so the whole step sees one version of M's weights; the next step sees the update;
- row edges: a node that changes the rows (generate with n samples, a filter) is ordered
  against every node the other edges leave unordered with it: a node above it in the file
  runs before it, on the rows it receives; a node below it runs after it, on the rows it
  returns. So no node's rows change between its dispatch and its collect.
A node none of whose outputs is read (under the params as set, e.g. ref_logprob when the
update's kl_loss_coef is 0) is dropped, and so is a model only such nodes used: it is never
loaded. The controller counts as a reader of "scores" (validation and metrics).
No torch or ray here.
"""

import attrs
import networkx as nx

from flowrl.backends import ROLLOUT_BACKENDS, missing_package
from flowrl.errors import Collector, did_you_mean
from flowrl.front import registry
from flowrl.front.schema import DATASET_KEYS, GraphSpec

DATASET = "dataset"
CONTROLLER_READS = ("scores",)  # what the controller itself reads: validation, metrics


@attrs.frozen
class Graph:
    spec: GraphSpec
    dag: nx.DiGraph  # node ids; edge attrs: kind ("data" | "state" | "rows"), keys (tuple)
    writers: dict[str, str]  # key -> node id, or "dataset"
    order: tuple[str, ...]  # a topological order, file order among equals
    warnings: tuple[str, ...]
    pruned: tuple[str, ...] = ()  # nodes dropped because nothing reads their outputs

    def readers(self, key: str) -> list[str]:
        return [n for n, d in self.spec.nodes.items() if key in d.reads]


def build(spec: GraphSpec) -> Graph:
    """Wire and check the graph; raises GraphErrors with every problem found."""
    errors = Collector(spec.file)
    writers = _writers(spec, errors)
    dag = nx.DiGraph()
    dag.add_nodes_from(spec.nodes)
    for node_id, decl in spec.nodes.items():
        for key in decl.reads:
            source = writers.get(key)
            if source is None:
                errors.add(
                    f"[nodes.{node_id}]",
                    f'reads "{key}", which no node writes and the '
                    f"dataset does not provide{did_you_mean(key, writers)}",
                    _fix_for(key),
                )
            elif source == node_id:
                errors.add(
                    f"[nodes.{node_id}]",
                    f'reads "{key}", which it writes itself',
                    f'rename one of them: rename = {{ {key} = "..." }}',
                )
            elif source != DATASET:
                _add_edge(dag, source, node_id, "data", key)
    _add_state_edges(spec, dag)
    _check_cycles(dag, errors)
    errors.raise_if_any()
    _add_row_edges(spec, dag)
    dead = _dead_nodes(spec)
    if dead:  # checked as written; runs without them
        return _without(spec, dead)
    index = {n: i for i, n in enumerate(spec.nodes)}
    order = tuple(nx.lexicographical_topological_sort(dag, key=index.__getitem__))
    return Graph(spec, dag, writers, order, tuple(_warnings(spec, writers)))


def _dead_nodes(spec: GraphSpec) -> list[str]:
    """Nodes whose every output is read by no live node (to a fixed point). Only plain
    producers go: a node that trains, keeps state or changes the rows always runs."""
    live = set(spec.nodes)
    while True:
        read = {k for n in live for k in spec.nodes[n].reads} | set(CONTROLLER_READS)
        dead = [
            n
            for n in live
            if spec.nodes[n].writes
            and spec.nodes[n].mode != "train"
            and spec.nodes[n].spec.rows == "same"
            and not spec.nodes[n].spec.stateful
            and not read & set(spec.nodes[n].writes)
        ]
        if not dead:
            return [n for n in spec.nodes if n not in live]
        live -= set(dead)


def _without(spec: GraphSpec, dead: list[str]) -> Graph:
    """The graph of `spec` minus the dead nodes and the models only they used."""
    nodes = {n: d for n, d in spec.nodes.items() if n not in dead}
    used = {d.model for d in spec.nodes.values()}
    still = {d.model for d in nodes.values()}
    models = {m: c for m, c in spec.models.items() if m in still or m not in used}
    built = build(attrs.evolve(spec, nodes=nodes, models=models))
    notes = []
    for node in dead:
        decl = spec.nodes[node]
        keys = ", ".join(f'"{k}"' for k in decl.writes)
        note = f"[nodes.{node}] is skipped: no node reads {keys} under these params"
        if decl.model and decl.model not in models:
            note += f"; model {decl.model} is not loaded"
        notes.append(note)
    return attrs.evolve(built, warnings=(*notes, *built.warnings), pruned=tuple(dead))


def _writers(spec: GraphSpec, errors: Collector) -> dict[str, str]:
    by_key: dict[str, list[str]] = {k: [DATASET] for k in DATASET_KEYS}
    for node_id, decl in spec.nodes.items():
        for key in decl.writes:
            by_key.setdefault(key, []).append(node_id)
    for key, nodes in by_key.items():
        if len(nodes) > 1:
            names = " and ".join(f"[nodes.{n}]" if n != DATASET else "the dataset" for n in nodes)
            errors.add(
                f"[nodes.{nodes[-1]}]",
                f'"{key}" is written by {names}',
                f'keep one writer, or rename one output: rename = {{ {key} = "..." }}',
            )
    return {key: nodes[0] for key, nodes in by_key.items()}


def _fix_for(key: str) -> str:
    """Suggest the built-in nodes that write `key`."""
    makers = []
    for name in registry.builtin_names():
        try:
            if key in registry.resolve(name).spec.writes:
                makers.append(name)
        except Exception:
            continue
    if makers:
        return (
            f'add a node that writes it, e.g. uses = "{makers[0]}" (writers: {", ".join(makers)})'
        )
    return f'add a node that writes "{key}", or rename another node\'s output to it'


def _add_edge(dag: nx.DiGraph, source: str, target: str, kind: str, key: str | None) -> None:
    if dag.has_edge(source, target):
        data = dag.edges[source, target]
        if key:
            data["keys"] = tuple(sorted({*data["keys"], key}))
        if kind == "data":
            data["kind"] = "data"
    else:
        dag.add_edge(source, target, kind=kind, keys=(key,) if key else ())


def _add_state_edges(spec: GraphSpec, dag: nx.DiGraph) -> None:
    for trainer, decl in spec.nodes.items():
        if decl.mode != "train":
            continue
        for user, other in spec.nodes.items():
            if user != trainer and other.model == decl.model and other.mode != "train":
                _add_edge(dag, user, trainer, "state", None)


def _add_row_edges(spec: GraphSpec, dag: nx.DiGraph) -> None:
    """Order every row-changing node against each node it is not yet ordered with: file order
    decides. Checked edge by edge, so no edge closes a cycle."""
    position = {n: i for i, n in enumerate(spec.nodes)}
    for changer, decl in spec.nodes.items():
        if decl.spec.rows == "same":
            continue
        for other in spec.nodes:
            if other == changer or nx.has_path(dag, changer, other):
                continue
            if nx.has_path(dag, other, changer):
                continue
            if position[other] < position[changer]:
                _add_edge(dag, other, changer, "rows", None)
            else:
                _add_edge(dag, changer, other, "rows", None)


def _check_cycles(dag: nx.DiGraph, errors: Collector) -> None:
    try:
        cycle = nx.find_cycle(dag)
    except nx.NetworkXNoCycle:
        return
    steps = []
    for source, target in cycle:
        data = dag.edges[source, target]
        why = ", ".join(data["keys"]) if data["kind"] == "data" else "model state"
        steps.append(f"{source} -> {target} ({why})")
    errors.add(
        f"[nodes.{cycle[0][0]}]",
        "the nodes form a cycle: " + "; ".join(steps),
        "a step must be acyclic: rename a key so no node (indirectly) reads its own output",
    )


def _warnings(spec: GraphSpec, writers: dict[str, str]) -> list[str]:
    read = {k for d in spec.nodes.values() for k in d.reads} | set(CONTROLLER_READS)
    read |= {d.rename.get(k, k) for d in spec.nodes.values() for k in d.spec.reads_if_written}
    out = [*spec.renamed]
    out += [
        _unread(spec.nodes[node], key)
        for key, node in sorted(writers.items())
        if node != DATASET and key not in read and _unread(spec.nodes[node], key)
    ]
    used = {d.model for d in spec.nodes.values()}
    trained = {d.model for d in spec.nodes.values() if d.mode == "train"}
    for name, model in spec.models.items():
        if name not in used:
            out.append(f"[models.{name}] is not used by any node")
        elif model.trainable and name not in trained:
            out.append(f"[models.{name}] is trainable but no node trains it")
        if name in used and (package := missing_package(model.rollout)):
            install = ROLLOUT_BACKENDS[model.rollout].install
            out.append(
                f'[models.{name}] rollout = "{model.rollout}" needs the {package} package, '
                f"not installed here: {install} (`flowrl run` stops on it before loading a model)"
            )
    return out


def _unread(decl, key: str) -> str:
    """The warning for a key a node writes and no node reads, or "" when that is no sign of a
    mistake. A node's writes are its contract, whatever the graph reads of them (the agent's
    rollout_logprobs come free with sampling; ReMax's greedy responses are renamed out of the
    way and only scored); a node none of whose writes is read is dropped instead, and a reader
    that misspells a key is an error of its own. An optional write that the node's params turn
    on and nobody reads is worth a word: it is computed for nothing."""
    declared = next((k for k, v in decl.rename.items() if v == key), key)
    if declared in decl.spec.optional_writes:
        return (
            f'[nodes.{decl.id}] writes "{key}", which its params turn on and no node reads '
            "(computed for nothing)"
        )
    return ""
