"""model.py against transformers' Qwen3 on tiny random checkpoints (float32, CPU).

Covers: logits for prefill / cached decode / chunks / rollback / ragged batches, ragged verification
(`Ragged`: the flattened tokens of requests with different counts against each request run alone), the
cache-free causal forward, captured layer features, the fast paths against their references, and the
parameter count of a Qwen3-8B-shaped config. Loading and its errors, reading a config and attaching a
drafter: tests/test_checkpoint.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import (
    arange_positions,
    hf_forward,
    import_model,
    max_err,
    random_tokens,
    target_with_caches,
)

m = import_model()
from support import (
    checkpoint,  # noqa: E402
    configs,  # noqa: E402
    )

ATOL = 1e-4


# ----------------------------------------------------------------------------------------
# Logits against Hugging Face

@pytest.mark.parametrize("rope_spelling", ["nested", "top"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_prefill_and_cached_decode_match_hf(target_factory, tied, rope_spelling):
    target = target_factory(tie_word_embeddings=tied, rope_spelling=rope_spelling)
    model = target_with_caches(target.path)
    if tied:
        assert model.lm_head.weight is model.embed_tokens.weight
    else:
        assert model.lm_head.weight is not model.embed_tokens.weight

    tokens = random_tokens(1, 16, seed=1)
    ref, _ = hf_forward(target.hf_model, tokens)
    assert ref.std() > 0.3  # logits are not flat, so the comparison means something

    P = 8
    with torch.no_grad():
        logits, feats = model(tokens[:, :P], arange_positions(1, 0, P))
    assert feats is None
    assert logits.shape == (1, P, 64)
    assert max_err(logits, ref[:, :P]) <= ATOL

    for p in range(P, 11):  # one token at a time
        with torch.no_grad():
            logits, _ = model(tokens[:, p:p + 1], torch.tensor([[p]]))
        assert max_err(logits, ref[:, p:p + 1]) <= ATOL, f"decode at position {p}"

    with torch.no_grad():  # then a multi-token chunk
        logits, _ = model(tokens[:, 11:16], arange_positions(1, 11, 5))
    assert max_err(logits, ref[:, 11:16]) <= ATOL


def test_attention_bias_and_other_theta_match_hf(target_factory):
    target = target_factory(attention_bias=True, rope_theta=1e6, seed=3)
    model = target_with_caches(target.path)
    assert model.args.attention_bias and model.args.rope_theta == 1e6
    tokens = random_tokens(1, 12, seed=4)
    ref, _ = hf_forward(target.hf_model, tokens)
    with torch.no_grad():
        logits, _ = model(tokens[:, :7], arange_positions(1, 0, 7))
        assert max_err(logits, ref[:, :7]) <= ATOL
        logits, _ = model(tokens[:, 7:], arange_positions(1, 7, 5))
    assert max_err(logits, ref[:, 7:]) <= ATOL


def test_rollback_by_rewriting_positions(tiny_target):
    """Moving the length pointer back and writing new tokens gives the new sequence's logits."""
    model = target_with_caches(tiny_target.path)
    tokens = random_tokens(1, 12, seed=5)
    with torch.no_grad():
        model(tokens, arange_positions(1, 0, 12))  # cache holds 12 positions
        other = random_tokens(1, 3, seed=6)
        logits, _ = model(other, arange_positions(1, 7, 3))  # roll back to length 7
    ref, _ = hf_forward(tiny_target.hf_model, torch.cat([tokens[:, :7], other], dim=1))
    assert max_err(logits, ref[:, 7:10]) <= ATOL


def test_setup_caches_keeps_same_size_buffers(tiny_target):
    """Asked again for the size it has, setup_caches keeps every buffer (compiled graphs hold them);
    any other size allocates new ones."""
    model = target_with_caches(tiny_target.path, max_batch=2, max_seq=16)
    buffers = lambda: [model.rope] + [b for l in model.layers for b in (l.self_attn.kv_cache.k, l.self_attn.kv_cache.v)]
    first = buffers()
    model.setup_caches(2, 16)
    assert all(a is b for a, b in zip(buffers(), first))
    for size in ((2, 24), (3, 16)):
        model.setup_caches(*size)
        assert not any(a is b for a, b in zip(buffers(), first))
        assert model.layers[0].self_attn.kv_cache.k.shape[:2] == size and model.max_seq == size[1]


