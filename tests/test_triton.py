"""The Triton kernels of kernels.py against their plain-torch references, on CPU tensors.

Triton runs here in its interpreter (TRITON_INTERPRET=1, set below before anything imports
triton; kernels.py imports triton lazily for that reason). On a CUDA machine the same tests
run the interpreter too; the compiled kernels are checked by `device_check()` at the bottom
(`python tests/test_triton.py --device`), which needs a GPU.

What is compared:
- Markov chain (vanilla head): greedy tokens exactly; sampled tokens exactly given the same
  Exp(1) noise, and q to float rounding; exact ties (integer-valued
  weights) resolve to the first index like torch.argmax, within and across V-tiles; bf16
  rounding of z as torch rounds it; other heads fall back to the reference.
- Greedy verification: hand-built and random cases, verify_len < K, K = 0, ties.
- Sampled verification: given u and noise; rejections,
  corrections, bonus, verify_len < K, K = 0 (q None).
- Attention over the KV cache: model.attend_cached's result to rounding, blocks past what a row may
  see left unread; and whole decodes with every kernel of the Triton set.
The tile sizes are shrunk so that V in 100..300 spans several tiles with a ragged last one.
The interpreter is slow; the whole file takes tens of seconds on two cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (_HERE, os.path.dirname(_HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

# Triton picks interpreter or GPU for its own language functions when it is first imported
# (kernels.py imports it at import only when CUDA is present, else on first use) and reads the
# variable again while launching. So: import both now with TRITON_INTERPRET=1 (unless the
# environment says otherwise), put the variable back, and set it again around each test here
# (`interpreter` below): other test modules never see it.
_TRITON_WAS_IMPORTED = "triton" in sys.modules
_SAVED_ENV = os.environ.get("TRITON_INTERPRET")
if "--device" not in sys.argv:  # the GPU check below wants real Triton
    os.environ.setdefault("TRITON_INTERPRET", "1")
try:
    pytest.importorskip("triton")
    import kernels
    kernels._import_triton()
    _INTERPRETED = bool(kernels._TRITON_IMPORT_INTERPRET)
finally:
    if _SAVED_ENV is None:
        os.environ.pop("TRITON_INTERPRET", None)

import sampling  # noqa: E402
from drafter import GatedMarkov, RNNMarkov, VanillaMarkov  # noqa: E402

torch.set_num_threads(1)

if __name__ != "__main__" and not _INTERPRETED:
    pytest.skip("triton was imported in GPU mode before this module could set TRITON_INTERPRET=1 "
                f"(already imported: {_TRITON_WAS_IMPORTED}); run this file on its own, or with "
                "TRITON_INTERPRET=1 in the environment", allow_module_level=True)

# The references, held before any test replaces the module's names.
REF_CHAIN, REF_SAMPLED = sampling.markov_chain, sampling.accept_sampled


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    """TRITON_INTERPRET=1 during each test (triton reads it while launching); and tiles of 32
    vocabulary entries and 16 rank entries: several tiles, a ragged last one."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels._triton_ok(torch.zeros(1))
    monkeypatch.setattr(kernels, "TRITON_BLOCK_V", 32)
    monkeypatch.setattr(kernels, "TRITON_BLOCK_R", 16)


@pytest.fixture
def no_fallback(monkeypatch):
    """Make the Triton functions' fallbacks fail loudly: a test using this really ran Triton."""
    def boom(*args, **kwargs):
        raise AssertionError("fell back to the plain-torch reference")
    for name in ("markov_chain", "accept_sampled"):
        monkeypatch.setattr(sampling, name, boom)


# conftest's `gen`, written again here: `python tests/test_triton.py --device` runs this file as a
# script, and importing conftest would set the test session's environment (offline hub, Inductor cache).
def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def vanilla(V: int, r: int, seed: int = 0, scale: float = 1.0, integer: bool = False, dtype=torch.float32):
    torch.manual_seed(seed)
    m = VanillaMarkov(16, V, r)
    if integer:  # exactly representable products and sums: both sides compute the same z bit for bit
        with torch.no_grad():
            m.markov_w1.weight.copy_(torch.randint(-2, 3, m.markov_w1.weight.shape).float())
            m.markov_w2.weight.copy_(torch.randint(-2, 3, m.markov_w2.weight.shape).float())
    else:
        with torch.no_grad():
            m.markov_w1.weight.mul_(scale)
            m.markov_w2.weight.mul_(scale)
    return m.to(dtype).requires_grad_(False)


def chain_inputs(B: int, K: int, V: int, seed: int = 0, dtype=torch.float32, integer: bool = False):
    g = gen(seed)
    if integer:
        U = torch.randint(-3, 4, (B, K, V), generator=g).to(dtype)
    else:
        U = (2 * torch.randn((B, K, V), generator=g)).to(dtype)
    return U, torch.randn((B, K, 16), generator=g).to(dtype), torch.randint(0, V, (B,), generator=g)


# ----------------------------------------------------------------------------------------
# Markov chain

CHAIN_CASES = [(1, 8, 100), (3, 8, 257), (3, 64, 100), (1, 64, 300)]  # (B, r, V)


@pytest.mark.parametrize("B,r,V", CHAIN_CASES)
def test_markov_greedy_equals_reference(B, r, V, no_fallback):
    K = 3
    m = vanilla(V, r, seed=B + r + V)
    U, h, a = chain_inputs(B, K, V, seed=V)
    ref, q_ref = REF_CHAIN(U, h, a, m, 0.0, None)
    out, q = kernels.markov_chain(U, h, a, m, 0.0, None)
    assert q is None and q_ref is None
    assert out.dtype == torch.long and out.shape == (B, K)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("B,r,V", CHAIN_CASES[:3])
def test_markov_sampled_equals_reference_given_noise(B, r, V, no_fallback):
    K, T = 3, 0.8
    m = vanilla(V, r, seed=1)
    U, h, a = chain_inputs(B, K, V, seed=2)
    noise = torch.empty((B, K, V)).exponential_(1, generator=gen(3))
    ref, q_ref = REF_CHAIN(U, h, a, m, T, noise)
    out, q = kernels.markov_chain(U, h, a, m, T, noise)
    assert torch.equal(out, ref)
    assert q.shape == (B, K, V) and q.dtype == torch.float32
    torch.testing.assert_close(q, q_ref, rtol=1e-5, atol=1e-7)


def test_markov_greedy_ties_pick_the_first_index(no_fallback):
    """Integer-valued U, W1, W2: z has many exact ties, computed exactly by both sides."""
    B, K, V, r = 3, 4, 130, 8
    m = vanilla(V, r, integer=True, seed=6)
    U, h, a = chain_inputs(B, K, V, seed=6, integer=True)
    ref, _ = REF_CHAIN(U, h, a, m, 0.0, None)
    out, _ = kernels.markov_chain(U, h, a, m, 0.0, None)
    assert torch.equal(out, ref)


def test_markov_greedy_tie_across_tiles_picks_the_earlier_tile(no_fallback):
    B, K, V, r = 1, 2, 100, 8
    m = vanilla(V, r)
    with torch.no_grad():
        m.markov_w2.weight.zero_()  # b_k = 0: the chain is the argmax of U alone
    U = torch.zeros((B, K, V))
    U[0, 0, [70, 40, 99]] = 5.0   # tiles 2, 1 and 3 of 32: the first index is 40
    U[0, 1, [99, 96]] = 1.0       # both in the ragged last tile: 96
    h = torch.zeros((B, K, 16))
    out, _ = kernels.markov_chain(U, h, torch.tensor([0]), m, 0.0, None)
    assert out.tolist() == [[40, 96]]
    assert out.tolist() == REF_CHAIN(U, h, torch.tensor([0]), m, 0.0, None)[0].tolist()


