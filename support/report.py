"""What speculate.py shows and keeps of a decode: the completions on stdout (one request streamed), the
trace and output files written as requests finish, W&B's running figures, the summary and its figures
line; the demo's prompt and speed-up. Interrupted, what finished is kept and the summary says so."""

from __future__ import annotations

import contextlib
import json
import sys
from typing import Optional

import torch

from support import metrics, runlog
from support.cli import Interrupted, device_line, device_name, dtype_name, signals_deferred
from support.files import StreamFile
from support.flags import calibration_note, sampling_for
from support.text import StopStrings, auto_chat

# the keys of the trace's end record, written once a request finishes (docs/trace-format.md)
END_RECORD = ("request", "output_ids", "num_rounds", "acceptance_length", "finish_reason")


class Printer:
    """Completions on stdout: one request streamed (holding back a possible stop string's start or an
    incomplete UTF-8 character), several labelled at the end (with `show`, only the first `show`)."""

    def __init__(self, tokenizer, stop: Optional[StopStrings], requests: int, samples: int,
                 show: Optional[int] = None, files: bool = True, output_file: Optional[str] = None):
        self.tokenizer = tokenizer
        self.files = files  # whether --output-file would keep these completions
        self.output_file = output_file  # the one that does
        self.stop = stop
        self.samples = samples
        self.n = requests
        self.show = show
        self.streaming = requests == 1 and tokenizer is not None
        self.shown = 0
        self.hold = 0
        if stop is not None:
            self.hold = max(map(len, stop.strings)) - 1

    def on_round(self, req):
        if not self.streaming:
            return
        text = self.tokenizer.decode(req.output_ids, skip_special_tokens=True)
        # a whole stop string in the text has ended the request
        final = req.finish_reason is not None
        if self.stop is not None:
            text = self.stop.cut(text)
        safe = len(text)
        if not final:  # not an incomplete UTF-8 character, nor a stop string's possible start
            safe = len(text.rstrip("\ufffd")) - self.hold
        if safe > self.shown:
            print(text[self.shown:safe], end="", flush=True)
            self.shown = safe

    def finish(self, completions: list):
        if self.streaming:
            if completions:
                print(completions[0].text[self.shown:])
            elif self.shown:  # interrupted mid-stream: the line ends, so the interruption's starts its own
                print()
            return
        shown = completions[:self.show]
        for c in shown:
            if self.n > 1:
                who = f"prompt {c.prompt + 1}"
                if self.samples > 1:
                    who += f", sample {c.sample + 1}"
                tau = ""
                if c.acceptance_length is not None:
                    tau = f", τ {c.acceptance_length:.2f}"
                print(f"--- request {c.request + 1} of {self.n} ({who}): "
                      f"{n_tokens(len(c.output_ids))}, {c.finish_reason}{tau} ---")
            if c.text is not None:
                print(c.text)
            else:
                print(",".join(map(str, c.output_ids)))
        if len(shown) < len(completions):
            hint = ""
            if self.output_file:
                hint = f"; {self.output_file} has every one"
            elif self.files:
                hint = "; --output-file FILE keeps every one"
            print(f"({len(completions) - len(shown)} more completions not shown{hint})")


def summarize(completions: list, engine, scheduler: str, tokens_per_second: float) -> tuple[dict, dict]:
    """The trace's summary record of the finished requests, and their raw counts (metrics.py's)."""
    c = metrics.count(completions, engine.K, engine.stop_ids)
    summary = {"summary": True, "tokens_per_second": tokens_per_second,
               "acceptance_length": metrics.acceptance_length(c),
               "accept_rate_by_position": metrics.accept_rate_by_position(c),
               "verified_per_round": metrics.verified_per_round(c), "scheduler": scheduler,
               "prefill_seconds": engine.prefill_seconds, "decode_seconds": engine.decode_seconds,
               "compile_seconds": engine.compile_seconds}
    return summary, c


def figure(x: Optional[float]) -> str:
    """A ratio as printed: two decimals, "-" where nothing is behind it."""
    if x is None:
        return "-"
    return f"{x:.2f}"


def n_tokens(n: int) -> str:
    """"1 token", "8 tokens"."""
    if n == 1:
        return "1 token"
    return f"{n} tokens"


