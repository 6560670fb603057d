"""cpu_kernels.py and cpu_kernels.cpp, the CPU backend: the few-row GEMM against F.linear, the few-token
attention against model.attend_cached (SDPA), their invariants (a row's bits do not depend on the rows
beside it, the thread count or the vector width; masked keys are not read), `install` (and undoing it) on
a model, the build's reasons when unavailable, and a compiled graph calling the operators."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import REPO_ROOT, gen

import model
from support import cpu_kernels

torch.set_num_threads(1)

needs_kernels = pytest.mark.skipif(cpu_kernels.unavailable() is not None,
                                   reason=f"the CPU kernels are unavailable: {cpu_kernels.unavailable()}")


def panels(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.dspark.panels(w)


def panel_linear(x, p, bias=None):
    return torch.ops.dspark.panel_linear(x, p, bias)


def cached_attention(q, k, v, bias):
    return torch.ops.dspark.cached_attention(q, k, v, bias)


def run_python(code: str, **env) -> str:
    """`code` in a fresh interpreter in the repository, with `env` added; its stdout."""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stderr
    return done.stdout


# ----------------------------------------------------------------------------------------
# The GEMM

@needs_kernels
@pytest.mark.parametrize("shape", [(16, 1), (48, 7), (64, 33), (208, 64), (96, 600)])
def test_panel_linear_equals_linear_at_every_row_count(shape):
    """panel_linear(x, panels(w), b) equals F.linear(x, w, b) to float32 rounding at 0-20 rows (one register
    tile, several, k-blocked past 256 steps when they share a pass), K odd or 1, one panel or a column
    block and a remainder, with and without bias; x 3-D and strided. Each row's result is bit for bit the
    one it gets alone: a verify's rows equal one-token steps'."""
    N, K = shape
    g = gen(50)
    w, b = torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    p = panels(w)
    assert p.shape == (N // 16, K, 16) and p.is_contiguous() and torch.equal(p, w.view(N // 16, 16, K).transpose(1, 2))
    x = torch.randn(20, K, generator=g)
    alone = [panel_linear(x[i:i + 1], p, b)[0] for i in range(20)]
    for rows in range(21):
        for bias in (None, b):
            got, want = panel_linear(x[:rows], p, bias), F.linear(x[:rows], w, bias)
            assert got.shape == want.shape == (rows, N)
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * K ** 0.5), (rows, (got - want).abs().max())
        for i in range(rows):
            assert torch.equal(got[i], alone[i]), (rows, i)
    xs = torch.randn(2, 3, 2 * K, generator=g)[:, :, ::2]  # 3-D, not contiguous
    assert torch.allclose(panel_linear(xs, p, b), F.linear(xs, w, b), rtol=1e-5, atol=1e-5 * K ** 0.5)


@needs_kernels
def test_panels_and_panel_linear_refuse_what_does_not_fit():
    """A weight without whole panels or of another dtype gets none; panel_linear refuses an x, a bias
    or panels that do not fit (the C++ would read past them), by shape, dtype and layout."""
    for bad in (torch.randn(40, 8), torch.randn(32, 8, dtype=torch.bfloat16), torch.randn(32)):
        with pytest.raises(RuntimeError, match="panels: weight"):
            panels(bad)
    p = panels(torch.randn(32, 8))
    for x in (torch.randn(2, 9), torch.randn(2, 8, dtype=torch.float64)):
        with pytest.raises(RuntimeError, match="does not fit"):
            panel_linear(x, p)
    with pytest.raises(RuntimeError, match="bias is not a float32 CPU vector of 32"):
        panel_linear(torch.randn(2, 8), p, torch.randn(16))
    for bad in (p.transpose(1, 2), p.double(), p[:, :, :8].contiguous(), p[0]):
        with pytest.raises(RuntimeError, match="panels"):
            panel_linear(torch.randn(2, 8), bad)


# ----------------------------------------------------------------------------------------
# The attention

def sdpa(q, k, v, bias):
    """The reference: model.attend_cached as it runs without the backend (SDPA, its own GQA)."""
    return model.attend_cached(q, k, v, bias)


def prefix_bias(ends: torch.Tensor, S: int) -> torch.Tensor:
    """ends [B, T]: token t of row b may read keys 0..ends[b, t]-1 -> the additive bias [B, 1, T, S]."""
    return model.cache_bias(torch.arange(S) < ends[..., None], 1, torch.float32)


@needs_kernels
@pytest.mark.parametrize("T,H,Hkv,hd", [(1, 8, 4, 64), (7, 4, 2, 64), (8, 8, 4, 64), (5, 12, 4, 16), (2, 6, 1, 128),
                                        (13, 4, 4, 32)])
def test_cached_attention_equals_sdpa_and_each_row_its_own(T, H, Hkv, hd):
    """cached_attention equals SDPA to float32 rounding for a step's, a block's and a verify's token
    counts, GQA groups of 1-6, head dims 16-128, two batch rows with their own lengths, q and k/v strided
    views (as the fused projection and the cache give them), cache lengths on and off blocks of 16. Each
    token's row is bit for bit what it gets alone and with a longer cache of masked keys; and keys past
    the last one any query may see are not read (NaN there changes nothing)."""
    g = gen(70 + T)
    for S in sorted({T, T + 7, max(T, 40), 204}):
        q = torch.randn(2, T, H + 3, hd, generator=g)[:, :, 1:H + 1]
        kv = torch.randn(2, S + 9, 2 * Hkv, hd, generator=g)
        k, v = kv[:, :S, :Hkv], kv[:, :S, Hkv:]
        ends = torch.tensor([S, max(S - 3, T)])[:, None] - T + 1 + torch.arange(T)  # row 1's cache shorter
        bias = prefix_bias(ends, S)
        got = cached_attention(q, k, v, bias)
        want = sdpa(q, k, v, bias)
        assert got.shape == want.shape == (2, T, H * hd)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (S, (got - want).abs().max())
        for t in (0, T - 1):
            assert torch.equal(cached_attention(q[:, t:t + 1], k, v, bias[:, :, t:t + 1])[:, 0], got[:, t])
        wide = kv.clone()
        wide[0, S:], wide[1, max(S - 3, T):] = float("nan"), float("nan")  # past every query's keys
        assert torch.equal(cached_attention(q, wide[:, :, :Hkv], wide[:, :, Hkv:], prefix_bias(ends, S + 9)), got)


@needs_kernels
def test_cached_attention_takes_any_mask_and_a_row_that_sees_nothing_gives_zeros():
    """Any additive mask (keys masked in the middle, finite non-zero biases), a row with every key
    masked gives zeros as SDPA's CPU kernel does, no keys at all likewise; a strided head dimension."""
    g = gen(71)
    T, H, hd, S = 4, 4, 16, 37
    q, k, v = (torch.randn(1, n, h, hd, generator=g) for n, h in ((T, H), (S, 2), (S, 2)))
    allowed = torch.rand(1, T, S, generator=g) < 0.6
    allowed[0, 2] = False
    bias = torch.randn(1, T, S, generator=g).masked_fill_(~allowed, float("-inf"))[:, None]
    got = cached_attention(q, k, v, bias)
    want = sdpa(q, k, v, bias)
    assert torch.equal(got[0, 2], torch.zeros(H * hd)) and torch.equal(want[0, 2], torch.zeros(H * hd))
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    empty = cached_attention(q, k[:, :0], v[:, :0], bias[..., :0])
    assert empty.shape == (1, T, H * hd) and not empty.any()
    qt = q.transpose(2, 3).contiguous().transpose(2, 3)
    assert qt.stride(3) != 1 and torch.equal(cached_attention(qt, k, v, bias), got)


