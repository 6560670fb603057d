"""What a run tells as it goes: Weights & Biases logging for speculate.py, eval.py, train.py and
scripts/train_target.py, speculate.py's progress bar, and the choice between a bar (on a terminal) and
plain progress lines (elsewhere) that eval.py and the training programs make (README, "What a run logs").

    python speculate.py ... --wandb --wandb-project P --wandb-name N --wandb-group G --wandb-tags a,b

What is notable here:
- One set of flags (`WandbFlags`), which every program's Args inherits. A flag that is not given goes
  to wandb as None, so wandb's own environment variables apply (WANDB_ENTITY, WANDB_NAME,
  WANDB_RUN_GROUP, WANDB_TAGS, and WANDB_MODE, WANDB_DIR, ...); the project is --wandb-project, else
  WANDB_PROJECT, else dspark-fast. `check` refuses a --wandb-* flag without --wandb, before any work.
- `session` starts the run before the work, so wandb's system metrics cover the work and a crash is
  on record, and always finishes it: exit code 0 when the work returns; 2 after a UserError and 1
  after any other exception (W&B shows "failed"); 128 + the signal after SIGINT / SIGTERM (130 / 143).
  The summary says which in words (`status`: finished, failed or interrupted; `error`: the reason).
- The run's config: the flags after their defaults, torch's version and the code's git commit at
  the start (`start_config`); each program adds what it resolved once its models are loaded (device,
  dtype, the checkpoints' config.json, sampling, ...) with `Log.config`.
- wandb is imported only inside `session` with --wandb: a run without it never loads it.
- `DecodeWatch` is speculate.py's observer of the engine: it counts rounds as they come and, every
  --log-every rounds, logs the figures so far (tokens/s, τ, drafts verified per round, the histogram
  of accepted lengths); with several requests it also drives a tqdm bar on stderr.
- What each program logs at its end is written here too, one function each (`log_decode`,
  `log_eval_dataset`, `log_eval`), so that the programs stay about their work and one file says what
  a run records.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Optional

import metrics
from common import Interrupted, UserError

DEFAULT_PROJECT = "dspark-fast"
TABLE_ROWS = 10_000  # a requests table longer than this keeps its first rows (wandb slows on huge tables)


@dataclass
class WandbFlags:
    """The Weights & Biases flags every program shares (inherited by each program's Args)."""

    wandb: bool = False
    """Log the run to Weights & Biases: config, figures as it goes, tables, charts and files (README,
    "What a run logs"). WANDB_MODE=offline logs to ./wandb (or WANDB_DIR) without a network."""
    wandb_project: Optional[str] = None
    """Project of --wandb. Default: WANDB_PROJECT when set, else dspark-fast."""
    wandb_entity: Optional[str] = None
    """Entity (user or team) of --wandb. Default: WANDB_ENTITY when set, else your default entity."""
    wandb_name: Optional[str] = None
    """Name of the run. Default: WANDB_NAME when set, else one wandb makes up."""
    wandb_group: Optional[str] = None
    """Group of the run (e.g. the runs of one experiment). Default: WANDB_RUN_GROUP when set, else none."""
    wandb_tags: Optional[str] = None
    """Comma-separated tags of the run. Default: WANDB_TAGS when set, else none."""


def parse_tags(text: Optional[str]) -> Optional[list[str]]:
    """--wandb-tags "a,b" -> ["a", "b"]; W&B takes 1 to 64 characters a tag."""
    if text is None:
        return None
    tags = [t.strip() for t in text.split(",")]
    for t in tags:
        if not 1 <= len(t) <= 64:
            raise UserError(f"--wandb-tags {text!r}: " + (f"the tag {t[:20]!r}... is longer than 64 characters"
                                                          if t else "an empty tag"))
    return tags


def check(args):
    """The --wandb-* flags, before any work: each needs --wandb, none may be empty, the project name is
    one W&B accepts."""
    given = {f: getattr(args, f) for f in ("wandb_project", "wandb_entity", "wandb_name", "wandb_group",
                                            "wandb_tags", "wandb_artifacts") if getattr(args, f, None)}
    for f in given:
        if not args.wandb:
            raise UserError(f"--{f.replace('_', '-')}: needs --wandb")
    fields = getattr(type(args), "__dataclass_fields__", {})
    if not args.wandb and "log_every" in fields and args.log_every != fields["log_every"].default:
        raise UserError(f"--log-every {args.log_every}: only paces what --wandb logs; without it, it changes nothing")
    for f in ("wandb_project", "wandb_entity", "wandb_name", "wandb_group", "wandb_tags"):
        value = getattr(args, f)
        if value is not None and not value.strip():
            raise UserError(f"--{f.replace('_', '-')}: empty")
    parse_tags(args.wandb_tags)
    project = args.wandb_project
    if project is not None and (len(project) > 128 or any(c in project for c in "/\\#?%:")):
        raise UserError(f"--wandb-project {project!r}: W&B takes at most 128 characters and none of / \\ # ? % :")


# ----------------------------------------------------------------------------------------
# The run's configuration

def code_version() -> dict:
    """The git commit of this code (and whether tracked files differ from it), or None when it is not
    a git checkout (an unpacked copy, no git installed)."""
    here = os.path.dirname(os.path.abspath(__file__))

    def git(*cmd) -> Optional[str]:
        try:
            p = subprocess.run(["git", *cmd], cwd=here, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return p.stdout.strip() if p.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")  # this directory's own repository, not one around it
    if top is None or os.path.realpath(top) != os.path.realpath(here):
        return {"git_commit": None, "git_dirty": None}
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"git_commit": git("rev-parse", "HEAD"), "git_dirty": bool(status) if status is not None else None}


def start_config(args, program: str) -> dict:
    """What a run's config holds from its start: the program, the flags after their defaults, torch's
    version and the code's commit."""
    import torch

    return {"program": program, **asdict(args), "torch": torch.__version__, **code_version()}


def checkpoint_config(directory: Optional[str]) -> Optional[dict]:
    """A checkpoint directory's config.json as read (None without one: random weights, no drafter)."""
    path = os.path.join(directory, "config.json") if directory else None
    if path is None or not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):  # the loader has read it already; this is only a record
        return None


