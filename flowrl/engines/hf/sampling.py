"""Choosing the next token from logits: greedy, or sampled after temperature, top-k and top-p.

Sampling runs in torch on the logits of the active rows, one uniform number per row from the
row's own random stream, so a rollout is reproducible from its seed. Two kinds of stream:

- a torch.Generator per request (the eager runner's, on the host: what the CPU path has always
  drawn, so its runs and the numbers measured on them stay as they were);
- a counter-based stream (the CUDA runner's, on the device): draw i of a request is
  Threefry-2x32-20 (Salmon et al. 2011, "Parallel random numbers: as easy as 1, 2, 3"; the
  generator JAX uses) of the counter i under the request's 64-bit key, computed with torch
  integer ops on whatever device holds the logits. No state, no host round trip: a block of
  decode steps draws all its numbers at once, and a row's draws depend on (key, i) alone, not
  on its neighbours, its slot or the batch size a call was padded to.

Both are keyed by (Request.seed, Request.turn) (rollout.py `mix`); the two give different
draws for the same key, so a sampled rollout on the CUDA runner is not the eager runner's.
"""

import torch

MASK32 = 0xFFFFFFFF
# Threefry-2x32's rotation constants, two sets of four rounds (Random123)
ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
PARITY = 0x1BD11BDA  # the key schedule's constant


def sample_tokens(
    logits,
    temperature,
    top_k,
    top_p,
    do_sample,
    generator,
    with_logprobs: bool = False,
    uniform=None,
    sync_free: bool = False,
):
    """logits (a, v) -> one token per row (a,): greedy, or sampled after temperature, top-k
    and top-p, in the order `generate` applies them.

    With `with_logprobs`, (tokens (a,), logprobs (a,)): each token's log-probability under the
    distribution it was drawn from (logits / temperature, renormalised over the top-k / top-p
    candidates); for greedy decoding, under the model's distribution at temperature 1.
    `uniform` (a,) replaces the draws from `generator`: one number in [0, 1) per row, from
    the row's own random stream (the continuous-batching engine's per-request sampling).
    `sync_free`: nothing waits for the device (`sample_scan`: the nucleus from one full sort,
    not from a top-c grown until it holds top_p), so a CUDA caller can queue steps ahead.
    """
    if not do_sample or temperature == 0:
        token = logits.argmax(-1)
        if not with_logprobs:
            return token
        return token, logits.log_softmax(-1).gather(-1, token[:, None]).squeeze(-1)
    if sync_free:
        if uniform is None:
            uniform = torch.rand(len(logits), generator=generator, device=logits.device)
        token, logprob = sample_scan(logits, temperature, top_k, top_p, uniform)
        return (token, logprob) if with_logprobs else token
    logits, order = logits / temperature, None
    if 0 < top_k < logits.shape[-1]:
        logits, order = logits.topk(top_k, dim=-1)  # (a, k), and their token ids
    if top_p < 1.0:
        logits, order = nucleus(logits, order, top_p)
    index = draw(logits.softmax(-1), generator, uniform)  # (a,): a position among the candidates
    token = index if order is None else order.gather(-1, index[:, None]).squeeze(-1)
    if not with_logprobs:
        return token
    return token, logits.log_softmax(-1).gather(-1, index[:, None]).squeeze(-1)


