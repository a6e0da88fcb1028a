"""Built-in nodes, one small module each; installed as flowrl.nodes.

A graph names a node by its path below this folder: `uses = "advantage.gae"` is
nodes/advantage/gae.py. Each module ends with a `SPEC = NodeSpec(...)`.
"""
