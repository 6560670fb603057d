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
schedulers' SPS(B) is profiled once per c, by each engine's own round (its seconds reported apart:
two profiles, so the two rows differ by the profiles' noise too), or replaced by one synthetic curve
(--sps-synthetic, `cliffs_sps`; compiled, priced at the bucket a round is padded to); then --repeats timed runs,
interleaved across schedulers, and the median is reported: total tokens/s (all requests' tokens ÷
prefill + decode wall seconds), per-request tokens/s (the mean of a request's tokens ÷ the seconds
from its admission to its end), τ, the verify budget (drafts sent to the target per request per
round) and total tokens/s ÷ the none scheduler's — and with --sps-synthetic the modelled tokens per
time unit: the rounds' tokens over their times as the synthetic curve prices them. Greedy outputs must be
identical under every scheduler and autoregressively (lossless): in float32 a difference raises; in
bf16/fp16, where a near-tie can flip an argmax, differences are counted as bench.py counts them and
the mode's row says its outputs did not agree. A markdown
table goes to stdout, --out writes JSON, --plot a PNG or SVG (plots.py). The demo pair is used
unless --target/--drafter are given; on cpu the engines run eagerly unless --compile is given (then a
line on stderr for each engine compiled: every concurrency compiles every mode). The
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

from bench import compare_outputs, timed_generate  # noqa: E402

from scheduler import KINDS, SPS_KINDS, profile_sps  # noqa: E402
from speculate import DEMO_DIR, Engine, Request, cache_length  # noqa: E402
from support import flags, plots  # noqa: E402
from support.checkpoint import load_models, resolve_checkpoint  # noqa: E402
from support.cli import (
    Interrupted,
    UserError,
    check_ranges,
    cli_main,
    device_name,
    dtype_name,
    flag,
    flat,
    one_process,
    parse_ints,
    resolve_device,
    resolve_dtype,
)
from support.files import check_input, check_outputs, write_json  # noqa: E402
from support.flags import Machine, Settings  # noqa: E402
from support.text import auto_chat, check_prompts, load_prompts  # noqa: E402

# the demo pair's committed held-out prompts (scripts/demo_prompts.py)
HELDOUT = os.path.join(DEMO_DIR, "heldout.jsonl")


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
    schedulers: str = ",".join(KINDS)
    """The verification schedulers to compare (default: every one, scheduler.KINDS)."""
    calibration: Optional[str] = None
    """STS temperatures from eval.py --calibration-out, applied to the confidences the threshold,
    hardware and async schedulers read (as speculate.py's --calibration)."""
    sps_synthetic: Optional[Literal["cliffs"]] = None
    """Instead of profiling SPS(B) for hardware and async (each on its own engine: their rows differ by
    the two profiles' noise too), give both one synthetic step function (to compare their decisions
    where Algorithm 1's early stop hurts). cliffs: a round of B verify tokens takes 1 + ceil(B/16)/4
    time units — flat inside each tile of 16 tokens, a quarter of the base cost more past every edge
    (B = 17, 33, ...), like kernels that work in 16-token tiles; with --compile, B is priced at the
    verify bucket it is padded to, as a profiled table routes it. The table then
    adds the modelled tokens per time unit: the rounds' tokens ÷ the sum of their synthetic times
    (prefill is not modelled); a unit is the curve's, not a second, so compare modes by it, not with
    the measured tokens/s."""
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
    batch (default: the demo pair's 20 held-out code prompts, demo/heldout.jsonl). Text is rendered with
    the target's chat template where it has one, as speculate.py renders it by default."""
    repeats: int = 3
    """Timed runs per mode and concurrency, interleaved in rotating order; the median is reported."""
    out: Optional[str] = None
    """Write the results as JSON here, after every concurrency level ("complete": false until the last)."""
    plot: Optional[str] = None
    """Draw total and per-request tokens/s against concurrency into this file (.png or .svg)."""


def use_curve(scheduler, sps: list[float]):
    """The scheduler prices rounds by SPS(B) as given for B = 0 .. top (no fit); with buckets (compiled),
    as a profiled table's: B at the best bucket holding it, where the engine pads it (`sps_curve`)."""
    if scheduler.buckets is not None:
        rates = [sps[b] for b in scheduler.profile_points]
        scheduler.set_sps({"steps_per_second": rates}, "--sps-synthetic")
        return
    scheduler.sps.copy_(torch.tensor(sps, dtype=torch.float64))
    scheduler.route = None
    scheduler.measured = True


def cliffs_sps(top: int) -> list[float]:
    """--sps-synthetic cliffs: SPS(B) for B = 0 .. top, steps per time unit when a round verifies B
    tokens, 1 / (1 + ceil(B/16)/4) (B = 0 priced as B = 1). Only its shape matters to the schedulers."""
    return [1 / (1 + math.ceil(max(b, 1) / 16) / 4) for b in range(top + 1)]


def recording(engine, sizes: list):
    """Make the engine append every round's verify size (its tokens) to `sizes`."""
    verify = engine.verify_fn

    def verify_fn(*args, num_tokens=None, **kwargs):
        sizes.append(num_tokens)
        return verify(*args, num_tokens=num_tokens, **kwargs)
    engine.verify_fn = verify_fn


# The decode settings this benchmark reads; any other given is refused rather than ignored.
READ = ("max_new_tokens", "temperature", "seed", "compile", "compile_mode", "verbose",
        "confidence_threshold", "ignore_eos")
ConcurrencyArgs.__doc__ = flags.reads_only(ConcurrencyArgs.__doc__, "bench_concurrency.py", READ)
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
        raise UserError(f"{flag(f.name)}: bench_concurrency.py decodes with {read} only "
                        f"(speculate.py decodes with it)")
    if args.decode.temperature is None:  # (other programs read the target's generation_config.json)
        raise UserError("--temperature None: give a temperature (0: greedy)")
    s = flags.check_settings(args.decode, args.machine.device)
    flags.check_machine(args.machine, s.compile)
    # The threshold scheduler's θ: at 0 it would verify every draft, the none scheduler's schedule.
    # (one new token is the prefill's: no round to time)
    check_ranges(s, confidence_threshold="(0, 1]", max_new_tokens="[2, 10485760]")
    return s


TIMING = ("total tokens/s = all requests' tokens / (prefill + decode wall seconds); per-request tokens/s "
          "= mean of a request's tokens / seconds from its admission to its last token; c x requests_per_slot "
          "requests streamed through c rows (continuous batching); medians over repeats")


def run(args: ConcurrencyArgs) -> list[dict]:
    """Total and per-request tokens/s against concurrency for every scheduler (and autoregressive)."""
    one_process("bench_concurrency.py", "it measures one process serving its requests")
    levels, schedulers, s = check_args(args)
    target_dir, drafter_dir, prompts_file = checked_inputs(args)
    # with --compile its line says so; the threads' line is not printed (the header's hardware names them)
    flags.start_machine(args.machine, s)
    dev = resolve_device(args.machine.device)
    dtype = resolve_dtype(args.machine.dtype, dev)
    m = load_models(target_dir, drafter_dir, device=dev, dtype=args.machine.dtype, calibration=args.calibration)
    if args.calibration is not None:
        note = flags.calibration_note(m, s.temperature)
        if note:
            print(note, file=sys.stderr)
    scheduled = [name for name in schedulers if name != "none"]
    if scheduled and m.drafter.confidence_head is None:
        raise UserError(f"--schedulers {args.schedulers}: {', '.join(scheduled)} read a drafter's "
                        f"confidence head, and --drafter {drafter_dir} has none (an Eagle3 drafter "
                        f"verifies every draft): use --schedulers none")
    chat = auto_chat(None, m.tokenizer)  # speculate.py's default: a template it cannot use is an error
    sources = []
    no_chat_why = "the target's tokenizer has no chat template: give prompt, prompt_ids or turns records"
    prompts = load_prompts(tokenizer=m.tokenizer, chat=chat, prompts_file=prompts_file, sources=sources,
                           no_chat_why=no_chat_why)
    check_prompts(prompts, m.target, s.max_new_tokens, sources=sources, drafter=m.drafter)
    modes = ["autoregressive"] + schedulers
    hw = device_name(dev)
    print(header(args, s, m, target_dir, drafter_dir, dtype, hw, len(prompts), schedulers), flush=True)
    # the largest level's caches, the longest prompt's length a row: checked before the first level runs
    longest = max(len(p) for p in prompts)
    max_seq = cache_length(longest, s.max_new_tokens, m.drafter)
    flags.check_cache_memory(m.target, m.drafter, levels[-1], max_seq, dev, rows="--concurrency")
    rows = []
    sps_tables = {}
    try:
        for c in levels:
            level_rows, tables = run_level(args, s, m, prompts, modes, c)
            rows += level_rows
            if tables:
                sps_tables[c] = tables
            speeds = []
            for r in level_rows:
                speeds.append(f"{r['mode']} {r['total_tokens_per_second']:.1f}")
            print(f"concurrency {c}: {', '.join(speeds)} tok/s", file=sys.stderr, flush=True)
            save(args, hw, m, len(prompts), sps_tables, rows, complete=c == levels[-1])
    except Interrupted as e:  # the last line says what was kept: --out, once a level has finished
        e.written = []
        if args.out and rows:
            e.written = [args.out]
        if not args.out:
            e.hint = "--out FILE keeps each finished level"
        raise
    print(table_markdown(rows))
    if args.plot:
        plots.concurrency_plot(args.plot, rows)
    return rows


def save(args: ConcurrencyArgs, hw: str, m, prompts: int, sps_tables: dict, rows: list[dict], complete: bool):
    """--out, rewritten after every concurrency level: a run cut short still leaves the levels it
    measured, marked incomplete."""
    if not args.out:
        return
    write_json(args.out, {
        "config": flags.recorded_flags(args, READ), "hardware": hw, "torch": torch.__version__,
        "drafter": m.drafter.cfg.describe(), "prompts": prompts, "sps": sps_tables,
        "sps_synthetic": args.sps_synthetic, "rows": rows, "complete": complete, "timing": TIMING}, indent=1)


def check_args(args: ConcurrencyArgs) -> tuple[list[int], list[str], Settings]:
    """The concurrencies, the schedulers and the decode settings, checked."""
    levels = sorted(parse_ints(args.concurrency, "--concurrency", distinct_positive=True))
    schedulers = [name.strip() for name in args.schedulers.split(",")]
    unknown = any(name not in KINDS for name in schedulers)
    if unknown or len(set(schedulers)) != len(schedulers):
        raise UserError(f"--schedulers: {args.schedulers!r} must be distinct names from {', '.join(KINDS)}")
    if args.sps_synthetic and not set(schedulers) & set(SPS_KINDS):
        raise UserError(f"--sps-synthetic {args.sps_synthetic}: only the hardware and async schedulers read "
                        f"SPS(B), and --schedulers has neither")
    s = check_settings(args)
    default = ConcurrencyArgs().decode.confidence_threshold
    if "threshold" not in schedulers and s.confidence_threshold != default:
        raise UserError(f"--confidence-threshold {s.confidence_threshold:g}: only the threshold scheduler reads "
                        f"it, and --schedulers {args.schedulers} has none: it would change nothing")
    if args.calibration is not None:
        flags.check_calibration_file(args.calibration)
        if schedulers == ["none"]:
            raise UserError(f"--calibration {args.calibration}: only a scheduler that reads the confidences "
                            f"(threshold, hardware, async), of a --drafter with a confidence head, uses it, "
                            f"and --schedulers is none: it would change nothing")
    check_ranges(args, repeats="[1, 1000]", requests_per_slot="[1, 100000]")
    return levels, schedulers, s


def checked_inputs(args: ConcurrencyArgs) -> tuple[str, str, str]:
    """The target and drafter directories (hub ids resolved) and the prompts file, the demo pair's by
    default; the outputs checked against them before any model loads."""
    demo = args.target is None and args.drafter is None
    target_dir = args.target
    drafter_dir = args.drafter
    prompts_file = args.prompts_file
    if demo:
        target_dir = os.path.join(DEMO_DIR, "target")
        drafter_dir = os.path.join(DEMO_DIR, "drafter")
        if prompts_file is None:
            prompts_file = HELDOUT
    outputs = {"--out": args.out, "--plot": args.plot}
    inputs = [args.target, args.drafter, prompts_file, args.calibration, args.machine.compile_cache]
    check_outputs(outputs, inputs=inputs)
    plots.check_plot_path(args.plot, "--plot")
    if target_dir is None or drafter_dir is None:
        raise UserError("--target/--drafter: this benchmark compares a drafter's schedulers: give both "
                        "(or neither, for the demo pair)")
    if prompts_file is None:
        raise UserError("--prompts-file: needed with --target/--drafter (without either, the demo pair "
                        "and its held-out prompts)")
    check_input(prompts_file, "--prompts-file", "prompts file")  # (the rest of its checks are load_prompts')
    target_dir = resolve_checkpoint(target_dir, "--target")
    drafter_dir = resolve_checkpoint(drafter_dir, "--drafter")
    check_outputs(outputs, inputs=[target_dir, drafter_dir])  # the snapshots hub ids resolved to
    return target_dir, drafter_dir, prompts_file


def header(args: ConcurrencyArgs, s: Settings, m, target_dir: str, drafter_dir: str, dtype, hw: str,
           num_prompts: int, schedulers: list[str]) -> str:
    """The run's first line: the pair, the machine and the settings."""
    sampling = "greedy"
    if s.temperature != 0:
        sampling = f"temperature {s.temperature}"
    threshold = ""
    if "threshold" in schedulers:
        threshold = f"threshold {s.confidence_threshold}, "
    budget = f"{s.max_new_tokens} new tokens each"
    if not s.ignore_eos:
        budget = f"at most {s.max_new_tokens} new tokens each (the target's EOS ends a request)"
    calibrated = ""
    if args.calibration is not None:
        calibrated = f", confidences calibrated by {args.calibration}"
    line = (f"# {target_dir} + {drafter_dir} ({m.drafter.cfg.describe()}){calibrated}, {dtype_name(dtype)}, {hw}, "
            f"torch {torch.__version__}, compile={s.compile}; at concurrency c the first "
            f"c x {args.requests_per_slot} of {num_prompts} prompts (cycled), "
            f"{budget}, {sampling}, {threshold}median of {args.repeats}")
    if args.sps_synthetic:
        line += f", SPS(B) synthetic: {args.sps_synthetic}"
    return line


def run_level(args: ConcurrencyArgs, s: Settings, m, prompts: list, modes: list[str], c: int):
    """Every mode at concurrency c, interleaved: its rows and its SPS(B) tables."""
    batch = []  # the workload
    for i in range(c * args.requests_per_slot):
        batch.append(prompts[i % len(prompts)])
    engines = build_engines(s, m, modes, c, batch)
    curve = None
    if args.sps_synthetic:
        curve = cliffs_sps(c * (m.drafter.cfg.num_drafts + 1))
    sps_tables, profile_seconds = price_rounds(engines, curve)
    sizes = {}
    for mode in modes:
        sizes[mode] = []
        recording(engines[mode], sizes[mode])
    for e in engines.values():  # untimed: settle allocators and caches, as bench.side_engine does
        first = [Request(i, p) for i, p in enumerate(batch[:c])]
        e.generate(first, min(s.max_new_tokens, 8))
    runs = {mode: [] for mode in modes}
    for rep in range(args.repeats):
        # Interleaved, and the order rotated each repeat, so a slow spell on a shared machine
        # lands on every mode rather than on whichever would run in it.
        k = rep % len(modes)
        for mode in modes[k:] + modes[:k]:
            sizes[mode].clear()
            timed = timed_generate(engines[mode], batch, s.max_new_tokens)
            if curve is not None:  # the rounds' tokens (not the prefill's) over their synthetic time
                round_tokens = timed["tokens"] - len(batch)
                modelled_seconds = sum(1 / curve[n] for n in sizes[mode])
                timed["modelled_tokens_per_unit"] = None  # no round ran: every request ended at its first token
                if modelled_seconds > 0:
                    timed["modelled_tokens_per_unit"] = round_tokens / modelled_seconds
            runs[mode].append(timed)
    greedy = s.temperature == 0
    differ = {}
    if greedy:  # lossless: every scheduler, every repeat, emits the autoregressive tokens
        # float32: a difference raises; bf16/fp16: near-tie flips are counted, as bench.py does
        exact = m.dtype == torch.float32
        differ = compare_outputs(runs, batch, m.target, exact=exact, what=f"concurrency {c}")
    rows = []
    for mode in modes:
        agree = None  # not checkable when sampling
        if greedy:
            agree = mode not in differ
        rows.append(level_row(runs[mode], c, mode, engines[mode], profile_seconds.get(mode), curve, agree))
    none = None
    for r in rows:
        if r["mode"] == "none":
            none = r
    for r in rows:
        r["vs_none"] = None
        if none is not None:
            r["vs_none"] = r["total_tokens_per_second"] / none["total_tokens_per_second"]
    return rows, sps_tables


def build_engines(s: Settings, m, modes: list[str], c: int, batch: list) -> dict:
    """One engine a mode, c rows each, all on one executor: ragged verification (free rows skipped),
    compiled and warmed up when asked. Building an engine (re)allocates the target's and drafter's
    caches, which every engine shares: so all of one concurrency's engines are built first, with one
    cache length, and only then compiled or run; they all use the last allocation."""
    longest = max(len(p) for p in batch)
    max_seq = cache_length(longest, s.max_new_tokens, m.drafter)
    engines = {}
    stop_ids = m.stop_ids
    if s.ignore_eos:
        stop_ids = ()
    for mode in modes:
        drafter = m.drafter
        scheduler = mode
        threshold = 0.0
        if mode == "autoregressive":
            drafter = None
            scheduler = "none"
        if mode == "threshold":
            threshold = s.confidence_threshold
        engines[mode] = Engine(m.target, drafter, batch_size=c, max_seq=max_seq, temperature=s.temperature,
                               seed=s.seed, stop_ids=stop_ids, scheduler=scheduler, threshold=threshold,
                               ragged=True, compile=s.compile, compile_mode=s.compile_mode,
                               compile_verbose=s.verbose)
    if s.compile:  # every concurrency compiles every mode anew: one line each, minutes on a CPU
        for i, (mode, e) in enumerate(engines.items(), 1):
            print(f"concurrency {c}: compiling {mode} ({i}/{len(engines)})", file=sys.stderr, flush=True)
            e.warmup()
    return engines


def price_rounds(engines: dict, curve: Optional[list[float]]) -> tuple[dict, dict]:
    """SPS(B) for each engine whose scheduler reads it (once per concurrency: it depends on the batch
    capacity): the synthetic curve, else profiled by the engine's own round (async's has no host read
    inside). Returns the tables by mode and the seconds each profile took."""
    tables = {}
    profile_seconds = {}
    for mode, engine in engines.items():
        if mode not in SPS_KINDS:
            continue
        if curve is not None:
            use_curve(engine.scheduler, curve)
            tables[mode] = {"verify_tokens": list(range(len(curve))), "steps_per_second": curve}
            continue
        t0 = time.perf_counter()
        table = profile_sps(engine)
        engine.scheduler.set_sps(table)
        profile_seconds[mode] = time.perf_counter() - t0
        tables[mode] = {"verify_tokens": table["profile_points"], "steps_per_second": table["steps_per_second"]}
    return tables, profile_seconds


def level_row(runs: list[dict], c: int, mode: str, engine, profile_seconds, curve,
              outputs_agree: Optional[bool]) -> dict:
    """A mode's row at concurrency c: the medians over its repeats. outputs_agree: its tokens were the
    autoregressive ones in every repeat (`compare_outputs`; None when sampling)."""
    def median(key):
        values = [r[key] for r in runs]
        if None in values:  # τ when no round ran: every request stopped at its first token
            return None
        return statistics.median(values)

    modelled = None
    if curve:
        modelled = median("modelled_tokens_per_unit")
    return {
        "concurrency": c, "mode": mode,
        "total_tokens_per_second": median("total_tokens_per_second"),
        "per_request_tokens_per_second": median("per_request_tokens_per_second"),
        "acceptance_length": median("acceptance_length"), "verified_per_round": median("verified_per_round"),
        "tokens": median("tokens"), "seconds": median("seconds"),
        "total_tokens_per_second_runs": [r["total_tokens_per_second"] for r in runs],
        "modelled_tokens_per_unit": modelled,
        "compile_seconds": engine.compile_seconds,
        "profile_seconds": profile_seconds,
        "outputs_agree": outputs_agree,
    }


def table_markdown(rows: list[dict]) -> str:
    modelled = any(r.get("modelled_tokens_per_unit") is not None for r in rows)
    head = ("| concurrency | mode | total tok/s | per-request tok/s | τ | verified drafts / request / round "
            "| total ÷ none | SPS profile s |")
    rule = "|---|---|---|---|---|---|---|---|"
    if modelled:
        head += " modelled tokens per unit (synthetic SPS) |"
        rule += "---|"
    lines = [head, rule]
    for r in rows:
        ratio = "—"
        if r["vs_none"] is not None:
            ratio = f"{r['vs_none']:.2f}×"
        prof = ""
        if r["profile_seconds"] is not None:
            prof = f"{r['profile_seconds']:.1f}"
        tau = "—"  # no round ran: every request stopped at its first token
        if r["acceptance_length"] is not None:
            tau = f"{r['acceptance_length']:.2f}"
        verified = "—"
        if r["verified_per_round"] is not None:
            verified = f"{r['verified_per_round']:.2f}"
        line = (f"| {r['concurrency']} | {r['mode']} | {r['total_tokens_per_second']:.1f} "
                f"| {r['per_request_tokens_per_second']:.1f} | {tau} | {verified} | {ratio} | {prof} |")
        if modelled:
            modelled_figure = "—"
            if r["modelled_tokens_per_unit"] is not None:
                modelled_figure = f"{r['modelled_tokens_per_unit']:.3f}"
            line += f" {modelled_figure} |"
        lines.append(line)
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    one_drafter = {"--drafter": "bench_concurrency.py times one (eval.py compares several)"}
    return cli_main(ConcurrencyArgs, run, argv, once=one_drafter)


if __name__ == "__main__":
    sys.exit(main())
