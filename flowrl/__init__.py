"""flowrl: RL for language models, declared as dataflow graphs.

The modules a graph check touches (dsl, graph, compiler, render, nodespec) import neither torch
nor ray at module level, so `flowrl check`, `plan` and `render` start fast.
"""

__version__ = "0.1.0"


def compile(file, overrides=()):  # noqa: A001 (the verb users expect: flowrl.compile)
    """Parse, check and compile a graph file into its `ExecutionPlan`; raises GraphErrors
    listing every problem. Torch-free: nothing is loaded.

    Args:
        file: path of a graph TOML file.
        overrides: dotted `table.key=value` strings, as on the command line.
    """
    from flowrl.front.compiler import compile_file

    return compile_file(file, overrides)
