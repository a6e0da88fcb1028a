"""decoding.py's `Decoding` is mixed into slots.py's `Batch`; `BatchParts` names what it needs
of that class. Both sides are checked against the list: every name `Decoding` reads on `self`
is its own or a part, and a `Batch` has every part."""

import ast
import inspect

from flowrl.engines.hf import decoding
from flowrl.engines.hf.slots import Batch


def parts() -> set[str]:
    methods = {
        n
        for n, v in vars(decoding.BatchParts).items()
        if inspect.isfunction(v) and not n.startswith("__")
    }
    return set(decoding.BatchParts.__annotations__) | methods


def test_every_name_decoding_reads_on_self_is_its_own_or_a_named_part():
    tree = ast.parse(inspect.getsource(decoding.Decoding))
    used = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    }
    own = {n for n, v in vars(decoding.Decoding).items() if inspect.isfunction(v)}
    assert used - own - parts() == set()
    assert parts() - used == set()  # and the list names nothing it does not use


def test_a_batch_has_every_part():
    batch = Batch(runner=object(), eos=2, hold=lambda request_id: None)
    assert isinstance(batch, decoding.Decoding)
    assert {name for name in parts() if not hasattr(batch, name)} == set()
