"""What every program's command line shares: one-line user errors and `cli_main`, signals, range checks,
devices, threads and the compile cache."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import inspect
import math
import numbers
import os
import platform
import re
import signal
import sys
import threading
import typing
from typing import Annotated, Callable, Optional

import torch

try:  # tyro parses the flags; the engine and the Python API run without it
    import tyro
except ImportError:
    tyro = None

if tyro is not None:
    AutoBool = Annotated[Optional[bool], tyro.conf.DisallowNone]  # --flag / --no-flag, None = "auto"
    Repeated = Annotated[tuple[str, ...], tyro.conf.UseAppendAction]  # --flag A --flag B
else:
    AutoBool = Optional[bool]
    Repeated = tuple[str, ...]


def flat_fields(args) -> dict:
    """A program's flags as one dict, the groups declared `flat` merged in (what its flags read)."""
    out = {}
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        if dataclasses.is_dataclass(value):
            out.update(flat_fields(value))
        else:
            out[f.name] = value
    return out


def flag_group(f: dataclasses.Field):
    """The default of a field that holds a group of flags (a dataclass), or None for a flag."""
    if f.default_factory is dataclasses.MISSING:
        return None
    group = f.default_factory()
    if not dataclasses.is_dataclass(group):
        return None
    return group


def from_flat(args_class, values: dict):
    """`args_class` built from flags given as one dict (as `flat_fields` gives them back)."""
    kwargs = {}
    rest = dict(values)
    for f in dataclasses.fields(args_class):
        group = flag_group(f)
        if group is not None:
            mine = {g.name for g in dataclasses.fields(group)} & set(rest)
            kwargs[f.name] = dataclasses.replace(group, **{k: rest.pop(k) for k in mine})
        elif f.name in rest:
            kwargs[f.name] = rest.pop(f.name)
    if rest:
        raise TypeError(f"{args_class.__name__}: no flag {sorted(rest)[0]!r}")
    return args_class(**kwargs)


def flat(group):
    """A dataclass field whose flags appear without a prefix (--max-new-tokens, not --decode.max-new-tokens)."""
    if tyro is None:
        return group
    return Annotated[group, tyro.conf.arg(name="")]

MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-4, 1e4  # beyond these logits / T overflow float32, or sampling is noise
MAX_TOP_K = 2**30
MAX_BLOCK = 256  # drafts a round at most: published drafters use 7 (DSpark) and 16 (DFlash)
SEED_RANGE = f"[0, {2**62}]"  # any program's --seed: room left for seed + a request's index
DTYPES = ("float32", "bfloat16", "float16")


def dtype_name(dtype) -> str:
    """A torch dtype as its flag names it: "bfloat16" for torch.bfloat16."""
    return str(dtype).removeprefix("torch.")


def first_line(e: BaseException) -> str:
    """An exception's message in one line (at most 300 characters), or its type's name."""
    lines = str(e).strip().splitlines()
    if not lines:
        return type(e).__name__
    return lines[0][:300]


def one_line(text: str) -> str:
    """`text` with its control characters and line separators escaped as Python writes them (a path
    holding a newline: \\n), so that it prints as one line."""
    return re.sub(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]", lambda m: repr(m.group())[1:-1], text)


class UserError(Exception):
    """A user mistake: printed as one line naming the file, key, flag or value, exit status 2."""


class RankError(UserError):
    """A failure one process of several meets alone (its line names its rank): printed by every rank, not
    rank 0's alone."""


class Interrupted(BaseException):
    """SIGINT or SIGTERM: keep what is finished, exit 128 + the signal (no `except Exception` catches it)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.written: Optional[list[str]] = None  # the files kept, set by whoever closed them (None: not said)
        self.hint = ""  # with nothing written: how a run keeps its finished work

    def kept(self) -> str:
        """What the run kept, as the interruption's line says it."""
        if self.written is None:
            return "what was finished is kept"
        if self.written:
            return "what was written: " + ", ".join(self.written)
        if self.hint:
            return f"nothing was written ({self.hint})"
        return "nothing was written"


