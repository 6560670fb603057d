"""The GPU checks and timings in one device call, each step saving what it measured before the next.

    python scripts/device_run.py --out DIR               # on a CUDA machine (needs only torch + triton)
    python scripts/device_run.py --dry-run --out DIR     # anywhere: the same steps on CPU with small shapes
                                                         # (a toy-layered preset, bf16, compiled where the
                                                         # step compiles, Triton in its interpreter)

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
(ok; skipped: it does nothing here; exit N; timed out; not run) and seconds. Exactness: bench asserts
equal tokens only in float32; in bf16 it reports the requests whose tokens differ and the target's
top-2 logit gap where they start.
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

from common import UserError, write_json  # noqa: E402  (common needs neither tyro nor wandb)

SKIPPED = 3  # a step's exit status when it did nothing here (summary.json: "skipped", not "ok")

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
    """bench.BenchArgs fields for a bench step. The dry run's are the GPU run's — a random-weight preset
    with the published vocabulary, bf16 (so the mismatch report's branch runs), compiled in the same mode
    where the step compiles, the same kernel set (Triton's in its CPU interpreter) — on CPU, with toy
    layers (qwen3-tiny), batch 2 for 32 and a few tokens."""
    compiled = step.startswith(("compiled", "triton"))
    args = dict(model="qwen3-8b", device="cuda", dtype="bfloat16", batch_sizes="32" if step.endswith("b32") else "1",
                prompt_len=128, max_new_tokens=128, repeats=2, compile=compiled, reference=False, out=out,
                kernels="triton" if step.startswith("triton-") else "torch")
    if compiled:  # CUDA graphs without autotuning (which would take most of the session for an 8B model)
        args["compile_mode"] = "reduce-overhead"
    if dry:
        args.update(model="qwen3-tiny", device="cpu", batch_sizes="2" if step.endswith("b32") else "1", prompt_len=8,
                    max_new_tokens=8, repeats=1)
    return args


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
        write_json(os.path.join(out_dir, "env.json"), info)
        return 0
    if step in ("eager-b1", "compiled-b1", "compiled-b32", "triton-b32"):
        import bench

        try:
            with torch.inference_mode():
                bench.run(bench.BenchArgs(**bench_args(step, dry, os.path.join(out_dir, f"{step}.json"))))
        except UserError as e:  # as bench.py's command line says it
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    if step == "triton":
        if dry:
            print("dry run: the Triton device check needs CUDA; skipped")
            return SKIPPED
        return subprocess.call([sys.executable, os.path.join(ROOT, "tests", "test_triton.py"), "--device"], cwd=ROOT)
    if step == "suite":
        if importlib.util.find_spec("tyro") is None:
            print("tyro is not importable here: the CLI tests need it; skipped")
            return SKIPPED
        if dry:
            print("dry run: the suite is what CI runs; skipped")
            return SKIPPED
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
    problem = (f"--steps: unknown step {bad[0]!r} (known: {', '.join(STEPS)})" if bad else
               "--steps: none given" if not steps else
               f"--budget {a.budget:g}: must be a number of seconds from 10 to 3600" if not 10 <= a.budget <= 3600 else
               f"--out {a.out}: is a file, not a directory" if os.path.exists(a.out) and not os.path.isdir(a.out)
               else None)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    a.out = os.path.abspath(a.out)  # the steps run from the repository root
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
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            if a.dry_run and step.startswith("triton-"):  # the Triton kernels on CPU: their interpreter
                env["TRITON_INTERPRET"] = "1"
            p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)

            def pump():  # echo and keep the step's output as it comes
                for line in p.stdout:
                    print(line, end="", flush=True)
                    log.write(line)
                    log.flush()
            reader = threading.Thread(target=pump, daemon=True)
            reader.start()
            try:
                p.wait(timeout=limit)
                status = {0: "ok", SKIPPED: "skipped"}.get(p.returncode, f"exit {p.returncode}")
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                status = "timed out"
            reader.join(timeout=5)
        summary["steps"].append({"step": step, "status": status, "seconds": round(time.monotonic() - t0, 1)})
        print(f"=== {step}: {status} in {time.monotonic() - t0:.0f} s", flush=True)
        write_json(os.path.join(a.out, "summary.json"), summary)
    return 0 if all(s["status"] in ("ok", "skipped") for s in summary["steps"]) else 1


if __name__ == "__main__":
    sys.exit(main())
