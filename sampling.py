"""The probability math of a round, in plain torch: filtered softmax, sampling, the Markov chain that
drafts a block, and the acceptance rules that keep speculative decoding exact.

Sampling is the exponential race, argmax(p / E) with E ~ Exp(1): exact, and no host sync. A round's
noise is drawn outside compiled graphs (`Noise`), so a seed repeats a run token for token. These are
the references; kernels.py has Triton versions of the chain and of sampled acceptance."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class Filters(NamedTuple):
    """After the temperature, in transformers' order: top-k (ties kept), top-p (the top token stays),
    min-p. Target and drafter are filtered alike, so speculative sampling stays exact."""
    top_k: int = 0       # 0: off
    top_p: float = 1.0   # 1.0: off
    min_p: float = 0.0   # 0.0: off

    @property
    def active(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


NO_FILTERS = Filters()


def filter_logits(z: torch.Tensor, f: Filters) -> torch.Tensor:
    """z [..., V] (float32, already / T) with -inf outside the kept set."""
    if 0 < f.top_k < z.shape[-1]:
        kth = torch.topk(z, f.top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if f.top_p < 1.0:
        # As transformers: ascending, drop what stays within 1 - p; never the largest.
        ordered, order = torch.sort(z, dim=-1, stable=True)
        drop = torch.softmax(ordered, dim=-1).cumsum(dim=-1) <= 1 - f.top_p
        drop[..., -1] = False
        z = z.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    if f.min_p > 0.0:
        p = torch.softmax(z, dim=-1)
        floor = f.min_p * p.amax(dim=-1, keepdim=True)
        z = z.masked_fill(p < floor, float("-inf"))
    return z


def probs(logits: torch.Tensor, temperature: float, filters: Filters = NO_FILTERS) -> torch.Tensor:
    """softmax(logits / T) in float32 over the tokens the filters keep."""
    z = logits.float() / temperature
    if filters.active:
        z = filter_logits(z, filters)
    return torch.softmax(z, dim=-1)


def sample_from(p: torch.Tensor, generator: Optional[torch.Generator], noise: Optional[torch.Tensor] = None):
    """One id per row of p [..., V]; noise ~ Exp(1) of p's shape, or drawn."""
    if noise is None:
        noise = torch.empty_like(p).exponential_(1, generator=generator)
    return torch.argmax(p / noise, dim=-1)


def sample(logits, temperature: float, generator, noise=None, *, filters: Filters = NO_FILTERS):
    """argmax at T=0, else a draw from the filtered softmax(logits / T)."""
    if temperature == 0:
        return torch.argmax(logits, dim=-1)
    return sample_from(probs(logits, temperature, filters), generator, noise)


class Noise(NamedTuple):
    """All the randomness of one sampled round, in draw order."""
    chain: torch.Tensor  # [B, K, V] Exp(1): the drafts' races
    u: torch.Tensor      # [B, K] uniforms of the acceptance tests
    bonus: torch.Tensor  # [B, V] Exp(1): the correction / bonus race


def round_noise(generator, B: int, K: int, V: int, device) -> Noise:
    chain = torch.empty((B, K, V), device=device).exponential_(1, generator=generator)
    u = torch.rand((B, K), generator=generator, device=device)
    bonus = torch.empty((B, V), device=device).exponential_(1, generator=generator)
    return Noise(chain, u, bonus)


def rows_noise(generators: list, K: int, V: int, device) -> Noise:
    """Each row's noise from its request's generator (independent of its neighbours); free rows
    (generator None) get placeholders."""
    free = None
    if any(g is None for g in generators):
        free = Noise(torch.ones((1, K, V), device=device), torch.zeros((1, K), device=device),
                     torch.ones((1, V), device=device))
    rows = []
    for g in generators:
        if g is None:
            rows.append(free)
        else:
            rows.append(round_noise(g, 1, K, V, device))
    return Noise(*(torch.cat(parts) for parts in zip(*rows)))


# Drafting: the Markov chain

def markov_chain(base_logits, hidden, anchor, markov, temperature: float, generator, noise=None, *,
                 filters: Filters = NO_FILTERS):
    """The sequential stage: z_k = U_k + b_k, with b_k from the head's `step(h_k, x_{k-1}, state)`
    (no head: DFlash, z_k = U_k). base_logits [B, K, V], hidden [B, K, H], anchor [B]; noise Exp(1)
    [B, K, V] or None. Returns drafts [B, K] and q [B, K, V], the distributions they were drawn
    from (None at T=0)."""
    drafts = []
    qs = []
    prev = anchor
    state = None
    for k in range(base_logits.shape[1]):
        z = base_logits[:, k]
        if markov is not None:
            bias, state = markov.step(hidden[:, k], prev, state)
            z = z + bias
        if temperature == 0:
            prev = torch.argmax(z, dim=-1)
        else:
            q = probs(z, temperature, filters)
            noise_k = None if noise is None else noise[:, k]
            prev = sample_from(q, generator, noise_k)
            qs.append(q)
        drafts.append(prev)
    q = torch.stack(qs, 1) if qs else None
    return torch.stack(drafts, 1), q


# Acceptance: the longest prefix of drafts the target keeps, then one token of its own

def accept_greedy(drafts, target_logits, verify_len):
    """Accept x_k while it is the target's argmax and k <= ℓ (verify_len [B]); target_logits
    [B, K+1, V]. Returns accepted n [B] and the token committed after them [B]."""
    K = drafts.shape[1]
    best = torch.argmax(target_logits, dim=-1)  # [B, K+1]
    verified = torch.arange(K, device=drafts.device) < verify_len[:, None]
    ok = (drafts == best[:, :K]) & verified
    n = torch.cumprod(ok.long(), dim=1).sum(1)
    next_token = best.gather(1, n[:, None])[:, 0]
    return n, next_token


def accept_sampled(drafts, q, target_logits, verify_len, temperature: float, generator, u=None, noise=None, *,
                   filters: Filters = NO_FILTERS):
    """Rejection sampling: accept x_k if u_k·q_k(x_k) < p_{k-1}(x_k) and k <= ℓ; at the first
    rejection the correction from normalize(max(p - q, 0)), else the bonus from p_ℓ. Draws u [B, K],
    then a race over [B, V] (or takes them). Returns accepted n [B] and the committed token [B]."""
    B, K = drafts.shape
    V = target_logits.shape[-1]
    p = probs(target_logits, temperature, filters)  # [B, K+1, V]
    if u is None:
        u = torch.rand((B, K), generator=generator, device=drafts.device)
    n = torch.zeros(B, dtype=torch.long, device=drafts.device)
    if K:
        p_x = p[:, :K].gather(2, drafts[:, :, None])[:, :, 0]
        q_x = q.gather(2, drafts[:, :, None])[:, :, 0]
        verified = torch.arange(K, device=drafts.device) < verify_len[:, None]
        ok = (u * q_x < p_x) & verified
        n = torch.cumprod(ok.long(), dim=1).sum(1)
    p_n = p.gather(1, n[:, None, None].expand(B, 1, V))[:, 0]
    if K:
        q_n = q.gather(1, n.clamp(max=K - 1)[:, None, None].expand(B, 1, V))[:, 0]
        residual = torch.clamp(p_n - q_n, min=0)
        mass = residual.sum(-1, keepdim=True)
        # p == q leaves no residual mass, and then x_k was never rejected: p_n is never read there.
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_n)
        rejected = n < verify_len
        p_n = torch.where(rejected[:, None], residual, p_n)
    return n, sample_from(p_n, generator, noise)