@needs_kernels
def test_cached_attention_keeps_a_nan_query_or_key_nan_as_sdpa_does():
    """A NaN in a query or in a key a query reads makes those rows NaN, as SDPA's: the engine's check for
    non-finite logits then refuses a corrupt checkpoint (the kernel's max and exp dropped the NaN: finite
    garbage that decoded)."""
    g = gen(72)
    T, H, Hkv, hd, S = 3, 4, 2, 16, 20
    q, k, v = (torch.randn(1, n, h, hd, generator=g) for n, h in ((T, H), (S, Hkv), (S, Hkv)))
    bias = prefix_bias(torch.tensor([[S - 2, S - 1, S]]), S)
    for where in ("q", "k"):
        qn, kn = q.clone(), k.clone()
        if where == "q":
            qn[0, 1, 2, 0] = float("nan")  # token 1, head 2
        else:
            kn[0, 5, 1, 3] = float("nan")  # a key every token reads, of K/V head 1 (heads 2 and 3)
        got = cached_attention(qn, kn, v, bias).view(1, T, H, hd)
        want = sdpa(qn, kn, v, bias).view(1, T, H, hd)
        assert torch.equal(got.isnan().any(-1), want.isnan().any(-1)) and want.isnan().any(), where
        finite = ~want.isnan()
        assert torch.allclose(got[finite], want[finite], rtol=1e-5, atol=1e-5)