def test_ragged_batch_rows_match_hf_alone(tiny_target):
    """Rows of lengths 5 and 9; row 0 right-padded with junk at positions 5..8."""
    hf = tiny_target.hf_model
    model = target_with_caches(tiny_target.path, max_batch=4)  # max_batch > B on purpose
    row0 = random_tokens(1, 5, seed=7)
    row1 = random_tokens(1, 9, seed=8)
    junk = torch.full((1, 4), 17)
    tokens = torch.cat([torch.cat([row0, junk], 1), row1], 0)
    with torch.no_grad():
        logits, _ = model(tokens, arange_positions(2, 0, 9))
    ref0, _ = hf_forward(hf, row0)
    ref1, _ = hf_forward(hf, row1)
    assert max_err(logits[0, :5], ref0[0]) <= ATOL
    assert max_err(logits[1], ref1[0]) <= ATOL

    # Next token per row at positions [5] and [9]: row 0 overwrites the junk at 5.
    nxt = torch.tensor([[21], [33]])
    with torch.no_grad():
        logits, _ = model(nxt, torch.tensor([[5], [9]]))
    seq0 = torch.cat([row0, nxt[:1]], 1)
    seq1 = torch.cat([row1, nxt[1:]], 1)
    ref0, _ = hf_forward(hf, seq0)
    ref1, _ = hf_forward(hf, seq1)
    assert max_err(logits[0, 0], ref0[0, 5]) <= ATOL
    assert max_err(logits[1, 0], ref1[0, 9]) <= ATOL

    # A 2-token chunk per row at [6, 7] and [10, 11] (junk still sits at row 0's position 8),
    # reading one position per row through logits_index.
    chunk = random_tokens(2, 2, seed=9)
    positions = torch.tensor([[6, 7], [10, 11]])
    with torch.no_grad():
        logits, _ = model(chunk, positions)
        last, _ = model(chunk, positions, logits_index=torch.tensor([1, 0]))
    ref0, _ = hf_forward(hf, torch.cat([seq0, chunk[:1]], 1))
    ref1, _ = hf_forward(hf, torch.cat([seq1, chunk[1:]], 1))
    assert max_err(logits[0], ref0[0, 6:8]) <= ATOL
    assert max_err(logits[1], ref1[0, 10:12]) <= ATOL
    assert last.shape == (2, 64)
    assert max_err(last[0], ref0[0, 7]) <= ATOL
    assert max_err(last[1], ref1[0, 10]) <= ATOL


def test_logits_index_selects_one_position_per_row(tiny_target):
    model = target_with_caches(tiny_target.path)
    tokens = random_tokens(3, 6, seed=10)
    positions = arange_positions(3, 0, 6)
    with torch.no_grad():
        full, _ = model(tokens, positions)
        idx = torch.tensor([5, 0, 3])
        picked, feats = model(tokens, positions, capture=(0,), logits_index=idx)
    assert picked.shape == (3, 64)
    assert max_err(picked, full[torch.arange(3), idx]) <= 1e-5
    assert feats.shape == (3, 6, 32)  # features are not indexed


# ----------------------------------------------------------------------------------------
# Ragged verification equals per-request verification

@pytest.fixture(scope="module")
def small_target(tmp_path_factory):
    from drafters import make_target

    return make_target(tmp_path_factory.mktemp("ragged") / "target", attn_scale=1.0, num_hidden_layers=3)


@pytest.mark.parametrize("counts,pad", [([2, 0, 5, 1], 0), ([5, 5, 5, 5], 0), ([1, 3, 0, 2], 7), ([0, 0, 1, 0], 3)])
def test_ragged_forward_equals_per_request_forward(small_target, counts, pad):
    target = checkpoint.load_target(small_target)
    R, W, P = 4, 5, 9
    g = torch.Generator().manual_seed(len(counts) + pad + sum(counts))
    prompts = torch.randint(0, 48, (R, P), generator=g)
    lens = torch.tensor([9, 4, 7, 6])  # rows at different positions
    tokens = torch.randint(0, 48, (R, W), generator=g)
    positions = lens[:, None] + torch.arange(W)
    capture = (0, 1)
    with torch.no_grad():
        target.setup_caches(R, 32)
        target(prompts, torch.arange(P).expand(R, P))
        before = [(l.self_attn.kv_cache.k.clone(), l.self_attn.kv_cache.v.clone()) for l in target.layers]
        counts_t = torch.tensor(counts)
        n = int(counts_t.sum()) + pad
        ragged = m.Ragged.build(counts_t, W, n)
        logits, feats = target(ragged.flatten(tokens), positions, capture=capture, ragged=ragged)
        assert logits.shape == (1, n, 48) and feats.shape == (1, n, 2 * 32)
        after = [(l.self_attn.kv_cache.k.clone(), l.self_attn.kv_cache.v.clone()) for l in target.layers]
        start = 0
        for r in range(R):
            c = counts[r]
            # The reference: this request alone, from the same cache.
            for layer, (k, v) in zip(target.layers, before):
                layer.self_attn.kv_cache.k.copy_(k)
                layer.self_attn.kv_cache.v.copy_(v)
            if c:
                ref_logits, ref_feats = target(tokens[:, :c], positions[:, :c], capture=capture)
                torch.testing.assert_close(logits[0, start:start + c], ref_logits[r], rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(feats[0, start:start + c], ref_feats[r], rtol=1e-5, atol=1e-5)
                for layer, (k, v) in zip(target.layers, after):  # the cache rows it wrote
                    sl = slice(int(lens[r]), int(lens[r]) + c)
                    torch.testing.assert_close(k[r, sl], layer.self_attn.kv_cache.k[r, sl], rtol=1e-5, atol=1e-5)
                    torch.testing.assert_close(v[r, sl], layer.self_attn.kv_cache.v[r, sl], rtol=1e-5, atol=1e-5)
            for (k0, v0), (k1, v1) in zip(before, after):  # committed rows are untouched
                assert torch.equal(k0[r, :int(lens[r])], k1[r, :int(lens[r])])
            start += c
        assert start + pad == n and torch.isfinite(logits).all()  # padding computes garbage, never NaN


def test_ragged_pad_and_unpad_are_inverse():
    counts, W = torch.tensor([3, 0, 2]), 4
    ragged = m.Ragged.build(counts, W, 7)
    x = torch.arange(7.0)[None, :, None]
    padded = ragged.pad(x)
    assert padded.shape == (3, W, 1)
    assert padded[0, :3, 0].tolist() == [0, 1, 2] and padded[2, :2, 0].tolist() == [3, 4]
    assert padded.sum() == 0 + 1 + 2 + 3 + 4  # padding tokens 5, 6 went nowhere
    back = ragged.unpad(padded)
    assert back[0, :5, 0].tolist() == [0, 1, 2, 3, 4]
    assert back[0, 5:, 0].tolist() == [padded[-1, -1, 0].item()] * 2  # padding reads the last slot


# ----------------------------------------------------------------------------------------
# The cache-free causal forward (positions=None): target pre-training and online capture

def test_cache_free_forward_equals_cached_forward_and_hf(tiny_target):
    """positions=None: causal over 0..T-1 without the cache. Its logits and features equal the cached
    forward's on the same tokens (float32, tight), and transformers'; the cache is left untouched;
    the RoPE rows are the cache table's or, when that is too short or absent, the same rows computed."""
    T, capture = 12, (-1, 0, 1)
    tokens = random_tokens(2, T, seed=13)
    ref, hidden = hf_forward(tiny_target.hf_model, tokens)
    model = target_with_caches(tiny_target.path, max_batch=2, max_seq=16)
    cache = [t.clone() for l in model.layers for t in (l.self_attn.kv_cache.k, l.self_attn.kv_cache.v)]
    with torch.no_grad():
        free, free_feats = model(tokens, capture=capture)
        assert all(torch.equal(a, b) for a, b in zip(
            cache, [t for l in model.layers for t in (l.self_attn.kv_cache.k, l.self_attn.kv_cache.v)]))
        cached, cached_feats = model(tokens, arange_positions(2, 0, T), capture=capture)
        h, h_feats = model.hidden(tokens, capture=capture)
    assert free.shape == (2, T, 64) and free_feats.shape == (2, T, 3 * 32)
    assert max_err(free, cached) <= 1e-5 and max_err(free_feats, cached_feats) <= 1e-5
    assert max_err(free, ref) <= ATOL
    assert max_err(free_feats, torch.cat([hidden[i + 1] for i in capture], dim=-1)) <= ATOL
    assert torch.equal(model.lm_head(h), free) and torch.equal(h_feats, free_feats)  # forward = lm_head ∘ hidden
    assert torch.equal(m.rope_table(16, 1e4, T, "cpu"), model.rope[:T])  # computed rows = the table's
    no_cache = checkpoint.load_target(str(tiny_target.path))
    short_cache = target_with_caches(tiny_target.path, max_batch=2, max_seq=8)
    for other in (no_cache, short_cache):
        with torch.no_grad():  # no cache at all / a cache table shorter than T
            assert torch.equal(other(tokens, capture=capture)[0], free)


def test_cache_free_forward_trains(tiny_target):
    """With grad (target pre-training): gradients reach every parameter."""
    model = checkpoint.load_target(str(tiny_target.path)).requires_grad_(True)
    tokens = random_tokens(2, 8, seed=14)
    logits, _ = model(tokens)
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 64), tokens[:, 1:].reshape(-1)).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


# ----------------------------------------------------------------------------------------
# The fast paths against their references: fused projections, RoPE once per forward, attention
# over the filled prefix of the cache, GQA folded into the query length

def fwd_all(model, tokens):
    """Logits and features of a prefill, a one-token step and a chunk through the cache, and the
    cache-free forward (float32, no grad)."""
    with torch.no_grad():
        out = [model(tokens[:, :7], arange_positions(2, 0, 7), capture=(0, 1)),
               model(tokens[:, 7:8], arange_positions(2, 7, 1), capture=(0, 1)),
               model(tokens[:, 8:], arange_positions(2, 8, 4), capture=(0, 1)),
               model(tokens, capture=(0, 1))]
    return [t for pair in out for t in pair]


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "attention_bias"])
def test_fused_projections_hold_the_published_weights(target_factory, bias):
    """The model stores q, [k; v] and [gate; up]; `checkpoint.published` gives back the checkpoint's
    names and tensors exactly, and `fused` inverts it."""
    from safetensors.torch import load_file
    target = target_factory(attention_bias=bias, seed=3 if bias else 0)
    model = target_with_caches(target.path, max_batch=2)
    want = {k.removeprefix("model."): v for k, v in load_file(str(target.path / "model.safetensors")).items()}
    got = checkpoint.published(model.state_dict())
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    back, state = checkpoint.fused(got), model.state_dict()
    assert sorted(back) == sorted(state) and all(torch.equal(back[k], state[k]) for k in state)
    assert (model.layers[0].self_attn.kv_proj.bias is not None) == bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_equals_the_written_out_reference(dtype):
    """`Rope` (made once per forward; rotate_half's sign folded into sin, one roll) equals HF's formula
    bit for bit."""
    def apply_rope(x, cos_sin):
        cos, sin = cos_sin[:, :, None, 0].to(x.dtype), cos_sin[:, :, None, 1].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    g = torch.Generator().manual_seed(34)
    table = m.rope_table(16, 1e4, 40, "cpu")
    positions = torch.randint(0, 40, (3, 5), generator=g)
    for heads in (4, 6):
        x = torch.randn(3, 5, heads, 16, generator=g).to(dtype)
        assert torch.equal(m.Rope.at(table[positions], dtype)(x), apply_rope(x, table[positions]))


def test_attended_length_buckets_eagerly_and_is_the_whole_cache_compiled(monkeypatch):
    end = torch.tensor([[3, 9], [70, 5]])
    assert m.attended_length(end, 1000) == 128 and m.attended_length(end, 100) == 100
    assert m.attended_length(torch.tensor([64]), 1000) == 64 and m.attended_length(torch.tensor([65]), 1000) == 128
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert m.attended_length(end, 1000) == 1000


