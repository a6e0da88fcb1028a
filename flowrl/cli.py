"""`flowrl run | replay | check | plan | render | nodes | export | serve`.

check, plan, render and nodes import neither torch nor ray; `run` imports the runtime lazily.
A bad graph file exits with code 2 and a list of its problems, any other flowrl error (a failed
node, a bad data file) with code 1 and its message: never a traceback for a user's mistake.
A graph is a path (with a directory part, or ending in .toml), or the bare name of a shipped
graph ("grpo").
"""

import argparse
import json
import os
import shlex
import sys
from importlib.resources import files
from pathlib import Path

import attrs

from flowrl import report
from flowrl.errors import FlowrlError, GraphErrors, Problem, did_you_mean, one_of
from flowrl.front import compiler, registry, render, schema, tiny_run
from flowrl.front.overrides import TOP_LEVEL


def graph_path(file: str) -> str:
    """The graph file that `file` names; raises GraphErrors when there is none.

    A path (it has a directory part, or ends in .toml) is that file, existing or not (the
    loader reports a missing one). A bare name ("grpo") is the shipped graph of that name, so
    an installed flowrl runs its own graphs from any directory.
    """
    if Path(file).is_dir():
        inside = sorted(str(p) for p in Path(file).glob("*.toml"))
        fix = f"give a graph file: {', '.join(inside)}" if inside else "give a .toml graph file"
        raise GraphErrors([Problem(file, "file", "is a directory, not a graph file", fix)])
    names = shipped_graphs()
    if not is_bare_name(file):
        stem = Path(file).stem
        if not Path(file).exists() and stem in names:
            fix = f'check the path, or write "{stem}" (no directory, no .toml): the shipped graph'
            raise GraphErrors([Problem(file, "file", "no such file", fix)])
        return file
    if file in names:
        return str(files("flowrl.graphs") / f"{file}.toml")
    message = f'no shipped graph named "{file}"{did_you_mean(file, names)}'
    fix = f"shipped graphs: {one_of(names)}; or give the path of a .toml file"
    raise GraphErrors([Problem(file, "file", message, fix)])


def is_bare_name(file: str) -> bool:
    return not ("/" in file or os.sep in file or file.endswith(".toml"))


def shipped_graphs() -> list[str]:
    return sorted(
        p.name.removesuffix(".toml")
        for p in files("flowrl.graphs").iterdir()
        if p.name.endswith(".toml")
    )


def say_which(file: str, path: str) -> None:
    """Name the shipped graph a bare name stands for (on stderr: stdout may be a plan)."""
    if path != file:
        print(f"flowrl: {file} is the shipped graph {path}", file=sys.stderr)


def load_plan(file: str, overrides=()):
    """The ExecutionPlan of a graph file or shipped graph name; raises GraphErrors. It carries
    the spec that runs (`plan.spec`, without the nodes the graph skips, see
    flowrl/front/graph.py) and the graph (`plan.graph`)."""
    return compiler.compile_file(graph_path(file), overrides)


def cmd_check(args) -> int:
    graphs = [f for f in args.files if not is_override(f)]
    args.overrides = [*args.overrides, *(f for f in args.files if is_override(f))]
    if not graphs:
        print("flowrl check: no graph file given (overrides alone check nothing)", file=sys.stderr)
        return 2
    status = 0
    for file in graphs:
        try:
            path = graph_path(file)
            plan = load_plan(path, args.overrides)
        except GraphErrors as e:
            print(e.report(), file=sys.stderr)
            status = 2
            continue
        spec = plan.spec
        counts = ", ".join(
            _count(len(things), what)
            for things, what in ((spec.nodes, "node"), (spec.models, "model"), (spec.pools, "pool"))
        )
        shipped = f" (the shipped graph {file})" if path != file else ""
        after = "".join(
            f", at most {plan.batch.rows_per_node[n]} after {f}" for f, n in _after_filters(plan)
        )
        print(f"{path}{shipped}: ok ({counts}, {plan.batch.rows} rows per step{after})")
        print(node_table(spec, plan.graph))
        for warning in plan.warnings:
            print(f"  warning: {warning}")
        if args.strict and spec.renamed:
            print(
                f"{path}: refused by --strict: {_count(len(spec.renamed), 'old key name')} "
                "(the warnings above say the new ones)",
                file=sys.stderr,
            )
            status = 2
    return status


def _after_filters(plan) -> list[tuple[str, str]]:
    """(filter, the first node after it) for each filter node that has nodes after it."""
    return [(node, plan.after(node)[0]) for node in plan.filters() if plan.after(node)]


def is_override(arg: str) -> bool:
    """An argument of `check` that is an override (table.key=value, or a table.key missing its
    value) rather than a graph file."""
    if Path(arg).exists():
        return False
    head = arg.split(".", 1)[0]
    return "=" in arg or (head in TOP_LEVEL and "." in arg and is_bare_name(arg))


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'s' * (n != 1)}"


