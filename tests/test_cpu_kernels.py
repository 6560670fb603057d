"""cpu_kernels.py and cpu_kernels.cpp: the few-row CPU GEMM against F.linear and its panel layout, the
few-token attention against SDPA, and the build's failure reasons. (How cpu_kernels.dense and
model.attend_cached pick them: tests/test_model.py; compiled graphs calling them: tests/test_compile.py.)"""

from __future__ import annotations

import os
import time

import pytest
import torch

import cpu_kernels

torch.set_num_threads(1)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


needs_kernels = pytest.mark.skipif(cpu_kernels.unavailable() is not None,
                                    reason=f"the CPU kernels are unavailable: {cpu_kernels.unavailable()}")


@needs_kernels
@pytest.mark.parametrize("shape", [(16, 1), (48, 7), (64, 33), (160, 64), (96, 200)])
def test_panel_linear_equals_linear_at_every_row_count(shape):
    """panel_linear(x, panel_weight(w), b) equals F.linear(x, w, b) to float32 rounding for every row
    count the kernel groups differently (1-6 in one group, 7-13 in two or three, 64; none), K odd or
    1, N one panel or many, with and without bias, x 2-D or 3-D or a strided view; and each row's
    result is bit for bit the one it gets alone (the sum over k runs in the same order whatever rows
    share the call: a verify's logits equal one-token steps')."""
    N, K = shape
    g = gen(50)
    w, b = torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    panels = cpu_kernels.panel_weight(w)
    assert panels.shape == (N // 16, K, 16) and panels.is_contiguous()
    for rows in (0, 1, 2, 3, 5, 6, 7, 12, 13, 64):
        x = torch.randn(rows, K, generator=g)
        for bias in (None, b):
            got, want = cpu_kernels.panel_linear(x, panels, bias), torch.nn.functional.linear(x, w, bias)
            assert got.shape == want.shape == (rows, N)
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * K ** 0.5)
            for i in range(rows):
                assert torch.equal(cpu_kernels.panel_linear(x[i:i + 1], panels, bias)[0], got[i])
    x = torch.randn(2, 3, 2 * K, generator=g)[:, :, ::2]  # 3-D, not contiguous
    assert torch.allclose(cpu_kernels.panel_linear(x, panels, b), torch.nn.functional.linear(x, w, b), rtol=1e-5,
                          atol=1e-5 * K ** 0.5)


@needs_kernels
def test_panel_weight_applies_to_float32_cpu_weights_with_whole_panels_only():
    """panel_weight: None where the kernel does not apply (out not a multiple of 16, another dtype, a
    1-D tensor); panel_linear refuses an x that does not fit, by shape and dtype, and panels that are
    not panel_weight's layout (the C kernel would read past them)."""
    assert cpu_kernels.panel_weight(torch.randn(40, 8)) is None
    assert cpu_kernels.panel_weight(torch.randn(32, 8, dtype=torch.bfloat16)) is None
    assert cpu_kernels.panel_weight(torch.randn(32)) is None
    panels = cpu_kernels.panel_weight(torch.randn(32, 8))
    with pytest.raises(RuntimeError, match="does not fit"):
        cpu_kernels.panel_linear(torch.randn(2, 9), panels)
    with pytest.raises(RuntimeError, match="does not fit"):
        cpu_kernels.panel_linear(torch.randn(2, 8, dtype=torch.float64), panels)
    with pytest.raises(RuntimeError, match="not a float32 CPU vector of 32"):
        cpu_kernels.panel_linear(torch.randn(2, 8), panels, torch.randn(16))
    for bad in (panels.transpose(1, 2), panels.double(), panels[:, :, :8].contiguous(), panels[0]):
        with pytest.raises(RuntimeError, match="panel_weight's"):
            cpu_kernels.panel_linear(torch.randn(2, 8), bad)


