"""Verification schedulers under load: tokens/s against the number of requests decoded together
(the paper's Figures 7/8, on this machine).

    python scripts/bench_concurrency.py --concurrency 1,2,4,8,16,32,64 --threads 1 --max-new-tokens 64 \
        --out conc.json --plot conc.png
    python scripts/bench_concurrency.py --concurrency 1,8,32 --target DIR --drafter DIR --prompts-file p.jsonl \
        --device cuda

For every concurrency c, c x --requests-per-slot requests (the demo pair's 20 held-out code prompts,
or --prompts-file, cycled) stream through c rows — continuous batching: a finished request's row
takes the next waiting one — autoregressively and under each verification scheduler (--schedulers;
--confidence-threshold for the threshold one), greedy by default. All modes run the same executor — the round's
two halves with ragged verification, which also skips rows left free when the workload drains — so
only the schedule differs between them. Each engine gets an untimed warm-up; the hardware and async
schedulers' SPS(B) is profiled once per c, by each engine's own round (its seconds reported apart),
or replaced by a synthetic curve (--sps-synthetic, `cliffs_sps`); then --repeats timed runs,
interleaved across schedulers, and the median is reported: total tokens/s (all requests' tokens ÷
prefill + decode wall seconds), per-request tokens/s (the mean of a request's tokens ÷ the seconds
from its admission to its end), τ, the verify budget (drafts sent to the target per request per
round) and total tokens/s ÷ the none scheduler's — and with --sps-synthetic the modelled tokens/s:
the rounds' tokens over their times as the synthetic curve prices them. Greedy outputs must be
identical under every scheduler and autoregressively (lossless); a difference raises. A markdown
table goes to stdout, --out writes JSON, --plot a PNG or SVG (plots.py). The demo pair is used
unless --target/--drafter are given; on cpu the engines run eagerly unless --compile is given. The
decode and machine flags are every program's (support.flags.Settings, Machine); a decode setting this
benchmark does not read (--scheduler, --batch-size, --top-k, ...) is refused.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field, fields
from typing import Literal, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import timed_generate  # noqa: E402

from scheduler import KINDS, SPS_KINDS, profile_sps  # noqa: E402
from speculate import DEMO_DIR, Engine, Request, cache_length  # noqa: E402
from support import flags, plots  # noqa: E402
from support.checkpoint import load_models, resolve_checkpoint  # noqa: E402
from support.cli import (
    UserError,
    check_ranges,
    cli_main,
    device_name,
    flag,
    flat,
    flat_fields,
    parse_ints,
    resolve_device,
    resolve_dtype,
    set_threads,
    use_compile_cache,
)
from support.files import check_outputs, write_json  # noqa: E402
from support.flags import Machine, Settings  # noqa: E402
from support.text import check_prompts, load_prompts  # noqa: E402

HELDOUT = os.path.join(DEMO_DIR, "heldout.jsonl")  # the demo pair's committed held-out prompts (scripts/demo_prompts.py)


@dataclass
class ConcurrencyArgs:
    """The verification schedulers against the number of requests decoded together."""

    concurrency: str = "1,2,4,8,16,32,64"
    """Comma-separated concurrencies: that many requests decoded together, for every --schedulers
    entry and autoregressively."""
    target: Optional[str] = None
    """A Hugging Face Qwen3 directory or hub id ORG/NAME[@REVISION] (default: the demo pair's, demo/target)."""
    drafter: Optional[str] = None
    """A drafter directory or hub id, with a confidence head (default: demo/drafter)."""
    schedulers: str = "none,threshold,hardware,async"
    """The verification schedulers to compare (none, threshold, hardware, async)."""
    sps_synthetic: Optional[Literal["cliffs"]] = None
    """Instead of profiling SPS(B) for hardware and async, give both a synthetic step function (to
    compare their decisions where Algorithm 1's early stop hurts). cliffs: a round of B verify tokens
    takes 1 + ceil(B/16)/4 time units — flat inside each tile of 16 tokens, a quarter of the base cost
    more past every edge (B = 17, 33, ...), like kernels that work in 16-token tiles. The table then
    adds the modelled tokens/s: the rounds' tokens ÷ the sum of their synthetic times (prefill is
    not modelled)."""
    # 64 new tokens a request, greedy (every scheduler's output is checked equal), and θ 0.8 for the
    # threshold scheduler: the demo drafter's first-draft confidences sit mostly above 0.8, so 0.5
    # would cut almost nothing. --confidence-threshold must be in (0, 1] here.
    decode: flat(Settings) = field(default_factory=lambda: Settings(max_new_tokens=64, temperature=0.0,
                                                                    confidence_threshold=0.8))
    machine: flat(Machine) = field(default_factory=Machine)
    requests_per_slot: int = 3
    """c x this many requests stream through the c rows (continuous batching: a finished request's
    row takes the next one), so one slow request does not idle the rest."""
    prompts_file: Optional[str] = None
    """JSON lines of {"prompt": str}, {"prompt_ids": [int]} or {"turns": [str]}, cycled to fill each
    batch (default: the demo pair's 20 held-out code prompts, demo/heldout.jsonl)."""
    repeats: int = 3
    """Timed runs per mode and concurrency, interleaved in rotating order; the median is reported."""
    out: Optional[str] = None
    """Write the results as JSON here."""
    plot: Optional[str] = None
    """Draw total and per-request tokens/s against concurrency into this file (.png or .svg)."""


def use_curve(scheduler, sps: list[float]):
    """The scheduler prices rounds by SPS(B) as given for B = 0 .. top (no fit, no bucket routing)."""
    scheduler.sps.copy_(torch.tensor(sps, dtype=torch.float64))
    scheduler.table, scheduler.route = {"steps_per_second_by_tokens": list(sps)}, None


def cliffs_sps(top: int) -> list[float]:
    """--sps-synthetic cliffs: SPS(B) for B = 0 .. top, steps per time unit when a round verifies B
    tokens, 1 / (1 + ceil(B/16)/4) (B = 0 priced as 1). Only its shape matters to the schedulers."""
    return [1 / (1 + math.ceil(max(b, 1) / 16) / 4) for b in range(top + 1)]


def recording(engine, sizes: list):
    """Make the engine append every round's verify size (its tokens) to `sizes`."""
    verify = engine.verify_fn

    def verify_fn(*args, num_tokens=None, **kwargs):
        sizes.append(num_tokens)
        return verify(*args, num_tokens=num_tokens, **kwargs)
    engine.verify_fn = verify_fn


# The decode settings this benchmark reads; any other given would change nothing here (every
# scheduler of --schedulers is timed at every --concurrency), so it is refused rather than ignored.
READ = ("max_new_tokens", "temperature", "seed", "compile", "compile_mode", "confidence_threshold")
# Settings whose part one of this benchmark's own flags plays, and what to give instead.
OWN_FLAG = {
    "scheduler": "bench_concurrency.py times every scheduler of --schedulers (e.g. --schedulers threshold)",
    "batch_size": "bench_concurrency.py decodes --concurrency requests together (e.g. --concurrency 8)",
}


def check_settings(args: ConcurrencyArgs) -> Settings:
    """The decode and machine flags alone, checked as every program checks them; returns the settings
    with --compile resolved."""
    default = Settings()
    for f in fields(Settings):
        given = getattr(args.decode, f.name)
        if f.name in READ or given == getattr(default, f.name):
            continue
        if f.name in OWN_FLAG:
            raise UserError(f"{flag(f.name)}: {OWN_FLAG[f.name]}")
        read = ", ".join(flag(name) for name in READ)
        raise UserError(f"{flag(f.name)}: bench_concurrency.py decodes with {read} only; it would change "
                        f"nothing here")
    if args.decode.temperature is None:  # (other programs read the target's generation_config.json)
        raise UserError("--temperature None: give a temperature (0: greedy)")
    s = flags.check_settings(args.decode, args.machine.device)
    flags.check_machine(args.machine, s.compile)
    # The threshold scheduler's θ: at 0 it would verify every draft, the none scheduler's schedule.
    check_ranges(s, confidence_threshold="(0, 1]")
    return s


def recorded_flags(args: ConcurrencyArgs) -> dict:
    """The flags as given, one key each (the --out file's config): the decode settings this benchmark
    does not read are left out, as a --batch-size or --scheduler there would misdescribe the run."""
    config = flat_fields(args)
    for f in fields(Settings):
        if f.name not in READ:
            del config[f.name]
    return config


def run(args: ConcurrencyArgs) -> list[dict]:
    """Total and per-request tokens/s against concurrency for every scheduler (and autoregressive)."""
    levels = sorted(parse_ints(args.concurrency, "--concurrency", positive=True, distinct=True))
    schedulers = [s.strip() for s in args.schedulers.split(",")]
    if any(s not in KINDS for s in schedulers) or len(set(schedulers)) != len(schedulers):
        raise UserError(f"--schedulers: {args.schedulers!r} must be distinct names from {', '.join(KINDS)}")
    if args.sps_synthetic and not set(schedulers) & set(SPS_KINDS):
        raise UserError(f"--sps-synthetic {args.sps_synthetic}: only the hardware and async schedulers read SPS(B), "
                        f"and --schedulers has neither")
    s = check_settings(args)
    check_ranges(args, repeats="[1, 1000]", requests_per_slot="[1, 100000]")
    demo = args.target is None and args.drafter is None
    prompts_file = args.prompts_file or (HELDOUT if demo else None)
    check_outputs({"--out": args.out, "--plot": args.plot}, inputs=[args.target, args.drafter, prompts_file])
    plots.check_plot_path(args.plot, "--plot")
    target_dir = os.path.join(DEMO_DIR, "target") if demo else args.target
    drafter_dir = os.path.join(DEMO_DIR, "drafter") if demo else args.drafter
    if target_dir is None or drafter_dir is None:
        raise UserError("--target/--drafter: this benchmark compares a drafter's schedulers: give both "
                        "(or neither, for the demo pair)")
    if prompts_file is None:  # before any model loads
        raise UserError("--prompts-file: needed with a --target other than the demo pair")
    if not os.path.exists(prompts_file):  # (the rest of its checks are load_prompts')
        raise UserError(f"{prompts_file}: prompts file not found")
    target_dir, drafter_dir = resolve_checkpoint(target_dir, "--target"), resolve_checkpoint(drafter_dir, "--drafter")
    check_outputs({"--out": args.out, "--plot": args.plot}, inputs=[target_dir, drafter_dir])  # hub ids' snapshots
    if s.compile:
        use_compile_cache(args.machine.compile_cache)
    set_threads(args.machine.threads)  # its line is not printed: the header's hardware names the threads
    dev = resolve_device(args.machine.device)
    dtype = resolve_dtype(args.machine.dtype, dev)
    m = load_models(target_dir, drafter_dir, device=dev, dtype=args.machine.dtype)
    target, drafter = m.target, m.drafter
    chat = m.tokenizer is not None and m.tokenizer.chat_template is not None
    sources = []
    prompts = load_prompts(tokenizer=m.tokenizer, chat=chat, prompts_file=prompts_file, sources=sources)
    check_prompts(prompts, target, s.max_new_tokens, sources=sources, drafter=drafter)
    modes = ["autoregressive"] + schedulers
    hw, greedy = device_name(dev), s.temperature == 0
    print(f"# {target_dir} + {drafter_dir} ({drafter.cfg.describe()}), {dtype}, {hw}, "
          f"torch {torch.__version__}, compile={s.compile}; {len(prompts)} prompts cycled, {s.max_new_tokens} "
          f"new tokens each, {'greedy' if greedy else f'temperature {s.temperature}'}, threshold "
          f"{s.confidence_threshold}, median of {args.repeats}"
          + (f", SPS(B) synthetic: {args.sps_synthetic}" if args.sps_synthetic else ""), flush=True)

    rows, sps_tables = [], {}
    for c in levels:
        batch = [prompts[i % len(prompts)] for i in range(c * args.requests_per_slot)]  # the workload
        max_seq = cache_length(max(len(p) for p in batch), s.max_new_tokens, drafter)
        # Building an engine (re)allocates the target's and drafter's caches, which every engine
        # shares: so all of one concurrency's engines are built first, with one cache length, and
        # only then compiled or run — they all use the last allocation.
        engines = {mode: Engine(target, None if mode == "autoregressive" else drafter, batch_size=c, max_seq=max_seq,
                                temperature=s.temperature, seed=s.seed, stop_ids=m.stop_ids,
                                scheduler="none" if mode == "autoregressive" else mode,
                                threshold=s.confidence_threshold if mode == "threshold" else 0.0,
                                ragged=True, compile=s.compile, compile_mode=s.compile_mode)  # one executor for all
                   for mode in modes}
        if s.compile:
            for e in engines.values():
                e.warmup()
        profile_seconds, curve = {}, cliffs_sps(c * (drafter.cfg.num_drafts + 1)) if args.sps_synthetic else None
        for mode in [m for m in modes if m in SPS_KINDS]:  # SPS(B) depends on the batch capacity: once per c
            if curve is not None:
                use_curve(engines[mode].scheduler, curve)
                sps_tables.setdefault(c, {})[mode] = {"verify_tokens": list(range(len(curve))),
                                                      "steps_per_second": curve}
                continue
            t0 = time.perf_counter()  # each engine's own round: async's has no host read inside
            table = profile_sps(engines[mode])
            engines[mode].scheduler.set_sps(table)
            profile_seconds[mode] = time.perf_counter() - t0
            sps_tables.setdefault(c, {})[mode] = {"verify_tokens": table["profile_points"],
                                                  "steps_per_second": table["steps_per_second"]}
        sizes = {mode: [] for mode in modes}
        for mode in modes:
            recording(engines[mode], sizes[mode])
        for e in engines.values():  # untimed: settle allocators and caches, as bench.side_engine does
            e.generate([Request(i, p) for i, p in enumerate(batch[:c])], min(s.max_new_tokens, 8))
        runs = {mode: [] for mode in modes}
        for rep in range(args.repeats):
            # Interleaved, and the order rotated each repeat, so a slow spell on a shared machine
            # lands on every mode rather than on whichever would run in it.
            k = rep % len(modes)
            for mode in modes[k:] + modes[:k]:
                sizes[mode].clear()
                runs[mode].append(timed_generate(engines[mode], batch, s.max_new_tokens))
                if curve is not None:  # the rounds' tokens (not the prefill's) over their synthetic time
                    runs[mode][-1]["modelled_tokens_per_second"] = \
                        (runs[mode][-1]["tokens"] - len(batch)) / sum(1 / curve[n] for n in sizes[mode])
        if greedy:  # lossless: every scheduler, every repeat, must emit the autoregressive tokens
            want = runs["autoregressive"][0]["outputs"]
            for mode in modes:
                for rep, r in enumerate(runs[mode]):
                    if r["outputs"] != want:
                        i = next(i for i, (a, b) in enumerate(zip(r["outputs"], want)) if a != b)
                        raise AssertionError(f"concurrency {c}: {mode} (repeat {rep}) emitted different tokens than "
                                             f"autoregressive decoding for request {i}")
        for mode in modes:
            med = lambda key: statistics.median(r[key] for r in runs[mode])  # noqa: E731
            rows.append({
                "concurrency": c, "mode": mode,
                "total_tokens_per_second": med("total_tokens_per_second"),
                "per_request_tokens_per_second": med("per_request_tokens_per_second"),
                "acceptance_length": med("acceptance_length"), "verified_per_round": med("verified_per_round"),
                "tokens": med("tokens"), "seconds": med("seconds"),
                "total_tokens_per_second_runs": [r["total_tokens_per_second"] for r in runs[mode]],
                "modelled_tokens_per_second": med("modelled_tokens_per_second") if curve else None,
                "compile_seconds": engines[mode].compile_seconds,
                "profile_seconds": profile_seconds.get(mode),
                "outputs_agree": greedy or None,  # checked above; not checkable when sampling
            })
        none = next((r for r in rows if r["concurrency"] == c and r["mode"] == "none"), None)
        for r in rows:
            if r["concurrency"] == c:
                r["vs_none"] = r["total_tokens_per_second"] / none["total_tokens_per_second"] if none else None
        print(f"concurrency {c}: " + ", ".join(f"{r['mode']} {r['total_tokens_per_second']:.1f}" for r in rows
                                               if r["concurrency"] == c) + " tok/s", file=sys.stderr, flush=True)

    print(table_markdown(rows))
    if args.out:
        config = recorded_flags(args)
        write_json(args.out, {
            "config": config, "hardware": hw, "torch": torch.__version__, "drafter": drafter.cfg.describe(),
            "prompts": len(prompts), "sps": sps_tables, "sps_synthetic": args.sps_synthetic, "rows": rows,
            "timing": "total tokens/s = all requests' tokens / (prefill + decode wall seconds); per-request "
                      "tokens/s = mean of a request's tokens / seconds from its admission to its last token; "
                      "c x requests_per_slot requests streamed through c rows (continuous batching); medians "
                      "over repeats"}, indent=1)
    if args.plot:
        plots.concurrency_plot(args.plot, rows)
    return rows


def table_markdown(rows: list[dict]) -> str:
    modelled = any(r.get("modelled_tokens_per_second") is not None for r in rows)
    lines = ["| concurrency | mode | total tok/s | per-request tok/s | τ | verified drafts / request / round "
             "| total ÷ none | SPS profile s |" + (" modelled tok/s (synthetic SPS) |" if modelled else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|" if modelled else "")]
    for r in rows:
        ratio = f"{r['vs_none']:.2f}×" if r["vs_none"] is not None else "—"
        prof = f"{r['profile_seconds']:.1f}" if r["profile_seconds"] is not None else ""
        lines.append(f"| {r['concurrency']} | {r['mode']} | {r['total_tokens_per_second']:.1f} "
                     f"| {r['per_request_tokens_per_second']:.1f} | {r['acceptance_length']:.2f} "
                     f"| {r['verified_per_round']:.2f} | {ratio} | {prof} |"
                     + (f" {r['modelled_tokens_per_second']:.3f} |" if modelled else ""))
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    return cli_main(ConcurrencyArgs, run, argv)


if __name__ == "__main__":
    sys.exit(main())