def sample_scan(logits, temperature: float, top_k: int, top_p: float, uniform):
    """The device's sampling step: logits (a, v) and one uniform per row (a,) -> (tokens (a,),
    logprobs (a,)), as `sample_tokens` draws them (temperature, then top-k, then top-p, the
    CDF inverted at the uniform) up to float rounding, in one scan over the candidates and
    nothing read back. The candidates' unnormalised weights exp((x - max) / T) are summed once
    (`cumsum`): the scan's last entry is their mass, the nucleus is the prefix of a sorted
    scan whose mass before an entry is under top_p of it (so top-p needs one sort, top-k its
    topk, temperature alone neither), the draw is a binary search in the same scan, and the
    log-prob is the chosen logit's (x - max) / T less the log of the kept mass. Where
    `sample_tokens` scales, normalises, cumsums and log-softmaxes the candidates (a pass over
    the vocabulary each, eager), this reads them twice (max, scan) and writes the scan once.
    """
    logits, order = logits.float(), None  # the CUDA runner's logits are float32 already
    if 0 < top_k < logits.shape[-1]:
        logits, order = logits.topk(top_k, dim=-1)  # (a, k), sorted
    elif top_p < 1.0:
        logits, order = logits.sort(dim=-1, descending=True)  # (a, v)
    top = logits[:, :1] if order is not None else logits.amax(-1, keepdim=True)  # (a, 1)
    weights = (logits - top).mul_(1 / temperature).exp_()  # in (0, 1], the largest 1
    scan = weights.cumsum(-1)  # (a, c)
    count = torch.full_like(top, scan.shape[-1], dtype=torch.long)  # candidates kept
    if top_p < 1.0:  # the more likely tokens hold less than top_p before each kept one
        inside = (scan - weights) < top_p * scan[:, -1:]
        count = inside.sum(-1, keepdim=True).clamp(min=1)  # the most likely token stays
    mass = scan.gather(-1, count - 1)  # (a, 1): the kept candidates' weight
    u = uniform.to(scan.device, scan.dtype)[:, None]
    index = torch.searchsorted(scan, u * mass, right=True)  # first entry with scan > u * mass
    index = torch.minimum(index, count - 1)  # (a, 1)
    chosen = (logits.gather(-1, index) - top) / temperature - mass.log()
    token = index if order is None else order.gather(-1, index)
    return token.squeeze(-1), chosen.squeeze(-1)


def nucleus(logits, order, top_p: float):
    """The smallest set of most likely tokens holding top_p of the mass (Holtzman et al. 2019,
    arXiv 1904.09751): (logits (a, c) of sorted candidates, the rest -inf; their ids in `order`,
    or in the vocabulary when order is None). The candidates come from a top-c grown until they
    hold top_p in every row: sorting SmolLM2's 49152 tokens for 32 rows takes 60 ms on CPU, a
    top-64 2 ms (a check read back per size: `sample_scan` sorts once instead)."""
    vocab = logits.shape[-1]
    normaliser = logits.logsumexp(-1, keepdim=True)
    c = min(64, vocab)
    while True:
        values, index = logits.topk(c, dim=-1)  # (a, c), sorted
        probs = (values - normaliser).exp()
        if c == vocab or bool((probs.sum(-1) >= top_p).all()):
            break
        c = min(8 * c, vocab)
    drop = probs.cumsum(-1) - probs >= top_p  # the more likely tokens already hold top_p
    drop[:, 0] = False  # the most likely token always stays
    values = values.masked_fill(drop, float("-inf"))
    return values, index if order is None else order.gather(-1, index)


def draw(probs: torch.Tensor, generator, uniform=None) -> torch.Tensor:
    """One index per row of probs (a, k), by inverting the CDF at a uniform draw: one random
    number per row, where torch.multinomial (without replacement) draws one per entry: 35 ms
    for 32 rows over SmolLM2's 49152 tokens on the 2-core CPU, against 1 ms here. Each entry's share
    of [0, 1) is its probability to within a float32 rounding of the running sum (~1e-7).
    `uniform` (a,): the numbers to use instead of drawing them."""
    cdf = probs.cumsum(-1)  # (a, k)
    if uniform is not None:
        u = uniform.to(probs.device, cdf.dtype)[:, None]
    else:
        u = torch.rand(len(probs), 1, generator=generator, device=probs.device, dtype=cdf.dtype)
    index = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)  # first entry with cdf > u
    return index.clamp(max=probs.shape[-1] - 1).squeeze(-1)