def _writes(decl) -> str:
    if decl.spec.rows == "filter":
        return "(keeps rows: keep)"
    return ", ".join(decl.writes) or "(update)"


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
                f"{', '.join(d.reads)} -> {_writes(d)}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join(
        "  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[4]
        for r in rows
    )


def cmd_plan(args) -> int:
    say_which(args.file, graph_path(args.file))
    plan = load_plan(args.file, args.overrides)
    print(plan.to_json() if args.json else plan.text(), end="")
    return 0


def cmd_render(args) -> int:
    say_which(args.file, graph_path(args.file))
    plan = load_plan(args.file, args.overrides)
    dot = plan.to_dot() if args.plan else render.graph_dot(plan.graph, all_keys=args.all_keys)
    out = args.output or str(Path(args.file).with_suffix(".plan.svg" if args.plan else ".svg"))
    try:
        ok, message = render.write(dot, out)  # the format follows the extension
    except OSError as e:
        ok, message = False, f"flowrl: cannot write {out}: {e.strerror or e}"
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
        kept = "(a filter: keeps the rows of its keep mask)" if spec.rows == "filter" else ""
        print(f"    writes: {', '.join(spec.writes) or kept or '(none)'}")
        if spec.optional_writes:
            print(f"            + {', '.join(spec.optional_writes)} (depending on its params)")
        for field in attrs.fields(spec.params):
            default = (
                field.default.factory()
                if isinstance(field.default, attrs.Factory)
                else field.default
            )
            print(f"    {field.name} = {default!r}")
    return 0


def cmd_run(args) -> int:
    from flowrl.runtime.stop import Stopped, stopped_by_signals  # torch-free

    command = _run_command(args)
    try:
        with stopped_by_signals():  # from the start: set-up can take minutes
            say_which(args.file, graph_path(args.file))
            if args.tiny:  # the tiny model first, so the command line's own overrides win
                args.overrides = [*tiny_run.tiny_overrides(graph_path(args.file)), *args.overrides]
            plan = load_plan(args.file, args.overrides)
            for warning in plan.warnings:  # as `flowrl check` shows them
                print(f"flowrl: warning: {warning}", file=sys.stderr)
            from flowrl.runtime.controller import run  # torch and ray load from here on

            try:
                run_dir = run(
                    plan,
                    backend=args.backend,
                    resume=args.resume,
                    allow_graph_change=args.allow_graph_change,
                    command=command,
                )
            except Exception as e:
                if args.pdb:
                    _debug(e)
                raise
            if args.tiny:  # what the run exercised: a tiny run looks more conclusive than it is
                lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
                print(tiny_run.summary(plan.spec, [json.loads(line) for line in lines]))
    except Stopped as e:
        if str(e) == f"stopped by {e.signal_name}":  # before the run began
            e.explain("the run had not begun; nothing was created")
        print(f"flowrl: {e}", file=sys.stderr)
        return 1
    return 0


def _run_command(args) -> str:
    """The command line that starts this run again (without --resume), for messages."""
    words = ["flowrl", "run", args.file]
    words += ["--tiny"] * args.tiny + (["--backend", args.backend] if args.backend else [])
    return shlex.join([*words, *args.overrides])


def _debug(error: Exception) -> None:
    """`--pdb`: the post-mortem debugger where a node failed, when it failed in this process;
    a node that failed in a Ray worker is replayed in-process instead (docs/debugging.md)."""
    from flowrl.runtime import replay

    if replay.in_this_process(error):
        replay.post_mortem(error)
        return
    print(
        "--pdb: the node failed in a Ray worker process, out of this debugger's reach: run "
        "the replay command below with --pdb to debug it here (or run with --backend local)",
        file=sys.stderr,
    )


def cmd_replay(args) -> int:
    from flowrl.runtime import replay  # torch loads from here on

    try:
        call = replay.load(args.run_dir, args.step, args.node, args.rank, args.overrides)
    except (FileNotFoundError, LookupError) as e:  # no such run, saved call or node
        print(f"flowrl: {e}", file=sys.stderr)
        return 1
    print(f"replaying node {args.node} of step {args.step}, rank {args.rank}")
    for note in call.notes:
        print(f"  {note}")
    try:
        result = call.run()
    except Exception as e:
        import traceback

        cause = replay.innermost(e)
        traceback.print_exception(type(cause), cause, cause.__traceback__)
        if args.pdb:
            replay.post_mortem(e)
        raise
    print(replay.describe(result.writes, result.metrics))
    return 0


def cmd_export(args) -> int:
    from flowrl.runtime.export import export  # torch loads from here on

    print(f"wrote {export(args.run_dir, args.output, step=args.step, model=args.model)}")
    return 0


def cmd_serve(args) -> int:
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        if not (args.api_key or os.environ.get("FLOWRL_API_KEY")):
            print(
                f"flowrl serve: --host {args.host} is reachable from other machines: give "
                "--api-key (or set FLOWRL_API_KEY)",
                file=sys.stderr,
            )
            return 2
    from flowrl.serve.server import serve  # torch, fastapi: only for this command

    return serve(args)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flowrl", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    over = "dotted overrides, e.g. run.steps=50 nodes.advantage.lam=0.9"

    r = sub.add_parser("run", help="train with a graph")
    r.add_argument("file")
    r.add_argument("overrides", nargs="*", help=over)
    r.add_argument("--backend", choices=schema.BACKENDS, help="default: run.backend")
    r.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue from RUN_DIR's last checkpoint (or from RUN_DIR/checkpoints/step_N)",
    )
    r.add_argument(
        "--allow-graph-change",
        action="store_true",
        help="with --resume: accept a graph that differs from the run's (docs/reliability.md)",
    )
    r.add_argument("--pdb", action="store_true", help="post-mortem debugger where a node failed")
    r.add_argument("--tiny", action="store_true", help="try the graph on a tiny random model")
    r.set_defaults(func=cmd_run)

    rp = sub.add_parser("replay", help="run one node call of a run again, in this process")
    rp.add_argument("run_dir", metavar="RUN_DIR")
    rp.add_argument("--step", type=int, required=True, help="the training step (metrics.jsonl)")
    rp.add_argument("--node", required=True, help="the node id")
    rp.add_argument("--rank", type=int, default=0, help="the pool rank (default 0)")
    rp.add_argument("--pdb", action="store_true", help="post-mortem debugger if it fails")
    rp.add_argument("overrides", nargs="*", help="e.g. nodes.update_policy.clip_high=0.28")
    rp.set_defaults(func=cmd_replay)

    c = sub.add_parser("check", help="validate graph files without loading any model")
    c.add_argument("files", nargs="+", help="graph files, then any KEY=VALUE overrides")
    c.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    c.add_argument(
        "--strict", action="store_true", help="refuse old spellings of keys (CHANGELOG.md)"
    )
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

    rep = sub.add_parser("report", help="plot runs' metrics on one HTML page (needs matplotlib)")
    rep.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="several: on the same axes")
    rep.add_argument(
        "-o", "--output", help="the page; default RUN_DIR/report.html, or ./report.html"
    )
    rep.set_defaults(func=report.command)

    n = sub.add_parser("nodes", help="list the built-in nodes")
    n.set_defaults(func=cmd_nodes)

    sv = sub.add_parser(
        "serve", help="an OpenAI-compatible endpoint over a model or a run's checkpoint"
    )
    sv.add_argument(
        "model", metavar="MODEL_OR_RUN_DIR", help="a model path (as a graph's) or a run directory"
    )
    sv.add_argument("--host", default="127.0.0.1", help="the address to bind (default 127.0.0.1)")
    sv.add_argument("--port", type=int, default=8000, help="the port (0: a free one; default 8000)")
    sv.add_argument(
        "--api-key", help="the key callers must give (default: $FLOWRL_API_KEY, else any)"
    )
    sv.add_argument("--name", help="the model's name in /v1/models (default: the path's last part)")
    sv.add_argument(
        "--step", type=int, help="a run directory's checkpoint step (default: the latest)"
    )
    sv.add_argument("--model-name", help="which model of the run (default: its only trainable one)")
    sv.add_argument(
        "--parser", default="hermes", help='tool-call parser: "hermes", "tag", "file.py:fn"'
    )
    sv.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    sv.add_argument("--max-n", type=int, default=16, help="the most choices a request may ask for")
    sv.add_argument("--seed", type=int, default=0, help="seeds requests that give no seed")
    sv.set_defaults(func=cmd_serve)

    e = sub.add_parser("export", help="write a trained model as a Hugging Face model directory")
    e.add_argument("run_dir", metavar="RUN_DIR")
    e.add_argument("-o", "--output", required=True, metavar="DIR")
    e.add_argument("--step", type=int, help="the checkpoint's step (default: the latest)")
    e.add_argument("--model", help="which model (default: the run's only trainable one)")
    e.set_defaults(func=cmd_export)
    return p


def main(argv=None) -> int:
    p = parser()
    args, extra = p.parse_known_args(argv)  # overrides may also follow options
    if extra and (not hasattr(args, "overrides") or any("=" not in e for e in extra)):
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    try:
        code = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, not at exit
        return code
    except GraphErrors as e:
        print(e.report(), file=sys.stderr)
        return 2
    except FlowrlError as e:  # a failed node or a bad data file: the message says what and where
        print(f"flowrl: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader went away (`flowrl nodes | head -1`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return 141  # as a shell reports a command ended by SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
