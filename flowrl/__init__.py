"""flowrl: RL for language models, declared as dataflow graphs.

The modules a graph check touches (dsl, graph, compiler, render, nodespec) import neither torch
nor ray at module level, so `flowrl check`, `plan` and `render` start fast.
"""

__version__ = "0.1.0"