@needs_kernels
def test_cached_attention_refuses_what_does_not_fit():
    q, k, b = torch.randn(1, 2, 4, 16), torch.randn(1, 5, 2, 16), torch.zeros(1, 1, 2, 5)
    three = k[:, :, :1].expand(1, 5, 3, 16)  # 3 K/V heads for 4 query heads
    for args in ((q, k, k[:, :4], b), (q, k, k, b[..., :4]), (q, k[..., :8], k[..., :8], b),
                 (q[..., :8], k[..., :8], k[..., :8], b), (q, three, three, b), (q.double(), k, k, b), (q[0], k, k, b)):
        with pytest.raises(RuntimeError, match="cached_attention"):
            cached_attention(*args)


# ----------------------------------------------------------------------------------------
# Same bits at any thread count and vector width

def invariance_outputs() -> list:
    """The GEMM at 1-9 rows on a weight large enough to be split among threads (65 panels, 2 MiB, not a
    whole number of column blocks) and at 12 rows with K past one k-block, and the attention over two
    batch rows of other lengths."""
    g = gen(80)
    w, b = torch.randn(1040, 512, generator=g), torch.randn(1040, generator=g)
    x = torch.randn(12, 512, generator=g)
    w2, x2 = torch.randn(64, 700, generator=g), torch.randn(12, 700, generator=g)
    q, k, v = (torch.randn(2, n, h, 64, generator=g) for n, h in ((6, 8), (90, 4), (90, 4)))
    bias = prefix_bias(torch.tensor([[40], [85]]) - 5 + torch.arange(6), 90)
    p = panels(w)
    return ([panel_linear(x[:m], p, b) for m in range(1, 10)] + [panel_linear(x2, panels(w2))]
            + [cached_attention(q, k, v, bias)])


@needs_kernels
def test_the_kernels_give_the_same_bits_at_every_thread_count_and_vector_width(tmp_path):
    """Torch's threads split the GEMM's column blocks and the attention's (batch row, K/V head) pairs:
    1, 2 and 3 threads give the same bits. Where the CPU has AVX-512, the AVX2 path
    (DSPARK_CPU_KERNELS=avx2, in a fresh process) gives them too: every output is one FMA chain."""
    before = torch.get_num_threads()
    try:
        want = invariance_outputs()
        for threads in (2, 3):
            torch.set_num_threads(threads)
            assert all(torch.equal(a, b) for a, b in zip(invariance_outputs(), want, strict=True))
    finally:
        torch.set_num_threads(before)
    with open("/proc/cpuinfo") as f:
        if "avx512f" not in f.read():
            return  # this process ran the AVX2 path already
    torch.save(want, tmp_path / "want.pt")
    out = run_python("import torch, sys; from support import cpu_kernels; sys.path.insert(0, 'tests'); import test_cpu_kernels as t; "
                     f"want = torch.load({str(tmp_path / 'want.pt')!r}); "
                     "print(all(torch.equal(a, b) for a, b in zip(t.invariance_outputs(), want, strict=True)))",
                     DSPARK_CPU_KERNELS="avx2")
    assert out.strip().splitlines()[-1] == "True"


# ----------------------------------------------------------------------------------------
# install / uninstall

def tiny(tied: bool = False) -> model.Transformer:
    torch.manual_seed(0)
    args = model.ModelArgs(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=tied)
    m = model.Transformer(args).eval()
    m.setup_caches(2, 32)
    return m


def decode_logits(m: model.Transformer) -> list:
    """A prefill of 5 tokens, a verify of 8 and a one-token step through the cache, and the cache-free
    forward: their logits."""
    g = gen(90)
    tokens = torch.randint(0, 64, (2, 14), generator=g)
    pos = torch.arange(14).expand(2, 14)
    with torch.no_grad():
        return [m(tokens[:, a:b], pos[:, a:b])[0] for a, b in ((0, 5), (5, 13), (13, 14))] + [m(tokens)[0]]