def test_cpu_kernels_build_says_why_it_is_unavailable(tmp_path, monkeypatch):
    """The build in words when it cannot be used: switched off, no compiler, a source the compiler
    rejects (its first error line, and no temporary file left in the cache folder); built, it lands
    in the cache folder under a key of source, flags and torch, clearing away builds unused for
    STALE_DAYS and dead builds' temporary files, and a second call finds it there and marks it used.
    (The process has loaded the library once already: a second load would define the operators
    twice, so only the build is tried here.)"""
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("DSPARK_CPU_KERNELS", "0")
    assert cpu_kernels._build_kernels() == (None, "turned off by DSPARK_CPU_KERNELS")
    monkeypatch.delenv("DSPARK_CPU_KERNELS")
    if cpu_kernels.unavailable() is not None:
        pytest.skip(f"the CPU kernels are unavailable here: {cpu_kernels.unavailable()}")
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    path, why = cpu_kernels._build_kernels()
    assert path is None and why.startswith("no C++ compiler")
    monkeypatch.delenv("CXX")
    bad = tmp_path / "bad.cpp"
    bad.write_text("#include <torch/library.h>\nthis is not C++\n")
    monkeypatch.setattr(cpu_kernels, "KERNELS_SOURCE", str(bad))
    path, why = cpu_kernels._build_kernels()
    assert path is None and f"failed on {bad}:" in why and "error" in why and "\n" not in why
    assert os.listdir(tmp_path / "cache") == []
    monkeypatch.undo()
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path / "cache"))
    # what a build clears away: builds unused for STALE_DAYS, temporary files of dead builds older than a day
    days = 86400
    for name, age in (("cpu_kernels-0000000000000000.so", cpu_kernels.STALE_DAYS * days + 60), ("tmp1234.so", 2 * days),
                      ("cpu_kernels-1111111111111111.so", cpu_kernels.STALE_DAYS * days - 3600), ("tmp5678.so", 3600),
                      ("notes.txt", 100 * days)):
        (tmp_path / "cache" / name).write_text("")
        os.utime(tmp_path / "cache" / name, (time.time() - age, time.time() - age))
    kept = {"cpu_kernels-1111111111111111.so", "tmp5678.so", "notes.txt"}
    path, why = cpu_kernels._build_kernels()
    assert why is None and os.path.isfile(path)
    built = set(os.listdir(tmp_path / "cache")) - kept
    assert built == {os.path.basename(path)} and path.endswith(".so") and os.path.basename(path).startswith("cpu_kernels-")
    os.utime(path, (time.time() - days, time.time() - days))
    assert cpu_kernels._build_kernels() == (path, None) and set(os.listdir(tmp_path / "cache")) == built | kept
    assert time.time() - os.path.getmtime(path) < 600  # found and used: touched


def sdpa(q, k, v, bias):
    """The reference: SDPA with its own GQA, as model.attend_cached runs it without the kernel."""
    B, T, H, hd = q.shape
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           attn_mask=bias, enable_gqa=k.shape[2] != H)
    return out.transpose(1, 2).reshape(B, T, H * hd)


def prefix_bias(ends: torch.Tensor, S: int) -> torch.Tensor:
    """ends [B, T]: token t of row b may read keys 0..ends[b, t]-1 -> the additive bias [B, 1, T, S]."""
    allowed = torch.arange(S) < ends[..., None]
    return torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))[:, None]


@needs_kernels
@pytest.mark.parametrize("T,H,Hkv,hd", [(1, 8, 4, 64), (6, 8, 4, 64), (5, 12, 4, 16), (2, 6, 1, 128),
                                        (13, 4, 4, 32), (64, 2, 2, 16)])
def test_cached_attention_equals_sdpa_and_each_row_its_own(T, H, Hkv, hd):
    """cached_attention equals SDPA (GQA, additive 0/-inf bias) to float32 rounding, for a verify's,
    a step's and a prompt's token counts, GQA groups of 1-6, head dims 16-128, two batch rows with
    their own lengths, q and k/v as strided views of larger tensors (as the fused projection and the
    cache give them), and cache lengths on and off the kernel's blocks of 8 and 16. Each token's row
    is bit for bit what it gets alone, and what it gets with a longer cache whose extra keys are
    masked (so a verify's rows equal one-token steps', and a compiled graph's whole-cache read the
    eager filled prefix)."""
    g = gen(70 + T)
    for S in sorted({T, T + 7, max(T, 40), 204}):
        q = torch.randn(2, T, H + 3, hd, generator=g)[:, :, 1:H + 1]          # a view, as the fused projection's
        kv = torch.randn(2, S + 5, 2 * Hkv, hd, generator=g)                   # as the cache's [B, S, heads, hd]
        k, v = kv[:, :S, :Hkv], kv[:, :S, Hkv:]
        last = torch.tensor([S, max(S - 3, T)])                                # row 1's cache shorter
        ends = last[:, None] - T + 1 + torch.arange(T)                          # token t reads up to its position
        bias = prefix_bias(ends, S)
        got = cpu_kernels.cached_attention(q, k, v, bias)
        want = sdpa(q, k, v, bias)
        assert got.shape == want.shape == (2, T, H * hd)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (S, (got - want).abs().max())
        for t in (0, T - 1):
            alone = cpu_kernels.cached_attention(q[:, t:t + 1], k, v, bias[:, :, t:t + 1])
            assert torch.equal(alone[:, 0], got[:, t])
        longer = torch.cat([kv[:, :S], torch.randn(2, 9, 2 * Hkv, hd, generator=g)], 1)
        wide = cpu_kernels.cached_attention(q, longer[:, :, :Hkv], longer[:, :, Hkv:], prefix_bias(ends, S + 9))
        assert torch.equal(wide, got)


@needs_kernels
def test_cached_attention_takes_any_mask_and_a_row_that_sees_nothing_gives_zeros():
    """Any additive mask, not only prefixes: keys masked in the middle, a finite (non-0) bias, and a row
    with every key masked, which gives zeros as SDPA's CPU kernel does; no keys at all likewise."""
    g = gen(71)
    T, H, hd, S = 4, 4, 16, 37
    q, k, v = torch.randn(1, T, H, hd, generator=g), torch.randn(1, S, 2, hd, generator=g), torch.randn(1, S, 2, hd, generator=g)
    allowed = torch.rand(1, T, S, generator=g) < 0.6
    allowed[0, 2] = False
    bias = torch.randn(1, T, S, generator=g).masked_fill_(~allowed, float("-inf"))[:, None]
    got = cpu_kernels.cached_attention(q, k, v, bias)
    want = sdpa(q, k, v, bias)
    assert torch.equal(got[0, 2], torch.zeros(H * hd)) and torch.equal(want[0, 2], torch.zeros(H * hd))
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    empty = cpu_kernels.cached_attention(q, k[:, :0], v[:, :0], bias[..., :0])
    assert empty.shape == (1, T, H * hd) and not empty.any()
    qt = q.transpose(2, 3).contiguous().transpose(2, 3)  # the head dim strided: copied before the kernel
    assert qt.stride(3) != 1 and torch.equal(cpu_kernels.cached_attention(qt, k, v, bias), got)


@needs_kernels
def test_attend_cached_takes_the_kernel_only_where_it_applies():
    """model.attend_cached: the kernel for CPU float32 up to ATTENTION_MAX_TOKENS tokens without
    autograd; SDPA past that many tokens, with grad, or in bfloat16 — the two agreeing to rounding
    wherever both apply."""
    import model

    g = gen(72)
    S, n = 300, cpu_kernels.ATTENTION_MAX_TOKENS
    k, v = torch.randn(1, S, 2, 16, generator=g), torch.randn(1, S, 2, 16, generator=g)
    for T, applies in ((1, True), (n, True), (n + 1, False)):
        q = torch.randn(1, T, 4, 16, generator=g)
        bias = model.cache_bias((torch.arange(S - T, S)[:, None] >= torch.arange(S))[None], 1, torch.float32)
        assert cpu_kernels.attention_applies(q, bias) == applies
        assert torch.allclose(model.attend_cached(q, k, v, bias), sdpa(q, k, v, bias), rtol=1e-5, atol=1e-5)
    q = torch.randn(1, 2, 4, 16, generator=g)
    bias = model.cache_bias(torch.ones(1, 2, S, dtype=torch.bool), 1, torch.float32)
    assert cpu_kernels.attention_applies(q, bias)
    assert not cpu_kernels.attention_applies(q.bfloat16(), bias.bfloat16())
    assert not cpu_kernels.attention_applies(q[..., :8], bias)  # head dim not a multiple of 16
    with torch.enable_grad():
        assert not cpu_kernels.attention_applies(q.clone().requires_grad_(), bias)


