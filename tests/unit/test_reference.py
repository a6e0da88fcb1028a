"""docs/graph-file.md's reference part is generated from the params classes: it is up to date,
and it lists every allowed value of every enumerated field."""

from pathlib import Path

import attrs

from flowrl import reference, registry, schema

DOC = Path(__file__).resolve().parents[2] / "docs" / "graph-file.md"


def test_the_generated_reference_is_up_to_date():
    text = DOC.read_text()
    assert reference.refreshed(text) == text, "run: python -m flowrl.reference --write"


def enumerated_classes():
    yield from (schema.RunConfig, schema.DataConfig, schema.ModelConfig, schema.PoolConfig)
    for name in registry.builtin_names():
        yield registry.resolve(name).spec.params


def test_every_enumeration_lists_its_values():
    text = DOC.read_text()
    rows = {line for line in text.splitlines() if line.startswith("| `")}
    checked = 0
    for cls in enumerated_classes():
        for field in attrs.fields(cls):
            values = reference.allowed_values(field)
            if not values:
                continue
            mine = [r for r in rows if r.startswith(f"| `{field.name}` |")]
            assert any(all(f'`"{v}"`' in r for v in values) for r in mine), field.name
            checked += 1
    # among them: backend, offload, the policy loss, agg, the KL kinds, the rollout backend
    assert checked >= 12


def test_allowed_values_reads_in_validators_and_the_rollout_table():
    fields = attrs.fields_dict(schema.ModelConfig)
    assert reference.allowed_values(fields["schedule"]) == schema.SCHEDULES
    assert reference.allowed_values(fields["rollout"]) == tuple(schema.ROLLOUT_BACKENDS)
    assert reference.allowed_values(fields["lr"]) == ()