def _interrupt(signum, frame):
    _set_handlers(_exit_now)  # a second signal while the first unwinds the run is no second exception
    raise Interrupted(signum)


def _exit_now(signum, frame):
    """A second SIGINT / SIGTERM while the first stops the run: exit at once (outputs are whole or absent,
    never torn: each is published by a rename)."""
    name = signal.Signals(signum).name
    os.write(2, f"interrupted again by {name}: exiting now\n".encode())
    os._exit(128 + signum)


def _set_handlers(handler) -> dict:
    """SIGINT and SIGTERM to `handler`; returns their handlers before (none set off the main thread: it cannot)."""
    main = threading.current_thread() is threading.main_thread()
    if not main:
        return {}
    return {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}


@contextlib.contextmanager
def signals_deferred():
    """SIGINT / SIGTERM wait until the block is done (outputs published), then act (main thread only)."""
    pending = []
    handlers = _set_handlers(lambda n, f: pending.append(n))
    try:
        yield
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
        if pending:
            h = handlers[pending[0]]
            if callable(h):
                h(pending[0], None)
            elif h == signal.SIG_DFL:
                os.kill(os.getpid(), pending[0])


@contextlib.contextmanager
def signals_held():
    """A first SIGINT / SIGTERM waits until the block is done and then ends nothing more (what it would
    stop is finishing); a second exits at once, as one during an interruption does (main thread only)."""
    handlers = _set_handlers(lambda n, f: _set_handlers(_exit_now))
    try:
        yield
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)


def one_process(program: str, instead: str):
    """A program that runs as one process refuses torchrun, whose every process would do all the work and
    write the same files: one line, from rank 0, exit 2. The other ranks leave without a word and with
    status 0: torchrun stops every process once one fails, rank 0 then perhaps before its line. instead:
    what to run for several processes or GPUs."""
    if os.environ.get("WORLD_SIZE", "1").strip() in ("", "1"):
        return
    if os.environ.get("RANK", "0").strip() != "0":
        sys.exit(0)
    raise UserError(f"{program} runs as one process, not under torchrun: {instead}")


def spelled(word: str) -> str:
    """A command-line word as the flag it may name: before any "=", underscores as dashes (tyro takes
    --max_new_tokens for --max-new-tokens)."""
    name = word.split("=")[0]
    return name.replace("_", "-")


def flag_names(args_class) -> list[str]:
    """The flags of a program's dataclass, its flat groups' included (bool flags without --no-)."""
    names = []
    for f in dataclasses.fields(args_class):
        group = flag_group(f)
        if group is not None:
            names += flag_names(type(group))
        else:
            names.append(flag(f.name))
    return names


def switch_names(args_class) -> list[str]:
    """The on/off flags (--x / --no-x) of a program's dataclass, as `flag_names` names them."""
    names = []
    hints = typing.get_type_hints(args_class)
    for f in dataclasses.fields(args_class):
        group = flag_group(f)
        if group is not None:
            names += switch_names(type(group))
        elif hints[f.name] in (bool, Optional[bool]):
            names.append(flag(f.name))
    return names


def switch_before(value: str, argv: list[str], switches: list[str]) -> Optional[str]:
    """The on/off flag that `value` was given to (`--compile True`, `--compile=True`), or None."""
    for i, token in enumerate(argv):
        name, equals, given = token.partition("=")
        if equals and given == value:
            before = name
        elif token == value and i > 0:
            before = argv[i - 1]
        else:
            continue
        if before.replace("--no-", "--", 1) in switches:
            return before
    return None


