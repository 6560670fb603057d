"""What every program shares: one-line user errors and `cli_main`, flag and device defaults, JSON reading
that names the line at fault, outputs checked before any work and written whole or not at all."""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import os
import platform
import re
import signal
import sys
import tempfile
import threading
from typing import Annotated, Callable, Optional, Union

import torch

try:  # tyro parses the flags; the engine and the Python API run without it
    import tyro
    AutoBool = Annotated[Optional[bool], tyro.conf.DisallowNone]  # --flag / --no-flag, None = "auto"
except ImportError:
    AutoBool = Optional[bool]

MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-4, 1e4  # beyond these logits / T overflow float32, or sampling is noise
MAX_TOP_K = 2**30
DTYPES = ("float32", "bfloat16", "float16")


def first_line(e: BaseException) -> str:
    """An exception's message in one line (at most 300 characters), or its type's name."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


class UserError(Exception):
    """A user mistake: printed as one line naming the file, key, flag or value, exit status 2."""


class Interrupted(BaseException):
    """SIGINT or SIGTERM: keep what is finished, exit 128 + the signal (no `except Exception` catches it)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _interrupt(signum, frame):
    raise Interrupted(signum)


def _set_handlers(handler) -> dict:
    """SIGINT and SIGTERM to `handler`; returns their handlers before (none set off the main thread: it cannot)."""
    main = threading.current_thread() is threading.main_thread()
    return {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}


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


def cli_main(args_class, run: Callable, argv: Optional[list[str]] = None, *, inference: bool = True,
             rank0: Callable[[], bool] = lambda: True) -> int:
    """A program's main(): tyro's flags, then `run(args)`; a UserError is one line on stderr (rank 0) and
    exit 2, SIGINT/SIGTERM raise `Interrupted` in the run and exit 128 + the signal."""
    import tyro

    args = tyro.cli(args_class, args=argv)  # None: sys.argv[1:]
    for stream in (sys.stdout, sys.stderr):  # a terminal that cannot show τ gets \u03c4, not a traceback
        if hasattr(stream, "reconfigure") and stream.errors == "strict":
            stream.reconfigure(errors="backslashreplace")
    handlers = _set_handlers(_interrupt)
    try:
        with torch.inference_mode() if inference else contextlib.nullcontext():
            run(args)
    except UserError as e:
        if rank0():
            print(f"error: {e}", file=sys.stderr)
        return 2
    except Interrupted as e:
        if rank0():
            print(f"interrupted by {e}: stopped; what was finished is kept", file=sys.stderr)
        return 128 + e.signum
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    return 0


# Flags

def check_ranges(args, **ranges: str):
    """Every named field of `args` (None skipped) inside its interval, "[1, inf)", "(0, 1]", ... (never NaN)."""
    for name, spec in ranges.items():
        value = getattr(args, name)
        if value is None:
            continue
        lo, hi = (float(x) for x in spec[1:-1].split(","))
        lo_in, hi_in = spec[0] == "[", spec[-1] == "]"
        ok = not isinstance(value, bool) and isinstance(value, numbers.Real) and not math.isnan(value) and (
            (value >= lo if lo_in else value > lo) and (value <= hi if hi_in else value < hi))
        if not ok:
            left = f"{'>=' if lo_in else '>'} {lo:g}" if lo > -math.inf else ""
            right = f"{'<=' if hi_in else '<'} {hi:g}" if hi < math.inf else ""
            valid = f"{lo:g} to {hi:g}" if lo_in and hi_in and left and right else " and ".join(
                s for s in (left, right) if s) or "any number"
            raise UserError(f"--{name.replace('_', '-')}: invalid value {value!r} (valid: {valid})")


def parse_ints(text: str, flag: str, *, positive: bool = False, distinct: bool = False) -> list[int]:
    """"1,2,3" -> [1, 2, 3]: ASCII digits (at most 18, an optional minus), no empty fields."""
    fields = [x.strip() for x in text.split(",")]
    for x in fields:
        digits = x[1:] if x.startswith("-") else x
        if not (digits.isascii() and digits.isdigit()):
            raise UserError(f"{flag}: {text!r} is not a comma-separated list of integers"
                            + (" (an empty field)" if not x else f" ({x!r})"))
        if len(digits) > 18:
            raise UserError(f"{flag}: {x[:20]}... is too large")
    values = [int(x) for x in fields]
    if (positive and any(v < 1 for v in values)) or (distinct and len(set(values)) != len(values)):
        what = " ".join(w for w, on in (("distinct", distinct), ("positive", positive)) if on)
        raise UserError(f"{flag}: {text!r} must be {what} integers")
    return values


