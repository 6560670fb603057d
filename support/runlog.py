"""What a run tells as it goes: Weights & Biases logging (`WandbFlags`, which every program's Args inherits),
a decode's summary, requests and files (`log_decode`; its running figures: report.Decoding), progress of long
runs (`Lines`). A W&B run starts before the work and always finishes: exit code 0, 2 after a UserError, 1 after
another exception, 128 + the signal (the summary's `status` and `error` say which). wandb is imported only with
--wandb."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from support.cli import Interrupted, UserError, first_line, flag, flat_fields, signals_deferred, signals_held
from support.files import read_json, wrong_kind

DEFAULT_PROJECT = "dspark-fast"
# a requests table longer than this keeps its first rows (wandb slows on huge tables)
TABLE_ROWS = 10_000


@dataclass
class WandbFlags:
    """The Weights & Biases flags every program shares (inherited by each program's Args)."""

    wandb: bool = False
    """Log the run to Weights & Biases: config, figures as it goes, tables, charts and files
    (docs/logging.md). WANDB_MODE=offline logs to ./wandb (or WANDB_DIR) without a network."""
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


def given(text: str, where: str) -> str:
    """A value as an error names it: after its flag (--wandb-tags 'a'), or its variable (WANDB_TAGS='a')."""
    if where.startswith("--"):
        return f"{where} {text!r}"
    return f"{where}={text!r}"


def parse_tags(text: Optional[str], where: str = "--wandb-tags") -> Optional[list[str]]:
    """--wandb-tags "a,b" -> ["a", "b"]; W&B takes 1 to 64 characters a tag. `where`: the flag, or the
    variable the text came from."""
    if text is None:
        return None
    tags = [t.strip() for t in text.split(",")]
    for t in tags:
        if not t:
            raise UserError(f"{given(text, where)}: an empty tag")
        if len(t) > 64:
            raise UserError(f"{given(text, where)}: the tag {t[:20]!r}... is longer than 64 characters")
    return tags


def check_project(project: str, where: str):
    """A project name W&B accepts; `where`: the flag or the variable it came from."""
    if len(project) > 128 or any(c in project for c in "/\\#?%:"):
        raise UserError(f"{given(project, where)}: W&B takes at most 128 characters and none of / \\ # ? % :")


# WandbFlags' strings, each with the variable that stands in for it when not given (logging.md)
NAMING_VARIABLES = {"wandb_project": "WANDB_PROJECT", "wandb_entity": "WANDB_ENTITY",
                    "wandb_name": "WANDB_NAME", "wandb_group": "WANDB_RUN_GROUP", "wandb_tags": "WANDB_TAGS"}
NAMING_FLAGS = tuple(NAMING_VARIABLES)


def check(args):
    """The --wandb-* flags and --log-every, before any work: each given needs --wandb, none empty, a project
    name W&B accepts; with --wandb, the variables standing in for them (`naming`)."""
    given = [name for name in NAMING_FLAGS + ("wandb_artifacts",) if getattr(args, name, None)]
    if given and not args.wandb:
        raise UserError(f"{flag(given[0])}: needs --wandb")
    fields = getattr(type(args), "__dataclass_fields__", {})
    log_every_set = "log_every" in fields and args.log_every != fields["log_every"].default
    if not args.wandb and log_every_set:
        raise UserError(f"--log-every {args.log_every}: only paces what --wandb logs; without it, "
                        f"it changes nothing")
    for name in NAMING_FLAGS:
        value = getattr(args, name)
        if value is not None and not value.strip():
            raise UserError(f"{flag(name)}: empty")
    parse_tags(args.wandb_tags)
    if args.wandb_project is not None:
        check_project(args.wandb_project, "--wandb-project")
    if args.wandb:
        naming(args)
        check_variables(imported())
        check_wandb_dir()


def imported():
    """wandb, imported: one line where it is missing, or installed and broken (a protobuf or pydantic it
    cannot use raises an ImportError, or a TypeError such as protobuf's "Descriptors cannot be created")."""
    if importlib.util.find_spec("wandb") is None:
        raise UserError("--wandb: needs the wandb package (pip install wandb)")
    try:
        import wandb
    except Exception as e:
        raise UserError(f"--wandb: the wandb package does not import ({first_line(e)})") from None
    return wandb


# what wandb's settings accept
WANDB_MODES = ("online", "offline", "disabled", "shared", "dryrun", "run")


def check_variables(wandb):
    """wandb's variables, as wandb.init would read them, each on its own so the error names it (wandb's
    own names only its setting, in pydantic's "1 validation error for Settings")."""
    mode = os.environ.get("WANDB_MODE")
    if mode is not None and mode not in WANDB_MODES:
        raise UserError(f"--wandb: WANDB_MODE={mode!r} is not one of {', '.join(WANDB_MODES)}")
    for variable in sorted(v for v in os.environ if v.startswith("WANDB_")):
        value = os.environ[variable]
        try:
            wandb.Settings().update_from_env_vars({variable: value})
        except Exception as e:
            reason = first_line(e)
            if hasattr(e, "errors"):  # pydantic's ValidationError: its first line says only how many
                reason = e.errors()[0]["msg"]
            raise UserError(f"--wandb: {given(value, variable)}: {reason}") from None


def check_wandb_dir():
    """WANDB_DIR, where the run's files go: a directory, or one wandb can make, writable (else wandb puts
    the run in the temporary directory, saying so only in warnings that WANDB_SILENT quiets)."""
    directory = os.environ.get("WANDB_DIR")
    if not directory:
        return
    real = os.path.realpath(directory)
    folder = real
    while not os.path.lexists(folder):  # the nearest folder there is, where wandb makes the rest
        folder = os.path.dirname(folder)
    problem = None
    if not os.path.isdir(folder):
        problem = f"{folder} {wrong_kind(folder, 'directory')}"
    elif real.startswith(("/proc/", "/sys/")):
        problem = "a process or system folder, not one for files"
    elif not os.access(folder, os.W_OK | os.X_OK):
        problem = f"{folder} is not writable"
    if problem:
        raise UserError(f"--wandb: {given(directory, 'WANDB_DIR')}: {problem}")


def naming(args) -> dict:
    """wandb.init's project, entity, name, group and tags: each flag, else its variable (checked as the
    flag is: not blank, tags parsed, a project W&B accepts), else None (the project: DEFAULT_PROJECT)."""
    values = {}
    for name, variable in NAMING_VARIABLES.items():
        value = getattr(args, name)
        where = flag(name)
        if value is None and variable in os.environ:
            value = os.environ[variable]
            where = variable
            if not value.strip():
                raise UserError(f"{variable}={value!r}: empty (unset it for the default)")
        values[name] = value
        if name == "wandb_tags":
            values[name] = parse_tags(value, where)
        if name == "wandb_project" and value is not None:
            check_project(value, where)
    if values["wandb_project"] is None:
        values["wandb_project"] = DEFAULT_PROJECT
    return values


# The run's configuration

def code_version() -> dict:
    """This code's git commit and whether tracked files differ from it (None outside a git checkout)."""
    # the checkout holding support/
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*cmd) -> Optional[str]:
        try:
            p = subprocess.run(["git", *cmd], cwd=here, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        if p.returncode != 0:
            return None
        return p.stdout.strip()

    top = git("rev-parse", "--show-toplevel")  # this directory's own repository, not one around it
    if top is None or os.path.realpath(top) != os.path.realpath(here):
        return {"git_commit": None, "git_dirty": None}
    status = git("status", "--porcelain", "--untracked-files=no")
    dirty = None
    if status is not None:
        dirty = bool(status)
    return {"git_commit": git("rev-parse", "HEAD"), "git_dirty": dirty}


def checkpoint_config(directory: Optional[str]) -> Optional[dict]:
    """A checkpoint directory's config.json, as loaded (None: random weights, or no drafter)."""
    if not directory:
        return None
    return read_json(os.path.join(directory, "config.json"))


# A run

class Log:
    """A started wandb run and the few calls the programs make on it (`wandb` for the objects they log).
    The first call that fails (wandb's service gone, a full disk) stops the logging with one warning:
    the run, its outputs and its checkpoints go on without their copy in W&B."""

    def __init__(self, run, wandb):
        self.run = run
        self.wandb = wandb
        self.stopped = False

    def call(self, method, *args, **kwargs):
        """`method` of the wandb run, unless logging has stopped; a failure stops it."""
        if self.stopped:
            return
        try:
            method(*args, **kwargs)
        except Exception as e:
            self.stopped = True
            print(f"warning: --wandb: logging stopped, the run goes on without it ({first_line(e)})",
                  file=sys.stderr, flush=True)
            # ended now, as far as wandb can: its exit hook would print a traceback for a lost service
            with contextlib.suppress(Exception):
                self.run.finish(exit_code=1)
            with contextlib.suppress(Exception):
                self.wandb.teardown()

    def config(self, **values):
        self.call(self.run.config.update, values, allow_val_change=True)

    def log(self, values: dict, step: Optional[int] = None):
        self.call(self.run.log, values, step=step)

    def summary(self, values: dict):
        self.call(self.run.summary.update, values)

    def step_metric(self, keys: str, step: str):
        """`keys` (a glob) plotted against the metric `step`."""
        self.call(self.run.define_metric, keys, step_metric=step)

    def table(self, columns: list[str], rows: Iterable) -> object:
        return self.wandb.Table(columns=columns, data=[list(r) for r in rows])

    def bar(self, key: str, columns: list[str], rows: Iterable, title: str):
        """A bar chart of (label, value) rows, logged under `key` (its table as `key`_table)."""
        chart = self.wandb.plot.bar(self.table(columns, rows), columns[0], columns[1], title=title)
        self.log({key: chart})

    def artifact(self, name: str, kind: str, paths: Iterable[str], metadata: Optional[dict] = None,
                 aliases: Optional[list[str]] = None):
        """Files as an artifact of this run, named `<run id>-<name>` (versions: wandb's)."""
        def log_artifact():  # staging copies every file: a full disk fails it as it fails a log
            art = self.wandb.Artifact(f"{self.run.id}-{name}", type=kind, metadata=metadata or {})
            for p in paths:
                art.add_file(p)
            self.run.log_artifact(art, aliases=aliases)

        self.call(log_artifact)

    def outputs(self, files: dict, **metadata):
        """Each output file written (`files`: its kind -> path or None) as an artifact of its own."""
        for what, path in files.items():
            if path is not None and os.path.isfile(path):
                self.artifact(what, what, [path], metadata=dict(metadata, path=os.path.abspath(path)))

    def finish(self, exit_code: int, status: str, error: Optional[str] = None):
        ending = {"status": status}
        if error:
            ending["error"] = error
        self.summary(ending)
        self.call(self.run.finish, exit_code=exit_code)


def _ending(e: BaseException) -> tuple[int, str]:
    if isinstance(e, Interrupted):
        return 128 + e.signum, "interrupted"
    if isinstance(e, KeyboardInterrupt):
        return 130, "interrupted"
    if isinstance(e, BrokenPipeError):  # stdout's reader went away (`| head`): cli_main's quiet exit
        return 128 + signal.SIGPIPE, "interrupted"
    if isinstance(e, UserError):
        return 2, "failed"
    if isinstance(e, SystemExit) and isinstance(e.code, int):
        return e.code, "failed"
    return 1, "failed"


def start(args, job_type: str, config: dict, run_id: Optional[str] = None) -> Log:
    """wandb.init with the flags, or the variables standing in for them (`naming`); `run_id`: the run
    to go on with (a resumed training's), else a new one."""
    import wandb  # it imports, and its variables are valid (`check`)

    values = naming(args)
    mode = os.environ.get("WANDB_MODE")
    resume = None
    if run_id is not None:
        resume = "allow"  # that run goes on; a new one of that id where it is not found
    try:
        run = wandb.init(project=values["wandb_project"], entity=values["wandb_entity"],
                         name=values["wandb_name"], group=values["wandb_group"], tags=values["wandb_tags"],
                         job_type=job_type, config=config, id=run_id, resume=resume)
    except Exception as e:  # not logged in, no network: say it in one line
        hint = ""
        if mode != "offline":
            hint = "; WANDB_MODE=offline logs without a network"
        raise UserError(f"--wandb: the run could not start ({first_line(e)}){hint}") from None
    return Log(run, wandb)


@contextlib.contextmanager
def logged_run(args, job_type: str, program: str, enabled: bool = True,
               from_rank0: Callable = lambda error: error, run_id: Optional[str] = None):
    """The work inside a wandb run: yields a `Log` (None without --wandb or `enabled`), and finishes the run
    however the work ends (exit code 0 and "finished", or as `_ending` says, the exception going on).
    `run_id`: the run to go on with (`start`).
    Under torchrun, with the process group joined and `distributed.from_rank0` given, a run that rank 0
    cannot start stops every rank."""
    if not args.wandb:
        yield None
        return
    import torch

    log = None
    error = None
    if enabled:
        config = {"program": program, **flat_fields(args), "torch": torch.__version__,
                  **code_version()}
        try:
            # wandb.init swallows a signal or half-ends its run: the signal acts once the run exists
            with signals_deferred():
                log = start(args, job_type, config, run_id)
        except UserError as e:
            error = str(e)
        except Interrupted as e:
            if log is not None:
                _finish(log, e)
            raise
    error = from_rank0(error)
    if error is not None:
        raise UserError(error)
    if log is None:
        yield None
        return
    try:
        yield log
    except BaseException as e:
        _finish(log, e)
        raise
    _finish_whole(log, 0, "finished")


def _finish(log: Log, e: BaseException):
    """Finish the run as the exception `e` ends it (`_ending`), naming it."""
    code, status = _ending(e)
    if status == "failed":
        error = f"{type(e).__name__}: {e}"
        _finish_whole(log, code, status, error)
        return
    error = str(e) or type(e).__name__  # a signal's name, or the exception's
    # stopped by a signal already: a second one exits at once (cli.py), also from an upload that hangs
    log.finish(code, status, error)


def _finish_whole(log: Log, code: int, status: str, error: Optional[str] = None):
    """log.finish, whole: a SIGINT / SIGTERM during it waits for it and then ends nothing more, so the
    program exits with `code`, the exit code W&B shows, not 128 + the signal; a second exits at once
    (an upload that hangs)."""
    with signals_held():
        log.finish(code, status, error)


# speculate.py

def log_decode(log: Log, name: str, summary: dict, completions: list, prompts: list, tokenizer,
               files: dict[str, Optional[str]]):
    """A decode's end: its summary under `<name>/`, acceptance by position, the requests, its files as artifacts."""
    figures = {f"{name}/{k}": v for k, v in summary.items() if k != "summary"}
    log.summary(figures)
    rates = summary["accept_rate_by_position"]
    if rates:
        points = [(k + 1, r) for k, r in enumerate(rates) if r is not None]
        log.bar(f"{name}/accept_rate_by_position", ["position", "accept_rate"], points,
                f"{name}: acceptance of draft k (given 1..k-1 accepted)")
    rows = []
    for c in completions[:TABLE_ROWS]:
        ids = prompts[c.prompt]
        if tokenizer is not None:
            prompt = tokenizer.decode(ids)
        else:
            prompt = ",".join(map(str, ids))
        completion = c.text
        if completion is None:
            completion = ",".join(map(str, c.output_ids))
        rows.append((c.request, c.prompt, c.sample, prompt, completion, len(c.output_ids),
                     c.num_rounds, c.acceptance_length, c.finish_reason))
    columns = ["request", "prompt_index", "sample", "prompt", "completion", "tokens", "rounds",
               "acceptance_length", "finish_reason"]
    # not <name>/requests: an interrupted decode's summary holds the number asked under that key
    log.log({f"{name}/requests_table": log.table(columns, rows)})
    log.summary({f"{name}/requests_logged": len(rows)})
    log.outputs(files, program="speculate.py")


# Progress of a long run (speculate.py, eval.py, training): a bar on a terminal, elsewhere a plain line now and then.
class Lines:
    """Progress off a terminal (no piled-up bar frames): a line at most every `every` s, always if `final`."""

    def __init__(self, every: float = 60.0):
        self.every = every
        self.last = time.monotonic()

    def say(self, text: str, final: bool = False):
        now = time.monotonic()
        if final or now - self.last >= self.every:
            self.last = now
            print(text, file=sys.stderr, flush=True)


def show(enabled: bool) -> Optional[str]:
    """How to show progress: "bar" on a terminal, "lines" elsewhere (`Lines`), None when not asked for."""
    if not enabled:
        return None
    if sys.stderr.isatty():
        return "bar"
    return "lines"