def parse_error_line(event, args_class, argv: list[str]) -> Optional[str]:
    """One of tyro's parse-error events on `argv` as one line; None for a kind not rendered here (tyro's
    box)."""
    kind = type(event).__name__
    if kind == "UnrecognizedArgs":
        first = event.tokens[0]
        if not re.match(r"--?[A-Za-z]", first):  # a value, not a flag
            shown = first
            if not first.strip():
                shown = repr(first)
            switch = switch_before(first, argv, switch_names(args_class))
            if switch is not None:  # a flag that takes a value would have taken it
                on = switch.replace("--no-", "--", 1)
                off = on.replace("--", "--no-", 1)
                return f"{switch}: takes no value ({shown} given): {on} or {off}"
            return f"{shown}: unexpected (no flag before it takes a value; --help lists the flags)"
        name = first.split("=")[0]
        known = flag_names(args_class)
        close = [known_flag for known_flag in known if known_flag.startswith(name)]  # a flag cut short
        if not close:  # or misspelt
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
        hint = "--help lists the flags"
        if close:
            hint = f"did you mean {' or '.join(close[:3])}?"
        return f"{name}: no such flag ({hint})"
    if kind == "MissingArgs":
        missing = []
        for needed in event.missing_arguments:
            missing.append("/".join(needed.arg.lowered.name_or_flags))
        return f"{', '.join(missing)}: required (--help says what each takes)"
    argument = getattr(event, "argument", None)
    if argument is None:
        return None
    name = "/".join(argument.lowered.name_or_flags)
    expected = argument.lowered.metavar
    if kind == "InvalidChoice":
        return f"{name} {event.value}: not one of {expected}"
    if kind == "BadValue" and event.reason == "too_few_values":
        # argparse reads a value that starts with "-" (`--stop --`, `--prompt -x`) as a flag
        known = set(flag_names(args_class)) | {"-h", "--help"}
        known |= {switch.replace("--", "--no-", 1) for switch in switch_names(args_class)}
        given = argument.lowered.name_or_flags
        after = [argv[i + 1] for i in range(len(argv) - 1) if spelled(argv[i]) in given]
        if any(v.startswith("-") and spelled(v) not in known for v in after):
            hint = f'a value that starts with "-" is written {name}=VALUE'
            return f"{name}: no value given (expects {expected}; {hint})"
        return f"{name}: no value given (expects {expected})"
    if kind == "BadValue":
        return f"{name} {event.offending_value}: takes no value"
    if kind == "InstantiationFailure":
        # a union's message lists each member type's failure; the last is the value's own type
        lines = [line.strip() for line in event.message.splitlines() if line.strip()]
        causes = [line for line in lines if line.startswith("- ")]
        why = lines[0]
        if causes:
            why = causes[-1].split(": ", 1)[-1]
        return f"{name}: expects {expected} ({why})"
    return None


def given_once(argv: list[str], once: dict[str, str]):
    """The flags a program takes once (`once`: each flag and why) refused where given more often: argparse
    would keep the last in silence."""
    for name, why in once.items():
        times = sum(1 for token in argv if token == name or token.startswith(name + "="))
        if times > 1:
            raise UserError(f"{name}: given {times} times; {why}")


def joined_lines(text: str) -> str:
    """A help text's paragraphs (apart at blank lines), each one line that the help's box wraps to the
    terminal. It stands in for tyro's own join, which a field docstring reaches before its dedent: each
    indented source line kept its line break, so a terminal wider than the source showed its lines."""
    paragraphs = inspect.cleandoc(text).split("\n\n")
    joined = []
    for paragraph in paragraphs:
        words = paragraph.split("\n")
        joined.append(" ".join(line.strip() for line in words if line.strip()))
    return "\n\n".join(joined)


@contextlib.contextmanager
def help_lines_joined():
    """tyro's help texts joined by `joined_lines` while it parses (tyro 1.0's private function, as
    constraints.txt pins; another tyro keeps its own)."""
    try:
        from tyro import _strings
        own = _strings.remove_single_line_breaks
    except (ImportError, AttributeError):
        yield
        return
    _strings.remove_single_line_breaks = joined_lines
    try:
        yield
    finally:
        _strings.remove_single_line_breaks = own


def parse_flags(args_class, argv: Optional[list[str]], once: Optional[dict[str, str]] = None):
    """tyro's parse of `argv` (None: sys.argv[1:]); a value, flag or choice it rejects is a one-line
    UserError, as is a flag of `once` given more than once (`given_once`). tyro's hook for that is
    private (tyro 1.0, as constraints.txt pins); a tyro without it prints its own box and exits 2."""
    if tyro is None:
        raise UserError("the command line needs tyro: pip install -r requirements.txt")
    try:
        from tyro._errors import on_parse_error
    except ImportError:
        return tyro.cli(args_class, args=argv)

    given = argv
    if given is None:
        given = sys.argv[1:]
    tokens = [str(a) for a in given]
    given_once(tokens, once or {})

    def refuse(event):
        try:
            line = parse_error_line(event, args_class, tokens)
        except AttributeError:  # another tyro's private events: its own box
            return
        if line is not None:
            raise UserError(line)

    with on_parse_error(refuse), help_lines_joined():
        return tyro.cli(args_class, args=argv)


def cli_main(args_class, run: Callable, argv: Optional[list[str]] = None, *, inference: bool = True,
             rank0: Callable[[], bool] = lambda: True, once: Optional[dict[str, str]] = None) -> int:
    """A program's main(): tyro's flags (`once`: `parse_flags`), then `run(args)`; a UserError (a bad
    flag's included) is one line on stderr and exit 2 (rank 0's; a RankError's from the rank that met it),
    a file the system refused one line and exit 1, SIGINT/SIGTERM raise `Interrupted` in the run and exit
    128 + the signal, and a reader of stdout that went away (`| head`) exits quietly, 128 + SIGPIPE."""
    for stream in (sys.stdout, sys.stderr):  # a terminal that cannot show τ gets \u03c4, not a traceback
        if hasattr(stream, "reconfigure") and stream.errors == "strict":
            stream.reconfigure(errors="backslashreplace")
    handlers = _set_handlers(_interrupt)
    try:
        args = parse_flags(args_class, argv, once)
        mode = contextlib.nullcontext()
        if inference:
            mode = torch.inference_mode()
        with mode:
            run(args)
    except UserError as e:
        if rank0() or isinstance(e, RankError):
            print(f"error: {one_line(str(e))}", file=sys.stderr)
            return 2
        # Under torchrun every rank met rank 0's refusal: rank 0 says it and exits 2. The others leave
        # without a word and with 0: torchrun stops every process once one fails, rank 0 then perhaps
        # before its line.
        return 0
    except Interrupted as e:
        if rank0():
            print(f"interrupted by {e}: stopped; {e.kept()}", file=sys.stderr)
        return 128 + e.signum
    except BrokenPipeError:  # stdout's reader went away (`| head`): a shell's quiet SIGPIPE exit
        # stdout on /dev/null, so that the interpreter's last flush finds no broken pipe either
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except OSError as e:  # a file the system refused (no permission, a full disk): one line naming it
        if e.filename is None:
            raise
        if rank0():
            print(f"error: {one_line(str(e.filename))}: {e.strerror}", file=sys.stderr)
        return 1
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    return 0


# Flags

def flag(name: str) -> str:
    """A field's flag: max_new_tokens -> --max-new-tokens."""
    return "--" + name.replace("_", "-")


def bound_text(x: float) -> str:
    """A range's bound as printed: an integral one in full (10485760, not 1.04858e+07), others as :g gives them."""
    if x.is_integer():
        return str(int(x))
    return f"{x:g}"


def check_ranges(args, **ranges: str):
    """Every named field of `args` (None skipped) inside its interval, "[1, inf)", "(0, 1]", ... (never NaN)."""
    for name, spec in ranges.items():
        value = getattr(args, name)
        if value is None:
            continue
        lo, hi = (float(x) for x in spec[1:-1].split(","))
        lo_in = spec[0] == "["
        hi_in = spec[-1] == "]"
        if not in_range(value, lo, hi, lo_in, hi_in):
            valid = range_text(lo, hi, lo_in, hi_in)
            raise UserError(f"{flag(name)}: invalid value {value!r} (valid: {valid})")


