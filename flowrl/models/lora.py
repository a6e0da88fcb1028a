"""LoRA adapters (Hu et al. 2021, arXiv 2106.09685) through PEFT, for
`models.<m>.lora = { rank = 16, alpha = 32, target_modules = [...] }`.

The adapter's low-rank matrices are injected into the model in place (peft's
`inject_adapter_in_model`), so the train engine and the rollout engine keep using the same
transformers module; every base weight is frozen and only the adapter (and a value head, which
is new) trains, is checkpointed and is sent to a rollout pool. The reference policy is the same
module with its adapters switched off (`uses = "logprob"` with `adapter = false`), as verl does:
no second copy of the weights. peft (the `lora` extra) is imported only when a model has one.
"""

from contextlib import contextmanager

DEFAULTS = {"rank": 16, "alpha": 32, "target_modules": "all-linear"}  # verl's defaults
KEYS = tuple(DEFAULTS)


def settings_problem(settings: dict) -> str:
    """What is wrong with a `lora` table, or "" (used by the schema's validator)."""
    unknown = sorted(set(settings) - set(KEYS))
    if unknown:
        return f"lora: unknown key {unknown[0]!r}; keys: {', '.join(KEYS)}"
    rank, alpha = settings.get("rank", 1), settings.get("alpha", 1)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        return f"lora: rank must be an integer > 0, got {rank!r}"
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or alpha <= 0:
        return f"lora: alpha must be a number > 0, got {alpha!r}"
    targets = settings.get("target_modules", "all-linear")
    if targets != "all-linear" and not (
        isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets)
    ):
        return f'lora: target_modules must be "all-linear" or a list of names, got {targets!r}'
    return ""


def add_adapter(module, settings: dict):
    """Inject a LoRA adapter into `module` (a causal LM or a ValueModel) in place and freeze
    everything else but a value head. Returns the module.

    The adapter's B matrices start at zero, so the module computes exactly what it did before.
    """
    from peft import LoraConfig, inject_adapter_in_model

    merged = {**DEFAULTS, **settings}
    config = LoraConfig(
        r=merged["rank"],
        lora_alpha=merged["alpha"],
        target_modules=merged["target_modules"],
        lora_dropout=0.0,  # updates score the sampled policy: no dropout (the engines run eval)
    )
    is_value = hasattr(module, "value_head")
    inject_adapter_in_model(config, module.model if is_value else module)  # not the value head
    for name, parameter in module.named_parameters():
        parameter.requires_grad_(_adapted(name))
    return module


def has_adapter(module) -> bool:
    return any("lora_" in name for name, _ in module.named_parameters())


def weights(module) -> dict:
    """What to checkpoint or send of a module: its adapter (and value head) when it has one
    (the base weights never change), else its whole state dict."""
    if not has_adapter(module):
        return module.state_dict()
    return {k: v for k, v in module.state_dict().items() if _adapted(k)}


def _adapted(name: str) -> bool:
    """Whether a parameter is one `add_adapter` leaves trainable (named, so that a frozen copy
    of the model on a rollout pool sends and receives the same tensors)."""
    return "lora_" in name or name.startswith("value_head.")


def load_weights(module, state: dict) -> None:
    """Load `weights(...)` of a module built the same way: all of them, or exactly its
    adapter's (and value head's) tensors."""
    if not has_adapter(module):
        module.load_state_dict(state)
        return
    expected = set(weights(module))
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise ValueError(
            f"adapter state does not match the model: missing {missing[:3]}, unexpected {extra[:3]}"
        )
    module.load_state_dict(state, strict=False)


def merged_state(module) -> dict:
    """The state dict of the plain model: every LoRA layer's update folded into its base weight
    (W + scale * B @ A) and the adapter's own tensors dropped, with the base model's key names,
    so `flowrl export` writes a model that loads without peft. Merges `module` in place."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for layer in module.modules():
        if isinstance(layer, BaseTunerLayer):
            layer.merge()
    return {
        k.replace(".base_layer.", "."): v
        for k, v in module.state_dict().items()
        if "lora_" not in k
    }


@contextmanager
def adapters_off(module):
    """Run `module` as its base model: every LoRA layer bypassed inside the block."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in module.modules() if isinstance(m, BaseTunerLayer)]
    if not layers:
        raise ValueError("the model has no LoRA adapter to switch off: set lora in its table")
    trainable = {p: p.requires_grad for p in module.parameters()}  # enable_adapters resets them
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield module
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        for parameter, flag in trainable.items():
            parameter.requires_grad_(flag)