def uninstall(m: nn.Module):
    """Undo `install`: plain nn.Linear layers and `model.attend_cached`."""
    for x in m.modules():
        if type(x) is cpu_kernels.PanelLinear:
            x.__class__ = nn.Linear
            del x.panels, x.stamp
        elif isinstance(x, model.Attention) and x.cache_attention is cpu_kernels.attend:
            x.cache_attention = model.attend_cached
            if "project" in vars(x):
                del x.project, x.qkv_panels, x.qkv_bias


@needs_kernels
@pytest.mark.parametrize("tied", [False, True])
def test_install_gives_the_plain_models_logits_and_uninstall_restores_it(tied):
    """install puts every Linear on the panel kernel (the same Parameter objects: state_dict and a tied
    lm_head unchanged) and every attention on the kernel; the logits equal the plain model's to rounding.
    A second install copies nothing; uninstall gives back the plain model, bit for bit."""
    plain = tiny(tied)
    want = decode_logits(plain)
    m = copy.deepcopy(plain)
    params = {k: v for k, v in m.state_dict(keep_vars=True).items()}
    assert cpu_kernels.install(m)
    assert {k: v for k, v in m.state_dict(keep_vars=True).items()} == params  # same keys, same objects
    assert (m.lm_head.weight is m.embed_tokens.weight) == tied
    linears = [x for x in m.modules() if isinstance(x, nn.Linear)]
    assert len(linears) == 11 and all(type(x) is cpu_kernels.PanelLinear for x in linears)
    assert all(layer.self_attn.cache_attention is cpu_kernels.attend for layer in m.layers)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = decode_logits(m)
    ran = {e.key: e.count for e in prof.key_averages()}
    # 11 layers, 9 calls a forward: each attention's q and [k; v] are one call
    assert ran.get("dspark::panel_linear") == 4 * 9 and ran.get("dspark::cached_attention") == 3 * 2, ran
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), (a - b).abs().max()
    kept = [x.panels for x in linears]
    assert cpu_kernels.install(m) and all(x.panels is p for x, p in zip(linears, kept))  # idempotent
    uninstall(m)
    assert all(type(x) is nn.Linear and not hasattr(x, "panels") for x in linears)
    assert all(layer.self_attn.cache_attention is model.attend_cached for layer in m.layers)
    assert all(torch.equal(a, b) for a, b in zip(decode_logits(m), want, strict=True))