def in_range(value, lo: float, hi: float, lo_in: bool, hi_in: bool) -> bool:
    """Whether `value` is a real number (not a bool, not NaN) inside the interval; lo_in, hi_in: the
    bounds are in it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    if value != value:  # NaN (math.isnan would overflow on an integer past a float's range)
        return False
    above = value > lo
    if lo_in:
        above = value >= lo
    below = value < hi
    if hi_in:
        below = value <= hi
    return above and below


def range_text(lo: float, hi: float, lo_in: bool, hi_in: bool) -> str:
    """An interval as an error names it: "1 to 100", ">= 0", "> 0 and <= 1", "any number"."""
    lo_text = bound_text(lo)
    hi_text = bound_text(hi)
    finite_lo = lo > -math.inf
    finite_hi = hi < math.inf
    if lo_in and hi_in and finite_lo and finite_hi:
        return f"{lo_text} to {hi_text}"
    parts = []
    if finite_lo and lo_in:
        parts.append(f">= {lo_text}")
    elif finite_lo:
        parts.append(f"> {lo_text}")
    if finite_hi and hi_in:
        parts.append(f"<= {hi_text}")
    elif finite_hi:
        parts.append(f"< {hi_text}")
    return " and ".join(parts) or "any number"


def parse_ints(text: str, flag: str, *, distinct_positive: bool = False) -> list[int]:
    """"1,2,3" -> [1, 2, 3]: ASCII digits (at most 18, an optional minus), no empty fields."""
    fields = [x.strip() for x in text.split(",")]
    for x in fields:
        digits = x.removeprefix("-")
        if not (digits.isascii() and digits.isdigit()):
            which = f"({x!r})"
            if not x:
                which = "(an empty field)"
            raise UserError(f"{flag}: {text!r} is not a comma-separated list of integers {which}")
        if len(digits) > 18:
            raise UserError(f"{flag}: {x[:20]}... is too large")
    values = [int(x) for x in fields]
    repeated = len(set(values)) != len(values)
    if distinct_positive and (min(values) < 1 or repeated):
        raise UserError(f"{flag}: {text!r} must be distinct positive integers")
    return values


def resolve_device(device: Optional[str]) -> str:
    """--device, checked; by default cuda where there is one, else cpu."""
    if device is None:
        device = "cpu"
        if torch.cuda.is_available():
            device = "cuda"
    if not isinstance(device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise UserError(f"--device {device!r}: cpu, cuda or cuda:N")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is available")
    return device


def resolve_dtype(dtype: Optional[str], device: str) -> torch.dtype:
    """--dtype, checked; by default bfloat16 on cuda, float32 on cpu."""
    if dtype is None:
        dtype = "float32"
        if device.startswith("cuda"):
            dtype = "bfloat16"
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: one of {', '.join(DTYPES)}")
    return getattr(torch, dtype)


def omp_threads(fix: str = "unset it, or give --threads") -> Optional[int]:
    """OMP_NUM_THREADS's outer level (OpenMP's nested form N,M,...: torch's), checked; None where unset.
    Anything else is an error, not OpenMP's silent fallback; `fix` says what to do instead."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if not value:
        return None
    first = value.split(",")[0]
    if not re.fullmatch(r"\d+(,\d+)*", value) or int(first) < 1:
        raise UserError(f"OMP_NUM_THREADS={value!r}: not a positive integer ({fix})")
    return int(first)