def sample_rows(rows: list, logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """The continuous-batching engine's step: logits (d, v) of d requests (slots.Row:
    `.request` with its Sampling and forced ids, `.stream` its random stream, `.out` its ids so
    far) -> one token per row and its log-prob. Rows are grouped by sampling settings; each
    sampled row draws one number from its own stream, so its token does not depend on the
    other rows; forced ids are taken as they are, with the log-prob of the temperature-scaled
    distribution."""
    tokens = torch.zeros(len(rows), dtype=torch.long, device=logits.device)
    chosen = torch.zeros(len(rows), device=logits.device)
    groups: dict = {}
    for k, row in enumerate(rows):
        groups.setdefault(row.request.sampling, []).append(k)
    for sampling, index in groups.items():
        uniform = None
        if not sampling.greedy:
            uniform = row_uniforms([rows[k] for k in index], logits.device)
        s = sampling
        # log-probs only where a request asked (a log-softmax over the vocabulary per row)
        wanted = any(rows[k].request.logprobs for k in index)
        part = logits if len(index) == len(rows) else logits[index]  # (g, v)
        out = sample_tokens(
            part, s.temperature, s.top_k, s.top_p, s.do_sample, None, wanted, uniform
        )
        token, logprob = out if wanted else (out, torch.zeros(len(index), device=logits.device))
        tokens[index], chosen[index] = token, logprob
    forced = [
        (k, r.request.forced[len(r.out)])
        for k, r in enumerate(rows)
        if len(r.out) < len(r.request.forced)
    ]
    if forced:
        index = torch.tensor([k for k, _ in forced], device=logits.device)
        ids = torch.tensor([t for _, t in forced], device=logits.device)
        temperature = torch.tensor(
            [1.0 if rows[k].request.sampling.greedy else rows[k].request.sampling.temperature
             for k, _ in forced],
            device=logits.device,
        )  # fmt: skip
        full = torch.log_softmax(logits[index] / temperature[:, None], -1)
        tokens[index], chosen[index] = ids, full.gather(-1, ids[:, None]).squeeze(-1)
    return tokens.tolist(), chosen.tolist()  # one host sync per step, as any stop check needs


def threefry2x32(key: tuple, counter: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """Threefry-2x32 with 20 rounds: key (k0, k1) and counter (c0, c1), each an int64 tensor
    of 32-bit values (broadcast together) -> the two output words, int64 tensors of 32-bit
    values. Additions are taken mod 2^32 by masking, so every value stays below 2^33 and the
    int64 arithmetic is exact on any device."""
    k0, k1 = key
    schedule = (k0, k1, k0 ^ k1 ^ PARITY)
    x0, x1 = (counter[0] + k0) & MASK32, (counter[1] + k1) & MASK32
    for group in range(5):
        for r in ROTATIONS[group % 2]:
            x0 = (x0 + x1) & MASK32
            x1 = ((x1 << r) & MASK32) | (x1 >> (32 - r))
            x1 = x1 ^ x0
        x0 = (x0 + schedule[(group + 1) % 3]) & MASK32
        x1 = (x1 + schedule[(group + 2) % 3] + group + 1) & MASK32
    return x0, x1


def stream_uniforms(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Draw `counters` of the counter-based streams `keys` (int64 tensors, broadcast together;
    a key is a 63-bit seed, a counter the index of the draw) -> float32 uniforms in [0, 1),
    24 random bits each (exact in float32), on the tensors' device."""
    word, _ = threefry2x32((keys >> 32, keys & MASK32), (counters >> 32, counters & MASK32))
    return (word >> 8).to(torch.float32) * 2.0**-24


def row_uniforms(rows: list, device) -> torch.Tensor:
    """One uniform per sampled row (slots.Row): the next number of its torch.Generator (CPU
    tensor), or of its counter-based stream (an int key) at its draw count, len(row.out)."""
    if isinstance(rows[0].stream, torch.Generator):
        return torch.stack([torch.rand((), generator=r.stream) for r in rows])
    keys = torch.tensor([r.stream for r in rows], dtype=torch.long)
    counters = torch.tensor([len(r.out) for r in rows], dtype=torch.long)
    return stream_uniforms(keys.to(device), counters.to(device))
