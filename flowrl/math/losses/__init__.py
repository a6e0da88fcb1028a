"""Policy losses: one table from a loss name to its `Loss` record, one module per family.

`update.policy` computes `LOSSES[params.loss].fn(logprobs, old_logprobs, advantages,
response_mask, params, chunk)`; every loss has that signature (`base`). Adding a loss is one
function (in a module of its family, or a new one) and one line here; its own params, if it
needs any, are fields of `update.policy`'s `Params` named in the record's `params`.
"""

from flowrl.math.losses import cispo, cov, gmpo, gpg, gspo, ppo, sapo
from flowrl.math.losses.base import CLIP, Chunk, Loss, tis_weights

__all__ = ["LOSSES", "Chunk", "Loss", "loss_params", "tis_weights"]

SEQ_MEAN = "seq-mean-token-mean"
# name: Loss(function, rates it reports, loss-only params it reads, all_rows, agg its paper fixes)
LOSSES = {
    "ppo": Loss(ppo.ppo_loss, ("clip_frac", "clip_frac_lower", "approx_kl"), CLIP + ("dual_clip",)),
    "gspo": Loss(gspo.gspo_loss, ("clip_frac", "approx_kl"), CLIP, agg=SEQ_MEAN),
    "cispo": Loss(cispo.cispo_loss, ("clip_frac", "approx_kl"), CLIP),
    "gpg": Loss(gpg.gpg_loss),
    "gmpo": Loss(gmpo.gmpo_loss, ("clip_frac", "approx_kl"), CLIP),
    "sapo": Loss(sapo.sapo_loss, ("gate", "approx_kl"), ("tau_pos", "tau_neg"), agg=SEQ_MEAN),
    "clip_cov": Loss(
        cov.clip_cov_loss,
        ("clip_frac", "cov_frac", "approx_kl"),
        CLIP + ("cov_ratio",),
        all_rows=True,
    ),
    "kl_cov": Loss(
        cov.kl_cov_loss, ("cov_frac", "approx_kl"), ("cov_ratio", "cov_kl_coef"), all_rows=True
    ),
}


def loss_params() -> tuple[str, ...]:
    """Every param some loss of the table reads and the rest of the update does not."""
    return tuple(sorted({name for loss in LOSSES.values() for name in loss.params}))
