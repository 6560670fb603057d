"""Hot math of a speculative round, as plain-torch references.

Each function here has a fixed signature that a fast version (Triton, or a compiled fusion)
can later replace; the reference stays beside it and the tests hold the two equal.

Randomness: sampling uses the exponential race (argmax of p / E with E ~ Exp(1)), which
draws from p exactly and needs no host sync. Every sampled function takes its noise either
pre-drawn (`noise`, `u`: what the engine passes, drawn by `round_noise` outside any compiled
graph, so eager and compiled rounds see the same numbers) or from an explicit
`torch.Generator`, in a fixed order. Either way a seed makes a run repeatable.
"""

from __future__ import annotations

from typing import Optional

import torch


def probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / T) in float32."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def sample_from(p: torch.Tensor, generator: Optional[torch.Generator], noise: Optional[torch.Tensor] = None):
    """One id per row of p ([..., V], rows sum to 1) by the exponential race; noise ~ Exp(1), p's shape."""
    e = torch.empty_like(p).exponential_(1, generator=generator) if noise is None else noise
    return torch.argmax(p / e, dim=-1)


def round_noise(generator: Optional[torch.Generator], B: int, K: int, V: int, device):
    """All the randomness of one sampled round, in draw order: the Markov chain's Exp(1) noise
    [B, K, V], the acceptance uniforms u [B, K], the correction/bonus Exp(1) noise [B, V]."""
    chain = torch.empty((B, K, V), device=device).exponential_(1, generator=generator)
    u = torch.rand((B, K), generator=generator, device=device)
    bonus = torch.empty((B, V), device=device).exponential_(1, generator=generator)
    return chain, u, bonus


def sample(logits: torch.Tensor, temperature: float, generator: Optional[torch.Generator]) -> torch.Tensor:
    """argmax at T=0, else a draw from softmax(logits / T). logits [..., V] -> ids [...]."""
    if temperature == 0:
        return torch.argmax(logits, dim=-1)
    return sample_from(probs(logits, temperature), generator)


def markov_chain(base_logits: torch.Tensor, hidden: torch.Tensor, anchor: torch.Tensor, markov,
                 temperature: float, generator: Optional[torch.Generator], noise: Optional[torch.Tensor] = None):
    """The sequential stage of DSPARK.md §3: draft K tokens left to right.

    base_logits: [B, K, V] (U_k), hidden: [B, K, H] (h_k), anchor: [B] (x_0).
    markov: a head with `step(h_k, prev_token, state) -> (bias [B, V], state)`, or None
    (DFlash: every slot is drawn from its own U_k).
    Returns drafts [B, K] and q [B, K, V], the distributions the drafts were drawn from
    (None at T=0, where verification is greedy and needs no q). noise: Exp(1) [B, K, V] or None.
    """
    B, K, V = base_logits.shape
    drafts, qs = [], []
    prev, state = anchor, None  # the anchor feeds slot 1; afterwards the token sampled at k-1
    for k in range(K):
        z = base_logits[:, k]
        if markov is not None:
            bias, state = markov.step(hidden[:, k], prev, state)
            z = z + bias
        if temperature == 0:
            x = torch.argmax(z, dim=-1)
        else:
            q = probs(z, temperature)
            x = sample_from(q, generator, None if noise is None else noise[:, k])
            qs.append(q)
        drafts.append(x)
        prev = x
    return torch.stack(drafts, 1), (torch.stack(qs, 1) if qs else None)


def verify_greedy(drafts: torch.Tensor, target_logits: torch.Tensor, verify_len: torch.Tensor):
    """Greedy acceptance. drafts [B, K]; target_logits [B, K+1, V] at the anchor and each draft;
    verify_len [B] (ℓ ≤ K drafts sent to the target).

    Accept x_k while x_k == argmax p_{k-1} and k ≤ ℓ; the next token is argmax p_n.
    Returns accepted n [B] and the token committed after them [B].
    """
    B, K = drafts.shape
    best = torch.argmax(target_logits, dim=-1)  # [B, K+1]
    ok = (drafts == best[:, :K]) & (torch.arange(K, device=drafts.device) < verify_len[:, None])
    n = torch.cumprod(ok.long(), dim=1).sum(1)
    return n, best.gather(1, n[:, None])[:, 0]


def verify_sampled(drafts: torch.Tensor, q: torch.Tensor, target_logits: torch.Tensor,
                   verify_len: torch.Tensor, temperature: float, generator: Optional[torch.Generator],
                   u: Optional[torch.Tensor] = None, noise: Optional[torch.Tensor] = None):
    """Lossless rejection sampling (DSPARK.md §5 step 4).

    drafts [B, K], q [B, K, V] (the draft distributions), target_logits [B, K+1, V], verify_len [B].
    Accept x_k if u_k < min(1, p_{k-1}(x_k) / q_k(x_k)); at the first rejection k sample the
    correction from normalize(max(p_{k-1} - q_k, 0)); if all ℓ pass, the bonus from p_ℓ.
    Draws: u [B, K] first, then one exponential race over [B, V] (or the given u and noise).
    Returns accepted n [B] and the committed correction or bonus token [B].
    """
    B, K = drafts.shape
    p = probs(target_logits, temperature)  # [B, K+1, V]
    if u is None:
        u = torch.rand((B, K), generator=generator, device=drafts.device)
    if K:
        p_x = p[:, :K].gather(2, drafts[:, :, None])[:, :, 0]
        q_x = q.gather(2, drafts[:, :, None])[:, :, 0]
        ok = (u * q_x < p_x) & (torch.arange(K, device=drafts.device) < verify_len[:, None])
        n = torch.cumprod(ok.long(), dim=1).sum(1)
    else:
        n = torch.zeros(B, dtype=torch.long, device=drafts.device)
    p_n = p.gather(1, n[:, None, None].expand(B, 1, p.shape[-1]))[:, 0]  # [B, V]
    if K:
        rejected = n < verify_len
        q_n = q.gather(1, n.clamp(max=K - 1)[:, None, None].expand(B, 1, q.shape[-1]))[:, 0]
        residual = torch.clamp(p_n - q_n, min=0)
        mass = residual.sum(-1, keepdim=True)
        # A rejection has probability 0 when p == q; guard the division all the same.
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_n)
        p_n = torch.where(rejected[:, None], residual, p_n)
    return n, sample_from(p_n, generator, noise)