def figures_line(name: str, summary: dict, c: dict, engine) -> str:
    """The one line of figures printed after a decode."""
    seconds = summary["prefill_seconds"] + summary["decode_seconds"]
    tau = figure(summary["acceptance_length"])
    line = (f"{name}: {n_tokens(c['tokens'])} in {seconds:.2f} s, "
            f"{summary['tokens_per_second']:.1f} tokens/s, τ={tau}")
    if engine.drafter is not None and c["num_rounds"]:
        rates = " ".join(map(figure, summary["accept_rate_by_position"]))
        line += (f", conditional accept by position [{rates}], "
                 f"drafts verified {summary['verified_per_round']:.2f}/round ({summary['scheduler']})")
    return line + (f" (prefill {summary['prefill_seconds']:.2f} s, "
                   f"decode {summary['decode_seconds']:.2f} s)")


class Decoding:
    """One decode's callbacks (`speculate.decode`'s on_round / on_finish / on_step): the printer, the
    trace and output files, a tqdm bar (off a terminal, progress lines) and W&B's running figures (a row under
    `<name>/` every `--log-every` batch rounds and at the end); what finished, and the summary once it is over."""

    def __init__(self, report: "Report", engine, name: str, files: bool):
        self.report = report
        self.engine = engine
        self.name = name
        self.log = report.log
        args = report.args
        self.files = files  # whether the flags' files keep this decode's requests
        self.trace_path = None
        self.out_path = None
        if files:
            self.trace_path = args.trace_file
            self.out_path = args.output_file
        requests = report.requests
        self.printer = Printer(report.models.tokenizer, engine.stop_strings, requests,
                               report.settings.num_samples, show=report.show, files=files,
                               output_file=self.out_path)
        self.done: list = []  # completions, as they finish
        self.summary: Optional[dict] = None
        self.counts: Optional[dict] = None
        # running sums of metrics.py's counts, for the bar and W&B while requests are in flight
        self.running = {"num_rounds": 0, "verified": 0, "committed": 0, "tokens": 0}
        self.length_hist = [0] * (engine.K + 2)  # rounds that committed 0 .. K+1 tokens
        self.seen: dict[int, int] = {}             # tokens of each request counted so far
        self.steps = self.logged = 0
        self.bar = None
        self.lines = None
        shown = runlog.show(args.progress and requests > 1)
        if shown == "bar":
            from tqdm import tqdm

            # leave=False: the bar is wiped at the end, so stderr keeps only its lines (settings, errors)
            self.bar = tqdm(total=requests, desc=name, unit="req", file=sys.stderr,
                            dynamic_ncols=True, leave=False)
        elif shown == "lines":
            self.lines = runlog.Lines()
        if self.log is not None:
            self.log.step_metric(f"{name}/*", f"{name}/step")
        # last: nothing after them can fail and leave their temporary files behind
        self.trace = None
        self.out = None
        if self.trace_path:
            self.trace = StreamFile(self.trace_path)
        if self.out_path:
            self.out = StreamFile(self.out_path)

    def on_round(self, req, entry: dict):
        if self.trace:
            self.trace.write(json.dumps(entry, allow_nan=False) + "\n")
        self.printer.on_round(req)
        accepted, verified, committed = metrics.round_counts(entry, self.engine.stop_ids)
        self.running["num_rounds"] += 1
        self.running["verified"] += verified
        self.running["committed"] += committed
        self.running["tokens"] += len(req.output_ids) - self.seen.get(req.index, 0)
        self.seen[req.index] = len(req.output_ids)
        self.length_hist[committed] += 1  # the round's accepted length, bonus included

    def on_finish(self, c):
        self.done.append(c)
        if self.trace:
            end = {k: getattr(c, k) for k in END_RECORD}
            self.trace.write(json.dumps(end, allow_nan=False) + "\n")
            self.trace.sync()
        if self.out:
            self.out.write(json.dumps(c.record(), ensure_ascii=False, allow_nan=False) + "\n")
            self.out.sync()
        self.running["tokens"] += len(c.output_ids) - self.seen.pop(c.request, 0)
        if self.bar is None and self.lines is None:
            return
        figures = self.figures()
        tau = figure(figures["acceptance_length"])
        speed = f"{figures['tokens_per_second']:.1f} tok/s, τ={tau}"
        if self.bar is not None:
            self.bar.set_postfix_str(speed, refresh=False)
            self.bar.update(1)
        else:
            self.lines.say(f"{self.name}: {len(self.done)}/{self.report.requests} requests done, {speed}")

    def on_step(self):
        self.steps += 1
        if self.log is not None and self.steps % self.report.args.log_every == 0:
            self.log_figures()

    def figures(self) -> dict:
        """The figures of the rounds so far (W&B's rows, the bar's)."""
        seconds = self.engine.prefill_seconds + self.engine.decode_seconds
        tokens = self.running["tokens"]
        tokens_per_second = 0.0
        if seconds > 0:
            tokens_per_second = tokens / seconds
        # step: one verify of the batch (a round of each request in it)
        return {"step": self.steps, "requests_done": len(self.done), "tokens": tokens,
                "tokens_per_second": tokens_per_second,
                "acceptance_length": metrics.acceptance_length(self.running),
                "verified_per_round": metrics.verified_per_round(self.running)}

    def log_figures(self):
        import numpy as np

        # bins centred on 0 .. K+1 committed tokens (0: never; 1: no draft accepted)
        edges = np.arange(self.engine.K + 3) - 0.5
        hist = self.log.wandb.Histogram(np_histogram=(self.length_hist, edges))
        figures = {f"{self.name}/{k}": v for k, v in self.figures().items() if v is not None}
        self.log.log({**figures, f"{self.name}/accepted_length": hist})
        self.logged = self.steps

    def stop_watching(self):
        """The last W&B row, if rounds ran since the previous one; the bar goes."""
        if self.log is not None and self.steps > self.logged:
            self.log_figures()
        if self.bar is not None:
            self.bar.close()

    def close(self, interrupted: bool):
        """Publish and print what finished, whole (a signal now acts after it). The files come first,
        so that a reader who went away (`| head`) cannot cost them; the completions are printed even
        when a file cannot be published (its folder removed meanwhile, a full disk)."""
        with signals_deferred():
            done = sorted(self.done, key=lambda c: c.request)
            # the throughput of the time spent: every token decoded (interrupted: unfinished requests' too)
            figures = self.figures()
            scheduler = self.engine.scheduler.kind  # the schedule that ran
            summary, counts = summarize(done, self.engine, scheduler, figures["tokens_per_second"])
            if self.engine.drafter is not None and self.report.models.calibration is not None:
                summary["calibration"] = self.report.models.calibration  # the records' confidences are its
            if interrupted:
                summary.update(interrupted=True, finished_requests=len(done),
                               requests=self.report.requests, decoded_tokens=figures["tokens"])
            self.summary = summary
            self.counts = counts
            self.done = done
            try:
                if self.trace:
                    self.trace.write(json.dumps(summary) + "\n")
                    self.trace.close()
                if self.out:
                    self.out.close()
            finally:
                self.printer.finish(done)

    def abort(self):
        for f in (self.trace, self.out):
            if f is not None:
                f.abort()  # each, whatever the other's failure was


