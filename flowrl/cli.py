"""`flowrl run | check | plan | render | nodes`.

check, plan, render and nodes import neither torch nor ray; `run` imports the runtime lazily.
A bad graph file exits with code 2 and a list of its problems, never a traceback.
"""

import argparse
import sys
from pathlib import Path

import attrs

from flowrl import compiler, registry, render, report, tiny_run
from flowrl.errors import GraphErrors


def graph_path(file: str) -> str:
    """`file`, or when it does not exist, the shipped graph of that name (graphs/ppo.toml or
    ppo), so an installed flowrl runs its own graphs from any directory."""
    if Path(file).exists():
        return file
    from importlib.resources import files

    shipped = files("flowrl.graphs") / Path(file).with_suffix(".toml").name
    return str(shipped) if shipped.is_file() else file


def load_plan(file: str, overrides=()):
    """(GraphSpec, Graph, ExecutionPlan) of a graph file; raises GraphErrors. The spec is the
    one that runs: without the nodes the graph skips (see flowrl/graph.py)."""
    plan = compiler.compile_file(graph_path(file), overrides)
    return plan.spec, plan.graph, plan


def cmd_check(args) -> int:
    status = 0
    files = [f for f in args.files if "=" not in f or Path(f).exists()]
    args.overrides = [*args.overrides, *(f for f in args.files if f not in files)]
    for file in files:
        try:
            spec, built, plan = load_plan(file, args.overrides)
        except GraphErrors as e:
            print(e.report(), file=sys.stderr)
            status = 2
            continue
        counts = ", ".join(
            _count(len(things), what)
            for things, what in ((spec.nodes, "node"), (spec.models, "model"), (spec.pools, "pool"))
        )
        print(f"{file}: ok ({counts}, {plan.batch.rows} rows per step)")
        print(node_table(spec, built))
        for warning in plan.warnings:
            print(f"  warning: {warning}")
    return status


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'s' * (n != 1)}"


def node_table(spec, built) -> str:
    rows = [("node", "uses", "model", "mode", "reads -> writes")]
    for node in built.order:
        d = spec.nodes[node]
        rows.append(
            (
                node,
                d.uses,
                d.model or "-",
                d.mode or "controller",
                f"{', '.join(d.reads)} -> {', '.join(d.writes) or '(update)'}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join(
        "  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[4]
        for r in rows
    )


def cmd_plan(args) -> int:
    _, _, plan = load_plan(args.file, args.overrides)
    print(plan.to_json() if args.json else plan.text(), end="")
    return 0


def cmd_render(args) -> int:
    _, built, plan = load_plan(args.file, args.overrides)
    dot = plan.to_dot() if args.plan else render.graph_dot(built, all_keys=args.all_keys)
    out = args.output or str(Path(args.file).with_suffix(".plan.svg" if args.plan else ".svg"))
    ok, message = render.write(dot, out)
    print(message, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


def cmd_nodes(args) -> int:
    for name in registry.builtin_names():
        ref = registry.resolve(name)
        spec = ref.spec
        where = f"model, {spec.mode}, head {spec.head}" if spec.uses_model else "controller"
        print(f"{name}  ({where})  {ref.location}")
        if ref.doc:
            print(f"    {ref.doc}")
        print(f"    reads:  {', '.join(spec.reads)}")
        if spec.optional_reads:
            print(f"            + {', '.join(spec.optional_reads)} (depending on its params)")
        print(f"    writes: {', '.join(spec.writes) or '(none)'}")
        for field in attrs.fields(spec.params):
            default = (
                field.default.factory()
                if isinstance(field.default, attrs.Factory)
                else field.default
            )
            print(f"    {field.name} = {default!r}")
    return 0


def cmd_run(args) -> int:
    if args.tiny:  # the tiny model first, so the command line's own overrides win
        args.overrides = [*tiny_run.tiny_overrides(graph_path(args.file)), *args.overrides]
    _, _, plan = load_plan(args.file, args.overrides)
    from flowrl.runtime.controller import run  # torch and ray load from here on

    run(plan, backend=args.backend, resume=args.resume)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flowrl", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    over = "dotted overrides, e.g. run.steps=50 nodes.advantage.lam=0.9"

    r = sub.add_parser("run", help="train with a graph")
    r.add_argument("file")
    r.add_argument("overrides", nargs="*", help=over)
    r.add_argument("--backend", choices=["ray", "local"], help="default: run.backend")
    r.add_argument("--resume", metavar="RUN_DIR", help="continue from RUN_DIR's last checkpoint")
    r.add_argument("--tiny", action="store_true", help="try the graph on a tiny random model")
    r.set_defaults(func=cmd_run)

    c = sub.add_parser("check", help="validate graph files without loading any model")
    c.add_argument("files", nargs="+", help="graph files, then any KEY=VALUE overrides")
    c.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    c.set_defaults(func=cmd_check)

    pl = sub.add_parser("plan", help="print the compiled plan of one step")
    pl.add_argument("file")
    pl.add_argument("overrides", nargs="*", help=over)
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(func=cmd_plan)

    rd = sub.add_parser("render", help="draw the graph (or, with --plan, the plan)")
    rd.add_argument("file")
    rd.add_argument("overrides", nargs="*", help=over)
    rd.add_argument("-o", "--output", help="output file: .svg (default), .png, .pdf or .dot")
    rd.add_argument("--plan", action="store_true", help="draw the compiled plan")
    rd.add_argument("--all-keys", action="store_true", help="an edge for every key read")
    rd.set_defaults(func=cmd_render)

    rp = sub.add_parser("report", help="plot runs' metrics on one HTML page (needs matplotlib)")
    rp.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="several: on the same axes")
    rp.add_argument(
        "-o", "--output", help="the page; default RUN_DIR/report.html, or ./report.html"
    )
    rp.set_defaults(func=report.command)

    n = sub.add_parser("nodes", help="list the built-in nodes")
    n.set_defaults(func=cmd_nodes)
    return p


def main(argv=None) -> int:
    p = parser()
    args, extra = p.parse_known_args(argv)  # overrides may also follow options
    if extra and (not hasattr(args, "overrides") or any("=" not in e for e in extra)):
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    try:
        return args.func(args)
    except GraphErrors as e:
        print(e.report(), file=sys.stderr)
        return 2
    except Exception as e:  # a failed node or a bad data file: the message says what and where
        if type(e).__name__ not in ("NodeFailure", "DataError", "ModelNotFound", "ScorerError"):
            raise
        print(f"flowrl: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