def set_threads(threads: Optional[int]) -> str:
    """torch's CPU threads: --threads (checked by the caller), else OMP_NUM_THREADS, else half the usable
    CPUs (a second thread per process slows decoding on a small shared machine). Returns the line saying which."""
    asked = None
    if threads is None:
        asked = omp_threads()
    if threads is not None:
        how = "--threads"
    elif asked is not None:
        value = os.environ["OMP_NUM_THREADS"].strip()
        threads = torch.get_num_threads()
        how = "OMP_NUM_THREADS"
        if threads != asked:
            how += f"={value}; torch took {threads}"
    else:
        threads = max(1, len(os.sched_getaffinity(0)) // 2)
        how = "default: half the CPUs, --threads to change"
    torch.set_num_threads(threads)
    return f"threads: {threads} ({how})"


def device_line(device) -> str:
    """Where a run decodes, for a program's first lines; on a CPU with a GPU beside it, how to use the GPU
    (--device defaults to cpu)."""
    if str(device).startswith("cuda"):
        return f"device: {device} ({torch.cuda.get_device_name(device)})"
    if torch.cuda.is_available():
        return "device: cpu (a GPU is here: --device cuda runs on it)"
    return "device: cpu"


def device_name(device) -> str:
    if str(device).startswith("cuda"):
        return torch.cuda.get_device_name(device)
    name = f"{platform.machine()} CPU"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    return f"{name} ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"


def fits(need: int, free: int) -> bool:
    """`need` bytes fit in `free` (`free_memory`'s) with a tenth to spare, or what is free is unknown (0)."""
    return not free or need <= 0.9 * free


def free_memory(device) -> int:
    """Bytes still free on `device` (0: unknown, no check; "meta" holds nothing). On CUDA, what the card
    has free and torch's allocator holds unused; on a CPU, what Linux says is available: free pages and
    the page cache it can reclaim (the free pages alone, where it does not say)."""
    kind = torch.device(device).type
    if kind == "cuda":
        device = torch.device(device)
        free = torch.cuda.mem_get_info(device)[0]
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return free + cached
    if kind != "cpu":
        return 0
    with contextlib.suppress(ValueError, OSError):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    kib = int(line.split()[1])
                    return kib * 1024
    with contextlib.suppress(ValueError, OSError, AttributeError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return 0


def sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def refuse_standard_output(path: str, flag: str, wanted: str):
    """`flag`'s path "-": not standard output here (no output is written there), refused in one line."""
    if path == "-":
        raise UserError(f"{flag} -: standard output is not supported here; give a {wanted} path")


def path_argument(value, name: str, what: str = "a path or hub id") -> Optional[str]:
    """An API path argument (`load`'s target, drafter, calibration, `use_compile_cache`'s directory) as
    its flag takes it: a str or an os.PathLike, None where not given."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if value is not None and not isinstance(value, str):
        raise UserError(f"{name}: invalid value {value!r} ({what}: a str or an os.PathLike)")
    return value


def use_compile_cache(path: Optional[str]) -> str:
    """Inductor's caches: --compile-cache, else $TORCHINDUCTOR_CACHE_DIR, else ~/.cache/dspark-fast/inductor
    ($XDG_CACHE_HOME for ~/.cache), which unlike Inductor's /tmp default survives a reboot."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    given = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    source = "$TORCHINDUCTOR_CACHE_DIR"  # named in every error: where the path came from
    path = path_argument(path, "--compile-cache", "a directory")
    if path is not None:
        refuse_standard_output(path, "--compile-cache", "directory")
        given = path
        source = "--compile-cache"
    if given is not None and not given.strip():
        raise UserError(f"{source}: empty (a directory for the compiled graphs)")
    if given is None:
        given = os.path.join(cache, "dspark-fast", "inductor")
        source = "the compile cache"
    where = os.path.abspath(os.path.expanduser(given))
    if os.path.exists(where) and not os.path.isdir(where):
        raise UserError(f"{source} {where}: not a directory")
    try:
        os.makedirs(where, exist_ok=True)
    except OSError as e:
        raise UserError(f"{source} {where}: cannot create the directory ({e.strerror})") from None
    if not os.access(where, os.W_OK | os.X_OK):
        raise UserError(f"{source} {where}: the directory is not writable")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = where
    return where