class Report:
    """What `python speculate.py` prints and writes around its decodes."""

    def __init__(self, args, settings, models, prompts: list[list[int]], threads: str, log, *,
                 demo: bool, lead: bool):
        from support import cpu_kernels

        self.args = args
        self.settings = settings
        self.models = models
        self.prompts = prompts
        # each prompt sampled num_samples times
        self.requests = len(prompts) * settings.num_samples
        self.log = log
        self.demo = demo
        self.show = None
        if lead:  # the demo prints its lead prompt's completion only
            self.show = 1
        self.sampling = sampling_for(models, settings)
        note = None
        if args.calibration:
            note = calibration_note(models, self.sampling.temperature)
        if note:
            print(note, file=sys.stderr)
        parts = [device_line(args.machine.device), threads,
                 cpu_kernels.describe(models.target, settings.compile),
                 self.sampling.describe()]
        self.announce = "; ".join(p for p in parts if p)
        if log is not None:
            self.log_config()

    def log_config(self):
        m, s, args = self.models, self.settings, self.args
        drafter = None
        if m.drafter is not None:
            drafter = m.drafter.cfg.describe(s.draft_length)
        self.log.config(demo=self.demo, hardware=device_name(args.machine.device),
                        dtype_resolved=dtype_name(m.dtype),
                        threads_resolved=torch.get_num_threads(), scheduler_resolved=s.scheduler,
                        max_new_tokens=s.max_new_tokens,  # resolved: the demo's budget, not null
                        chat_resolved=auto_chat(args.rendering.chat, m.tokenizer), compile_resolved=s.compile,
                        sampling=self.sampling.record(), num_prompts=len(self.prompts),
                        num_requests=self.requests,
                        target_config=runlog.checkpoint_config(m.directories[0]),
                        drafter_config=runlog.checkpoint_config(m.directories[1]),
                        drafter_resolved=drafter)

    def show_prompt(self):
        """The demo's first prompt, as the target reads it."""
        more = ""
        if self.show is not None:
            n = len(self.prompts)
            more = (f" 1 of {n} (the figures cover all {n}: this one, then the {n - 1} of "
                    f"demo/heldout.jsonl)")
        print(f"--- prompt{more} ---\n{self.models.tokenizer.decode(self.prompts[0])}")

    @contextlib.contextmanager
    def decoding(self, engine, heading: Optional[str] = None, files: bool = True,
                 announce: bool = True):
        """Around one decode: announce it, stream its outputs; afterwards print, write and log the summary
        (interrupted: for what finished, then the interruption goes on; an error: the files are dropped)."""
        if announce:
            print(self.announce, file=sys.stderr)
        if engine.drafter is not None or self.models.hub_snapshots:
            random = ""
            if self.args.random_init:
                random = " (random weights)"
            print(self.models.describe(engine.K) + random, file=sys.stderr)
        name = "autoregressive"
        if engine.drafter is not None:
            name = "speculative"
        if heading:
            print(f"--- {heading} ---")
        d = Decoding(self, engine, name, files)
        interrupted = None
        try:
            yield d
        # a signal, or stdout's reader gone while a request streams (`| head`): what finished is kept
        except (Interrupted, BrokenPipeError) as e:
            interrupted = e
        except BaseException:
            d.abort()
            raise
        finally:
            d.stop_watching()
        try:
            d.close(interrupted is not None)
        # a signal while the outputs were published, or stdout's reader gone (`| head`): the files
        # are whole and logged, then it acts
        except (Interrupted, BrokenPipeError) as e:
            self.log_decode(name, d)
            if isinstance(e, Interrupted):
                self.kept(e, d)
            raise
        except OSError:  # a file not published: no temporary file left, and the figures all the same
            d.abort()
            print(figures_line(name, d.summary, d.counts, engine))
            raise
        self.log_decode(name, d)
        if isinstance(interrupted, Interrupted):
            self.kept(interrupted, d)
        if interrupted is not None:
            raise interrupted
        print(figures_line(name, d.summary, d.counts, engine))

    def log_decode(self, name: str, d: Decoding):
        """The decode's figures, requests and files to W&B (with --wandb)."""
        if self.log is not None:
            runlog.log_decode(self.log, name, dict(d.summary, tokens=d.counts["tokens"]), d.done,
                              self.prompts, self.models.tokenizer,
                              {"trace": d.trace_path, "outputs": d.out_path})

    def kept(self, e: Interrupted, d: Decoding):
        """Tell the interruption which files this decode kept (closed whole): cli_main's last line names them."""
        e.written = [p for p in (d.trace_path, d.out_path) if p]
        if d.files and not self.args.output_file:  # the demo's baseline keeps none, whatever the flags
            e.hint = "--output-file FILE keeps finished requests"

    def speed_up(self, baseline: Decoding, speculative: Decoding):
        """The demo's last line: speculative against autoregressive tokens/s."""
        summary = speculative.summary
        if baseline.summary["tokens_per_second"] <= 0:
            return
        speed_up = summary["tokens_per_second"] / baseline.summary["tokens_per_second"]
        same = [c.output_ids for c in baseline.done] == [c.output_ids for c in speculative.done]
        seconds = summary["prefill_seconds"] + summary["decode_seconds"]
        greedy = self.sampling.temperature == 0
        if greedy:
            how = f"greedy outputs identical: {same})"
        else:
            how = "sampled: the two follow the same distribution, not the same tokens)"
        noisy = ""
        if seconds < 1:
            noisy = f"; a {seconds:.1f} s run is noisy: use scripts/bench.py for figures"
        print(f"speed-up: {speed_up:.2f}x "
              f"(speculative vs autoregressive tokens/s, same prompts, {how}{noisy}")
        if self.log is not None:
            figures = {"speed_up": speed_up}
            if greedy:
                figures["greedy_outputs_identical"] = same
            self.log.summary(figures)
