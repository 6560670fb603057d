"""Unit tests of sampling.py: the Markov chain, greedy and sampled acceptance, sampling, the top-k,
top-p and min-p filters (`sampling.filter_logits` against a by-definition filter written here with
sorted Python lists, which test_generate.py's distribution tests use too), and the pre-drawn noise.

Everything here is hand-built tensors (no checkpoints), except the last two tests, which run a round's
finite check through `speculate.Engine` on a random target and on the demo pair. Distributional claims
are checked with a chi-square goodness-of-fit test on a large batch drawn from a seeded
`torch.Generator`, so the tests are deterministic; the p-value threshold (1e-3) is far from where the
seeded draws land.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (_HERE, os.path.dirname(_HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from conftest import chi2_pvalue, gen  # noqa: E402

import sampling  # noqa: E402
from sampling import Filters  # noqa: E402

torch.set_num_threads(1)

P_MIN = 1e-3  # chi-square p-value below which a distribution is declared different


def chain_noise(B: int, K: int, V: int, seed: int) -> torch.Tensor:
    """A chain's Exp(1) noise [B, K, V] from a seeded generator, as a round draws it
    (`sampling.round_noise`)."""
    return sampling.exponential((B, K, V), gen(seed), "cpu")


def acceptance_noise(B: int, K: int, V: int, seed: int):
    """The acceptance's uniforms u [B, K], then its race's Exp(1) noise [B, V], from a seeded
    generator in a round's order (`sampling.round_noise`)."""
    g = gen(seed)
    u = torch.rand((B, K), generator=g)
    noise = sampling.exponential((B, V), g, "cpu")
    return u, noise