@needs_kernels
def test_installed_layers_fall_back_where_the_kernel_does_not_apply():
    """F.linear under autograd (gradients flow as in the plain layer), under CPU autocast and for another
    dtype; SDPA for a bias with the GQA group folded in, past ATTENTION_MAX_TOKENS tokens, or under
    autograd. Layers whose out_features are not a multiple of 16 stay nn.Linear; a model of another
    dtype is left alone."""
    m = tiny()
    lin = m.layers[0].mlp.gate_up_proj
    plain = copy.deepcopy(lin)
    cpu_kernels.install(m)
    x = torch.randn(3, 32, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    with torch.enable_grad():
        lin(x).square().sum().backward()
        plain(x2).square().sum().backward()
    assert torch.equal(x.grad, x2.grad) and torch.equal(lin.weight.grad, plain.weight.grad)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        assert torch.equal(lin(x2), plain(x2)) and lin(x2).dtype == torch.bfloat16
    half = copy.deepcopy(lin).bfloat16()
    with torch.no_grad():
        assert torch.equal(half(x2.bfloat16()), F.linear(x2.bfloat16(), half.weight, half.bias))
    odd = nn.Sequential(nn.Linear(8, 24), nn.Linear(24, 32))
    assert cpu_kernels.install(odd) and type(odd[0]) is nn.Linear and type(odd[1]) is cpu_kernels.PanelLinear
    half = tiny().bfloat16()
    assert not cpu_kernels.install(half)
    assert all(type(x) is nn.Linear for x in half.modules() if isinstance(x, nn.Linear))
    assert cpu_kernels.describe(half) is None
    g = gen(91)
    k, v = torch.randn(1, 40, 2, 16, generator=g), torch.randn(1, 40, 2, 16, generator=g)
    for T, group, grad in ((2, 2, False), (cpu_kernels.ATTENTION_MAX_TOKENS + 1, 1, False), (2, 1, True)):
        q = torch.randn(1, T, 4, 16, generator=g, requires_grad=grad)
        bias = model.cache_bias(torch.ones(1, T, 40, dtype=torch.bool), group, torch.float32)
        with torch.enable_grad():
            got = cpu_kernels.attend(q, k, v, bias)
        assert torch.equal(got, model.attend_cached(q, k, v, bias)) and got.requires_grad == grad


@needs_kernels
def test_install_copies_each_weight_once_and_again_after_an_edit():
    """A weight shared by two layers gets one panel copy; a layer whose weight is rows 16i.. of another's
    (fused rows) gets a view of that copy, not a copy; a weight edited in place is copied again by the
    next install."""
    a, b, c = nn.Linear(8, 64, bias=False), nn.Linear(8, 64, bias=False), nn.Linear(8, 32, bias=False)
    b.weight = a.weight
    c.weight = nn.Parameter(a.weight.detach()[16:48])
    m = nn.Sequential(a, b, c)
    assert cpu_kernels.install(m)
    assert a.panels is b.panels and c.panels.data_ptr() == a.panels[1].data_ptr() and c.panels.shape == (2, 8, 16)
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.allclose(c(x), F.linear(x, c.weight)) and torch.allclose(a(x), F.linear(x, a.weight))
        a.weight.mul_(2)
    cpu_kernels.install(m)
    with torch.no_grad():
        assert torch.allclose(a(x), F.linear(x, a.weight)) and torch.allclose(c(x), F.linear(x, c.weight))


@needs_kernels
def test_install_again_after_a_bias_edit_takes_the_new_bias():
    """The fused q/kv projection's bias is a copy too: an edit in place is taken by the next install (it kept
    the old one: only the weights were compared)."""
    args = model.ModelArgs(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=True)
    m = model.Transformer(args).eval()
    assert cpu_kernels.install(m)
    a = m.layers[0].self_attn
    x = torch.randn(1, 3, 32)
    with torch.no_grad():
        a.q_proj.bias.add_(1.0)
        cpu_kernels.install(m)
        q, _ = a.project(x)
        want = F.linear(x, a.q_proj.weight, a.q_proj.bias)
    assert torch.allclose(q.reshape(want.shape), want, atol=1e-5)


@needs_kernels
def test_a_projection_replaced_since_install_is_the_one_used():
    """A q_proj or kv_proj replaced by another module (an ablation, a merged copy) is what projects at once,
    and `refresh` puts a fitting replacement on the kernel (the panels of the module replaced kept
    decoding, in silence, under no_grad)."""
    m = tiny()
    assert cpu_kernels.install(m)
    a = m.layers[0].self_attn
    x = torch.randn(1, 3, 32)
    old_q = a.q_proj
    new_q = nn.Linear(old_q.in_features, old_q.out_features, bias=False)
    new_kv = nn.Sequential(nn.Linear(a.kv_proj.in_features, a.kv_proj.out_features, bias=False))  # fits no kernel
    with torch.no_grad():
        new_q.weight.mul_(3)
        a.q_proj = new_q
        q, _ = a.project(x)
        assert torch.equal(q, new_q(x)) and not torch.allclose(q, F.linear(x, old_q.weight))
        cpu_kernels.refresh(m)
        assert type(a.q_proj) is cpu_kernels.PanelLinear
        q, _ = a.project(x)
        assert torch.allclose(q, F.linear(x, new_q.weight), atol=1e-5)
        a.kv_proj = new_kv
        cpu_kernels.refresh(m)
        _, kv = a.project(x)
        assert torch.equal(kv, new_kv(x))


@needs_kernels
def test_describe_names_the_gemms():
    m = tiny()
    assert cpu_kernels.describe(m) == "GEMMs: MKL (the CPU kernels are not installed)"
    cpu_kernels.install(m)
    assert cpu_kernels.describe(m) == "GEMMs: the few-row kernel (cpu_kernels.cpp; few-token attention too)"
    assert cpu_kernels.describe(m, compiled=True).endswith(", one op each in the compiled graphs")


# ----------------------------------------------------------------------------------------
# The build

def test_a_setting_it_does_not_know_is_one_line(monkeypatch):
    """DSPARK_CPU_KERNELS=fasle ran the kernels without a word; " AVX2 " was off's opposite in Python but
    not 'avx2' to the C++ side, which kept AVX-512."""
    from support.cli import UserError

    monkeypatch.setenv("DSPARK_CPU_KERNELS", "fasle")
    with pytest.raises(UserError, match=r"^DSPARK_CPU_KERNELS='fasle': one of 1, on, true, yes, 0, off, false, no, "
                                        r"avx2 \(unset: on\)$"):
        cpu_kernels._build()
    monkeypatch.setenv("DSPARK_CPU_KERNELS", " AVX2 ")
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: {"avx"})  # stop before building
    cpu_kernels._build()
    assert os.environ["DSPARK_CPU_KERNELS"] == "avx2"


