"""The front end: graph file -> spec -> checked graph -> execution plan, and its drawings.

Torch-free and ray-free (tests/unit/test_layout.py), so `flowrl check`, `plan` and `render`
start fast: TOML parsing (typed_toml, overrides, validators, schema, dsl), the graph (graph,
registry), the compiler (batching, memory, compiler, plan), render, the generated TOML
reference, and the tiny-run overrides.
"""