def draw_from(p: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """One id per row of p, raced against Exp(1) noise drawn from g."""
    noise = sampling.exponential(p.shape, g, "cpu")
    return sampling.sample_from(p, noise)


def test_chi2_helper_has_power():
    g = gen(0)
    p = torch.tensor([0.1, 0.2, 0.3, 0.4])
    good = torch.multinomial(p, 4000, replacement=True, generator=g)
    assert chi2_pvalue(good, p) > P_MIN
    assert chi2_pvalue(good, torch.tensor([0.15, 0.2, 0.3, 0.35])) < P_MIN
    assert chi2_pvalue(torch.tensor([0, 1, 2]), torch.tensor([0.5, 0.5, 0.0])) == 0.0


# ----------------------------------------------------------------------------------------
# markov_chain

class RecordingHead:
    """A fake Markov head: records every (h, prev, state) it is given.

    mode "next": the bias forces token (prev + 1) % V (one-hot * 100).
    mode "zero": no bias (the draft is whatever the base logits give).
    mode "mild": a bias of 1.5 on token (3 * prev + 1) % V (depends on prev, does not swamp U).
    The returned state counts the steps, so the test can see it is threaded through.
    """

    def __init__(self, V: int, mode: str = "next"):
        self.V, self.mode = V, mode
        self.prevs, self.hiddens, self.states, self.biases = [], [], [], []

    def step(self, h, prev, state):
        self.prevs.append(prev.clone())
        self.hiddens.append(h.clone())
        self.states.append(None if state is None else state.clone())
        one_hot = torch.nn.functional.one_hot
        if self.mode == "next":
            bias = one_hot((prev + 1) % self.V, self.V).float() * 100
        elif self.mode == "mild":
            bias = one_hot((prev * 3 + 1) % self.V, self.V).float() * 1.5
        else:
            bias = torch.zeros(prev.shape[0], self.V)
        self.biases.append(bias)
        new_state = torch.ones(prev.shape[0]) if state is None else state + 1
        return bias, new_state


def _inputs(B=6, K=5, V=11, H=3, seed=0, scale=1.0):
    g = gen(seed)
    base = torch.randn(B, K, V, generator=g) * scale
    hidden = torch.randn(B, K, H, generator=g)
    anchor = torch.randint(0, V, (B,), generator=g)
    return base, hidden, anchor


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
def test_markov_chain_feeds_anchor_then_previous_draft(temperature):
    B, K, V = 6, 5, 11
    base, hidden, anchor = _inputs(B, K, V)
    head = RecordingHead(V, "next")
    noise = chain_noise(B, K, V, seed=1)
    drafts, q = sampling.markov_chain(base, hidden, anchor, head, temperature, noise)
    assert drafts.shape == (B, K) and drafts.dtype == torch.long
    assert len(head.prevs) == K
    # The anchor feeds slot 1, and slot k receives the token drafted at slot k-1.
    assert torch.equal(head.prevs[0], anchor)
    for k in range(1, K):
        assert torch.equal(head.prevs[k], drafts[:, k - 1])
    # The forced bias (100) dominates the base logits: x_k = x_{k-1} + 1.
    expected = (anchor[:, None] + torch.arange(1, K + 1)) % V
    assert torch.equal(drafts, expected)
    # h_k is slot k's hidden state; the state is threaded from step to step (None first).
    for k in range(K):
        assert torch.equal(head.hiddens[k], hidden[:, k])
    assert head.states[0] is None
    for k in range(1, K):
        assert torch.equal(head.states[k], torch.full((B,), float(k)))


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_markov_chain_sampled_prev_is_the_sampled_token(temperature):
    """With no bias and flat-ish logits the draws are random: slot k must still receive the
    token actually sampled at slot k-1 (not an argmax, not the slot-k-1 logits' mode)."""
    B, K, V = 64, 6, 9
    base, hidden, anchor = _inputs(B, K, V, scale=0.3)
    head = RecordingHead(V, "zero")
    noise = chain_noise(B, K, V, seed=3)
    drafts, q = sampling.markov_chain(base, hidden, anchor, head, temperature, noise)
    assert torch.equal(head.prevs[0], anchor)
    for k in range(1, K):
        assert torch.equal(head.prevs[k], drafts[:, k - 1])
    # The draws really are random (not the argmax), so the check above means something.
    assert not torch.equal(drafts, torch.argmax(base, dim=-1))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
@pytest.mark.parametrize("with_head", [True, False], ids=["markov", "no-markov"])
def test_markov_chain_q_is_the_distribution_drafted_from(temperature, with_head):
    B, K, V = 8, 4, 13
    base, hidden, anchor = _inputs(B, K, V, scale=2.0)
    head = RecordingHead(V, "mild") if with_head else None
    noise = chain_noise(B, K, V, seed=5)
    drafts, q = sampling.markov_chain(base, hidden, anchor, head, temperature, noise)
    assert q is not None and q.shape == (B, K, V) and q.dtype == torch.float32
    for k in range(K):
        z = base[:, k] + (head.biases[k] if head is not None else 0)
        torch.testing.assert_close(q[:, k], torch.softmax(z / temperature, dim=-1))
    torch.testing.assert_close(q.sum(-1), torch.ones(B, K))
    assert bool((q.gather(2, drafts[:, :, None]) > 0).all())


def test_markov_chain_q_is_none_at_t0_and_greedy_is_argmax():
    B, K, V = 5, 4, 10
    base, hidden, anchor = _inputs(B, K, V)
    noise = chain_noise(B, K, V, seed=0)  # read by nothing at T=0
    drafts, q = sampling.markov_chain(base, hidden, anchor, None, 0.0, noise)
    assert q is None
    assert torch.equal(drafts, torch.argmax(base, dim=-1))
    head = RecordingHead(V, "zero")
    drafts2, q2 = sampling.markov_chain(base, hidden, anchor, head, 0.0, None)
    assert q2 is None and torch.equal(drafts2, drafts)


def test_markov_chain_without_head_samples_each_slot_from_its_own_logits():
    """markov=None: slot k's draft comes from U_k only. Each slot gets a disjoint support, and
    within it the frequencies follow softmax(U_k / T)."""
    B, K, V, T = 4000, 3, 12, 0.8
    g = gen(7)
    row = torch.randn(K, V, generator=g)
    support = torch.zeros(K, V, dtype=torch.bool)
    for k in range(K):
        support[k, 4 * k:4 * k + 4] = True
    row = torch.where(support, row, torch.tensor(float("-inf")))
    base = row.expand(B, K, V).contiguous()
    hidden = torch.zeros(B, K, 2)
    anchor = torch.zeros(B, dtype=torch.long)
    noise = chain_noise(B, K, V, seed=8)
    drafts, q = sampling.markov_chain(base, hidden, anchor, None, T, noise)
    for k in range(K):
        assert bool(support[k, drafts[:, k]].all())
        assert chi2_pvalue(drafts[:, k], torch.softmax(row[k] / T, -1)) > P_MIN
        torch.testing.assert_close(q[:, k], torch.softmax(base[:, k] / T, -1))


def test_markov_chain_repeatable_with_seed():
    B, K, V = 16, 5, 9
    base, hidden, anchor = _inputs(B, K, V, scale=0.5)
    runs = []
    for seed in (11, 11, 12):
        noise = chain_noise(B, K, V, seed)
        runs.append(sampling.markov_chain(base, hidden, anchor, RecordingHead(V, "zero"), 1.0, noise))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    assert not torch.equal(runs[0][0], runs[2][0])


# ----------------------------------------------------------------------------------------
# accept_greedy

def _onehot_logits(best: torch.Tensor, V: int, noise_seed: int = 0) -> torch.Tensor:
    """[B, K+1, V] logits whose argmax at each position is `best` [B, K+1] (small noise elsewhere)."""
    g = gen(noise_seed)
    logits = torch.randn(*best.shape, V, generator=g) * 0.1
    return logits + torch.nn.functional.one_hot(best, V).float() * 5


def test_accept_greedy_counts_and_next_token():
    V, K = 10, 3
    best = torch.tensor([
        [1, 2, 3, 4],  # all accepted -> bonus = best[3]
        [1, 2, 3, 4],  # first wrong -> 0, correction best[0]
        [1, 2, 3, 4],  # second wrong -> 1, correction best[1]
        [1, 2, 3, 4],  # third wrong -> 2
        [1, 2, 3, 4],  # later drafts right but the first wrong -> still 0
        [5, 5, 5, 5],  # repeated tokens, all right
    ])
    drafts = torch.tensor([
        [1, 2, 3],
        [9, 2, 3],
        [1, 9, 3],
        [1, 2, 9],
        [0, 2, 3],
        [5, 5, 5],
    ])
    verify_len = torch.full((6,), K)
    n, nxt = sampling.accept_greedy(drafts, _onehot_logits(best, V), verify_len)
    assert n.tolist() == [3, 0, 1, 2, 0, 3]
    assert nxt.tolist() == [4, 1, 2, 3, 1, 5]
    assert n.dtype == torch.long and nxt.dtype == torch.long


def test_accept_greedy_verify_len_caps_acceptance():
    V = 10
    best = torch.tensor([[1, 2, 3, 4, 6]] * 5)
    drafts = torch.tensor([[1, 2, 3, 4]] * 4 + [[1, 7, 3, 4]])
    verify_len = torch.tensor([0, 1, 2, 4, 3])
    n, nxt = sampling.accept_greedy(drafts, _onehot_logits(best, V), verify_len)
    # Stopped by ℓ: n = ℓ and the next token is argmax p_n (= p_ℓ); a rejection before ℓ wins.
    assert n.tolist() == [0, 1, 2, 4, 1]
    assert nxt.tolist() == [1, 2, 3, 6, 2]


def test_accept_greedy_no_drafts_is_a_plain_step():
    V = 7
    logits = torch.randn(3, 1, V, generator=gen(2))
    n, nxt = sampling.accept_greedy(torch.zeros(3, 0, dtype=torch.long), logits, torch.zeros(3, dtype=torch.long))
    assert n.tolist() == [0, 0, 0]
    assert torch.equal(nxt, logits[:, 0].argmax(-1))


# ----------------------------------------------------------------------------------------
# accept_sampled

def _logits_of(p: torch.Tensor) -> torch.Tensor:
    """Logits whose softmax at T=1 is p (zeros become -inf)."""
    return torch.log(p)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_accept_sampled_p_equals_q_accepts_every_verified_draft(temperature):
    B, K, V = 500, 4, 9
    g = gen(3)
    target_logits = torch.randn(B, K + 1, V, generator=g) * 2
    q = sampling.probs(target_logits[:, :K], temperature)
    drafts = draw_from(q, g)
    verify_len = torch.randint(0, K + 1, (B,), generator=g)
    u, noise = acceptance_noise(B, K, V, seed=4)
    n, nxt = sampling.accept_sampled(drafts, q, target_logits, verify_len, temperature, u, noise)
    assert torch.equal(n, verify_len)
    assert bool(((nxt >= 0) & (nxt < V)).all())


def test_accept_sampled_bonus_comes_from_p_ell():
    """All ℓ verified drafts accepted: the next token is drawn from p_ℓ, not p_K."""
    B, K, V = 6000, 3, 8
    g = gen(5)
    row = torch.randn(K + 1, V, generator=g)
    # p_1 (for ℓ = 1) lives on tokens 0..3, p_3 (= p_K) on tokens 4..7.
    row[1, 4:] = float("-inf")
    row[3, :4] = float("-inf")
    target_logits = row.expand(B, K + 1, V).contiguous()
    q = sampling.probs(target_logits[:, :K], 1.0)
    drafts = draw_from(q, g)
    verify_len = torch.tensor([1, 3]).repeat(B // 2)
    u, noise = acceptance_noise(B, K, V, seed=6)
    n, nxt = sampling.accept_sampled(drafts, q, target_logits, verify_len, 1.0, u, noise)
    assert torch.equal(n, verify_len)
    p = sampling.probs(row, 1.0)
    assert chi2_pvalue(nxt[verify_len == 1], p[1]) > P_MIN
    assert chi2_pvalue(nxt[verify_len == 3], p[3]) > P_MIN


def test_accept_sampled_draft_with_zero_target_probability_is_always_rejected():
    B, K, V = 2000, 2, 6
    bad = 2
    p0 = torch.tensor([0.3, 0.2, 0.0, 0.25, 0.15, 0.1])
    q0 = torch.tensor([0.1, 0.1, 0.6, 0.1, 0.05, 0.05])
    target_logits = torch.stack([_logits_of(p0), _logits_of(p0), _logits_of(p0)])[None].expand(B, K + 1, V)
    q = torch.stack([q0, q0])[None].expand(B, K, V).contiguous()
    drafts = torch.full((B, K), bad)
    u, noise = acceptance_noise(B, K, V, seed=9)
    n, nxt = sampling.accept_sampled(drafts, q, target_logits, torch.full((B,), K), 1.0, u, noise)
    assert n.tolist() == [0] * B
    assert not bool((nxt == bad).any())
    # The correction is drawn from normalize(max(p - q, 0)).
    residual = torch.clamp(p0 - q0, min=0)
    assert chi2_pvalue(nxt, residual / residual.sum()) > P_MIN


def test_accept_sampled_u_zero_never_accepts_a_token_the_target_cannot_produce():
    """The acceptance test is strict, u·q(x) < p(x): with u = 0 exactly and p(x) = 0 the draft is
    rejected (u·q(x) <= p(x) would accept a token the target never produces)."""
    p0 = torch.tensor([0.5, 0.5, 0.0])
    logits = torch.stack([_logits_of(p0), _logits_of(p0)])[None]      # [1, 2, 3]
    q = torch.tensor([[[0.0, 0.0, 1.0]]])
    drafts = torch.tensor([[2]])
    u, noise = torch.zeros(1, 1), torch.ones(1, 3)
    n, nxt = sampling.accept_sampled(drafts, q, logits, torch.tensor([1]), 1.0, u, noise)
    assert n.tolist() == [0] and nxt.item() != 2


def test_accept_sampled_residual_example():
    """p = [.5, .5, 0], q = [1, 0, 0], draft 0: accepted with probability 1/2; a rejection's
    correction is always token 1; after an acceptance the bonus is drawn from p_1."""
    B, V = 4000, 3
    p0 = torch.tensor([0.5, 0.5, 0.0])
    p1 = torch.tensor([0.2, 0.3, 0.5])
    target_logits = torch.stack([_logits_of(p0), _logits_of(p1)])[None].expand(B, 2, V).contiguous()
    q = torch.tensor([1.0, 0.0, 0.0]).expand(B, 1, V).contiguous()
    drafts = torch.zeros(B, 1, dtype=torch.long)
    u, noise = acceptance_noise(B, 1, V, seed=10)
    n, nxt = sampling.accept_sampled(drafts, q, target_logits, torch.ones(B, dtype=torch.long), 1.0, u, noise)
    rate = n.float().mean().item()
    assert abs(rate - 0.5) < 4 * (0.25 / B) ** 0.5, rate
    assert bool((nxt[n == 0] == 1).all())
    assert chi2_pvalue(nxt[n == 1], p1) > P_MIN
    # The committed pair (draft-or-correction) follows p0 exactly: 0 and 1 each with 1/2.
    first = torch.where(n == 1, drafts[:, 0], nxt)
    assert chi2_pvalue(first, p0) > P_MIN


def test_accept_sampled_is_lossless_on_random_distributions():
    """One round over random p, q: the first committed token (draft if accepted, else the
    correction) is distributed as p_0, and the second (given the first draft accepted) as p_1."""
    B, K, V = 20000, 2, 5
    g = gen(12)
    tl_row = torch.randn(K + 1, V, generator=g) * 1.5
    q_row = torch.softmax(torch.randn(K, V, generator=g) * 1.5, -1)
    target_logits = tl_row.expand(B, K + 1, V).contiguous()
    q = q_row.expand(B, K, V).contiguous()
    drafts = draw_from(q, g)
    u, noise = acceptance_noise(B, K, V, seed=13)
    n, nxt = sampling.accept_sampled(drafts, q, target_logits, torch.full((B,), K), 1.0, u, noise)
    p = torch.softmax(tl_row, -1)
    first = torch.where(n >= 1, drafts[:, 0], nxt)
    assert chi2_pvalue(first, p[0]) > P_MIN
    second = torch.where(n >= 2, drafts[:, 1], nxt)[n >= 1]
    assert chi2_pvalue(second, p[1]) > P_MIN
    # Acceptance rate of slot 1 is sum_x min(p, q).
    rate = (n >= 1).float().mean().item()
    assert abs(rate - torch.minimum(p[0], q_row[0]).sum().item()) < 4 * (0.25 / B) ** 0.5


def test_accept_sampled_verify_len_caps_acceptance():
    B, K, V = 300, 4, 7
    g = gen(14)
    target_logits = torch.randn(B, K + 1, V, generator=g)
    q = sampling.probs(target_logits[:, :K], 1.0)  # p == q: every verified draft passes
    drafts = draw_from(q, g)
    verify_len = torch.tensor([0, 1, 2, 3, 4]).repeat(B // 5)
    u, noise = acceptance_noise(B, K, V, seed=15)
    n, _ = sampling.accept_sampled(drafts, q, target_logits, verify_len, 1.0, u, noise)
    assert torch.equal(n, verify_len)


def test_accept_sampled_no_drafts_samples_from_p0():
    B, V = 6000, 6
    row = torch.randn(1, V, generator=gen(16))
    target_logits = row.expand(B, 1, V).contiguous()
    u, noise = acceptance_noise(B, 0, V, seed=17)
    n, nxt = sampling.accept_sampled(torch.zeros(B, 0, dtype=torch.long), None, target_logits,
                                    torch.zeros(B, dtype=torch.long), 0.9, u, noise)
    assert n.tolist() == [0] * B
    assert chi2_pvalue(nxt, torch.softmax(row[0] / 0.9, -1)) > P_MIN


def test_accept_sampled_repeatable_with_seed():
    B, K, V = 64, 3, 8
    g = gen(18)
    target_logits = torch.randn(B, K + 1, V, generator=g)
    q = torch.softmax(torch.randn(B, K, V, generator=g), -1)
    drafts = draw_from(q, g)
    vl = torch.full((B,), K)
    u_a, noise_a = acceptance_noise(B, K, V, seed=1)
    u_b, noise_b = acceptance_noise(B, K, V, seed=1)
    u_c, noise_c = acceptance_noise(B, K, V, seed=2)
    a = sampling.accept_sampled(drafts, q, target_logits, vl, 1.0, u_a, noise_a)
    b = sampling.accept_sampled(drafts, q, target_logits, vl, 1.0, u_b, noise_b)
    c = sampling.accept_sampled(drafts, q, target_logits, vl, 1.0, u_c, noise_c)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not (torch.equal(a[0], c[0]) and torch.equal(a[1], c[1]))


# ----------------------------------------------------------------------------------------
# sample

def test_sample_argmax_at_t0():
    logits = torch.randn(4, 3, 11, generator=gen(19))
    noise = sampling.exponential(logits.shape, gen(0), "cpu")  # read by nothing at T=0
    assert torch.equal(sampling.sample(logits, 0.0, noise), logits.argmax(-1))
    assert torch.equal(sampling.sample(logits, 0, None), logits.argmax(-1))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_sample_frequencies_match_softmax(temperature):
    B, V = 20000, 7
    row = torch.randn(V, generator=gen(20)) * 1.5
    noise = sampling.exponential((B, V), gen(21), "cpu")
    ids = sampling.sample(row.expand(B, V), temperature, noise)
    assert ids.shape == (B,)
    assert chi2_pvalue(ids, torch.softmax(row / temperature, -1)) > P_MIN
    # ... and not the distribution at another temperature (the check has power).
    assert chi2_pvalue(ids, torch.softmax(row / (temperature * 1.5), -1)) < P_MIN


def test_sample_repeatable_with_seed():
    logits = torch.randn(50, 9, generator=gen(22))
    noise_a = sampling.exponential(logits.shape, gen(5), "cpu")
    noise_b = sampling.exponential(logits.shape, gen(5), "cpu")
    noise_c = sampling.exponential(logits.shape, gen(6), "cpu")
    a = sampling.sample(logits, 1.0, noise_a)
    assert torch.equal(a, sampling.sample(logits, 1.0, noise_b))
    assert not torch.equal(a, sampling.sample(logits, 1.0, noise_c))


# ----------------------------------------------------------------------------------------
# The filters, by definition

def filtered_by_definition(logits, temperature: float, f: Filters) -> list[float]:
    """Probabilities after temperature, top-k, top-p (renormalised over top-k's survivors; the most
    likely tokens whose mass reaches p, the first always kept) and min-p, for one row, in Python."""
    z = [float(x) / temperature for x in logits]
    V = len(z)
    order = sorted(range(V), key=lambda i: -z[i])
    keep = set(range(V))
    if 0 < f.top_k < V:
        kth = z[order[f.top_k - 1]]
        keep = {i for i in keep if z[i] >= kth}

    def probs_of(kept):
        mx = max(z[i] for i in kept)
        e = {i: math.exp(z[i] - mx) for i in kept}
        s = sum(e.values())
        return {i: e[i] / s for i in kept}

    if f.top_p < 1:
        p = probs_of(keep)
        cum, kept = 0.0, set()
        for i in [i for i in order if i in keep]:
            if cum < f.top_p:
                kept.add(i)
            cum += p[i]
        keep = kept
    if f.min_p > 0:
        p = probs_of(keep)
        mx = max(p.values())
        keep = {i for i in keep if p[i] >= f.min_p * mx}
    p = probs_of(keep)
    return [p.get(i, 0.0) for i in range(V)]


def margins(logits, temperature: float, f: Filters) -> float:
    """How far the row is from flipping a token across a top-p or min-p cut (relative units)."""
    z = [float(x) / temperature for x in logits]
    order = sorted(range(len(z)), key=lambda i: -z[i])
    kept = order[:f.top_k] if f.top_k else order
    mx = max(z[i] for i in kept)
    e = [math.exp(z[i] - mx) for i in kept]
    p = [x / sum(e) for x in e]
    out = [1.0]
    if f.top_p < 1:
        cum = 0.0
        for x in p:
            out.append(abs(cum - f.top_p))
            cum += x
    if f.min_p > 0:
        out += [abs(x / p[0] - f.min_p) for x in p]
    return min(out)


@pytest.mark.parametrize("f", [Filters(3), Filters(0, 0.7), Filters(0, 1.0, 0.2), Filters(5, 0.9, 0.05),
                               Filters(1), Filters(0, 1e-6), Filters(0, 1.0, 1.0), Filters(100)])
def test_filter_logits_equals_the_definition(f):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 40, generator=g) * 3
    logits[0, :5] = logits[0, 5]  # ties at the top
    T = 0.8
    got = sampling.probs(logits, T, f).double()
    for row, p in zip(logits, got):
        want = torch.tensor(filtered_by_definition(row.tolist(), T, f), dtype=torch.float64)
        if margins(row.tolist(), T, f) > 1e-4:  # away from a cut, the kept set is the same
            assert torch.equal(p > 0, want > 0), (row, p, want)
            assert torch.allclose(p, want, atol=1e-6)
        assert (p > 0).any() and abs(p.sum().item() - 1) < 1e-5


@pytest.mark.parametrize("p,top_p", [([.5, .25, .25], .5), ([.25, .25, .25, .125, .125], .75),
                                     ([.5, .25, .125, .125], .875), ([.5, .5], .5)])
def test_top_p_at_an_exact_cut_matches_transformers(p, top_p):
    """Rows whose cumulative sums hit 1 - top_p exactly: the cut is transformers' (a token whose
    ascending cumulative probability is <= 1 - p is dropped), which the margin-skipping test above
    never reaches."""
    from transformers.generation.logits_process import TopPLogitsWarper

    z = torch.log(torch.tensor([p]))
    want = TopPLogitsWarper(top_p)(None, z.clone())
    got = sampling.filter_logits(z, Filters(0, top_p))
    assert torch.equal(torch.isinf(got), torch.isinf(want)), (got, want)


def test_filters_off_change_nothing():
    logits = torch.randn(3, 4, 50)
    assert torch.equal(sampling.probs(logits, 0.7, Filters()), torch.softmax(logits / 0.7, dim=-1))
    assert torch.equal(sampling.filter_logits(logits, Filters(50, 1.0, 0.0)), logits)  # top-k = V keeps all


# ----------------------------------------------------------------------------------------
# Pre-drawn noise (what the engine passes: `round_noise` drawn outside the round)

def test_exponential_draws_follow_exp1():
    """Kolmogorov-Smirnov against 1 - exp(-x) over 400,000 draws (the 1% level), all finite and positive."""
    n = 400_000
    e = sampling.exponential((n,), gen(7), "cpu")
    assert e.dtype == torch.float32 and bool(torch.isfinite(e).all()) and bool((e > 0).all())
    x = torch.sort(e.double()).values
    cdf = 1 - torch.exp(-x)
    above = torch.arange(1, n + 1, dtype=torch.float64) / n - cdf
    below = cdf - torch.arange(n, dtype=torch.float64) / n
    assert max(float(above.max()), float(below.max())) < 1.63 / n ** 0.5


def test_round_noise_shapes_and_draw_order():
    B, K, V = 3, 4, 7
    draft, u, bonus = sampling.round_noise(gen(30), B, sampling.noise_shape(K, V), "cpu")
    assert draft.shape == (B, K, V) and u.shape == (B, K) and bonus.shape == (B, V)
    assert bool((draft > 0).all()) and bool((bonus > 0).all()) and bool(((u >= 0) & (u < 1)).all())
    g = gen(30)  # documented order: the drafting's noise, then u, then the bonus noise
    assert torch.equal(draft, sampling.exponential((B, K, V), g, "cpu"))
    assert torch.equal(u, torch.rand(B, K, generator=g))
    assert torch.equal(bonus, sampling.exponential((B, V), g, "cpu"))
    again = sampling.round_noise(gen(30), B, sampling.noise_shape(K, V), "cpu")
    assert all(torch.equal(a, b) for a, b in zip((draft, u, bonus), again))
    # K = 0 (the baseline) still works.
    c0, u0, b0 = sampling.round_noise(gen(1), B, sampling.noise_shape(0, V), "cpu")
    assert c0.shape == (B, 0, V) and u0.shape == (B, 0) and b0.shape == (B, V)


@pytest.mark.parametrize("with_head", [True, False], ids=["markov", "no-markov"])
def test_markov_chain_with_predrawn_noise(with_head):
    B, K, V, T = 32, 5, 9, 1.0
    base, hidden, anchor = _inputs(B, K, V, scale=0.5)
    noise = torch.empty(B, K, V).exponential_(1, generator=gen(31))
    head = RecordingHead(V, "zero") if with_head else None
    drafts, q = sampling.markov_chain(base, hidden, anchor, head, T, noise)
    # Each draft is the exponential race over its own q with its own slot's noise.
    assert torch.equal(drafts, torch.argmax(q / noise, dim=-1))
    torch.testing.assert_close(q, torch.softmax(base / T, -1))
    if head is not None:
        assert torch.equal(head.prevs[0], anchor)
        for k in range(1, K):
            assert torch.equal(head.prevs[k], drafts[:, k - 1])
    again, _ = sampling.markov_chain(base, hidden, anchor, RecordingHead(V, "zero") if with_head else None, T,
                                    noise.clone())
    assert torch.equal(drafts, again)


def test_accept_sampled_acceptance_rule_with_given_u():
    """Accept x_k iff u_k < p(x_k) / q(x_k), over the prefix: exact decisions for chosen u."""
    V, K = 4, 3
    p_row = torch.tensor([0.2, 0.4, 0.3, 0.1])   # every p_j
    q_row = torch.tensor([0.1, 0.8, 0.05, 0.05])  # every q_k
    B = 6
    target_logits = torch.log(p_row).expand(B, K + 1, V).contiguous()
    q = q_row.expand(B, K, V).contiguous()
    # Draft token 1 everywhere: p/q = 0.5.  Token 0: p/q = 2 (always accepted).
    drafts = torch.tensor([[1, 1, 1], [1, 1, 1], [0, 1, 1], [0, 0, 1], [0, 0, 0], [1, 0, 0]])
    u = torch.tensor([
        [0.49, 0.49, 0.49],  # all accepted
        [0.49, 0.51, 0.0],   # second rejected -> n = 1
        [0.99, 0.51, 0.0],   # first always accepted, second rejected -> n = 1
        [0.99, 0.99, 0.3],   # all accepted
        [0.999, 0.999, 0.999],
        [0.5001, 0.0, 0.0],  # first rejected -> n = 0 (later acceptances don't count)
    ])
    noise = torch.ones(B, V)  # the race then picks the argmax of the sampling distribution
    n, nxt = sampling.accept_sampled(drafts, q, target_logits, torch.full((B,), K), 1.0, u, noise)
    assert n.tolist() == [3, 1, 1, 3, 3, 0]
    # Bonus rows: argmax p = token 1. Rejected rows: residual max(p - q, 0) = [.1, 0, .25, .05] -> token 2.
    assert nxt.tolist() == [1, 2, 2, 1, 1, 2]


def test_accept_sampled_predrawn_noise_matches_race_over_residual():
    B, K, V = 256, 2, 6
    g = gen(32)
    target_logits = torch.randn(B, K + 1, V, generator=g)
    q = torch.softmax(torch.randn(B, K, V, generator=g) * 2, -1)
    drafts = draw_from(q, g)
    u = torch.rand(B, K, generator=g)
    noise = torch.empty(B, V).exponential_(1, generator=g)
    vl = torch.randint(0, K + 1, (B,), generator=g)
    n, nxt = sampling.accept_sampled(drafts, q, target_logits, vl, 1.0, u, noise)
    p = torch.softmax(target_logits, -1)
    for i in range(B):
        m = 0
        while m < int(vl[i]) and u[i, m] * q[i, m, drafts[i, m]] < p[i, m, drafts[i, m]]:
            m += 1
        assert int(n[i]) == m
        dist = p[i, m]
        if m < int(vl[i]):
            dist = torch.clamp(p[i, m] - q[i, m], min=0)
            dist = dist / dist.sum()
            assert int(nxt[i]) != int(drafts[i, m])  # a rejected draft is never the correction
        assert int(nxt[i]) == int(torch.argmax(dist / noise[i]))


def test_a_round_whose_target_logits_are_not_finite_is_one_line_error():
    """The round checks on the device the logits its tokens came from, and the engine turns a NaN or
    Inf there into a UserError naming the request and the round."""
    import speculate
    from support.checkpoint import random_target

    target = random_target("qwen3-tiny", dtype=torch.float32)
    engine = speculate.Engine(target, None, batch_size=2, max_seq=16)
    packed, _, _ = engine.round(torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long),
                                torch.ones(2, dtype=torch.bool), None)
    assert speculate.unpack(packed, engine.widths)[0].finite
    with torch.no_grad():
        target.norm.weight[0] = float("nan")
    packed, _, _ = engine.round(torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long),
                                torch.ones(2, dtype=torch.bool), None)
    assert not any(r.finite for r in speculate.unpack(packed, engine.widths))
    with pytest.raises(speculate.UserError, match="request 0, the prefill: the logits are not finite"):
        engine.generate([speculate.Request(0, [1, 2])], 4)
    # a decode whose weights go bad after its first round: the round's check, not the prefill's, says so
    with torch.no_grad():
        target.norm.weight[0] = 1.0

    def spoil(request, entry):
        with torch.no_grad():
            target.norm.weight[0] = float("nan")

    with pytest.raises(speculate.UserError, match="^request 0, round 1: the logits are not finite"):
        engine.generate([speculate.Request(0, [1, 2])], 4, on_round=spoil)


