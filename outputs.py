"""What a run gives back: each request's completion — its text, ids and figures — printed, streamed
or written to `--output-file`.

- `Completion`: one request's result, as the Python API returns it and the output file records it.
  The text is decoded with special tokens skipped (`<|im_end|>` is not text) and cut before a stop
  string; the ids keep every generated token up to the stop token or the token that completed the
  stop string.
- `Printer`: standard output. One request streams round by round (holding back what could still
  turn out to be the start of a stop string, and an incomplete UTF-8 character); several are printed
  in request order, each under a line naming it.
- `OutputFile`: JSON lines, one record per request as it finishes, written like the trace
  (a temporary file synced per record, published whole at the end or on an interruption).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field, fields
from typing import Optional

import metrics
from common import StreamFile
from text import StopStrings, Tokenizer


@dataclass
class Completion:
    """One request's result."""
    request: int                 # its index in the run (prompts in order, each --num-samples times)
    prompt: int                  # which prompt
    sample: int                  # which sample of that prompt
    text: Optional[str]          # the generated text (None without a tokenizer)
    output_ids: list[int]        # the generated tokens
    finish_reason: str           # "stop" (a stop token or string) or "length" (the budget)
    num_rounds: int              # speculative rounds (autoregressive: one per token after the first)
    acceptance_length: Optional[float]  # τ of this request (None without rounds)
    prompt_ids: list[int]
    # Its rounds as the trace records them (metrics.count(completions, K, stop_ids) pools them, as eval.py
    # does); not in the output file, whose records the trace's rounds complement.
    rounds: list[dict] = field(default_factory=list, repr=False)


def text_of(ids: list[int], tokenizer: Optional[Tokenizer], stop: Optional[StopStrings]) -> Optional[str]:
    """Printed text: special tokens skipped, cut before the first stop string."""
    if tokenizer is None:
        return None
    text = tokenizer.decode(ids, skip_special_tokens=True)
    return stop.cut(text) if stop is not None else text


def completion(req, tokenizer: Optional[Tokenizer], stop: Optional[StopStrings], stop_ids) -> Completion:
    """A finished `speculate.Request` as a Completion; τ counted as metrics.py counts it."""
    tau = metrics.acceptance_length(metrics.count([req], 0, stop_ids))
    return Completion(req.index, req.prompt, req.sample, text_of(req.output_ids, tokenizer, stop),
                      list(req.output_ids), req.finish_reason, len(req.rounds), tau, list(req.prompt_ids),
                      list(req.rounds))


def label(c: Completion, samples: int) -> str:
    who = f"prompt {c.prompt}" + (f", sample {c.sample}" if samples > 1 else "")
    tau = f", τ {c.acceptance_length:.2f}" if c.acceptance_length is not None else ""
    return f"--- request {c.request} ({who}): {len(c.output_ids)} tokens, {c.finish_reason}{tau} ---"


class Printer:
    """Completions on standard output: one request streamed as it decodes, several labelled at the end
    (with `show`, only the first `show` of them, and a line saying how many more there are)."""

    def __init__(self, tokenizer: Optional[Tokenizer], stop: Optional[StopStrings], n_requests: int, samples: int,
                 out=None, show: Optional[int] = None):
        self.tokenizer, self.stop, self.samples, self.n_requests = tokenizer, stop, samples, n_requests
        self.show = show
        self.out = out or sys.stdout
        self.streaming = n_requests == 1 and tokenizer is not None
        self.shown = 0  # characters of the streamed request already printed
        self.hold = max((len(s) for s in stop.strings), default=1) - 1 if stop is not None else 0

    def on_round(self, req):
        """Print what the request's text gained, except what could still change."""
        if not self.streaming:
            return
        text = self.tokenizer.decode(req.output_ids, skip_special_tokens=True)
        final = req.finish_reason is not None
        if self.stop is not None:
            cut = self.stop.cut(text)
            final, text = final or len(cut) < len(text), cut
        end = len(text)
        while not final and end > 0 and text[end - 1] == "\ufffd":  # an incomplete UTF-8 character: not yet text
            end -= 1
        safe = end if final else end - self.hold  # held back: the start of a stop string still to come
        if safe > self.shown:
            self.out.write(text[self.shown:safe])
            self.out.flush()
            self.shown = safe

    def finish(self, completions: list[Completion]):
        """The rest of a streamed request, or every request in order, labelled."""
        if self.streaming:
            if completions:
                self.out.write(completions[0].text[self.shown:] + "\n")
            return
        shown = completions if self.show is None else completions[:self.show]
        for c in shown:
            if self.n_requests > 1:
                print(label(c, self.samples), file=self.out)
            print(c.text if c.text is not None else ",".join(map(str, c.output_ids)), file=self.out)
        if len(shown) < len(completions):
            print(f"({len(completions) - len(shown)} more completions not shown; --output-file FILE keeps every one)",
                  file=self.out)


class OutputFile:
    """--output-file: one JSON record per finished request, in the order they finish."""

    def __init__(self, path: str):
        self.file = StreamFile(path)

    def write(self, c: Completion):
        record = {f.name: getattr(c, f.name) for f in fields(c) if f.name != "rounds"}
        self.file.write(json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n")
        self.file.sync()

    def close(self):
        self.file.close()

    def abort(self):
        self.file.abort()
