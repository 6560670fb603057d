"""speculate.py's command line: flags (checked before anything loads), the demo, prompts, printing, the
trace and output files; the decode itself is speculate.py's Python API.

    python speculate.py [--target DIR --drafter DIR --prompt "..." --trace-file t.jsonl]  # no flags: the demo"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, fields, replace
from typing import Annotated, Literal, Optional

import tyro

from speculate import (
    DEMO_DIR,
    MAX_REQUESTS,
    CompileMode,
    Completion,
    Engine,
    Request,
    Settings,
    completion,
    kernels_for,
    make_engine,
    requests_for,
    sampling_for,
)
from support import metrics, runlog
from support.checkpoint import Models, load_models, resolve_checkpoint
from support.cli import (
    AutoBool,
    Interrupted,
    UserError,
    check_ranges,
    cli_main,
    device_name,
    resolve_device,
    set_threads,
    signals_deferred,
    use_compile_cache,
)
from support.files import StreamFile, check_outputs, read_json
from support.text import StopStrings, auto_chat, check_chat_flags, check_prompts, encode, load_prompts

# The demo's printed prompt, from the held-out shutil.py; demo/heldout.jsonl's 20 follow (figures over 21).
DEMO_PROMPT = ('def copyfileobj(fsrc, fdst, length=0):\n'
               '    """copy data from file-like object fsrc to file-like object fdst"""\n')
END_RECORD = ("request", "output_ids", "num_rounds", "acceptance_length", "finish_reason")  # the trace's, of a request


@dataclass
class Args(runlog.WandbFlags):
    """Speculative decoding with DSpark / DFlash drafters (baseline decoding without --drafter)."""

    target: Optional[str] = None
    """Qwen3 checkpoint directory, or a Hugging Face hub id ORG/NAME[@REVISION] (from the HF cache or
    downloaded; HF_HUB_OFFLINE=1: the cache only). Default, with no --drafter or --random-init: demo/."""
    drafter: Optional[str] = None
    """Drafter directory or hub id (any DSpark / DFlash spelling); omitted: autoregressive decoding."""
    prompt: Optional[str] = None
    """One prompt as text (rendered with the chat template unless --no-chat)."""
    prompt_ids: Optional[str] = None
    """One prompt as comma-separated token ids, e.g. 1,2,3."""
    prompts_file: Optional[str] = None
    """JSON lines of {"prompt": str}, {"prompt_ids": [int]}, {"turns": [str]} (the first) or {"messages":
    [{"role", "content"}, ...]} (ending with the user's turn). The demo's default: 21 held-out prompts."""
    chat: AutoBool = None
    """Render text prompts with the chat template, thinking off. Default: on when the tokenizer has a
    template; --chat without one uses Qwen3's format."""
    system_prompt: Optional[str] = None
    """A system turn before every text prompt (chat rendering only)."""
    enable_thinking: bool = False
    """Render with the template's thinking on (the published drafters were trained with it off)."""
    num_samples: int = 1
    """Run every prompt this many times (independent samples)."""
    batch_size: int = 1
    """Requests decoded together; a finished request's row takes the next at once (continuous batching)."""
    max_new_tokens: int = 128
    """Token budget per request (exact)."""
    temperature: Optional[float] = None
    """0 = greedy, else lossless sampling at this temperature. Default: with no sampling flag, the
    target's generation_config.json (greedy without one); 1.0 with only filter flags."""
    top_k: Optional[int] = None
    """Sample from the K most likely tokens only (0: off), in the target's and the drafter's alike."""
    top_p: Optional[float] = None
    """Then from the most likely tokens that make up probability P (1: off)."""
    min_p: Optional[float] = None
    """Then only tokens at least M times as likely as the most likely one (0: off)."""
    stop: Annotated[tuple[str, ...], tyro.conf.UseAppendAction] = ()
    """End a request at this text (repeatable); the printed text is cut before it."""
    ignore_eos: bool = False
    """Do not stop at the target's EOS tokens."""
    seed: int = 0
    """Request i samples from its own generator seeded seed + i (independent of the batch)."""
    confidence_threshold: float = 0.0
    """Verify drafts only up to the first confidence below this; 0 = the whole block."""
    scheduler: Optional[Literal["none", "threshold", "hardware", "async"]] = None
    """How many drafts a round verifies: none (all), threshold, hardware (the paper's Algorithm 1 over SPS(B))
    or async (its production variant, sized two rounds ahead). Default: threshold if --confidence-threshold > 0."""
    sps_table: Optional[str] = None
    """SPS(B) table for hardware/async: read if it exists (it must match this run), else profiled and
    written there. Without it, profiled at start and not kept."""
    verify_buckets: Optional[str] = None
    """Comma-separated token counts a scheduled round's verification is padded to (one compiled graph
    each). Default: compiled 1,2,3,4,6,8,12,... up to batch x (drafts + 1); eager, exact."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where to run."""
    dtype: Optional[Literal["float32", "bfloat16", "float16"]] = None
    """Weights and activations. Default: bfloat16 on cuda, float32 on cpu."""
    threads: Optional[int] = None
    """CPU threads. Default: OMP_NUM_THREADS, else half the CPUs (docs/performance.md)."""
    compile: AutoBool = None
    """torch.compile the round. Default: on for cuda, off for cpu (a first compile takes minutes)."""
    compile_mode: Optional[CompileMode] = None
    """With --compile: this torch.compile mode instead of the recipe (cpu: max-autotune, frozen weights,
    C++ wrapper; cuda: reduce-overhead). "default" is cached across runs but slower (docs/performance.md)."""
    compile_cache: Optional[str] = None
    """With --compile: its cache directory. Default: $TORCHINDUCTOR_CACHE_DIR, else ~/.cache/dspark-fast/inductor."""
    verbose: bool = False
    """With --compile: show what compiling prints (autotuning tables)."""
    kernels: Literal["torch", "triton"] = "torch"
    """Markov chain, sampled acceptance, cache attention: torch or kernels.py's Triton (cuda; cpu under
    TRITON_INTERPRET=1)."""
    trace_file: Optional[str] = None
    """Write every round, request and a summary here as JSON lines (docs/trace-format.md)."""
    output_file: Optional[str] = None
    """Write one JSON record per request as it finishes (text, ids, finish reason, rounds, τ)."""
    progress: bool = True
    """A progress bar on stderr (a terminal) while several requests decode."""
    log_every: int = 10
    """With --wandb: log the figures so far every this many rounds."""
    calibration: Optional[str] = None
    """Confidence temperatures from `eval.py --calibration-out`: c_k = σ(logit_k / T_k)."""
    random_init: Optional[Literal["qwen3-4b", "qwen3-8b", "qwen3-14b"]] = None
    """Instead of --target/--drafter: a real-shaped pair with random weights (speed without downloads)."""


def check_args(args: Args) -> Settings:
    """The flags alone, before anything is loaded or downloaded."""
    names = {f.name for f in fields(Settings)} - {"compile_verbose"}
    s = Settings(**{n: getattr(args, n) for n in names}, compile_verbose=args.verbose).check()
    check_ranges(args, log_every="[1, inf)", threads="[1, 4096]")
    runlog.check(args)
    text = [f for f, on in (("--prompt", args.prompt is not None), ("--stop", bool(args.stop)),
                            ("--system-prompt", args.system_prompt is not None)) if on]
    if args.random_init is not None and text:  # no tokenizer: say so before building the model
        raise UserError(f"{text[0]}: text needs a tokenizer, and --random-init {args.random_init} has none "
                        f"(use --prompt-ids)")
    if args.chat and args.prompt_ids is not None:
        raise UserError("--chat: --prompt-ids are token ids, never rendered; it would change nothing")
    check_chat_flags(chat=args.chat, ids=args.prompt_ids is not None, system_prompt=args.system_prompt,
                     thinking=args.enable_thinking)
    if args.calibration is not None and s.scheduler == "none":
        raise UserError(f"--calibration {args.calibration}: only a scheduled round reads the confidences "
                        f"(--scheduler threshold, hardware or async); without one it changes nothing")
    if args.compile_cache is not None and not s.compile:
        raise UserError("--compile-cache: only used with --compile (the run is eager)")
    sps_read = args.sps_table if args.sps_table is not None and os.path.isfile(args.sps_table) else None
    check_outputs({"--trace-file": args.trace_file, "--output-file": args.output_file,
                   "--sps-table": None if sps_read else args.sps_table},  # read if it exists, else written
                  inputs=[args.target, args.drafter, args.prompts_file, args.calibration, sps_read])
    resolve_device(args.device)
    kernels_for(args.kernels, args.device)
    return s


def run(args: Args) -> dict:
    """Everything `python speculate.py` does; returns the summary."""
    demo = args.target is None and args.drafter is None and args.random_init is None
    no_prompt = args.prompt is None and args.prompt_ids is None and args.prompts_file is None
    if demo:
        args = replace(args, target=os.path.join(DEMO_DIR, "target"), drafter=os.path.join(DEMO_DIR, "drafter"),
                       prompts_file=os.path.join(DEMO_DIR, "heldout.jsonl") if no_prompt else args.prompts_file)
    args = replace(args, compile=args.device.startswith("cuda") if args.compile is None else args.compile)
    s = check_args(args)
    if args.random_init is None:
        args = replace(args, target=resolve_checkpoint(args.target, "--target"),
                       drafter=resolve_checkpoint(args.drafter, "--drafter"))
        check_outputs({"--trace-file": args.trace_file, "--output-file": args.output_file},
                      inputs=[args.target, args.drafter])  # not inside the snapshots hub ids resolved to
    with runlog.logged_run(args, "speculate", "speculate.py") as log:
        return load_and_decode(args, s, demo, log, lead=DEMO_PROMPT if demo and no_prompt else None)


def load_and_decode(args: Args, s: Settings, demo: bool, log, lead: Optional[str] = None) -> dict:
    """Load, read the prompts and decode them (the demo: autoregressive first, then speculative)."""
    threads = set_threads(args.threads)
    if s.compile:
        cache = use_compile_cache(args.compile_cache)
        print("loading the models; compiling the round next (a first compile takes minutes on a CPU, then it is "
              f"cached in {cache})", file=sys.stderr)
    m = load_models(args.target, args.drafter, device=args.device, dtype=args.dtype, random_init=args.random_init,
                    calibration=args.calibration, seed=args.seed)
    sampling = sampling_for(m, s)
    note = args.calibration and calibration_note(args.calibration, m.directories[1], sampling.temperature)
    if note:
        print(note, file=sys.stderr)
    context = m.target.args.max_position_embeddings
    chat = auto_chat(args.chat, m.tokenizer)
    sources = ["the demo prompt"] if lead is not None else []  # the demo's first prompt, whose completion is printed
    prompts = [encode(m.tokenizer, lead, "the demo prompt", chat=chat)] if lead is not None else []
    prompts += load_prompts(tokenizer=m.tokenizer, chat=chat, prompt=args.prompt, prompt_ids=args.prompt_ids,
                            prompts_file=args.prompts_file, max_len=max(context - s.max_new_tokens, 1),
                            system_prompt=args.system_prompt, thinking=args.enable_thinking, sources=sources)
    check_prompts(prompts, m.target, s.max_new_tokens, drafter=m.drafter, sources=sources)
    if len(prompts) * s.num_samples > MAX_REQUESTS:
        raise UserError(f"--num-samples {s.num_samples}: {len(prompts)} prompts x {s.num_samples} samples is more "
                        f"than {MAX_REQUESTS:,} requests")
    if log is not None:
        log.config(demo=demo, hardware=device_name(args.device), dtype_resolved=str(m.dtype).removeprefix("torch."),
                   threads_resolved=int(threads.split()[1]), scheduler_resolved=s.scheduler, chat_resolved=chat,
                   compile_resolved=s.compile, sampling={"temperature": sampling.temperature,
                                                         **sampling.filters._asdict(), "source": sampling.source},
                   num_prompts=len(prompts), num_requests=len(prompts) * s.num_samples,
                   target_config=runlog.checkpoint_config(m.directories[0]),
                   drafter_config=runlog.checkpoint_config(m.directories[1]),
                   drafter_resolved=m.drafter.cfg.describe() if m.drafter is not None else None)
    from support import cpu_kernels
    announce = "; ".join(filter(None, [threads, cpu_kernels.describe(m.target, s.compile), sampling.describe()]))
    show = 1 if lead is not None else None
    engine = make_engine(m, m.drafter, prompts, s)
    if demo:  # the baseline by the same engine without the drafter, as many cache rows (shared caches)
        more = (f" 1 of {len(prompts)} (the figures cover all {len(prompts)}: this one, then the "
                f"{len(prompts) - 1} of demo/heldout.jsonl)" if lead is not None else "")
        print(f"--- prompt{more} ---\n{m.tokenizer.decode(prompts[0])}")  # the demo target has a tokenizer
        baseline = decode(args, s, m, make_engine(m, None, prompts, s, max_seq=engine.max_seq), prompts, None, None,
                          heading="autoregressive", announce=announce, log=log, show=show)
    summary = decode(args, s, m, engine, prompts, args.trace_file, args.output_file,
                     heading="speculative" if demo else None, announce=None if demo else announce, log=log, show=show)
    if demo and baseline["tokens_per_second"] > 0:
        speed_up = summary["tokens_per_second"] / baseline["tokens_per_second"]
        seconds = summary["prefill_seconds"] + summary["decode_seconds"]
        same, greedy = baseline["outputs"] == summary["outputs"], sampling.temperature == 0
        print(f"speed-up: {speed_up:.2f}x (speculative vs autoregressive tokens/s, same prompts, "
              + (f"greedy outputs identical: {same})" if greedy else
                 "sampled: the two follow the same distribution, not the same tokens)")
              + (f"; a {seconds:.1f} s run is noisy: use bench.py for figures" if seconds < 1 else ""))
        if log is not None:
            log.summary({"speed_up": speed_up, **({"greedy_outputs_identical": same} if greedy else {})})
    return summary


def calibration_note(calibration: str, drafter: Optional[str], temperature: float) -> Optional[str]:
    """A note when an STS file was fitted on another drafter or at another temperature than this run."""
    cal, other = read_json(calibration), []
    fitted, fitted_t = cal.get("drafter_dir"), cal.get("temperature")
    if isinstance(fitted, str) and drafter is not None and fitted != os.path.realpath(drafter):
        other.append(f"on drafter {fitted} (this run: {os.path.realpath(drafter)})")
    if isinstance(fitted_t, (int, float)) and not isinstance(fitted_t, bool) and fitted_t != temperature:
        other.append(f"at temperature {fitted_t:g} (this run: {temperature:g})")
    return (f"note: --calibration {calibration} was fitted {' and '.join(other)}; its temperatures may not fit "
            f"this run (eval.py --calibration-out refits them)") if other else None


class Printer:
    """Completions on stdout: one request streamed (holding back a possible stop string's start or an
    incomplete UTF-8 character), several labelled at the end (with `show`, only the first `show`)."""

    def __init__(self, tokenizer, stop: Optional[StopStrings], requests: int, samples: int, show: Optional[int] = None):
        self.tokenizer, self.stop, self.samples, self.n, self.show = tokenizer, stop, samples, requests, show
        self.streaming = requests == 1 and tokenizer is not None
        self.shown = 0
        self.hold = max((len(s) for s in self.stop.strings), default=1) - 1 if self.stop is not None else 0

    def on_round(self, req: Request):
        if not self.streaming:
            return
        text = self.tokenizer.decode(req.output_ids, skip_special_tokens=True)
        final = req.finish_reason is not None  # a whole stop string in the text has ended the request
        text = self.stop.cut(text) if self.stop is not None else text
        safe = len(text) if final else len(text.rstrip("\ufffd")) - self.hold  # not an incomplete UTF-8 character
        if safe > self.shown:
            print(text[self.shown:safe], end="", flush=True)
            self.shown = safe

    def finish(self, completions: list[Completion]):
        if self.streaming:
            if completions:  # none if interrupted first
                print(completions[0].text[self.shown:])
            return
        shown = completions[:self.show]
        for c in shown:
            if self.n > 1:
                who = f"prompt {c.prompt + 1}" + (f", sample {c.sample + 1}" if self.samples > 1 else "")
                tau = f", τ {c.acceptance_length:.2f}" if c.acceptance_length is not None else ""
                print(f"--- request {c.request + 1} of {self.n} ({who}): {len(c.output_ids)} tokens, "
                      f"{c.finish_reason}{tau} ---")
            print(c.text if c.text is not None else ",".join(map(str, c.output_ids)))
        if len(shown) < len(completions):
            print(f"({len(completions) - len(shown)} more completions not shown; --output-file FILE keeps every one)")


def decode(args: Args, s: Settings, m: Models, engine: Engine, prompts: list[list[int]], trace_file, output_file,
           heading=None, announce=None, log=None, show=None) -> dict:
    """Decode every prompt on `engine`: print the texts and a figures line, stream the trace and output file
    (interrupted: what finished is kept, the summary marked; on an error the files are left as they were)."""
    requests = requests_for(prompts, s.num_samples)
    if announce:
        print(announce, file=sys.stderr)
    if engine.drafter is not None or m.hub_snapshots:
        print(m.describe() + (" (random weights)" if args.random_init else ""), file=sys.stderr)
    trace = out = interrupted = None
    printer = Printer(m.tokenizer, engine.stop_strings, len(requests), s.num_samples, show=show)
    name = "speculative" if engine.drafter is not None else "autoregressive"
    watch = runlog.DecodeWatch(log, name, engine.K, engine.stop_ids, len(requests), args.log_every,
                               lambda: engine.prefill_seconds + engine.decode_seconds,
                               bar=args.progress and len(requests) > 1 and sys.stderr.isatty())
    if heading:
        print(f"--- {heading} ---")

    def on_round(req, rec):
        if trace:
            trace.write(json.dumps(rec, allow_nan=False) + "\n")
        printer.on_round(req)
        watch.on_round(req, rec)

    def on_finish(req):
        record = completion(req, m, engine).record() if trace or out else None  # its text decoded once, if written
        if trace:
            trace.write(json.dumps({k: record[k] for k in END_RECORD}, allow_nan=False) + "\n")
            trace.sync()
        if out:
            out.write(json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n")
            out.sync()
        watch.on_finish(req)

    try:
        trace = StreamFile(trace_file) if trace_file else None
        out = StreamFile(output_file) if output_file else None
        engine.generate(requests, s.max_new_tokens, on_round, on_finish, watch.on_step)
    except Interrupted as e:
        interrupted = e
    except BaseException:
        for f in filter(None, (trace, out)):
            f.abort()
        raise
    finally:
        watch.close()
    with signals_deferred():  # what is done, printed and published whole; a signal now acts after it
        done = [r for r in requests if r.finish_reason is not None]
        completions = [completion(r, m, engine) for r in done]
        printer.finish(completions)
        c = metrics.count(done, engine.K, engine.stop_ids)
        seconds = engine.prefill_seconds + engine.decode_seconds
        summary = {"summary": True, "tokens_per_second": c["tokens"] / seconds if seconds > 0 else 0.0,
                   "acceptance_length": metrics.acceptance_length(c),
                   "accept_rate_by_position": metrics.accept_rate_by_position(c),
                   "verified_per_round": metrics.verified_per_round(c), "scheduler": s.scheduler,
                   "prefill_seconds": engine.prefill_seconds, "decode_seconds": engine.decode_seconds,
                   "compile_seconds": engine.compile_seconds}
        if interrupted is not None:
            summary.update(interrupted=True, finished_requests=len(done), requests=len(requests))
        if trace:
            trace.write(json.dumps(summary) + "\n")
            trace.close()
        if out:
            out.close()
    if log is not None:
        runlog.log_decode(log, name, dict(summary, tokens=c["tokens"]), completions, prompts, m.tokenizer,
                          {"trace": trace_file, "outputs": output_file})
    if interrupted is not None:
        raise interrupted
    tau = summary["acceptance_length"]
    rates = " ".join("-" if x is None else f"{x:.2f}" for x in summary["accept_rate_by_position"])
    print(f"{name}: {c['tokens']} tokens in {seconds:.2f} s, {summary['tokens_per_second']:.1f} tokens/s, "
          f"τ={'-' if tau is None else f'{tau:.2f}'}"
          + (f", accept by position [{rates}], verified {summary['verified_per_round']:.2f}/round ({s.scheduler})"
             if engine.drafter is not None and c["num_rounds"] else "")
          + f" (prefill {engine.prefill_seconds:.2f} s, decode {engine.decode_seconds:.2f} s)")
    return dict(summary, outputs=[r.output_ids for r in requests])


def main(argv: Optional[list[str]] = None) -> int:
    return cli_main(Args, run, argv)