def test_markov_chain_feeds_previous_draft(no_fallback):
    """W1·W2 = a permutation: the bias at slot k is +10 on (x_{k-1} + 1) mod V."""
    B, K, V = 2, 4, 100
    m = vanilla(V, V, seed=0)
    with torch.no_grad():
        m.markov_w1.weight.copy_(torch.eye(V))
        m.markov_w2.weight.copy_(10 * torch.eye(V).roll(1, 0))
    U, h, _ = chain_inputs(B, K, V, seed=1)
    U = U.clamp(-1, 1)
    a = torch.tensor([5, 99])
    out, _ = kernels.markov_chain(U, h, a, m, 0.0, None)
    assert out.tolist() == [[6, 7, 8, 9], [0, 1, 2, 3]]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_markov_bf16_rounds_z_like_torch(temperature, no_fallback):
    """bf16 weights and logits: the bias is rounded to bf16 and U + bias again, like torch."""
    B, K, V, r = 3, 3, 100, 8
    m = vanilla(V, r, integer=True, seed=8, dtype=torch.bfloat16)
    U, h, a = chain_inputs(B, K, V, seed=9, dtype=torch.bfloat16)
    U = U * 37.3  # values whose sum with the integer bias needs rounding in bf16
    noise = torch.empty((B, K, V)).exponential_(1, generator=gen(10)) if temperature else None
    ref, q_ref = REF_CHAIN(U, h, a, m, temperature, noise)
    out, q = kernels.markov_chain(U, h, a, m, temperature, noise)
    assert torch.equal(out, ref)
    if temperature:
        torch.testing.assert_close(q, q_ref, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("head", ["gated", "rnn", "none"])
def test_markov_other_heads_fall_back_to_reference(head):
    B, K, V, r = 2, 3, 100, 8
    torch.manual_seed(0)
    m = {"gated": GatedMarkov, "rnn": RNNMarkov}[head](16, V, r).requires_grad_(False) if head != "none" else None
    U, h, a = chain_inputs(B, K, V)
    noise = torch.empty((B, K, V)).exponential_(1, generator=gen(1))
    for T in (0.0, 0.9):
        ref, q_ref = REF_CHAIN(U, h, a, m, T, noise)
        out, q = kernels.markov_chain(U, h, a, m, T, noise)
        assert torch.equal(out, ref)
        assert (q is None) == (q_ref is None) and (q is None or torch.equal(q, q_ref))


def test_a_fallback_runs_the_version_patched_in_sampling_and_model(monkeypatch):
    """docs/hacking.md: a step replaced with monkeypatch.setattr(sampling, ...) is what runs, under
    --kernels triton too where a kernel falls back (here: an rnn head, float64 logits, head dim 8)."""
    import model

    calls = []

    def counted(name, reference):
        def mine(*args, **kwargs):
            calls.append(name)
            return reference(*args, **kwargs)
        return mine
    monkeypatch.setattr(sampling, "markov_chain", counted("chain", REF_CHAIN))
    monkeypatch.setattr(sampling, "accept_sampled", counted("accept", REF_SAMPLED))
    monkeypatch.setattr(model, "attend_cached", counted("attention", model.attend_cached))
    torch.manual_seed(0)
    U, h, a = chain_inputs(2, 3, 100)
    kernels.markov_chain(U, h, a, RNNMarkov(16, 100, 8).requires_grad_(False), 0.0, None)
    drafts, q, logits, verify_len, u, noise = sampled_case(2, 3, 100, seed=0)
    kernels.accept_sampled(drafts, q, logits.double(), verify_len, 1.0, u, noise)
    q, k, v, allowed = attention_case(1, 2, 2, 2, 8, 10)
    kernels.cached_attention(q, k, v, model.cache_bias(allowed, 1, torch.float32))
    assert calls == ["chain", "accept", "attention"]


def test_check_backend():
    """--kernels torch needs nothing; triton builds its kernels where it can run (here, its interpreter)
    and is refused where it cannot."""
    kernels.check_backend("torch", "cpu")
    kernels.check_backend("triton", "cpu")
    assert kernels._TRITON_KERNELS


# ----------------------------------------------------------------------------------------
# Sampled verification

def sampled_case(B, K, V, seed, T=1.0):
    """Draft distributions near the target's (so some drafts pass and some are rejected)."""
    g = gen(seed)
    logits = torch.randn((B, K + 1, V), generator=g)
    q = torch.softmax((logits[:, :K] + 1.5 * torch.randn((B, K, V), generator=g)) / T, -1)
    drafts = torch.multinomial(q.reshape(B * K, V), 1, generator=g).reshape(B, K) if K else \
        torch.zeros((B, 0), dtype=torch.long)
    verify_len = torch.randint(0, K + 1, (B,), generator=g)
    u = torch.rand((B, K), generator=g)
    noise = torch.empty((B, V)).exponential_(1, generator=g)
    return drafts, (q if K else None), logits, verify_len, u, noise


@pytest.mark.parametrize("B,K,V,T", [(3, 4, 100, 1.0), (1, 7, 257, 0.7), (3, 0, 100, 1.0), (3, 2, 300, 1.5)])
def test_accept_sampled_equals_reference_given_u_and_noise(B, K, V, T, no_fallback):
    seen_rejection = False
    for trial in range(3):
        drafts, q, logits, verify_len, u, noise = sampled_case(B, K, V, seed=trial + V + K, T=T)
        n, nxt = kernels.accept_sampled(drafts, q, logits, verify_len, T, u, noise)
        n_ref, nxt_ref = REF_SAMPLED(drafts, q, logits, verify_len, T, u, noise)
        assert torch.equal(n, n_ref) and torch.equal(nxt, nxt_ref), trial
        seen_rejection |= bool((n_ref < verify_len).any())
    assert seen_rejection or K == 0  # the correction path was exercised


def test_accept_sampled_hand_built(no_fallback):
    """p = q: every verified draft passes and the bonus races p_ℓ; a draft with p(x) = 0 is
    rejected and the correction comes from max(p − q, 0)."""
    V, K = 40, 3
    logits = torch.randn((2, K + 1, V), generator=gen(13))
    q = torch.softmax(logits[:, :K], -1)
    drafts = torch.tensor([[1, 2, 3], [4, 5, 6]])
    logits[1, 1, 5] = float("-inf")  # p_1(x_2) = 0: row 1 stops after one draft
    verify_len = torch.tensor([3, 3])
    u = torch.full((2, K), 0.999)
    noise = torch.empty((2, V)).exponential_(1, generator=gen(14))
    n, nxt = kernels.accept_sampled(drafts, q, logits, verify_len, 1.0, u, noise)
    n_ref, nxt_ref = REF_SAMPLED(drafts, q, logits, verify_len, 1.0, u, noise)
    assert n.tolist() == n_ref.tolist() == [3, 1]
    assert torch.equal(nxt, nxt_ref)


def test_accept_sampled_u_zero_rejects_a_token_the_target_cannot_produce(no_fallback):
    """As the reference: u·q(x) < p(x) is strict, so u = 0 with p(x) = 0 rejects."""
    V = 40
    logits = torch.randn((1, 2, V), generator=gen(15))
    logits[0, 0, 7] = float("-inf")
    q = torch.softmax(logits[:, :1], -1)
    u = torch.zeros(1, 1)
    noise = torch.ones(1, V)
    n, nxt = kernels.accept_sampled(torch.tensor([[7]]), q, logits, torch.tensor([1]), 1.0, u, noise)
    assert n.tolist() == [0] and nxt.item() != 7


# ----------------------------------------------------------------------------------------
# Attention over the KV cache (the verification's), against model.attend_cached

def attention_case(B, T, H, Hkv, hd, S, seed=0, dtype=torch.float32):
    """q, k, v and the boolean mask of a verify-like step: token t of row b may see keys < end[b, t]
    (a prefix ending at a random filled length, one more key per token), row 0's first token none."""
    g = gen(seed)
    q, k, v = (torch.randn(shape, generator=g).to(dtype) for shape in ((B, T, H, hd), (B, S, Hkv, hd), (B, S, Hkv, hd)))
    end = (torch.randint(T, S + 1, (B, 1), generator=g) - T + 1 + torch.arange(T)).clamp(max=S)
    end[0, 0] = 0
    return q, k, v, torch.arange(S) < end[..., None]


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("B,T,H,Hkv,hd,S", [(2, 3, 4, 2, 16, 40), (1, 8, 8, 2, 32, 70), (3, 1, 4, 4, 16, 33),
                                            (1, 8, 8, 1, 64, 16)])
def test_cached_attention_equals_the_models(B, T, H, Hkv, hd, S, split, monkeypatch):
    """kernels.cached_attention = model.attend_cached (the CPU kernel's / SDPA's result) to float32
    rounding, with the mask one row per token or folded for GQA (rows i*T + t), across several key
    blocks with a ragged last one and several blocks of query rows, the keys in one pass or split
    among programs (a split that sees nothing included); a row that may see no key gives zeros; q may
    be strided."""
    import model

    monkeypatch.setattr(kernels, "TRITON_BLOCK_N", 16)
    monkeypatch.setattr(kernels, "TRITON_BLOCK_M", 16)
    monkeypatch.setattr(kernels, "TRITON_SPLIT_MIN_BLOCKS", 1 if split else 1000)
    programs = B * Hkv * -(-T * H // Hkv // 16)
    assert (kernels.attention_splits(programs, S)[0] > 1) == (split and S > 16)
    q, k, v, allowed = attention_case(B, T, H, Hkv, hd, S)
    want = model.attend_cached(q, k, v, model.cache_bias(allowed, 1, torch.float32))
    assert not want[0, 0].any()
    for group in (1, H // Hkv):
        got = kernels.cached_attention(q, k, v, model.cache_bias(allowed, group, torch.float32))
        assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    strided = q.transpose(0, 1).contiguous().transpose(0, 1)  # other batch/token strides
    assert torch.allclose(kernels.cached_attention(strided, k, v, model.cache_bias(allowed, 1, torch.float32)),
                          want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("split", [False, True])
def test_cached_attention_reads_no_key_block_past_what_its_rows_may_see(split, monkeypatch):
    """Blocks of keys that no query row may see are skipped, K and V unread: NaN there changes
    nothing (a static cache costs what is filled), with the keys in one pass or split. The same NaN
    inside a visible block would."""
    import model

    monkeypatch.setattr(kernels, "TRITON_BLOCK_N", 16)
    monkeypatch.setattr(kernels, "TRITON_SPLIT_MIN_BLOCKS", 1 if split else 1000)
    q, k, v, _ = attention_case(2, 4, 4, 2, 16, 96, seed=3)
    end = torch.tensor([[20, 21, 22, 23], [40, 41, 42, 43]])
    allowed = torch.arange(96) < end[..., None]
    bias = model.cache_bias(allowed, 1, torch.float32)
    want = kernels.cached_attention(q, k, v, bias)
    k2, v2 = k.clone(), v.clone()
    k2[0, 32:], v2[0, 32:], k2[1, 48:], v2[1, 48:] = float("nan"), float("nan"), float("nan"), float("nan")
    assert torch.equal(kernels.cached_attention(q, k2, v2, bias), want)
    k2[0, 30] = float("nan")  # masked, but in a block that is read: the kernel did read it
    assert torch.isnan(kernels.cached_attention(q, k2, v2, bias)[0]).any()


# ----------------------------------------------------------------------------------------
# The engine with --kernels triton: the whole decode, Triton for the chain and the acceptance

@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    from drafters import make_drafter, make_target

    d = tmp_path_factory.mktemp("triton_engine")
    target = make_target(d / "target", vocab_size=48, attn_scale=0.01)
    drafter = make_drafter(d / "drafter", target, block_size=4, markov="vanilla", oracle=True, oracle_scale=4.0,
                           norm_scale=0.05)
    return target, drafter


@pytest.mark.parametrize("temperature,scheduler", [(0.0, "none"), (1.0, "none"), (0.0, "threshold")])
def test_engine_with_triton_kernels_decodes_like_the_references(tiny_pair, monkeypatch, temperature, scheduler):
    import speculate
    from support.checkpoint import load_drafter, load_target

    target = load_target(tiny_pair[0])
    drafter = load_drafter(tiny_pair[1], target)
    prompts = [[1, 2, 3, 4, 5], [7, 30, 2], [9]]

    def decode(triton):
        engine = speculate.Engine(target, drafter, batch_size=2, max_seq=64, temperature=temperature,
                                  threshold=0.6 if scheduler == "threshold" else 0.0, scheduler=scheduler,
                                  backend="triton" if triton else "torch")
        reqs = [speculate.Request(i, p, [], []) for i, p in enumerate(prompts)]
        with torch.inference_mode():
            engine.generate(reqs, 16)
        return [(r.output_ids, [(rd["draft"], rd["verified"], rd["accepted"]) for rd in r.rounds]) for r in reqs]

    want = decode(False)
    # From here on, only Triton may run (greedy acceptance is torch's).
    for name in ("markov_chain", "accept_sampled"):
        monkeypatch.setattr(sampling, name, lambda *a, **k: (_ for _ in ()).throw(AssertionError("reference ran")))
    triton_attention = kernels.cached_attention
    verified = []  # the verification's attention: the Triton kernel's, on every layer of every round

    def attention(q, k, v, bias):
        assert kernels._triton_ok(q) and q.shape[-1] == 16  # no fallback to the model's
        verified.append(q.shape[1])
        return triton_attention(q, k, v, bias)
    monkeypatch.setattr(kernels, "cached_attention", attention)
    got = decode(True)
    assert got == want
    assert any(a >= 2 for _, rounds in want for _, _, a in rounds)
    assert verified and len(verified) % target.args.num_hidden_layers == 0


# ----------------------------------------------------------------------------------------
# On a GPU (not part of the pytest run): compiled Triton against the references, and timings.

# (B, T, H, Hkv, hd, S, filled lengths): Qwen3-8B's attention in a verify of 8 tokens, a static cache
# for 2048 new tokens after a 256-token prompt, filled to a short and a long way
ATTENTION_SHAPES = [(1, 8, 32, 8, 128, 2312, (300, 2000)), (32, 8, 32, 8, 128, 2312, (300, 1200, 2000))]


def attention_check(dev="cuda", shapes=ATTENTION_SHAPES, dtype=torch.bfloat16, compile=True, reps=20):
    """The cache attention on `dev`: kernels.cached_attention against model.attend_cached (on
    CUDA: SDPA over the whole static cache, GQA folded, as a compiled graph runs it) at each filled
    length — agreement, and both timed — then traced by torch.compile(fullgraph). Returns failures."""
    import time

    import model

    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    failures = 0
    for (B, T, H, Hkv, hd, S, filled) in shapes:
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn((B, T, H, hd), generator=g, device=dev).to(dtype)
        k = torch.randn((B, S, Hkv, hd), generator=g, device=dev).to(dtype)
        v = torch.randn((B, S, Hkv, hd), generator=g, device=dev).to(dtype)
        for n in filled:
            positions = (n - T + torch.arange(T, device=dev)).expand(B, T)
            allowed = positions[:, :, None] >= torch.arange(S, device=dev)
            group = H // Hkv if model.fold_gqa(dev) else 1
            ref_bias, bias = model.cache_bias(allowed, group, dtype), model.cache_bias(allowed, 1, dtype)
            want = model.attend_cached(q, k, v, ref_bias)
            got = kernels.cached_attention(q, k, v, bias)
            err = (got.float() - want.float()).abs().max().item()
            ok = err <= (2e-2 if dtype != torch.float32 else 1e-4)
            failures += not ok
            times = {}
            for name, fn, b in (("sdpa", model.attend_cached, ref_bias), ("triton", kernels.cached_attention, bias)):
                fn(q, k, v, b)
                sync()
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn(q, k, v, b)
                sync()
                times[name] = (time.perf_counter() - t0) / reps * 1e6
            print(f"attention B={B} T={T} H={H}/{Hkv} hd={hd} S={S} filled={n} {dtype}: sdpa {times['sdpa']:.0f} us, "
                  f"triton {times['triton']:.0f} us ({times['sdpa'] / times['triton']:.2f}x)  max|diff| {err:.2e} ok={ok}")
    if compile:
        try:
            t0 = time.perf_counter()
            got = torch.compile(kernels.cached_attention, fullgraph=True, dynamic=False)(q, k, v, bias)
            ok = torch.equal(got, kernels.cached_attention(q, k, v, bias))
            print(f"torch.compile(fullgraph) attention: ok={ok} ({time.perf_counter() - t0:.1f} s)")
        except Exception as e:  # noqa: BLE001 - report, do not hide
            ok = False
            print(f"torch.compile(fullgraph) attention FAILED: {type(e).__name__}: {str(e)[:2000]}")
        failures += not ok
    return failures


def test_attention_check_runs_on_cpu(capsys):
    """The device check's attention part, on CPU in the interpreter at tiny shapes (its plumbing:
    what a GPU run does first)."""
    assert attention_check("cpu", [(2, 4, 4, 2, 16, 70, (10, 60))], torch.float32, compile=False, reps=1) == 0
    out = capsys.readouterr().out
    assert out.count("attention B=2") == 2 and "ok=True" in out


# ----------------------------------------------------------------------------------------
# Each kernel as a torch.compile graph launches it

class LaunchRecorder:
    """A jitted kernel that keeps the arguments of each launch, then launches."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.launches = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((args, kwargs))
            return self.kernel[grid](*args, **kwargs)
        return launch


def inductor_launch(name: str, kernel, args: tuple, kwargs: dict) -> dict:
    """A recorded launch of `kernel` as tests/triton_lowering.py reads it: keyword arguments are the
    constexprs (launch options such as num_warps left out), the others typed as Inductor types them."""
    signature = {}
    constexprs = {}
    for i, argument in enumerate(kernel.arg_names):
        if argument in kwargs:
            signature[argument] = "constexpr"
            constexprs[argument] = kwargs[argument]
        else:
            signature[argument] = inductor_type(args[i])
    return {"kernel": name, "signature": signature, "constexprs": constexprs}


def inductor_type(value) -> str:
    """How Inductor types a user kernel's runtime argument: a Python float is fp64 (a plain launch
    makes it fp32)."""
    if isinstance(value, torch.Tensor):
        names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
                 torch.int64: "i64", torch.int32: "i32", torch.bool: "i1"}
        return "*" + names[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        if -2 ** 31 <= value < 2 ** 31:
            return "i32"
        return "i64"
    assert isinstance(value, float), type(value)
    return "fp64"


def test_every_kernel_lowers_with_float_arguments_as_a_compiled_graph_passes_them(monkeypatch):
    """Inside a torch.compile graph, Inductor passes a kernel's Python floats (the temperature, the
    attention's scale) as fp64 where a plain launch passes fp32. Each kernel, on the arguments of real
    launches (greedy and sampled chains, sampled verification with and without drafts, attention in
    one pass and split), lowers so typed through Triton's GPU front end, and computes in fp32: no f64
    beyond the function's arguments and their one conversion. (An fp64 scale once broke the attention
    kernel's compile on the GPU.)"""
    import model

    pytest.importorskip("triton.backends.nvidia.compiler")
    kernels.check_backend("triton", "cpu")
    recorders = {}
    for name in kernels.TRITON_SOURCES:
        if name.endswith("_kernel"):
            recorders[name] = LaunchRecorder(kernels._TRITON_KERNELS[name])
            monkeypatch.setitem(kernels._TRITON_KERNELS, name, recorders[name])
    m = vanilla(100, 16)
    U, h, a = chain_inputs(2, 3, 100)
    kernels.markov_chain(U, h, a, m, 0.0, None)
    noise = torch.empty((2, 3, 100)).exponential_(1, generator=gen())
    kernels.markov_chain(U, h, a, m, 0.8, noise)
    for K in (3, 0):
        drafts, q, logits, verify_len, u, noise = sampled_case(2, K, 100, seed=K)
        kernels.accept_sampled(drafts, q, logits, verify_len, 0.7, u, noise)
    monkeypatch.setattr(kernels, "TRITON_BLOCK_N", 16)
    for split_min_blocks in (1000, 1):
        monkeypatch.setattr(kernels, "TRITON_SPLIT_MIN_BLOCKS", split_min_blocks)
        q, k, v, allowed = attention_case(1, 2, 4, 2, 16, 40)
        kernels.cached_attention(q, k, v, model.cache_bias(allowed, 2, torch.float32))
    launches = []
    for name, recorder in recorders.items():
        assert recorder.launches, name
        for args, kwargs in recorder.launches:
            launches.append(inductor_launch(name, recorder.kernel, args, kwargs))
    unique = {json.dumps(launch, sort_keys=True): launch for launch in launches}
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    lowering = os.path.join(_HERE, "triton_lowering.py")
    done = subprocess.run([sys.executable, lowering], input=json.dumps(list(unique.values())),
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout)
    assert len(results) == len(unique)
    assert {result["kernel"] for result in results} == set(recorders)
    for result in results:
        assert "error" not in result, result
        computed = [line for line in result["f64"] if not line.startswith("tt.func")]
        conversions = [line for line in computed if "arith.truncf" in line]
        assert computed == conversions, (result["kernel"], computed[:3])


DEVICE_SHAPES = [(1, 7, 151936, 256, torch.bfloat16), (4, 7, 151936, 256, torch.float32),
                 (3, 5, 1000, 64, torch.float32), (16, 7, 151936, 256, torch.bfloat16)]  # (B, K, V, r, dtype)


def device_check(dev="cuda", shapes=DEVICE_SHAPES, fast=None):  # pragma: no cover - needs CUDA and GPU triton
    """`python tests/test_triton.py --device`: real-shaped comparisons and timings on CUDA."""
    import time
    if dev == "cuda":
        assert torch.cuda.is_available() and kernels.HAVE_TRITON and not kernels._TRITON_IMPORT_INTERPRET
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    kernels.check_backend("triton", dev)
    fast = fast or (kernels.markov_chain, sampling.accept_greedy, kernels.accept_sampled)
    failures = 0
    for (B, K, V, r, dtype) in shapes:
        m = vanilla(V, r, seed=0, dtype=dtype).to(dev)
        g = torch.Generator(device=dev).manual_seed(0)
        U = (2 * torch.randn((B, K, V), generator=g, device=dev)).to(dtype)
        a = torch.randint(0, V, (B,), generator=g, device=dev)
        h = torch.zeros((B, K, 16), device=dev, dtype=dtype)
        for T in (0.0, 1.0):
            noise = torch.empty((B, K, V), device=dev).exponential_(1, generator=g) if T else None
            ref, q_ref = REF_CHAIN(U, h, a, m, T, noise)
            out, q = fast[0](U, h, a, m, T, noise)
            ok = torch.equal(out, ref) and (q is None or torch.allclose(q, q_ref, rtol=1e-4, atol=1e-6))
            if not ok:  # bf16 near-ties can flip a token; say how many slots differ
                print(f"  chain mismatch: {int((out != ref).sum())}/{out.numel()} tokens differ, first slot "
                      f"{int((out[:, 0] != ref[:, 0]).sum())}/{B}")
            failures += not ok
            fast_name = "triton"
            if B > kernels.TRITON_CHAIN_MAX_BATCH:  # the chain's fast path is the reference there
                fast_name = "triton (the reference above TRITON_CHAIN_MAX_BATCH)"
            for name, fn in (("ref", REF_CHAIN), (fast_name, fast[0])):
                fn(U, h, a, m, T, noise)
                sync()
                t0 = time.perf_counter()
                for _ in range(20):
                    fn(U, h, a, m, T, noise)
                sync()
                print(f"chain B={B} K={K} V={V} r={r} {dtype} T={T} {name}: "
                      f"{(time.perf_counter() - t0) / 20 * 1e6:.0f} us  ok={ok}")
        logits = torch.randn((B, K + 1, V), generator=g, device=dev).to(dtype)
        drafts = torch.argmax(logits[:, :K], -1)
        vl = torch.randint(0, K + 1, (B,), generator=g, device=dev)
        q = torch.softmax(logits[:, :K].float() + torch.randn((B, K, V), generator=g, device=dev), -1)
        u = torch.rand((B, K), generator=g, device=dev)
        bn = torch.empty((B, V), device=dev).exponential_(1, generator=g)
        ok2 = all(torch.equal(x, y) for x, y in zip(fast[2](drafts, q, logits, vl, 1.0, u, bn),
                                                    REF_SAMPLED(drafts, q, logits, vl, 1.0, u, bn)))
        failures += not ok2
        print(f"verify B={B} K={K} V={V} {dtype}: sampled ok={ok2}")
    failures += attention_check(dev)
    # The engine compiles the round (fullgraph, static shapes): the Triton path must trace.
    B, K, V, r, dtype = shapes[0]
    m = vanilla(V, r, seed=0, dtype=dtype).to(dev)
    U = torch.randn((B, K, V), device=dev).to(dtype)
    a = torch.randint(0, V, (B,), device=dev)
    h = torch.zeros((B, K, 16), device=dev, dtype=dtype)
    logits = torch.randn((B, K + 1, V), device=dev).to(dtype)
    vl = torch.full((B,), K, device=dev)

    def step(U, a, logits, vl):
        drafts, _ = fast[0](U, h, a, m, 0.0, None)
        return (drafts,) + tuple(fast[1](drafts, logits, vl))
    try:
        t0 = time.perf_counter()
        got = torch.compile(step, fullgraph=True, dynamic=False)(U, a, logits, vl)
        ok = all(torch.equal(x, y) for x, y in zip(got, step(U, a, logits, vl)))
        print(f"torch.compile(fullgraph) chain+verify: ok={ok} ({time.perf_counter() - t0:.1f} s)")
    except Exception as e:  # noqa: BLE001 - report, do not hide
        ok = False
        print(f"torch.compile(fullgraph) chain+verify FAILED: {type(e).__name__}: {str(e)[:2000]}")
    failures += not ok
    print("FAILURES", failures)
    return failures


if __name__ == "__main__":  # pragma: no cover
    if "--device" in sys.argv:
        sys.exit(1 if device_check() else 0)
