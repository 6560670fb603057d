"""scripts/gemm_bench.py: four kernels side by side per shape and row count, agreeing to rounding,
and the kernel the eager engine picks (cpu_kernels.dense / fuse_) named for each."""

from __future__ import annotations

import sys

import pytest
import torch

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "scripts"))
import gemm_bench  # noqa: E402

import cpu_kernels  # noqa: E402


def _table(capsys, shapes: str, threads: int) -> dict:
    before = torch.get_num_threads()
    try:
        assert gemm_bench.main(["--shapes", shapes, "--rows", "1,3", "--reps", "2", "--warmup", "1", "--copies", "2",
                                "--threads", str(threads)]) == 0
    finally:
        torch.set_num_threads(before)
    lines = capsys.readouterr().out.splitlines()
    assert "2 copies of the weight" in lines[0] and lines[1].split()[-2:] == ["engine", "uses"]
    rows = [l.split() for l in lines[2:]]
    assert [(r[0], r[1]) for r in rows] == [(s, n) for s in shapes.split(",") for n in ("1", "3")]
    assert all(float(r[6]) < 1e-4 for r in rows)  # the kernels agree to rounding
    return {(r[0], r[1]): (r[5], " ".join(r[7:])) for r in rows}


def test_gemm_bench_rows_and_engine_choice(capsys, monkeypatch):
    """The engine's choice per shape and row count: the few-row kernel from two rows on where out % 16
    == 0, for one row from the packing threshold on (with two threads on any weight); else (and where
    the kernels are unavailable) MKL, column-major where out >= in, and oneDNN from two rows on weights
    at the threshold."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN")
    big = int(cpu_kernels.PACK_MIN_ELEMENTS ** 0.5)  # a square weight at the packing threshold
    shapes = f"64x32,32x64,{big}x{big},40x32"
    one = _table(capsys, shapes, 1)
    if cpu_kernels.unavailable() is None:
        for shape in ("64x32", "32x64", f"{big}x{big}"):  # the few-row kernel, where out % 16 == 0
            for rows in ("1", "3"):
                assert one[(shape, rows)][0] != "n/a"
            assert one[(shape, "3")][1] == "panels"
        assert one[(f"{big}x{big}", "1")][1] == "panels"  # one row: on the kernel from the packing threshold on
        assert one[("64x32", "1")][1] == "MKL col" and one[("32x64", "1")][1] == "MKL"
        assert one[("40x32", "3")][0] == "n/a" and one[("40x32", "3")][1] == "MKL col"
        two = {k: v[1] for k, v in _table(capsys, shapes, 2).items()}
        assert two == {k: "panels" if k[0] != "40x32" else v[1] for k, v in one.items()}
        monkeypatch.setattr(cpu_kernels, "_kernels_why", "turned off by DSPARK_CPU_KERNELS")  # as if unavailable
        one = _table(capsys, shapes, 1)
    assert all(ours == "n/a" for ours, _ in one.values())
    without = {k: v[1] for k, v in one.items()}
    assert without[("64x32", "1")] == without[("64x32", "3")] == "MKL col"  # out >= in, under the threshold
    assert without[("32x64", "1")] == without[("32x64", "3")] == "MKL"      # in > out stays row-major
    assert without[(f"{big}x{big}", "1")] == "MKL col" and without[(f"{big}x{big}", "3")] == "oneDNN"


def test_gemm_bench_bad_input_is_one_line(capsys):
    assert gemm_bench.main(["--shapes", "64by32"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --shapes") and err.count("\n") == 1, err


def test_gemm_bench_attention_table_agrees_and_names_the_engine_choice(capsys, monkeypatch):
    """--attention: SDPA and the few-token kernel per TOKENSxKEYS agree to rounding, and the engine's
    choice is named (the kernel up to ATTENTION_MAX_TOKENS tokens, else SDPA);
    --shapes none leaves the GEMM table out; a TOKENS past KEYS is a one-line error."""
    monkeypatch.setattr(cpu_kernels, "ATTENTION_MAX_TOKENS", 4)
    before = torch.get_num_threads()
    try:
        assert gemm_bench.main(["--shapes", "none", "--attention", "1x20,6x33", "--heads", "4,2,16", "--reps", "2",
                                "--warmup", "1", "--copies", "2", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(before)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("attention, 4 query heads, 2 K/V heads, head dim 16") and "weight" not in lines[2]
    rows = [l.split() for l in lines[3:]]
    assert [(r[0], r[1]) for r in rows] == [("1", "20"), ("6", "33")]
    if cpu_kernels.unavailable() is None:
        assert all(float(r[4]) < 1e-5 for r in rows) and [r[5] for r in rows] == ["kernel", "SDPA"]
    else:
        assert all(r[3] == "n/a" and r[5] == "SDPA" for r in rows)
    assert gemm_bench.main(["--shapes", "none", "--attention", "9x8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --attention 9x8") and err.count("\n") == 1, err
