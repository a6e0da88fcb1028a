"""flowrl's public API: every name the docs tell you to write against, in one place.

    from flowrl.api import NodeSpec, checked, count, DataProto, run_tiny

What this module exports is a promise: a name here keeps its spelling and meaning within a minor
version, and a rename keeps the old spelling working for one more minor version with a
`FlowrlDeprecationWarning` that names the new one (CHANGELOG.md lists each). Everything else
in the package is internal and may move between releases (docs/api-stability.md).

The names load on first use (flowrl/lazy.py), so `from flowrl.api import NodeSpec` imports
neither torch nor ray: a node file may import from here and still be read by `flowrl check`.
"""

from flowrl.lazy import exports

# name -> "module:attribute", grouped as the docs present them
PUBLIC = {
    # a node: its spec, params base classes, what check hooks receive (docs/extending.md)
    "NodeSpec": "flowrl.nodespec:NodeSpec",
    "RolloutParams": "flowrl.nodespec:RolloutParams",
    "CheckContext": "flowrl.hooks:CheckContext",
    "Finding": "flowrl.hooks:Finding",
    "MiniBatches": "flowrl.hooks:MiniBatches",
    "MINI_BATCHES": "flowrl.hooks:MINI_BATCHES",
    "Refill": "flowrl.hooks:Refill",
    "TruncatedIS": "flowrl.hooks:TruncatedIS",
    "TinyNode": "flowrl.hooks:TinyNode",
    "Continuation": "flowrl.hooks:Continuation",
    # param validators that state their rule (flowrl/params.py)
    "Rule": "flowrl.params:Rule",
    "checked": "flowrl.params:checked",
    "one_of": "flowrl.params:one_of",
    "count": "flowrl.params:count",
    "at_least": "flowrl.params:at_least",
    "above": "flowrl.params:above",
    "positive": "flowrl.params:positive",
    "interval": "flowrl.params:interval",
    "zero_or": "flowrl.params:zero_or",
    "pair": "flowrl.params:pair",
    "not_empty": "flowrl.params:not_empty",
    "MAX_STEPS": "flowrl.params:MAX_STEPS",
    "MAX_ROWS": "flowrl.params:MAX_ROWS",
    "MAX_TOKENS": "flowrl.params:MAX_TOKENS",
    "MAX_SAMPLES": "flowrl.params:MAX_SAMPLES",
    "MAX_EPOCHS": "flowrl.params:MAX_EPOCHS",
    # the batch
    "DataProto": "flowrl.protocol:DataProto",
    # data samplers: which prompts a step draws (docs/data.md, "Choosing the prompts")
    "UniformSampler": "flowrl.samplers:UniformSampler",
    "PassRateBand": "flowrl.samplers:PassRateBand",
    # losses: the record, the chunk a loss sees, helpers (docs/extending.md, "a new loss")
    "Loss": "flowrl.math.losses.base:Loss",
    "Chunk": "flowrl.math.losses.base:Chunk",
    "approx_kl": "flowrl.math.losses.base:approx_kl",
    "tis_weights": "flowrl.math.losses.base:tis_weights",
    "ops": "flowrl.math.ops",
    # losses and KL kinds of your own, by reference (docs/extending.md, "A policy loss")
    "resolve_loss": "flowrl.math.components:resolve_loss",
    "kl_function": "flowrl.math.components:kl_function",
    "ComponentError": "flowrl.math.components:ComponentError",
    # the rollout contract and backend records (docs/extending.md, "a rollout backend")
    "Request": "flowrl.engines.rollout:Request",
    "Result": "flowrl.engines.rollout:Result",
    "Sampling": "flowrl.engines.rollout:Sampling",
    "RolloutBackend": "flowrl.engines.rollout:RolloutBackend",
    "RolloutBase": "flowrl.engines.rollout:RolloutBase",
    "ServerRollout": "flowrl.engines.server:ServerRollout",
    "rollout_weights": "flowrl.engines.served_weights:rollout_weights",
    "weight_buckets": "flowrl.engines.served_weights:weight_buckets",
    "Backend": "flowrl.backends:Backend",
    "NoOptions": "flowrl.backends:NoOptions",
    "HFOptions": "flowrl.backends:HFOptions",
    "SGLangOptions": "flowrl.backends:SGLangOptions",
    # tools: a function's JSON schema, as the model is shown it (docs/multi-turn.md)
    "function_schema": "flowrl.agent.tools.schema:function_schema",
    "type_schema": "flowrl.agent.tools.schema:type_schema",
    # graphs
    "compile": "flowrl:compile",
    "GraphErrors": "flowrl.errors:GraphErrors",
    # what a tool or an engine raises when its infrastructure failed, not the model
    # (the request is left out of its group: docs/recovery.md)
    "InfraError": "flowrl.errors:InfraError",
    "FlowrlDeprecationWarning": "flowrl.compat:FlowrlDeprecationWarning",
    # testing helpers (docs/testing.md)
    "run_tiny": "flowrl.testing:run_tiny",
    "TinyRun": "flowrl.testing:TinyRun",
    "tiny_plan": "flowrl.testing:tiny_plan",
    "write_graph": "flowrl.testing:write_graph",
    "compile_text": "flowrl.testing:compile_text",
    "graph_problems": "flowrl.testing:graph_problems",
    "tiny_model": "flowrl.testing:tiny_model",
    "tiny_tokenizer": "flowrl.testing:tiny_tokenizer",
    "tiny_qwen2": "flowrl.testing:tiny_qwen2",
    "tiny_engine": "flowrl.testing:tiny_engine",
    "load_node": "flowrl.testing:load_node",
    "load_ref": "flowrl.testing:load_ref",
    "update_batch": "flowrl.testing:update_batch",
    "update_rows": "flowrl.testing:update_rows",
    "ragged_rows": "flowrl.testing:ragged_rows",
    "first_step": "flowrl.testing:first_step",
    "assert_same": "flowrl.testing:assert_same",
    "check_sampler": "flowrl.testing:check_sampler",
    "loss_params": "flowrl.testing:loss_params",
    "try_loss": "flowrl.testing:try_loss",
    "scripted_request": "flowrl.testing:scripted_request",
    "ScriptedTurns": "flowrl.testing:ScriptedTurns",
}

__getattr__ = exports(__name__, PUBLIC)
__all__ = sorted(PUBLIC)


def __dir__():
    return __all__