def test_unavailable_says_why(monkeypatch, tmp_path):
    """Turned off by DSPARK_CPU_KERNELS (0/off/false/no; in a fresh process, which then keeps the plain
    model), another machine, a CPU without AVX2/FMA, no compiler, a source that does not compile (one
    line, the compiler's error)."""
    code = ("import model; from support import cpu_kernels; m = model.Transformer(model.ModelArgs(vocab_size=64, hidden_size=32, "
            "intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16)); "
            "print(cpu_kernels.unavailable()); print(cpu_kernels.install(m)); print(cpu_kernels.describe(m))")
    assert run_python(code, DSPARK_CPU_KERNELS=" Off ").splitlines() == [
        "turned off by DSPARK_CPU_KERNELS", "False",
        "GEMMs: MKL (the CPU kernels are unavailable: turned off by DSPARK_CPU_KERNELS)"]
    monkeypatch.delenv("DSPARK_CPU_KERNELS", raising=False)
    monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: "aarch64")
    assert "x86-64 Linux" in cpu_kernels._build()
    monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_kernels.platform, "system", lambda: "Linux")
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: {"avx", "fma"})
    assert cpu_kernels._build() == "this CPU lacks AVX2 or FMA"
    monkeypatch.undo()
    if cpu_kernels.unavailable() is not None:
        pytest.skip(f"the CPU kernels are unavailable here: {cpu_kernels.unavailable()}")
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert cpu_kernels._build().startswith("no C++ compiler")
    monkeypatch.delenv("CXX")
    # an install that left the source out (pip install . of an older pyproject): a reason, not a traceback
    monkeypatch.setattr(cpu_kernels, "SOURCE", str(tmp_path / "cpu_kernels.cpp"))
    assert cpu_kernels._build() == f"their source {tmp_path / 'cpu_kernels.cpp'} is missing"
    bad = tmp_path / "bad.cpp"
    bad.write_text("this is not C++\n")
    monkeypatch.setattr(cpu_kernels, "SOURCE", str(bad))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "build"))  # not the real build's folder
    why = cpu_kernels._build()
    assert why.startswith(f"building {bad} failed: ") and "error" in why and "\n" not in why
    # built where TORCH_EXTENSIONS_DIR says, as torch's extensions are (it went to ~/.cache in any case)
    assert [p.name[:19] for p in (tmp_path / "build").iterdir()] == ["dspark_cpu_kernels_"]


# ----------------------------------------------------------------------------------------
# Compiled

@needs_kernels
def test_a_compiled_graph_calls_the_operators_and_matches_eager():
    """torch.compile(fullgraph=True) of an installed Linear and attention: one graph, which calls
    dspark::panel_linear and dspark::cached_attention as opaque ops (their fake implementations give the
    shapes), with eager's results."""
    from torch._dynamo.testing import CompileCounterWithBackend

    m = tiny()
    cpu_kernels.install(m)
    lin, attn = m.layers[0].self_attn.q_proj, m.layers[0].self_attn
    g = gen(92)
    x, k, v = (torch.randn(*shape, generator=g) for shape in ((1, 8, 32), (1, 24, 2, 16), (1, 24, 2, 16)))
    bias = prefix_bias(torch.arange(17, 25)[None], 24)

    def step(x, k, v, bias):
        return attn.cache_attention(lin(x).view(1, 8, 4, 16), k, v, bias)

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    with torch.no_grad():
        got, want = compiled(x, k, v, bias), step(x, k, v, bias)
    assert counter.frame_count == 1
    targets = {str(n.target) for n in counter.graphs[0].graph.nodes}
    assert {"dspark.panel_linear", "dspark.cached_attention"} <= targets, targets
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
