"""CPU GEMMs of a round: MKL (`F.linear`) against oneDNN on a packed weight (`model.dense`), in one process.

    python scripts/gemm_bench.py --threads 1
    python scripts/gemm_bench.py --threads 1 --shapes 3072x512,512x1536 --rows 1,6,64

Why it exists: the eager engine sends float32 GEMMs of more than one row to oneDNN on weights packed
once (`model.Dense`), because on this project's CPU MKL multiplied the few rows of a verification at a
fraction of a core's peak. Whether that holds is a property of the CPU and the BLAS build: run this on
yours. For each weight shape OUTxIN (a layer's [out, in]) and row count it prints the median
microseconds per product of `--reps` calls (after `--warmup`) for both, interleaved, their ratio, and
the largest difference between the two results (they round differently; they must agree to ~1e-5),
and whether the engine packs that weight (`model.PACK_MIN_ELEMENTS`: smaller ones stay with MKL).
Default shapes: a layer's GEMMs ([v; k; q], o_proj, gate or up, down_proj, a 4096-token lm_head) at
hidden 256 (the demo pair's), at hidden 384 (fused gate-up there), and a wider 512 / 1536 / 8192 set.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import UserError, check_ranges, cli_main, device_name, parse_ints  # noqa: E402
from model import PACK_MIN_ELEMENTS, dense, pack_weight  # noqa: E402


@dataclass
class GemmArgs:
    """MKL vs packed oneDNN float32 GEMMs at the shapes of a round, on this CPU."""

    shapes: str = ("512x256,256x256,768x256,256x768,4096x256,"
                   "640x384,384x384,2304x384,384x1152,4096x384,3072x512,512x1536,8192x512")
    """Comma-separated weight shapes OUTxIN."""
    rows: str = "1,2,6,12,64"
    """Comma-separated row counts of the input (a verification of a block of K drafts has K+1 rows per request)."""
    threads: int = 1
    """torch threads."""
    reps: int = 200
    """Timed products per (shape, rows, kernel), interleaved between the two kernels."""
    warmup: int = 20
    """Untimed products first."""
    seed: int = 0
    """Seed of the random weights and inputs."""


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for part in text.split(","):
        try:
            out, inp = (int(x) for x in part.strip().lower().split("x"))
        except ValueError:
            raise UserError(f"--shapes: {part.strip()!r} is not OUTxIN (e.g. 3072x512)") from None
        if not (1 <= out <= 1 << 20 and 1 <= inp <= 1 << 20):
            raise UserError(f"--shapes: {part.strip()!r} is outside 1..1048576")
        shapes.append((out, inp))
    return shapes


def run(args: GemmArgs) -> int:
    check_ranges(args, threads="[1, 1024]", reps="[1, 100000]", warmup="[0, 100000]", seed=f"[0, {2**62}]")
    shapes = parse_shapes(args.shapes)
    rows = parse_ints(args.rows, "--rows")
    if any(r < 1 or r > 65536 for r in rows):
        raise UserError(f"--rows {args.rows}: each must be in 1..65536")
    if not torch.backends.mkldnn.is_available():
        raise UserError("this torch was built without oneDNN (torch.backends.mkldnn): nothing to compare")
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(args.seed)
    print(f"{device_name('cpu')}, torch {torch.__version__}, {args.threads} thread(s), float32; "
          f"median µs of {args.reps} interleaved products")
    print(f"{'weight':>11} {'rows':>5} {'MKL µs':>9} {'oneDNN µs':>10} {'MKL/oneDNN':>11} {'max |diff|':>11} {'packed':>7}")
    for out, inp in shapes:
        w = torch.randn(out, inp, generator=g) / inp ** 0.5
        packed = pack_weight(w, min_elements=0)
        for r in rows:
            x = torch.randn(r, inp, generator=g)
            kernels = {"mkl": lambda: torch.nn.functional.linear(x, w), "onednn": lambda: dense(x, w, None, packed)}
            if r == 1:  # dense keeps one row on F.linear: time oneDNN itself
                kernels["onednn"] = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            for _ in range(args.warmup):
                for f in kernels.values():
                    f()
            times = {k: [] for k in kernels}
            for _ in range(args.reps):
                for k, f in kernels.items():
                    t0 = time.perf_counter()
                    f()
                    times[k].append(time.perf_counter() - t0)
            mkl, onednn = (statistics.median(times[k]) * 1e6 for k in ("mkl", "onednn"))
            diff = (kernels["mkl"]() - kernels["onednn"]()).abs().max().item()
            print(f"{out:>5}x{inp:<5} {r:>5} {mkl:>9.1f} {onednn:>10.1f} {mkl / onednn:>10.2f}x {diff:>11.2e} "
                  f"{'yes' if out * inp >= PACK_MIN_ELEMENTS else 'no':>7}",
                  flush=True)
    return 0


def main(argv=None) -> int:
    return cli_main(GemmArgs, run, argv)


if __name__ == "__main__":
    sys.exit(main())