# ----------------------------------------------------------------------------------------
# A run

class Log:
    """A started wandb run and the few calls the programs make on it (`run` and `wandb` for the rest)."""

    def __init__(self, run, wandb):
        self.run, self.wandb = run, wandb

    @property
    def id(self) -> str:
        return self.run.id

    def config(self, **values):
        """Add what the program resolved to the run's config."""
        self.run.config.update(values, allow_val_change=True)

    def log(self, values: dict, step: Optional[int] = None):
        self.run.log(values, step=step)

    def summary(self, values: dict):
        self.run.summary.update(values)

    def table(self, columns: list[str], rows: Iterable) -> object:
        return self.wandb.Table(columns=columns, data=[list(r) for r in rows])

    def bar(self, key: str, columns: list[str], rows: Iterable, title: str, step: Optional[int] = None):
        """A bar chart of (label, value) rows, logged under `key` (its table as `key`_table)."""
        table = self.table(columns, rows)
        self.log({key: self.wandb.plot.bar(table, columns[0], columns[1], title=title)}, step=step)

    def artifact(self, name: str, kind: str, paths: Iterable[str], metadata: Optional[dict] = None,
                 aliases: Optional[list[str]] = None):
        """Files as an artifact of this run, named `<run id>-<name>` (versions: wandb's)."""
        art = self.wandb.Artifact(f"{self.id}-{name}", type=kind, metadata=metadata or {})
        for p in paths:
            art.add_file(p)
        self.run.log_artifact(art, aliases=aliases)

    def finish(self, exit_code: int, status: str, error: Optional[str] = None):
        self.run.summary.update({"status": status, **({"error": error} if error else {})})
        self.run.finish(exit_code=exit_code)


def _ending(e: BaseException) -> tuple[int, str]:
    """(exit code, status) of a run that ended with `e`."""
    if isinstance(e, Interrupted):
        return 128 + e.signum, "interrupted"
    if isinstance(e, KeyboardInterrupt):
        return 130, "interrupted"
    if isinstance(e, UserError):
        return 2, "failed"
    if isinstance(e, SystemExit):
        return (e.code if isinstance(e.code, int) else 1), "failed"
    return 1, "failed"


WANDB_MODES = ("online", "offline", "disabled", "shared", "dryrun", "run")  # what wandb's settings accept


