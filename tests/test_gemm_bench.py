"""scripts/gemm_bench.py: three kernels side by side per shape and row count, agreeing to rounding,
and the kernel the eager engine picks (model.dense / fuse_) named for each."""

from __future__ import annotations

import sys

import pytest
import torch

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "scripts"))
import gemm_bench  # noqa: E402

import model  # noqa: E402


def test_gemm_bench_rows_and_engine_choice(capsys):
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN")
    big = int(model.PACK_MIN_ELEMENTS ** 0.5)  # a square weight at the packing threshold
    shapes = f"64x32,32x64,{big}x{big}"
    assert gemm_bench.main(["--shapes", shapes, "--rows", "1,3", "--reps", "2", "--warmup", "1", "--copies", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "2 copies of the weight" in lines[0] and lines[1].split()[-2:] == ["engine", "uses"]
    rows = [l.split() for l in lines[2:]]
    assert [(r[0], r[1]) for r in rows] == [(s, n) for s in shapes.split(",") for n in ("1", "3")]
    assert all(float(r[5]) < 1e-4 for r in rows)  # the three agree to rounding
    choice = {(r[0], r[1]): " ".join(r[6:]) for r in rows}
    assert choice[("64x32", "1")] == choice[("64x32", "3")] == "MKL col"  # out >= in, under the threshold
    assert choice[("32x64", "1")] == choice[("32x64", "3")] == "MKL"      # in > out stays row-major
    assert choice[(f"{big}x{big}", "1")] == "MKL col" and choice[(f"{big}x{big}", "3")] == "oneDNN"


def test_gemm_bench_bad_input_is_one_line(capsys):
    assert gemm_bench.main(["--shapes", "64by32"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --shapes") and err.count("\n") == 1, err
