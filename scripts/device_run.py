"""The GPU checks and timings in one device call, each step saving what it measured before the next.

    python scripts/device_run.py --out DIR               # on a CUDA machine (needs only torch + triton)
    python scripts/device_run.py --dry-run --out DIR     # anywhere: the same steps on CPU with small shapes

A device session is short (minutes, compiling included), so every step runs in its own process
under its own time limit, within one overall budget: a step that hangs, crashes or runs out of time
is reported and the next one still runs. Steps, most important first:
  env          the GPU, driver, torch and triton versions
  eager-b1     bench.py on random-weight Qwen3-8B + a block-7, 5-layer DSpark drafter, bf16, batch 1, eager
  compiled-b1  the same compiled (reduce-overhead: CUDA graphs without autotuning, which would take
               most of the session for an 8B model's GEMM shapes)
  triton       kernels.py's Triton kernels against the references on real shapes, and traced by torch.compile
  compiled-b32 batch 32 compiled
  suite        the CPU test suite under this machine's torch (when tyro is importable), in parallel
  triton-b32   batch 32 compiled with --kernels triton (the Markov chain, acceptance and the cache
               attention as kernels.py's Triton kernels): after the rest, or alone in a call of its own
               (--steps triton-b32)
Bench steps write DIR/<step>.json (bench's own JSON, rewritten after every batch size), env writes
DIR/env.json, every step's output goes to DIR/log.txt, and DIR/summary.json gives each step's status
and seconds. Exactness: bench asserts equal tokens only in float32; in bf16 it reports the
requests whose tokens differ and the target's top-2 logit gap where they start.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# step -> (seconds it may take at most, what it runs)
STEPS = {
    "env": 60,
    "eager-b1": 150,
    "compiled-b1": 300,
    "triton": 150,
    "compiled-b32": 300,
    "suite": 300,
    "triton-b32": 300,
}


def bench_args(step: str, dry: bool, out: str) -> dict:
    """bench.BenchArgs fields for a bench step."""
    batch = "32" if step.endswith("b32") else "1"
    if dry:  # the constructed CPU pair, tiny, eager, the plain kernels: the plumbing only
        return dict(model="bigram-35m", device="cpu", batch_sizes=batch if batch == "1" else "2", prompt_len=8,
                    max_new_tokens=8, repeats=1, compile=False, reference=False, out=out)
    return dict(model="qwen3-8b", device="cuda", dtype="bfloat16", batch_sizes=batch, prompt_len=128,
                max_new_tokens=128, repeats=2, compile=step.startswith(("compiled", "triton")),
                compile_mode="reduce-overhead", reference=False, out=out,
                kernels="triton" if step.startswith("triton-") else "torch")


def run_step(step: str, dry: bool, out_dir: str):
    """One step, in this process (the parent runs each in a child under a time limit)."""
    import torch

    if step == "env":
        info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
                "cuda_available": torch.cuda.is_available()}
        try:
            import triton
            info["triton"] = triton.__version__
        except ImportError:
            info["triton"] = None
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            info.update(gpu=p.name, memory_gib=p.total_memory / 2**30, multiprocessors=p.multi_processor_count)
        print(json.dumps(info))
        with open(os.path.join(out_dir, "env.json"), "w") as f:
            json.dump(info, f, indent=1)
        return 0
    if step in ("eager-b1", "compiled-b1", "compiled-b32", "triton-b32"):
        import bench

        with torch.inference_mode():
            bench.run(bench.BenchArgs(**bench_args(step, dry, os.path.join(out_dir, f"{step}.json"))))
        return 0
    if step == "triton":
        if dry:
            print("dry run: the Triton device check needs CUDA; skipped")
            return 0
        return subprocess.call([sys.executable, os.path.join(ROOT, "tests", "test_triton.py"), "--device"], cwd=ROOT)
    if step == "suite":
        if importlib.util.find_spec("tyro") is None:
            print("tyro is not importable here: the CLI tests need it; skipped")
            return 0
        if dry:
            print("dry run: the suite is what CI runs; skipped")
            return 0
        cmd = [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", "tests"]
        if importlib.util.find_spec("xdist") is not None:
            cmd[-1:-1] = ["-n", "12"]
        if importlib.util.find_spec("pytest_timeout") is not None:
            cmd[-1:-1] = ["--timeout", "150"]
        return subprocess.call(cmd, cwd=ROOT, env=dict(os.environ, TRITON_INTERPRET="0"))
    raise SystemExit(f"unknown step {step!r}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "device_out"), help="where the results go (default: $OUT)")
    ap.add_argument("--dry-run", action="store_true", help="run every step on CPU with small shapes (no CUDA needed)")
    ap.add_argument("--budget", type=float, default=540, help="seconds for all steps together (default 540)")
    ap.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated steps, in order (default: {','.join(STEPS)})")
    ap.add_argument("--step", help=argparse.SUPPRESS)  # internal: run one step in this process
    a = ap.parse_args()
    steps = [s.strip() for s in a.steps.split(",") if s.strip()]
    bad = [s for s in steps if s not in STEPS]
    if bad:
        print(f"error: --steps: unknown step {bad[0]!r} (known: {', '.join(STEPS)})", file=sys.stderr)
        return 2
    if a.step:
        return run_step(a.step, a.dry_run, a.out)
    if not a.dry_run:
        import torch
        if not torch.cuda.is_available():
            print("error: scripts/device_run.py needs a CUDA device (use --dry-run to check its plumbing on CPU)",
                  file=sys.stderr)
            return 2
    os.makedirs(a.out, exist_ok=True)
    t_end = time.monotonic() + a.budget
    summary = {"dry_run": a.dry_run, "budget_s": a.budget, "steps": []}
    for step in steps:
        left = t_end - time.monotonic()
        if left < 10:
            summary["steps"].append({"step": step, "status": "not run: budget spent"})
            continue
        limit = min(STEPS[step], left)
        print(f"=== {step} (at most {limit:.0f} s)", flush=True)
        t0 = time.monotonic()
        cmd = [sys.executable, os.path.abspath(__file__), "--step", step, "--out", a.out] + (["--dry-run"] if a.dry_run else [])
        with open(os.path.join(a.out, "log.txt"), "a") as log:  # one log for all steps (few files come back)
            log.write(f"=== {step}\n")
            p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 env=dict(os.environ, PYTHONUNBUFFERED="1"))

            def pump():  # echo and keep the step's output as it comes
                for line in p.stdout:
                    print(line, end="", flush=True)
                    log.write(line)
                    log.flush()
            reader = threading.Thread(target=pump, daemon=True)
            reader.start()
            try:
                p.wait(timeout=limit)
                status = "ok" if p.returncode == 0 else f"exit {p.returncode}"
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                status = "timed out"
            reader.join(timeout=5)
        summary["steps"].append({"step": step, "status": status, "seconds": round(time.monotonic() - t0, 1)})
        print(f"=== {step}: {status} in {time.monotonic() - t0:.0f} s", flush=True)
        with open(os.path.join(a.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if all(s["status"] == "ok" for s in summary["steps"]) else 1


if __name__ == "__main__":
    sys.exit(main())
