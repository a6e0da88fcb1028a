"""The train engine: one model on one rank, its optimizer and schedule, forward passes that
return per-response-token log-probs (or values), data-parallel gradient sync, offload/reload.

Frozen models (a reference policy) use the same engine with trainable=False: forward only.
"""

import math

import torch
import torch.distributed as dist

HOST = "cpu"


class TrainEngine:
    def __init__(
        self,
        module,
        tokenizer,
        *,
        trainable: bool = True,
        lr: float = 1e-6,
        weight_decay: float = 0.0,
        betas=(0.9, 0.999),
        warmup_steps: int = 0,
        schedule: str = "constant",
        min_lr_ratio: float = 0.0,
        total_steps: int = 1,
        grad_clip: float = 1.0,
        micro_tokens: int = 4096,
        device: str = "cpu",
        rank: int = 0,
        world_size: int = 1,
        group=None,
    ):
        self.module, self.tokenizer, self.trainable = module, tokenizer, trainable
        self.device, self.rank, self.world_size, self.group = device, rank, world_size, group
        self.grad_clip, self.micro_tokens = grad_clip, micro_tokens
        self.is_value = hasattr(module, "value_head")
        self.optimizer = self.scheduler = None
        self.resident = {"weights"}
        if trainable:
            self.optimizer = torch.optim.AdamW(
                module.parameters(), lr=lr, betas=tuple(betas), weight_decay=weight_decay
            )
            factor = _schedule(schedule, warmup_steps, total_steps, min_lr_ratio)
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, factor)
            self.resident |= {"grads", "optimizer"}
        else:
            module.requires_grad_(False)
        module.eval()  # no dropout in RL updates: the sampled policy is the one we score

    # -- forward -------------------------------------------------------------------------------
    def micro_batches(self, rows):
        """Row chunks whose padded tokens (after trimming padding columns) fit micro_tokens."""
        if len(rows) == 0:
            return [rows]
        width = int(rows["prompt_mask"].sum(-1).max()) + int(rows["response_mask"].sum(-1).max())
        return rows.split(max(1, self.micro_tokens // max(width, 1)))

    def mini_batches(self, rows, size: int) -> list:
        """This rank's part of each mini-batch of `size` rows over all ranks (0 = one); every
        rank gets the same number of parts, so their optimizer steps line up."""
        total = self.all_reduce_sum(len(rows))
        return rows.chunk(math.ceil(total / size) if size else 1)

    def infer(self, rows, **kwargs) -> dict:
        """`forward` without gradients over token-bounded micro-batches, outputs concatenated."""
        parts = [self.forward(m, grad=False, **kwargs) for m in self.micro_batches(rows)]
        return {key: torch.cat([p[key] for p in parts]) for key in parts[0]}

    def forward(self, rows, *, grad: bool, entropy: bool = False, temperature: float = 1.0) -> dict:
        """Per response token: {"logprobs" (b, t)[, "entropy" (b, t)]} or {"values" (b, t)}."""
        responses, response_mask = rows["responses"], rows["response_mask"]
        b, t = responses.shape
        if b == 0:
            empty = torch.zeros(0, t)
            return {"values": empty} if self.is_value else {"logprobs": empty, "entropy": empty}
        prompts, prompt_mask = rows["prompts"], rows["prompt_mask"]
        start = int((prompt_mask.sum(0) > 0).nonzero()[0])  # drop all-padding left columns
        length = max(int(response_mask.sum(-1).max()), 1)  # and all-padding right columns
        prompts, prompt_mask = prompts[:, start:], prompt_mask[:, start:]
        tokens = responses[:, :length]
        ids = torch.cat([prompts, tokens], dim=1).to(self.device)
        mask = torch.cat([prompt_mask, response_mask[:, :length]], dim=1).to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        p = prompts.shape[1]
        with torch.set_grad_enabled(grad):
            hidden = self.module.model(
                input_ids=ids, attention_mask=mask, position_ids=positions
            ).last_hidden_state
            hidden = hidden[:, p - 1 : p - 1 + length]  # (b, t, h): the states predicting responses
            if self.is_value:
                out = {"values": self.module.value_head(hidden).squeeze(-1).float()}
            else:
                logits = self.module.lm_head(hidden).float() / temperature  # (b, t, v)
                out = _token_logprobs(logits, tokens.to(self.device), entropy)
        keep = response_mask[:, :length].to(self.device)
        return {k: _pad_right(v * keep, t) for k, v in out.items()}

    # -- update --------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> dict:
        """Sum grads over ranks, clip, AdamW step, schedule step: {"grad_norm", "lr"}."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        for p in params:  # a skipped (all-zero) contribution is a zero gradient, not "no step"
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.world_size > 1:
            grads = [p.grad for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
            offset = 0
            for p, g in zip(params, grads, strict=True):
                p.grad = flat[offset : offset + g.numel()].view_as(p)
                offset += g.numel()
        max_norm = self.grad_clip if self.grad_clip > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": float(norm), "lr": lr}

    def all_reduce_sum(self, value: float) -> float:
        if self.world_size == 1:
            return float(value)
        tensor = torch.tensor([float(value)], dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return float(tensor)

    # -- residency -----------------------------------------------------------------------------
    def offload(self, parts) -> None:
        self._move(parts, HOST)
        self.resident -= set(parts)

    def reload(self, parts) -> None:
        self._move(parts, self.device)
        self.resident |= set(parts) & (
            {"weights", "grads", "optimizer"} if self.trainable else {"weights"}
        )

    def _move(self, parts, device) -> None:
        if "weights" in parts:
            self.module.to(device)
        if "grads" in parts:
            for p in self.module.parameters():
                if p.grad is not None:
                    p.grad = p.grad.to(device)
        if "optimizer" in parts and self.optimizer is not None:
            for state in self.optimizer.state.values():
                for key, value in state.items():
                    if torch.is_tensor(value) and key != "step":
                        state[key] = value.to(device)

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        out = {"module": self.module.state_dict()}
        if self.trainable:
            out |= {
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
            }
        return out

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["module"])
        if self.trainable and "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])


def _token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, entropy: bool) -> dict:
    """logits (b, t, v), tokens (b, t) -> log p(token) without a full log-softmax tensor."""
    normaliser = logits.logsumexp(-1)  # (b, t)
    out = {"logprobs": logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - normaliser}
    if entropy:  # H = logsumexp(z) - sum softmax(z) z
        probs = torch.softmax(logits, dim=-1)
        out["entropy"] = normaliser - (probs * logits).sum(-1)
    return out


def _pad_right(x: torch.Tensor, t: int) -> torch.Tensor:
    x = x.cpu()
    return torch.nn.functional.pad(x, (0, t - x.shape[1])) if x.shape[1] < t else x


def _schedule(kind: str, warmup: int, total: int, floor: float):
    """Multiplier of the peak lr at optimizer step k: linear warmup, then constant or cosine."""

    def factor(k: int) -> float:
        if k < warmup:
            return (k + 1) / warmup
        if kind == "constant":
            return 1.0
        progress = min(1.0, (k - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor
