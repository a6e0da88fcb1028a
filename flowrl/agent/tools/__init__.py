"""Load a user's object from a graph-file reference: "file.py:name" (relative to the graph's
folder) or "package.module:name". Tools, parsers and interactions are referenced this way;
flowrl/refs.py resolves them, as it does every reference of a graph file."""

from __future__ import annotations

from pathlib import Path

from flowrl import refs

# a tool's short name in a graph -> the reference it stands for (tools.py and verl.py read it)
BUILTIN_TOOLS = {
    "calculator": "flowrl.agent.tools.builtin:calc",
    "python": "flowrl.agent.tools.builtin:python",
    "answer_check": "flowrl.agent.tools.builtin:AnswerCheck",
    "sandbox_fusion": "flowrl.agent.tools.sandbox_service:SandboxFusionTool",  # config: a tool YAML
}


class ToolError(ValueError):
    """A tool reference that cannot be loaded or described."""


def load_object(ref: str, base_dir: str | Path = ".", what: str = "tool"):
    """The object "file.py:name" (relative to base_dir) or "package.module:name" names."""
    return refs.load(ref, base_dir, what, error=ToolError)
