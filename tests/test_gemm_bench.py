"""scripts/gemm_bench.py: MKL and the CPU backend's kernels side by side per shape and row count (and per
attention size), agreeing to rounding, with what `cpu_kernels.install` runs there named for each."""

from __future__ import annotations

import sys

import torch
from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "scripts"))
import gemm_bench  # noqa: E402

from support import cpu_kernels  # noqa: E402

FAST = ["--reps", "2", "--warmup", "1", "--copies", "2", "--threads", "1"]


def _run(capsys, *argv) -> list[str]:
    before = torch.get_num_threads()
    try:
        assert gemm_bench.main([*argv, *FAST]) == 0
    finally:
        torch.set_num_threads(before)
    lines = capsys.readouterr().out.splitlines()
    assert "2 copies" in lines[0] and lines[-1].startswith("process: ") and "s CPU" in lines[-1]
    return lines[1:-1]


def test_gemm_bench_compares_mkl_and_the_kernel_per_shape_and_rows(capsys, monkeypatch):
    """One row per shape and row count: both times, their ratio, a difference of rounding; the kernel
    where out is a multiple of 16 (n/a and MKL elsewhere, and everywhere when the kernels are
    unavailable)."""
    kernels = cpu_kernels.unavailable() is None
    lines = _run(capsys, "--shapes", "64x32,40x32", "--rows", "1,9")
    assert lines[0].split()[-2:] == ["install", "uses"]
    rows = [line.split() for line in lines[1:]]
    assert [(r[0], r[1]) for r in rows] == [("64x32", "1"), ("64x32", "9"), ("40x32", "1"), ("40x32", "9")]
    for r in rows[:2]:
        if kernels:
            assert r[3] != "n/a" and r[4].endswith("x") and float(r[5]) < 1e-4 and r[6] == "kernel"
        else:
            assert r[3] == "n/a" and r[-1] == "MKL"
    # where no kernel ran nothing was compared: no ratio and no difference (a 0.00e+00 was printed)
    assert all(r[3:6] == ["n/a"] * 3 and r[-1] == "MKL" for r in rows[2:])
    monkeypatch.setattr(cpu_kernels, "_why", "turned off by DSPARK_CPU_KERNELS")  # as if unavailable
    lines = _run(capsys, "--shapes", "64x32", "--rows", "2")
    assert lines[1].split()[3:6] == ["n/a"] * 3 and lines[1].split()[-1] == "MKL"


def test_gemm_bench_attention_table_agrees_and_names_what_runs(capsys, monkeypatch):
    """--attention: SDPA and the kernel per TOKENSxKEYS agree to rounding, the kernel named up to
    ATTENTION_MAX_TOKENS tokens, else SDPA; --shapes none leaves the GEMM table out."""
    monkeypatch.setattr(cpu_kernels, "ATTENTION_MAX_TOKENS", 4)
    lines = _run(capsys, "--shapes", "none", "--attention", "1x20,6x33", "--heads", "4,2,16")
    assert lines[0].startswith("attention, 4 query heads, 2 K/V heads, head dim 16") and "weight" not in lines[1]
    rows = [line.split() for line in lines[2:]]
    assert [(r[0], r[1]) for r in rows] == [("1", "20"), ("6", "33")]
    if cpu_kernels.unavailable() is None:
        assert all(float(r[5]) < 1e-5 for r in rows) and [r[6] for r in rows] == ["kernel", "SDPA"]
    else:
        assert all(r[3] == "n/a" and r[-1] == "SDPA" for r in rows)


def test_gemm_bench_bad_input_is_one_line(capsys):
    for argv, start in ((["--shapes", "64by32"], "error: --shapes"), (["--shapes", "none", "--attention", "9x8"],
                                                                       "error: --attention 9x8")):
        assert gemm_bench.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(start) and err.count("\n") == 1, err
    # each flag's own example: --attention's is TOKENSxKEYS, not a weight's OUTxIN
    assert gemm_bench.main(["--shapes", "none", "--attention", "8x"]) == 2
    assert capsys.readouterr().err == "error: --attention: '8x' is not two numbers AxB (e.g. 8x204)\n"


def test_gemm_bench_refuses_a_shape_that_does_not_fit_before_building_it(capsys):
    """A weight of 2^40 floats is within the shapes' range, not within memory: one line, not the allocator's."""
    assert gemm_bench.main(["--shapes", "1048576x1048576", "--copies", "1", "--rows", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --shapes 1048576x1048576: needs 8192.0 GiB at --copies 1") and err.count("\n") == 1
    assert gemm_bench.main(["--shapes", "none", "--attention", "1x1048576", "--copies", "1024"]) == 2
    assert capsys.readouterr().err.startswith("error: --attention 1x1048576: needs")


def test_gemm_bench_each_way_takes_every_copy_in_turn():
    """Each of the interleaved ways goes through all --copies, whatever their number (a counter shared
    by two ways gave each only half of an even number, one copy each at --copies 2), and from 3 copies
    on no call reuses the copy of the call before it."""
    for copies in (1, 2, 3, 4, 16):
        used = {"mkl": [], "kernel": []}
        calls = []
        ways = {k: lambda i, k=k: (used[k].append(i), calls.append(i)) for k in used}
        gemm_bench.interleaved_us(ways, gemm_bench.GemmArgs(reps=2 * copies, warmup=0, copies=copies))
        assert all(sorted(set(u)) == list(range(copies)) for u in used.values()), (copies, used)
        if copies >= 3:
            assert all(a != b for a, b in zip(calls, calls[1:])), (copies, calls)
