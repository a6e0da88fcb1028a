"""The math of the nodes: tensor ops, advantage estimators and policy losses, as pure functions
on tensors, each tested against a plain reference loop (tests/unit)."""
