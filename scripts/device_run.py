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
(ok; skipped: it does nothing here; exit N; timed out; interrupted; not run) and seconds. DIR and the
files the steps write there are checked before the first step. Several calls may write one DIR (the
second call above): summary.json keeps the earlier calls' steps (each entry names its call; "calls"
gives each call's time and steps), a step run again replaces its entry and its file, and log.txt gets
a header line per call. Ctrl-C (SIGINT) or SIGTERM stops the running step (and what it started), marks
it interrupted in summary.json and ends with one line, exit 130 / 143. Exactness: bench asserts
equal tokens only in float32; in bf16 it reports the requests whose tokens differ and the target's
top-2 logit gap where they start.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from common import UserError, check_writable, read_json, write_json  # noqa: E402  (common needs neither tyro nor wandb)

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
BENCH_STEPS = ("eager-b1", "compiled-b1", "compiled-b32", "triton-b32")


def result_file(step: str):
    """The file a step writes in --out besides log.txt and summary.json (None: none)."""
    return "env.json" if step == "env" else f"{step}.json" if step in BENCH_STEPS else None


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
    if step in BENCH_STEPS:
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


def check_out(out: str, steps: list[str]):
    """--out before any step: the folder made if missing, and every file this call writes there writable."""
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out}: cannot create it ({e.strerror or e})") from None
    for name in ("summary.json", "log.txt", *filter(None, map(result_file, steps))):
        check_writable(os.path.join(out, name), "--out")


def earlier_summary(path: str) -> dict:
    """summary.json of the earlier calls into --out ({"calls": [...], "steps": [...]}), or an empty one."""
    if not os.path.exists(path):
        return {"calls": [], "steps": []}
    old = read_json(path)
    steps, calls = old.get("steps"), old.get("calls")
    if not (isinstance(steps, list) and all(isinstance(s, dict) and isinstance(s.get("step"), str) for s in steps)
            and isinstance(calls, (list, type(None)))):
        raise UserError(f"{path}: not a summary of scripts/device_run.py; remove it, or give another --out")
    if calls is None:  # written before calls were counted: one call
        calls, steps = [{k: old[k] for k in ("dry_run", "budget_s") if k in old}], [dict(s, call=1) for s in steps]
    return {"calls": calls, "steps": steps}


def stop(p: subprocess.Popen):
    """End a step's process and whatever it started (its process group): SIGTERM, SIGKILL after 5 s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:  # none left
            break
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    p.wait()


def now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


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
    summary_path = os.path.join(a.out, "summary.json")
    try:
        check_out(a.out, steps)
        summary = earlier_summary(summary_path)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    call = len(summary["calls"]) + 1
    started = now()
    summary["calls"].append({"call": call, "started": started, "steps": steps, "dry_run": a.dry_run,
                             "budget_s": a.budget})
    entries, mine = summary["steps"], []  # every call's steps; this call's statuses

    def put(entry: dict):  # this call's entry for a step replaces an earlier call's
        i = next((i for i, e in enumerate(entries) if e["step"] == entry["step"]), None)
        if i is None:
            entries.append(entry)
        else:
            entries[i] = entry

    with open(os.path.join(a.out, "log.txt"), "a") as log:
        log.write(f"##### call {call} at {started}: --steps {','.join(steps)}{' --dry-run' if a.dry_run else ''}\n")
    signals = []  # Ctrl-C / SIGTERM: the running step is stopped, no other starts
    handlers = {s: signal.signal(s, lambda signum, frame: signals.append(signum))
                for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        t_end = time.monotonic() + a.budget
        for step in steps:
            left = t_end - time.monotonic()
            if signals or left < 10:
                status = "not run: " + ("interrupted" if signals else "budget spent")
                mine.append(status)
                if not any(e["step"] == step for e in entries):  # else an earlier call's result stays
                    put({"step": step, "status": status, "call": call})
                continue
            limit = min(STEPS[step], left)
            print(f"=== {step} (at most {limit:.0f} s)", flush=True)
            t0 = time.monotonic()
            entry = {"step": step, "status": "running", "call": call, "started": now()}
            put(entry)
            if result_file(step) and os.path.exists(os.path.join(a.out, result_file(step))):
                os.remove(os.path.join(a.out, result_file(step)))  # an earlier call's, no longer in the summary
            write_json(summary_path, summary)
            cmd = [sys.executable, os.path.abspath(__file__), "--step", step, "--out", a.out] + (["--dry-run"] if a.dry_run else [])
            with open(os.path.join(a.out, "log.txt"), "a") as log:  # one log for all steps (few files come back)
                log.write(f"=== {step}\n")
                env = dict(os.environ, PYTHONUNBUFFERED="1")
                if a.dry_run and step.startswith("triton-"):  # the Triton kernels on CPU: their interpreter
                    env["TRITON_INTERPRET"] = "1"
                # its own process group (no Ctrl-C of its own): stopped here, with what it started
                p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, start_new_session=True)

                def pump():  # echo and keep the step's output as it comes
                    for line in p.stdout:
                        print(line, end="", flush=True)
                        log.write(line)
                        log.flush()
                reader = threading.Thread(target=pump, daemon=True)
                reader.start()
                while True:
                    try:
                        p.wait(timeout=0.2)
                        status = {0: "ok", SKIPPED: "skipped"}.get(p.returncode, f"exit {p.returncode}")
                        break
                    except subprocess.TimeoutExpired:
                        pass
                    if signals or time.monotonic() - t0 > limit:
                        status = "interrupted" if signals else "timed out"
                        stop(p)
                        break
                reader.join(timeout=5)
            entry.update(status=status, seconds=round(time.monotonic() - t0, 1))
            mine.append(status)
            print(f"=== {step}: {status} in {time.monotonic() - t0:.0f} s", flush=True)
            write_json(summary_path, summary)
        write_json(summary_path, summary)
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    if signals:
        print(f"interrupted by {signal.Signals(signals[0]).name}: stopped; {summary_path} lists what finished",
              file=sys.stderr)
        return 128 + signals[0]
    return 0 if all(s in ("ok", "skipped") for s in mine) else 1


if __name__ == "__main__":
    sys.exit(main())