@needs_kernels
def test_the_kernels_give_the_same_bits_at_every_thread_count():
    """With torch's threads the GEMM splits its panels (in whole groups of six) and the attention its
    (batch row, K/V head) pairs among them: every output is computed by one thread in the order one
    thread computes it, so 1, 2 and 3 threads give the same bits (the weight is large enough to be
    split, its panels not a multiple of six; the batch rows see different keys)."""
    import model

    g = gen(80)
    w, b = torch.randn(1040, 512, generator=g), torch.randn(1040, generator=g)  # 65 panels, 2 MiB
    panels = cpu_kernels.panel_weight(w)
    x = torch.randn(7, 512, generator=g)
    q, k, v = torch.randn(2, 6, 8, 64, generator=g), torch.randn(2, 90, 4, 64, generator=g), torch.randn(2, 90, 4, 64, generator=g)
    ends = torch.tensor([[40], [85]])  # request 0 sees keys < 40 - 5 + t, request 1 < 85 - 5 + t
    bias = model.cache_bias((torch.arange(90) < ends[:, None] - 5 + torch.arange(6)[None, :, None]), 1, torch.float32)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = [cpu_kernels.panel_linear(x[:m], panels, b) for m in (1, 3, 6, 7)], cpu_kernels.cached_attention(q, k, v, bias)
        for threads in (2, 3):
            torch.set_num_threads(threads)
            for got, ref in zip([cpu_kernels.panel_linear(x[:m], panels, b) for m in (1, 3, 6, 7)], want[0]):
                assert torch.equal(got, ref)
            assert torch.equal(cpu_kernels.cached_attention(q, k, v, bias), want[1])
    finally:
        torch.set_num_threads(before)
    assert torch.allclose(want[0][3], torch.nn.functional.linear(x, w, b), rtol=1e-4, atol=1e-4)
    assert torch.allclose(want[1], sdpa(q, k, v, bias), rtol=1e-5, atol=1e-5)


@needs_kernels
def test_cached_attention_refuses_what_does_not_fit():
    q, k, b = torch.randn(1, 2, 4, 16), torch.randn(1, 5, 2, 16), torch.zeros(1, 1, 2, 5)
    for args in ((q, k, k[:, :4], b), (q, k, k, b[..., :4]), (q, k[..., :8], k[..., :8], b),
                 (q[..., :8], k[..., :8], k[..., :8], b), (q, k[:, :, :1].expand(1, 5, 3, 16), k[:, :, :1].expand(1, 5, 3, 16), b),
                 (q.double(), k, k, b), (q[0], k, k, b)):
        with pytest.raises(RuntimeError, match="cached_attention"):
            cpu_kernels.cached_attention(*args)


@needs_kernels
def test_weight_memory_hands_out_aligned_disjoint_slices_that_outlive_their_block_reference(monkeypatch):
    """weight_memory: 64-byte-aligned, non-overlapping slices of a huge-page block; a request larger
    than a block gets a block of its own; a slice stays valid after the block is no longer the current
    one (the slices keep it mapped); panel_weight's panels are such a slice, contiguous, the weight's."""
    monkeypatch.setattr(cpu_kernels, "_arena", None)
    monkeypatch.setattr(cpu_kernels, "ARENA_BYTES", 1 << 16)
    a, b = cpu_kernels.weight_memory(100), cpu_kernels.weight_memory(1000)
    assert a.numel() == 100 and b.numel() == 1000 and a.data_ptr() % 64 == 0 and b.data_ptr() % 64 == 0
    assert b.data_ptr() >= a.data_ptr() + 100
    big = cpu_kernels.weight_memory((1 << 16) + 5)
    assert big.numel() == (1 << 16) + 5
    a.fill_(3)
    big.fill_(7)
    monkeypatch.setattr(cpu_kernels, "_arena", None)  # the first block is no longer held by the arena
    assert int(a.sum()) == 300 and int(big[-5:].sum()) == 35
    w = torch.randn(48, 40, generator=gen(73))
    panels = cpu_kernels.panel_weight(w)
    assert panels.is_contiguous() and torch.equal(panels, w.reshape(3, 16, 40).transpose(1, 2))
