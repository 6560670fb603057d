"""cpu_gemm.py and cpu_gemm.cpp: the few-row CPU GEMM against F.linear, its panel layout, and its
build's failure reasons. (How model.dense picks it: tests/test_model.py; compiled graphs calling it:
tests/test_compile.py.)"""

from __future__ import annotations

import os

import pytest
import torch

import cpu_gemm

torch.set_num_threads(1)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


needs_cpu_gemm = pytest.mark.skipif(cpu_gemm.cpu_gemm_unavailable() is not None,
                                    reason=f"the CPU GEMM kernel is unavailable: {cpu_gemm.cpu_gemm_unavailable()}")


@needs_cpu_gemm
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
    panels = cpu_gemm.panel_weight(w)
    assert panels.shape == (N // 16, K, 16) and panels.is_contiguous()
    for rows in (0, 1, 2, 3, 5, 6, 7, 12, 13, 64):
        x = torch.randn(rows, K, generator=g)
        for bias in (None, b):
            got, want = cpu_gemm.panel_linear(x, panels, bias), torch.nn.functional.linear(x, w, bias)
            assert got.shape == want.shape == (rows, N)
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * K ** 0.5)
            for i in range(rows):
                assert torch.equal(cpu_gemm.panel_linear(x[i:i + 1], panels, bias)[0], got[i])
    x = torch.randn(2, 3, 2 * K, generator=g)[:, :, ::2]  # 3-D, not contiguous
    assert torch.allclose(cpu_gemm.panel_linear(x, panels, b), torch.nn.functional.linear(x, w, b), rtol=1e-5,
                          atol=1e-5 * K ** 0.5)


@needs_cpu_gemm
def test_panel_weight_applies_to_float32_cpu_weights_with_whole_panels_only():
    """panel_weight: None where the kernel does not apply (out not a multiple of 16, another dtype, a
    1-D tensor); panel_linear refuses an x that does not fit, by shape and dtype, and panels that are
    not panel_weight's layout (the C kernel would read past them)."""
    assert cpu_gemm.panel_weight(torch.randn(40, 8)) is None
    assert cpu_gemm.panel_weight(torch.randn(32, 8, dtype=torch.bfloat16)) is None
    assert cpu_gemm.panel_weight(torch.randn(32)) is None
    panels = cpu_gemm.panel_weight(torch.randn(32, 8))
    with pytest.raises(ValueError, match="does not fit"):
        cpu_gemm.panel_linear(torch.randn(2, 9), panels)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_gemm.panel_linear(torch.randn(2, 8, dtype=torch.float64), panels)
    for bad in (panels.transpose(1, 2), panels.double(), panels[:, :, :8].contiguous(), panels[0]):
        with pytest.raises(ValueError, match="panel_weight's"):
            cpu_gemm.panel_linear(torch.randn(2, 8), bad)


def test_cpu_gemm_build_says_why_it_is_unavailable(tmp_path, monkeypatch):
    """The build in words when it cannot be used: switched off, no compiler, a source the compiler
    rejects (its first error line, and no temporary file left in the cache folder); built, it lands
    in the cache folder under a key of source and flags, and a second call finds it there."""
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("DSPARK_CPU_GEMM", "0")
    assert cpu_gemm._build_cpu_gemm() == "turned off by DSPARK_CPU_GEMM"
    monkeypatch.delenv("DSPARK_CPU_GEMM")
    if cpu_gemm.cpu_gemm_unavailable() is not None:
        pytest.skip(f"the CPU GEMM kernel is unavailable here: {cpu_gemm.cpu_gemm_unavailable()}")
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert cpu_gemm._build_cpu_gemm().startswith("no C++ compiler")
    monkeypatch.delenv("CXX")
    bad = tmp_path / "bad.cpp"
    bad.write_text("this is not C++\n")
    monkeypatch.setattr(cpu_gemm, "CPU_GEMM_SOURCE", str(bad))
    why = cpu_gemm._build_cpu_gemm()
    assert isinstance(why, str) and f"failed on {bad}:" in why and "\n" not in why
    assert os.listdir(tmp_path / "cache") == []
    monkeypatch.undo()
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path / "cache"))
    fn = cpu_gemm._build_cpu_gemm()
    assert callable(fn)
    built = os.listdir(tmp_path / "cache")
    assert len(built) == 1 and built[0].startswith("cpu_gemm-") and built[0].endswith(".so")
    assert callable(cpu_gemm._build_cpu_gemm()) and os.listdir(tmp_path / "cache") == built