def test_a_decode_after_a_non_finite_one_starts_from_clean_caches():
    """A decode that ended on non-finite logits leaves NaN in the caches past where the next decode's rows
    reach. Eager attention multiplies a masked slot's value by a weight of 0, and 0 x NaN is NaN, so
    the next decode on the same engine must not inherit them: it equals a fresh engine's."""
    import speculate
    from support.checkpoint import random_target

    target = random_target("qwen3-tiny", dtype=torch.float32)
    fresh = speculate.Engine(target, None, batch_size=1, max_seq=16)
    expected = fresh.generate([speculate.Request(0, [1, 2])], 4)[0].output_ids
    engine = speculate.Engine(target, None, batch_size=1, max_seq=16)
    with torch.no_grad():
        target.layers[1].input_layernorm.weight[0] = float("nan")  # NaN keys and values from layer 1 on
    with pytest.raises(speculate.UserError, match="request 0, the prefill: the logits are not finite"):
        engine.generate([speculate.Request(0, [1, 2, 3, 4, 5, 6])], 4)
    with torch.no_grad():
        target.layers[1].input_layernorm.weight[0] = 1.0
    assert engine.generate([speculate.Request(0, [1, 2])], 4)[0].output_ids == expected


@pytest.mark.parametrize("drafts", ["none", "chain", "tree"])
def test_one_nan_logit_in_a_sampled_round_is_caught(drafts):
    """Sampled, one NaN in the vocabulary makes the row's softmax all NaN and the race still returns a
    token, whose own logit may be finite: the record checks every logit of the rows it read."""
    import speculate

    m = speculate.load()  # the demo pair
    target = m.target
    drafter = None
    if drafts != "none":
        drafter = m.drafter
    tree_budget = 0
    if drafts == "tree":
        tree_budget = 4
    with torch.no_grad():  # the demo ties the head to the embedding: untie it, then spoil one token
        target.lm_head.weight = torch.nn.Parameter(target.lm_head.weight.clone())
    engine = speculate.Engine(target, drafter, batch_size=2, max_seq=32, temperature=1.0,
                              tree_budget=tree_budget)
    B = 2
    anchor = torch.full((B,), 5, dtype=torch.long)
    anchor_pos = torch.zeros(B, dtype=torch.long)
    active = torch.ones(B, dtype=torch.bool)
    noise = sampling.round_noise(gen(0), B, engine.noise_shape, torch.device("cpu"))
    packed, _, _ = engine.round(anchor, anchor_pos, active, noise)
    assert all(r.finite for r in speculate.unpack(packed, engine.widths))
    with torch.no_grad():
        target.lm_head.weight[7] = float("nan")
    packed, _, _ = engine.round(anchor, anchor_pos, active, noise)
    rows = speculate.unpack(packed, engine.widths)
    assert not any(r.finite for r in rows)
    assert all(r.bonus != 7 for r in rows)  # the race did not pick the NaN token: only the row test sees it


