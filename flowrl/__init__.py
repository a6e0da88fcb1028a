"""flowrl: RL for language models, declared as dataflow graphs.

The modules a graph check touches (dsl, graph, compiler, render, nodespec) import neither torch
nor ray at module level, so `flowrl check`, `plan` and `render` start fast.
"""

import sys
import warnings

from flowrl import compat

__version__ = "0.2.0"

# old module spellings (flowrl.validators, flowrl.engines.hf_rollout, ...) import, with a
# warning naming the new one; shown by default (the import is in the user's file, where
# Python hides DeprecationWarning), unless the user set warning options (-W, PYTHONWARNINGS)
compat.install()
if not sys.warnoptions:
    warnings.filterwarnings("default", category=compat.FlowrlDeprecationWarning)


def compile(file, overrides=()):  # noqa: A001 (the verb users expect: flowrl.compile)
    """Parse, check and compile a graph file into its `ExecutionPlan`; raises GraphErrors
    listing every problem. Torch-free: nothing is loaded.

    Args:
        file: path of a graph TOML file.
        overrides: dotted `table.key=value` strings, as on the command line.
    """
    from flowrl.front.compiler import compile_file

    return compile_file(file, overrides)