def start(args, job_type: str, config: dict) -> Log:
    """wandb.init with the flags (None where not given: wandb's environment variables apply)."""
    import wandb

    project = args.wandb_project or os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT
    mode = os.environ.get("WANDB_MODE")
    if mode is not None and mode not in WANDB_MODES:  # wandb's own message names neither
        raise UserError(f"--wandb: WANDB_MODE={mode!r} is not one of {', '.join(WANDB_MODES)}")
    try:
        run = wandb.init(project=project, entity=args.wandb_entity, name=args.wandb_name, group=args.wandb_group,
                         tags=parse_tags(args.wandb_tags), job_type=job_type, config=config)
    except Exception as e:  # not logged in, no network, a bad WANDB_* variable: say it in one line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise UserError(f"--wandb: the run could not start ({first}); WANDB_MODE=offline logs without a network") \
            from None
    return Log(run, wandb)


@contextlib.contextmanager
def session(args, job_type: str, program: str, enabled: bool = True):
    """The program's work inside a wandb run: yields a `Log` (None without --wandb, or when not
    `enabled`, e.g. off rank 0 under torchrun), and finishes the run however the work ends — exit
    code 0 and status "finished", or as `_ending` says, the exception then going on."""
    if not (args.wandb and enabled):
        yield None
        return
    log = start(args, job_type, start_config(args, program))
    try:
        yield log
    except BaseException as e:
        code, status = _ending(e)
        log.finish(code, status, f"{type(e).__name__}: {e}" if status == "failed" else str(e) or type(e).__name__)
        raise
    log.finish(0, "finished")


# ----------------------------------------------------------------------------------------
# Progress off a terminal (eval.py, the training loop)

class Lines:
    """Progress where stderr is not a terminal (a log file, a pipe, a batch job's output), in which a
    tqdm bar's frames would pile up: `say(text)` prints a plain line at most every `every` seconds,
    and always with `final=True`. eval.py and the training loop (train.py, scripts/train_target.py)
    use it in place of their bars there."""

    def __init__(self, every: float = 60.0):
        self.every, self.last = every, time.monotonic()

    def say(self, text: str, final: bool = False):
        now = time.monotonic()
        if final or now - self.last >= self.every:
            self.last = now
            print(text, file=sys.stderr, flush=True)


def progress(enabled: bool) -> Optional[str]:
    """How to show progress: "bar" on a terminal, "lines" elsewhere (`Lines`), None when not asked for."""
    return None if not enabled else "bar" if sys.stderr.isatty() else "lines"


# ----------------------------------------------------------------------------------------
# speculate.py