@pytest.mark.parametrize("group", [1, 2], ids=["sdpa_gqa", "folded"])
@pytest.mark.parametrize("T", [1, 6])
def test_attend_cached_equals_boolean_mask_attention_over_the_whole_cache(group, T):
    """attend_cached over the first S positions of a cache of S_max under the additive bias equals the
    reference `attend` (boolean mask, SDPA's GQA) over all S_max positions, for both GQA layouts; the
    bias rows repeat per folded head."""
    g = torch.Generator().manual_seed(35)
    B, H, Hkv, hd, S_max = 3, 4, 2, 16, 200
    q = torch.randn(B, T, H, hd, generator=g)
    k, v = torch.randn(B, S_max, Hkv, hd, generator=g), torch.randn(B, S_max, Hkv, hd, generator=g)
    positions = torch.tensor([40, 3, 101])[:, None] + torch.arange(T)  # rows at different lengths
    allowed = positions[:, :, None] >= torch.arange(S_max)
    want = m.attend(q, k, v, allowed)
    S = m.attended_length(positions + 1, S_max)
    assert S == 128
    bias = m.cache_bias(allowed[:, :, :S], H // Hkv if group > 1 else 1, torch.float32)
    assert bias.shape == (B, 1, (H // Hkv if group > 1 else 1) * T, S)
    got = m.attend_cached(q, k[:, :S], v[:, :S], bias)
    assert max_err(got, want) <= 1e-6
    full = m.attend_cached(q, k, v, m.cache_bias(allowed, H // Hkv if group > 1 else 1, torch.float32))
    assert max_err(full, want) <= 1e-6


def test_bucketed_cache_forward_equals_whole_cache_forward(tiny_target, monkeypatch):
    """The eager forward reads the cache up to its longest row's end (rounded up); reading all of it,
    as the compiled forward does, gives the same logits."""
    tokens = random_tokens(2, 12, seed=36)
    model = target_with_caches(tiny_target.path, max_batch=2, max_seq=100)
    bucketed = fwd_all(model, tokens)
    seen = []
    real = m.attended_length
    monkeypatch.setattr(m, "attended_length", lambda end, max_seq: seen.append(real(end, max_seq)) or max_seq)
    whole = fwd_all(model, tokens)
    assert seen == [64, 64, 64]  # three forwards through the cache, each bucketed to 64 of 100 positions
    for x, y in zip(bucketed, whole):
        assert max_err(x, y) <= 1e-6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: which SDPA kernel runs")
def test_cuda_cached_attention_runs_without_the_math_kernel():
    """On CUDA the folded layout with an additive mask runs in a fused kernel (memory-efficient or cuDNN);
    a boolean mask with enable_gqa, the reference, is what needs the math kernel on torch <= 2.11."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator(device="cuda").manual_seed(0)
    B, T, H, Hkv, hd, S = 2, 8, 32, 8, 128, 256
    q = torch.randn(B, T, H, hd, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(B, S, Hkv, hd, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    allowed = (torch.tensor([100, 200], device="cuda")[:, None] + torch.arange(T, device="cuda"))[:, :, None] \
        >= torch.arange(S, device="cuda")
    assert m.fold_gqa(q.device)
    bias = m.cache_bias(allowed, H // Hkv, q.dtype)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
        got = m.attend_cached(q, k, v, bias)
    assert max_err(got, m.attend(q, k, v, allowed)) <= 2e-2


# ----------------------------------------------------------------------------------------
# Captured features

@pytest.mark.parametrize("capture", [(-1,), (0,), (1,), (1, -1, 0), (0, 1)])
def test_capture_matches_hf_hidden_states(tiny_target, capture):
    model = target_with_caches(tiny_target.path)
    tokens = random_tokens(2, 10, seed=11)
    _, hidden = hf_forward(tiny_target.hf_model, tokens)
    assert len(hidden) == 4  # embeddings + 3 layers
    expected = torch.cat([hidden[i + 1] for i in capture], dim=-1)
    with torch.no_grad():
        logits, feats = model(tokens[:, :6], arange_positions(2, 0, 6), capture=capture)
        assert feats.shape == (2, 6, 32 * len(capture))
        assert max_err(feats, expected[:, :6]) <= ATOL
        # and through the cache, on a decode step and a chunk
        _, feats = model(tokens[:, 6:7], arange_positions(2, 6, 1), capture=capture)
        assert max_err(feats, expected[:, 6:7]) <= ATOL
        _, feats = model(tokens[:, 7:], arange_positions(2, 7, 3), capture=capture)
        assert max_err(feats, expected[:, 7:]) <= ATOL


def test_capture_embeddings_is_embedding_lookup(tiny_target):
    model = target_with_caches(tiny_target.path)
    tokens = random_tokens(1, 4, seed=12)
    with torch.no_grad():
        _, feats = model(tokens, arange_positions(1, 0, 4), capture=(-1,))
    assert torch.equal(feats, model.embed_tokens.weight[tokens])


# ----------------------------------------------------------------------------------------
# Qwen3-8B shapes on the meta device

QWEN3_8B_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "tie_word_embeddings": False, "rope_theta": 1000000.0,
    "rope_scaling": None, "rms_norm_eps": 1e-6, "max_position_embeddings": 40960,
    "attention_bias": False, "hidden_act": "silu", "use_sliding_window": False,
    "sliding_window": None, "max_window_layers": 36, "bos_token_id": 151643, "eos_token_id": 151645,
}


def qwen3_param_count(V, H, I, L, nh, nkv, hd, tied):
    attn = H * nh * hd + 2 * H * nkv * hd + nh * hd * H + 2 * hd  # q, k, v, o, q_norm, k_norm
    mlp = 3 * H * I
    layer = attn + mlp + 2 * H  # + input / post-attention norms
    return V * H * (1 if tied else 2) + L * layer + H  # + final norm


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_qwen3_8b_param_count_on_meta(tied):
    cfg = dict(QWEN3_8B_CONFIG, tie_word_embeddings=tied)
    args = configs.target_args(cfg, "config.json")
    assert args.rope_theta == 1e6 and args.head_dim == 128 and args.eos_token_ids == (151645,)
    expected = qwen3_param_count(151936, 4096, 12288, 36, 32, 8, 128, tied)
    if not tied:
        assert expected == 8_190_735_360
    else:
        assert expected == 8_190_735_360 - 151936 * 4096
    with torch.device("meta"):
        model = m.Transformer(args)
    assert all(p.device.type == "meta" for p in model.parameters())
    a = model.layers[0].self_attn
    assert tuple(a.q_proj.weight.shape) == (4096, 4096)
    assert tuple(a.kv_proj.weight.shape) == (2048, 4096)
    assert tuple(a.o_proj.weight.shape) == (4096, 4096)
    assert tuple(a.q_norm.weight.shape) == (128,)
    assert tuple(model.layers[35].mlp.down_proj.weight.shape) == (4096, 12288)
    assert tuple(model.lm_head.weight.shape) == (151936, 4096)
    assert sum(p.numel() for p in model.parameters()) == expected


def test_num_params_matches_tiny_hf(target_factory):
    for tied in (False, True):
        target = target_factory(tie_word_embeddings=tied)
        args = configs.target_args(json.loads((target.path / "config.json").read_text()), "c")
        with torch.device("meta"):
            ours = sum(p.numel() for p in m.Transformer(args).parameters())
        assert ours == sum(p.numel() for p in target.hf_model.parameters())


@pytest.mark.parametrize("shape", [(1, 6, 512), (2, 3, 12, 64), (1, 1, 256)])
def test_rms_norm_on_cpu_float32_is_the_formula_bit_for_bit(shape):
    """`rms_norm` takes F.rms_norm on CPU in float32 (one call, not six): it must give the written-out
    Qwen3 formula's bits — a torch whose kernel rounds otherwise fails here, not in the golden traces."""
    g = torch.Generator().manual_seed(42)
    x, w = torch.randn(*shape, generator=g) * 3, torch.randn(shape[-1], generator=g)
    want = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert torch.equal(m.rms_norm(x, w, 1e-6), want)