def resolve_device(device: Optional[str]) -> str:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise UserError(f"--device {device!r}: cpu, cuda or cuda:N")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is available")
    return device


def resolve_dtype(dtype: Optional[str], device: str) -> torch.dtype:
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: one of {', '.join(DTYPES)}")
    return getattr(torch, dtype or ("bfloat16" if device.startswith("cuda") else "float32"))


def set_threads(threads: Optional[int]) -> str:
    """torch's CPU threads: --threads (checked by the caller), else OMP_NUM_THREADS, else half the usable
    CPUs (a second thread per process slows decoding on a small shared machine). Returns the line saying which."""
    if threads is not None:
        how = "--threads"
    elif os.environ.get("OMP_NUM_THREADS", "").strip():
        value = os.environ["OMP_NUM_THREADS"].strip()
        first = value.split(",")[0]  # OpenMP's nested form N,M,...: the outer level is torch's
        if not re.fullmatch(r"\d+(,\d+)*", value) or int(first) < 1:
            raise UserError(f"OMP_NUM_THREADS={value!r}: not a positive integer (unset it, or give --threads)")
        threads, how = torch.get_num_threads(), "OMP_NUM_THREADS"
        if threads != int(first):
            how += f"={value}; torch took {threads}"
    else:
        threads, how = max(1, len(os.sched_getaffinity(0)) // 2), "default: half the CPUs, --threads to change"
    torch.set_num_threads(threads)
    return f"threads: {threads} ({how})"


def device_name(device) -> str:
    if str(device).startswith("cuda"):
        return torch.cuda.get_device_name(device)
    name = f"{platform.machine()} CPU"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    return f"{name} ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"


def free_memory(device) -> int:
    """Bytes still free on `device` (0: unknown, no check)."""
    if str(device).startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[0]
    with contextlib.suppress(ValueError, OSError, AttributeError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return 0


def sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def use_compile_cache(path: Optional[str]) -> str:
    """Inductor's caches: --compile-cache, else $TORCHINDUCTOR_CACHE_DIR, else ~/.cache/dspark-fast/inductor
    ($XDG_CACHE_HOME for ~/.cache), which unlike Inductor's /tmp default survives a reboot."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    where = os.path.abspath(os.path.expanduser(path or os.environ.get("TORCHINDUCTOR_CACHE_DIR")
                                               or os.path.join(cache, "dspark-fast", "inductor")))
    if os.path.exists(where) and not os.path.isdir(where):
        raise UserError(f"--compile-cache {where}: not a directory")
    try:
        os.makedirs(where, exist_ok=True)
    except OSError as e:
        raise UserError(f"--compile-cache {where}: cannot create the directory ({e.strerror})") from None
    if not os.access(where, os.W_OK | os.X_OK):
        raise UserError(f"--compile-cache {where}: the directory is not writable")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = where
    return where


# Reading

def optional_file(path: str) -> bool:
    """True for a file, False for nothing; a folder or a broken link under its name is an error."""
    if os.path.isfile(path):
        return True
    if os.path.lexists(path):
        raise UserError(f"{path}: not a file ({'a folder' if os.path.isdir(path) else 'a broken link'})")
    return False


def _unique_keys(pairs: list) -> dict:
    out = {}
    for k, v in pairs:
        if k in out:  # json would keep the last one without a word
            raise ValueError(f"key {k!r} appears twice")
        out[k] = v
    return out


def _parse(text, where: str):
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError) as e:  # malformed, not UTF-8, a 5000-digit number, nested too deep
        raise UserError(f"{where}: malformed JSON ({str(e).splitlines()[0][:200] or type(e).__name__})") from None


def read_json(path: str) -> dict:
    """A JSON object file; every failure one line naming the file."""
    if not optional_file(path):
        raise UserError(f"{path}: file not found")
    with open(path, "rb") as f:
        obj = _parse(f.read(), path)
    if not isinstance(obj, dict):
        raise UserError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def read_jsonl(path: str):
    """(where, object) for every non-blank line of a JSON-lines file; `where` is "path:line"."""
    lineno = 0
    with open(path, "rb") as f:
        for raw in f:
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise UserError(f"{path}:{lineno + 1}: not UTF-8 text") from None
            for line in re.split(r"\r(?!\n)", text):  # a lone CR ends a line too, as text mode reads it
                lineno += 1
                if lineno == 1 and line.startswith("\ufeff"):
                    raise UserError(f"{path}:1: starts with a byte-order mark (save the file as UTF-8 without BOM)")
                if line.strip():
                    yield f"{path}:{lineno}", _parse(line, f"{path}:{lineno}")


# Writing

def check_writable(path: str, flag: str):
    """Fail now if `path` cannot be written as a regular file (a link is judged by its target)."""
    if not path.strip():
        raise UserError(f"{flag}: empty path")
    real = os.path.realpath(path)
    if os.path.isdir(real):
        raise UserError(f"{flag} {path}: is a directory, not a file")
    if path.endswith(os.sep):
        raise UserError(f"{flag} {path}: names a directory; give a file path")
    if os.path.exists(real) and not os.path.isfile(real):
        raise UserError(f"{flag} {path}: is not a regular file (a device or a pipe); give a file path")
    given = os.path.abspath(path)
    if (given in ("/dev/stdout", "/dev/stderr", "/dev/stdin") or given.startswith("/dev/fd/")
            or any(p.startswith(("/proc/", "/sys/")) for p in (given, real))):
        raise UserError(f"{flag} {path}: a device or process file, not a file path (the output is written "
                        f"to a temporary file and renamed into place)")
    folder = os.path.dirname(real)
    if not os.path.isdir(folder):
        raise UserError(f"{flag} {path}: directory {folder} does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(real) and not os.access(real, os.W_OK)):
        raise UserError(f"{flag} {path}: not writable")
    try:  # what the atomic write will do, now
        StreamFile(path).abort()
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot write there ({e.strerror})") from None


LOADED_NAMES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "chat_template.jinja", "latest")  # what loading reads in a checkpoint directory


def check_outputs(outputs: dict, inputs=()):
    """Every output (flag -> path or None) writable, no two the same, none an input or a file in an input
    directory (links followed), nor a new file that loading that directory would read."""
    seen = {}
    for flag, path in outputs.items():
        if path is None:
            continue
        check_writable(path, flag)
        real = os.path.realpath(path)
        if real in seen:
            raise UserError(f"{flag} {path}: is also {seen[real]}'s output; give each output its own file")
        seen[real] = flag
        for src in filter(None, inputs):
            inp = os.path.realpath(src)
            if real == inp:
                raise UserError(f"{flag} {path}: is an input of this run ({src}); refusing to overwrite it")
            if not os.path.isdir(inp):
                continue
            try:
                files = {os.path.realpath(os.path.join(inp, f)) for f in os.listdir(inp)}
            except OSError:
                files = set()
            inside = os.path.dirname(real) == inp
            if real in files or (inside and os.path.exists(real)):
                raise UserError(f"{flag} {path}: would overwrite a file of the input directory {src}")
            name = os.path.basename(real)
            if inside and (name in LOADED_NAMES or name.endswith((".safetensors", ".safetensors.index.json"))):
                raise UserError(f"{flag} {path}: a file named so in the input directory {src} would be read "
                                f"as part of it by the next load; write it elsewhere")


def atomic_write(path: str, data: Union[str, bytes, Callable[[str], None]]):
    """`path` whole or not at all (a synced temporary file renamed over it); `data`: text, bytes or `f(path)`."""
    f = StreamFile(path, "wb")
    try:
        if callable(data):
            data(f.tmp)
        else:
            f.write(data.encode() if isinstance(data, str) else data)
        f.close()
    finally:
        f.abort()


def write_json(path: str, obj, indent: Optional[int] = 2):
    atomic_write(path, json.dumps(obj, indent=indent, allow_nan=False) + "\n")


class StreamFile:
    """A file written as a run goes, into a temporary file beside it: whole at `close()`, never at `abort()`."""

    def __init__(self, path: str, mode: str = "w"):
        self.path = os.path.realpath(path)
        fd, self.tmp = tempfile.mkstemp(dir=os.path.dirname(self.path), prefix="." + os.path.basename(self.path) + ".",
                                        suffix=".tmp")
        self.f = os.fdopen(fd, mode)

    def write(self, data):
        self.f.write(data)

    def sync(self):
        self.f.flush()
        os.fsync(self.f.fileno())

    def abort(self):
        self.f.close()
        if os.path.exists(self.tmp):
            os.remove(self.tmp)

    def close(self):
        self.f.close()
        with open(self.tmp, "rb+") as f:  # synced by name: atomic_write's `data(tmp)` may have made a new file
            os.fsync(f.fileno())
        try:
            mode = os.stat(self.path).st_mode & 0o777
        except OSError:  # a new file: what open() gives it
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(self.tmp, mode)
        os.replace(self.tmp, self.path)
