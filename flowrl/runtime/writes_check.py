"""The shape and values of what a node writes under a documented key, checked where the writes
come back (the walk's merge, for a node of the user's as for a built-in): a per-token key
(docs/keys.md: (b, t)) must be 2-D and as wide as the batch's `response_mask`, a per-sequence
score 1-D, and their values finite on the trained tokens. A (b,) advantage or a NaN score
would otherwise broadcast or propagate into the loss and stop the run steps later, far from
the node that made it."""

from flowrl.runtime.node_call import NodeFailure

# graph keys of docs/keys.md: one float per response token, one per sequence
PER_TOKEN = (
    "advantages",
    "returns",
    "values",
    "token_rewards",
    "logprobs",
    "old_logprobs",
    "ref_logprobs",
    "rollout_logprobs",
)
PER_ROW = ("scores", "rm_scores", "shaped_scores", "baseline_scores", "rule_scores")


def check_writes(node: str, uses: str, writes, batch) -> None:
    """NodeFailure naming node `node` (its file `uses`), the key, what it wrote and the fix,
    when a documented key of `writes` has the wrong shape or a non-finite trained value."""
    import torch

    keys = set(writes.keys())
    mask = batch["response_mask"] if "response_mask" in batch.keys() else None
    where = f"node {node} ({uses})"
    for key in sorted(keys & set(PER_TOKEN)):
        value = writes[key]
        if not torch.is_tensor(value):
            continue
        if value.dim() != 2 or (mask is not None and value.shape[1] != mask.shape[1]):
            width = mask.shape[1] if mask is not None else "t"
            raise NodeFailure(
                f"{where} wrote {key} of shape {tuple(value.shape)}, but {key} is one value per "
                f"response token, (b, t) = ({len(value)}, {width}) here (docs/keys.md): return "
                "e.g. per_row[:, None] * response_mask"
            )
        if mask is not None and value.is_floating_point():
            bad = ~torch.isfinite(value) & mask.bool()
            if bad.any():
                row, token = (int(i) for i in bad.nonzero()[0])
                raise NodeFailure(
                    f"{where} wrote {key} = {float(value[row, token])} at row {row}, token "
                    f"{token} (a trained token): fix the node's formula (a division by a zero "
                    "std or count, a log of 0); non-finite values there make the loss NaN"
                )
    for key in sorted(keys & set(PER_ROW)):
        value = writes[key]
        if not torch.is_tensor(value):
            continue
        if value.dim() != 1:
            raise NodeFailure(
                f"{where} wrote {key} of shape {tuple(value.shape)}, but {key} is one value per "
                "sequence, (b,) (docs/keys.md): return a 1-D tensor"
            )
        if value.is_floating_point() and not torch.isfinite(value).all():
            row = int((~torch.isfinite(value)).nonzero()[0])
            raise NodeFailure(
                f"{where} wrote {key} = {float(value[row])} at row {row}: return a finite "
                "score for every row"
            )