class DecodeWatch:
    """speculate.py's observer of one decode (`Engine.generate`'s callbacks): `on_round(request,
    record)` for each row's round, `on_step()` after each round of the batch, `on_finish(request)`.

    The figures are kept as running sums (metrics.py's definitions: a stop token among the accepted
    drafts ends the round there), so logging costs the same at round 10 and round 10 million. Every
    `every` rounds of the batch, and at `close`, a W&B row under `<name>/`: round, requests done,
    tokens, tokens/s (tokens over the engine's prefill + decode seconds so far), acceptance_length
    τ, verified_per_round and the histogram of accepted drafts per round. `bar`: a tqdm bar on stderr
    (requests done, tokens/s, τ)."""

    def __init__(self, log: Optional[Log], name: str, K: int, stop_ids, requests: int, every: int,
                 seconds: Callable[[], float], bar: bool = False):
        self.log, self.name, self.K, self.stop, self.every, self.seconds = log, name, K, set(stop_ids), every, seconds
        self.steps = self.rounds = self.accepted = self.verified = self.committed = self.tokens = self.done = 0
        self.accepted_hist = [0] * (K + 1)  # rounds that accepted 0 .. K drafts
        self.seen: dict[int, int] = {}      # tokens of each request counted so far
        self.logged = 0                     # the step of the last W&B row
        self.bar = None
        if bar:
            from tqdm import tqdm
            # leave=False: the bar is wiped at the end, so stderr keeps only its lines (settings, errors)
            self.bar = tqdm(total=requests, desc=name, unit="req", file=sys.stderr, dynamic_ncols=True, leave=False)
        if log is not None:
            log.run.define_metric(f"{name}/*", step_metric=f"{name}/round")

    def _count_tokens(self, req):
        n = len(req.output_ids)
        self.tokens += n - self.seen.get(req.index, 0)
        self.seen[req.index] = n

    def on_round(self, req, rec: dict):
        a, v, c = metrics.round_counts(rec, self.stop)
        self.rounds += 1
        self.accepted, self.verified, self.committed = self.accepted + a, self.verified + v, self.committed + c
        self.accepted_hist[min(a, self.K)] += 1
        self._count_tokens(req)

    def on_step(self):
        self.steps += 1
        if self.log is not None and self.steps % self.every == 0:
            self._log()

    def on_finish(self, req):
        self._count_tokens(req)
        self.seen.pop(req.index, None)
        self.done += 1
        if self.bar is not None:
            fig = self.figures()
            tau = fig[f"{self.name}/acceptance_length"]
            self.bar.set_postfix_str(f"{fig[f'{self.name}/tokens_per_second']:.1f} tok/s, "
                                     f"τ={'-' if tau is None else f'{tau:.2f}'}", refresh=False)
            self.bar.update(1)

    def figures(self) -> dict:
        s = self.seconds()
        return {f"{self.name}/{k}": v for k, v in (
            ("round", self.steps), ("requests_done", self.done), ("tokens", self.tokens),
            ("tokens_per_second", self.tokens / s if s > 0 else 0.0),
            ("acceptance_length", self.committed / self.rounds if self.rounds else None),
            ("verified_per_round", self.verified / self.rounds if self.rounds else None))}

    def _log(self):
        import numpy as np

        hist = self.log.wandb.Histogram(np_histogram=(self.accepted_hist, np.arange(self.K + 2) - 0.5))
        self.log.log({**{k: v for k, v in self.figures().items() if v is not None},
                      f"{self.name}/accepted_length": hist})
        self.logged = self.steps

    def close(self):
        """The last row (if rounds ran since the one before) and the bar's end."""
        if self.log is not None and self.steps > self.logged:
            self._log()
        if self.bar is not None:
            self.bar.close()


def log_decode(log: Log, name: str, summary: dict, completions: list, prompts: list, tokenizer,
               files: dict[str, Optional[str]]):
    """The end of one speculate.py decode: its summary figures under `<name>/` in the run's summary,
    the acceptance by position as a chart (the paper's conditional rate) with a table of both rates,
    the accepted-length distribution as a chart, a table of the requests (prompt, completion, tokens,
    τ, finish reason) and the files written (trace, outputs) as artifacts."""
    log.summary({f"{name}/{k}": v for k, v in summary.items() if k not in ("summary", "outputs")})
    rates = summary["accept_rate_by_position"]
    if rates:
        log.bar(f"{name}/accept_rate_by_position", ["position", "accept_rate"],
                [(k + 1, r) for k, r in enumerate(rates) if r is not None],
                f"{name}: acceptance of draft k (given 1..k-1 accepted)")
    rows = []
    for c in completions[:TABLE_ROWS]:
        ids = prompts[c.prompt]
        text = tokenizer.decode(ids) if tokenizer is not None else ",".join(map(str, ids))
        rows.append((c.request, c.prompt, c.sample, text, c.text if c.text is not None else
                     ",".join(map(str, c.output_ids)), len(c.output_ids), c.num_rounds, c.acceptance_length,
                     c.finish_reason))
    log.log({f"{name}/requests": log.table(["request", "prompt_index", "sample", "prompt", "completion", "tokens",
                                            "rounds", "acceptance_length", "finish_reason"], rows)})
    log.summary({f"{name}/requests_logged": len(rows)})
    for what, path in files.items():
        if path is not None and os.path.isfile(path):
            log.artifact(what, what, [path], metadata={"program": "speculate.py", "path": os.path.abspath(path)})


# ----------------------------------------------------------------------------------------
# eval.py

