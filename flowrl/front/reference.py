"""The TOML reference tables, generated from the attrs classes that own the defaults.

`python -m flowrl.front.reference --write` refreshes the generated part of docs/graph-file.md
(between the BEGIN/END markers); a test fails when the file is stale. No torch or ray here.
"""

import inspect
import re
import sys
from pathlib import Path

import attrs

from flowrl.backends import ROLLOUT_BACKENDS
from flowrl.front import registry, schema
from flowrl.front.typed_toml import toml_value
from flowrl.params import describe
from flowrl.samplers import SAMPLERS

BEGIN = "<!-- BEGIN GENERATED: python -m flowrl.front.reference --write -->"
END = "<!-- END GENERATED -->"
DOC = Path(__file__).resolve().parents[2] / "docs" / "graph-file.md"


def field_comments(cls) -> dict[str, str]:
    """The trailing `# comment` of each field line in the class's source (and its bases')."""
    out = {}
    for klass in reversed(cls.__mro__):
        if not attrs.has(klass):
            continue
        for line in inspect.getsource(klass).splitlines():
            match = re.match(r"\s+(\w+)\s*:[^#]*#\s*(.*)$", line)
            if match and not match.group(2).startswith("noqa"):
                out[match.group(1)] = match.group(2).strip()
    return out


def table(cls) -> list[str]:
    attrs.resolve_types(cls)
    comments = field_comments(cls)
    rows = ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    for field in attrs.fields(cls):
        kind = getattr(field.type, "__name__", str(field.type))
        rows.append(
            f"| `{field.name}` | {kind} | `{toml_value(field.default)}` | {allowed(field)} "
            f"| {comments.get(field.name, '').replace('|', chr(92) + '|')} |"
        )
    return rows


def allowed(field: attrs.Attribute) -> str:
    """The field's rule in words, as the checks enforce it."""
    rule = describe(field.validator).replace("|", "\\|")
    if rule:
        return rule
    return {bool: "true, false", float: "any finite number"}.get(field.type, "any")


def markdown() -> str:
    parts = []
    sections = [
        ("[run]", schema.RunConfig),
        ("[data]", schema.DataConfig),
        ("[models.<name>]", schema.ModelConfig),
        ("[pools.<name>]", schema.PoolConfig),
    ]
    for title, cls in sections:
        parts += [f"### {title}", "", *table(cls), ""]
    for name, record in ROLLOUT_BACKENDS.items():
        if attrs.fields(record.options):
            parts += [
                f'### [models.<name>.rollout_options] with rollout = "{name}"',
                "",
                *table(record.options),
                "",
            ]
    for name, sampler in SAMPLERS.items():
        if attrs.fields(sampler.Options):
            parts += [f'### [data.sampler_options] with sampler = "{name}"', ""]
            parts += [*table(sampler.Options), ""]
    parts += [
        "### Node parameters",
        "",
        "Besides `uses`, `model` and `rename`, a `[nodes.<id>]` table takes the "
        "parameters of the node it uses:",
        "",
    ]
    for name in registry.builtin_names():
        ref = registry.resolve(name)
        parts += [
            f'#### `uses = "{name}"`',
            "",
            f"{ref.doc}  ",
            f"Source: `nodes/"
            f"{name.replace('.', '/')}.py`; reads {_keys(ref.spec.reads)}; writes "
            f"{_keys(ref.spec.writes)}"
            + (
                f"; reads also {_keys(ref.spec.optional_reads)} depending on its params"
                if ref.spec.optional_reads
                else ""
            )
            + (
                f"; writes also {_keys(ref.spec.optional_writes)} depending on its params"
                if ref.spec.optional_writes
                else ""
            )
            + ".",
            "",
        ]
        parts += [*table(ref.spec.params), ""] if attrs.fields(ref.spec.params) else []
    return "\n".join(parts)


def _keys(keys) -> str:
    return ", ".join(f"`{k}`" for k in keys) or "nothing"


def refreshed(text: str) -> str:
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n\n{markdown()}\n{END}{tail}"


if __name__ == "__main__":
    if "--write" in sys.argv:
        DOC.write_text(refreshed(DOC.read_text()))
        print(f"wrote {DOC}")
    else:
        print(markdown())