@pytest.mark.parametrize("spoiled", ["confidence", "chain-q", "tree-q"])
def test_a_non_finite_drafter_is_caught_by_the_rounds_check(spoiled):
    """A drafter whose confidences or q go non-finite (a float16 overflow): the round's check said nothing,
    so a schedule read NaN confidences and verified no draft in silence, a sampled round drew its residual
    from a NaN q, and the trace file failed on the NaN."""
    import speculate

    m = speculate.load(cpu_kernels=False)  # the demo pair, its weights edited below read as they are
    temperature = 1.0
    tree_budget = 0
    scheduler = "none"
    threshold = 0.0  # read only under the threshold schedule: refused under another
    if spoiled == "confidence":
        temperature = 0.0
        scheduler = "threshold"
        threshold = 0.5
    if spoiled == "tree-q":
        tree_budget = 4
    engine = speculate.Engine(m.target, m.drafter, batch_size=2, max_seq=32, temperature=temperature,
                              tree_budget=tree_budget, scheduler=scheduler, threshold=threshold)
    B = 2
    anchor = torch.full((B,), 5, dtype=torch.long)
    anchor_pos = torch.zeros(B, dtype=torch.long)
    active = torch.ones(B, dtype=torch.bool)
    noise = None
    if temperature > 0:
        noise = sampling.round_noise(gen(0), B, engine.noise_shape, torch.device("cpu"))
    packed, _, _ = engine.round(anchor, anchor_pos, active, noise)
    assert all(r.finite for r in speculate.unpack(packed, engine.widths))
    with torch.no_grad():
        if spoiled == "confidence":
            m.drafter.confidence_head.proj.bias.fill_(float("nan"))
        else:  # the Markov head's W2: the drafter's logits, not the target's
            m.drafter.markov_head.markov_w2.weight[3] = float("inf")
    packed, _, _ = engine.round(anchor, anchor_pos, active, noise)
    assert not any(r.finite for r in speculate.unpack(packed, engine.widths))