def log_eval_dataset(log: Log, entry: dict, step: Optional[int]):
    """One dataset's row of results.json, logged as soon as it is done, under `<dataset>/`."""
    d = entry["dataset"]
    row = {f"{d}/{k}": entry[k] for k in ("num_samples", "num_rounds", "num_tokens", "acceptance_length",
                                          "draft_tokens_per_proposal", "verify_rate", "tokens_per_second",
                                          "seconds") if entry[k] is not None}
    row.update({f"{d}/accept_rate@{j}": r for j, r in enumerate(entry["accept_rates_by_position"]) if r is not None})
    row.update({f"{d}/conditional_accept_rate@{j + 1}": r for j, r in enumerate(entry["accept_rate_by_position"])
                if r is not None})
    log.log(row, step=step)


def log_eval(log: Log, results: dict, step: Optional[int], image: Optional[str], files: dict[str, Optional[str]]):
    """The end of eval.py: a table of the datasets, the acceptance by position of each as one chart,
    the calibration per position (ECE, AUROC, Brier; before / after STS on the held-out requests) as a
    table, scalars and an ECE chart, the reliability diagram as an image, and results.json and the STS
    temperatures as artifacts."""
    wb = log.wandb
    K = results["config"]["num_drafts"]
    cols = ["dataset", "num_samples", "num_rounds", "acceptance_length", "draft_tokens_per_proposal", "verify_rate",
            "tokens_per_second"]
    out = {"acceptance": log.table(cols + [f"accept_rate@{j}" for j in range(K)],
                                   ([e[c] for c in cols] + e["accept_rates_by_position"] for e in results["datasets"]))}
    if K:
        by_pos = log.table(["dataset", "position", "accept_rate", "conditional_accept_rate"],
                           [(e["dataset"], j + 1, a, c) for e in results["datasets"]
                            for j, (a, c) in enumerate(zip(e["accept_rates_by_position"], e["accept_rate_by_position"]))])
        out["accept_rate_by_position"] = wb.plot.line(by_pos, "position", "accept_rate", stroke="dataset",
                                                      title="accept_rate@j by draft position (authors' definition)")
    cal = results["calibration"]
    if cal is not None:
        sts = "temperatures" in cal
        ccols = ["position", "rounds", "mean_survival", "observed_survival", "ece", "auroc", "brier"]
        out["calibration"] = log.table(
            ccols + ["temperature", "heldout_ece_raw", "heldout_ece_sts", "heldout_brier_raw", "heldout_brier_sts"],
            ([m[c] for c in ccols] + ([cal["temperatures"][j], cal["raw_heldout"][j]["ece"], cal["sts_heldout"][j]["ece"],
                                       cal["raw_heldout"][j]["brier"], cal["sts_heldout"][j]["brier"]] if sts else [None] * 5)
             for j, m in enumerate(cal["raw"])))
        for j, m in enumerate(cal["raw"]):
            out.update({f"calibration/{k}_{j + 1}": m[k] for k in ("ece", "auroc", "brier") if m[k] is not None})
            if sts:
                out.update({f"calibration/temperature_{j + 1}": cal["temperatures"][j],
                            **{f"calibration/heldout_{k}_{w}_{j + 1}": cal[f"{w}_heldout"][j][k]
                               for k in ("ece", "brier") for w in ("raw", "sts") if cal[f"{w}_heldout"][j][k] is not None}})
        for d, ms in cal.get("raw_by_dataset", {}).items():  # per dataset, as the authors report it
            out.update({f"{d}/calibration/{k}_{m['position']}": m[k] for m in ms for k in ("ece", "auroc", "brier")
                        if m[k] is not None})
        positions = [m["position"] for m in cal["raw"]]
        series = {"all rounds, raw": [m["ece"] for m in cal["raw"]]}
        if sts:
            series.update({"held-out, raw": [m["ece"] for m in cal["raw_heldout"]],
                           "held-out, after STS": [m["ece"] for m in cal["sts_heldout"]]})
        out["calibration/ece_by_position"] = wb.plot.line_series(
            xs=positions, ys=[[float("nan") if v is None else v for v in s] for s in series.values()],
            keys=list(series), title="ECE of the prefix survival a_k by position", xname="position")
    if image is not None:
        out["calibration/reliability_diagram"] = wb.Image(image)
    log.log(out, step=step)
    log.summary({k: v for k, v in out.items() if isinstance(v, (int, float))})
    for what, path in files.items():
        if path is not None and os.path.isfile(path):
            log.artifact(what, what, [path], metadata={"program": "eval.py", "step": step,
                                                       "path": os.path.abspath(path)})
