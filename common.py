"""What every program here shares: one-line user errors, flag checks, device defaults, safe file I/O.

Each program (speculate.py, eval.py, train.py, bench.py, scripts/) keeps its own flags in its own
dataclass; this module only holds what they would otherwise each write again:
- `UserError` and `cli_main`: a user mistake is one line on stderr and exit status 2, never a traceback;
- `check_ranges` / `parse_ints`: flag values checked with the valid range in the message;
- `resolve_device` / `resolve_dtype`: the "auto" defaults (cuda -> bfloat16, cpu -> float32), in one place;
- `read_json` / `read_jsonl`: parsing that names the file and line at fault;
- `check_writable` / `atomic_write` / `save_tensors`: output paths checked before any work, written whole or not at all;
- `torchrun_env` / `dist_init`: torchrun's variables checked, the process group joined with a timeout.
"""

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

try:  # tyro parses the flags (cli_main); the engines and the Python API also run without it
    import tyro

    AutoBool = Annotated[Optional[bool], tyro.conf.DisallowNone]
    """A --flag / --no-flag whose default None means "auto", resolved by the program (its help says how)."""
except ImportError:
    AutoBool = Optional[bool]


def user_cache_dir(*parts: str) -> str:
    """This project's per-user cache folder (joined with `parts`): $XDG_CACHE_HOME/dspark-fast when that
    is set, else ~/.cache/dspark-fast — unlike /tmp, it survives a reboot."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "dspark-fast", *parts)


class UserError(Exception):
    """A user mistake: a missing or malformed file, a flag out of range, a tensor that does not fit.

    Programs print the message as one line on stderr and exit with status 2 (`cli_main`).
    Messages name the file, key, flag or value at fault.
    """


class Interrupted(BaseException):
    """SIGINT (Ctrl-C) or SIGTERM arrived: the program finishes what it can (prints what is done,
    marks its outputs incomplete) and `cli_main` exits with 128 + the signal's number. A BaseException,
    as KeyboardInterrupt is: an `except Exception` (ours, a library's) around where the signal lands
    would otherwise turn it into that code's error ("cannot load tokenizer (SIGINT)")."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _interrupt(signum, frame):
    raise Interrupted(signum)


@contextlib.contextmanager
def signals_deferred():
    """SIGINT / SIGTERM wait until the block is done, then act as they would have: for the short steps
    that must not stop half-way (a checkpoint switched in, outputs published). Main thread only, where
    handlers live; elsewhere the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending = []
    handlers = {s: signal.signal(s, lambda signum, frame: pending.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
        if pending:  # now delivered as it would have been
            h = handlers[pending[0]]
            if callable(h):
                h(pending[0], None)
            elif h == signal.SIG_DFL:
                os.kill(os.getpid(), pending[0])


def cli_main(args_class, run: Callable, argv: Optional[list[str]] = None, *, inference: bool = True) -> int:
    """A program's `main()`: flags parsed by tyro from `args_class`, then `run(args)` (under
    torch.inference_mode unless `inference` is False). A UserError is one line on stderr (rank 0
    only under torchrun) and exit status 2; SIGINT / SIGTERM raise `Interrupted` inside the run (which
    may tidy up) and end as one line and exit status 130 / 143."""
    import tyro

    args = tyro.cli(args_class, args=sys.argv[1:] if argv is None else argv)
    for stream in (sys.stdout, sys.stderr):  # a terminal that cannot show τ gets \u03c4, not a traceback
        if hasattr(stream, "reconfigure") and stream.errors == "strict":
            stream.reconfigure(errors="backslashreplace")
    try:  # under torchrun every rank meets the same error: rank 0 says it (anyone, if the variables are broken)
        rank0 = torchrun_env()[0] == 0
    except UserError:
        rank0 = True
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        handlers = {s: signal.signal(s, _interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if inference:
            with torch.inference_mode():
                run(args)
        else:
            run(args)
    except UserError as e:
        if rank0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    except Interrupted as e:
        if rank0:
            print(f"interrupted by {e}: stopped; what was finished is kept", file=sys.stderr)
        return 128 + e.signum
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    return 0


# ----------------------------------------------------------------------------------------
# Flags

def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_ranges(args, **ranges: str):
    """Every named field of `args` inside its interval, written "[1, inf)", "(0, 1]", ... (None
    values are skipped: an unset optional flag). NaN is outside every interval. The message
    gives the valid range: "--lr: invalid value 0.0 (valid: > 0)"."""
    for name, spec in ranges.items():
        value = getattr(args, name)
        if value is None:
            continue
        lo_closed, hi_closed = spec[0] == "[", spec[-1] == "]"
        lo, hi = (float(x) for x in spec[1:-1].split(","))
        ok = not isinstance(value, bool) and isinstance(value, numbers.Real) and not math.isnan(value) and (
            (value >= lo if lo_closed else value > lo) and (value <= hi if hi_closed else value < hi))
        if not ok:
            raise UserError(f"{_flag(name)}: invalid value {value!r} (valid: {_describe(lo, hi, lo_closed, hi_closed)})")


def _describe(lo: float, hi: float, lo_closed: bool, hi_closed: bool) -> str:
    num = lambda x: f"{x:g}"  # noqa: E731
    left = f"{'>=' if lo_closed else '>'} {num(lo)}" if lo > -math.inf else ""
    right = f"{'<=' if hi_closed else '<'} {num(hi)}" if hi < math.inf else ""
    if lo_closed and hi_closed and left and right:
        return f"{num(lo)} to {num(hi)}"
    return " and ".join(s for s in (left, right) if s) or "any number"


def parse_ints(text: str, flag: str, *, positive: bool = False, distinct: bool = False) -> list[int]:
    """A comma-separated list of integers ("1,2,3"), in the order given: ASCII digits only (at most 18
    per number, an optional leading minus), no empty fields; one-line errors naming the flag."""
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


def free_memory(device) -> int:
    """Bytes that can still be allocated on `device`: the CUDA allocator's free memory, or the
    machine's available physical memory (0 when it cannot be read: no check)."""
    if str(device).startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def resolve_device(device: Optional[str]) -> str:
    """--device: as given (checked), or cuda when available."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise UserError(f"--device {device!r}: cpu, cuda or cuda:N")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is available")
    return device


def default_threads() -> int:
    """--threads' default: half the CPUs this process may run on, at least 1. On a small shared machine
    a second thread per process slowed decoding (README, "Threads"); on a large one, half leaves the
    hyper-threads' siblings idle, which rarely help matrix multiplies."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, cpus // 2)


def check_threads(threads: Optional[int]):
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 4096):
        raise UserError(f"--threads: invalid value {threads!r} (valid: 1 to 4096)")


def set_threads(threads: Optional[int]) -> str:
    """torch's CPU threads: --threads, else OMP_NUM_THREADS when set, else `default_threads()`. Returns
    the line saying which (printed at start)."""
    check_threads(threads)
    if threads is not None:
        how = "--threads"
    elif os.environ.get("OMP_NUM_THREADS", "").strip():
        value = os.environ["OMP_NUM_THREADS"].strip()
        first = value.split(",")[0]  # OpenMP's nested form N,M,...: the outer level is torch's
        if not re.fullmatch(r"\d+(,\d+)*", value) or int(first) < 1:  # OpenMP would warn and use every CPU
            raise UserError(f"OMP_NUM_THREADS={value!r}: not a positive integer (unset it, or give --threads)")
        threads, how = torch.get_num_threads(), "OMP_NUM_THREADS"
        if threads != int(first):
            how += f"={value}; torch took {threads}"
    else:
        threads, how = default_threads(), "default: half the CPUs, --threads to change"
    torch.set_num_threads(threads)
    return f"threads: {threads} ({how})"


def resolve_dtype(dtype: Optional[str], device: str) -> torch.dtype:
    """--dtype: as given, or bfloat16 on cuda and float32 on cpu."""
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: one of {', '.join(DTYPES)}")
    return getattr(torch, dtype or ("bfloat16" if device.startswith("cuda") else "float32"))


DTYPES = ("float32", "bfloat16", "float16")  # what --dtype takes (weights and activations)


def device_name(device) -> str:
    """The hardware, in words: the GPU's name, or the CPU's model, cores and torch threads."""
    if str(device).startswith("cuda"):
        return torch.cuda.get_device_name(device)
    name = f"{platform.machine()} CPU"
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return f"{name} ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"


# Dense bf16 tensor-core peaks from the vendors' data sheets (TFLOP/s), for MFU estimates.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0}


def peak_tflops(device) -> Optional[float]:
    """The data-sheet dense bf16 peak of a known GPU (TFLOP/s), else None (CPUs: give it yourself)."""
    if not str(device).startswith("cuda"):
        return None
    name = device_name(device)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def sync(device):
    """Wait for the device (timing)."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------
# Files

def optional_file(path: str) -> bool:
    """Whether a file a checkpoint may have is there: True for a file, False for nothing at all; anything
    else under its name (a folder, a broken link) is an error, not taken for an absent file."""
    if os.path.isfile(path):
        return True
    if os.path.lexists(path):
        raise UserError(f"{path}: not a file ({'a folder' if os.path.isdir(path) else 'a broken link'})")
    return False


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list) -> dict:
    """json's object_pairs_hook: a key given twice is an error (json keeps the last one without a word)."""
    out = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(f"key {k!r} appears twice")
        out[k] = v
    return out


def read_json(path: str) -> dict:
    """Parse a JSON object file, turning every failure into one line that names the file (a key given
    twice in one object included)."""
    if not optional_file(path):
        raise UserError(f"{path}: file not found")
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f, object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError) as e:  # malformed, not UTF-8, a 5000-digit number, nested too deep
        raise UserError(f"{path}: malformed JSON ({str(e).splitlines()[0][:200] or type(e).__name__})") from None
    if not isinstance(obj, dict):
        raise UserError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def read_jsonl(path: str):
    """Yield (where, object) for every non-blank line of a JSON-lines file; `where` is "path:line"
    for messages. A line that is not JSON, or not UTF-8, is a UserError naming it."""
    lineno = 0
    with open(path, "rb") as f:  # each line decoded on its own: an error names its line, not its chunk's
        for raw in f:
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise UserError(f"{path}:{lineno + 1}: not UTF-8 text") from None
            for line in re.split(r"\r(?!\n)", text):  # a lone CR ends a line too (as text mode reads it)
                lineno += 1
                where = f"{path}:{lineno}"
                if lineno == 1 and line.startswith("\ufeff"):
                    raise UserError(f"{where}: starts with a byte-order mark (save the file as UTF-8 without BOM)")
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line, object_pairs_hook=_unique_keys)
                except (ValueError, RecursionError) as e:  # as read_json
                    raise UserError(f"{where}: malformed JSON ({str(e).splitlines()[0][:200] or type(e).__name__})") \
                        from None
                yield where, obj


def check_writable(path: Optional[str], flag: str):
    """Fail before any work if an output path cannot be written: empty, a directory, a device or
    anything else that is not a regular file, or in a missing or unwritable folder. A symbolic link
    is judged by what it points to (and writes go there, see `atomic_write`)."""
    if path is None:
        return
    if not path.strip():
        raise UserError(f"{flag}: empty path")
    real = os.path.realpath(path)
    if os.path.isdir(real):
        raise UserError(f"{flag} {path}: is a directory, not a file")
    if path.endswith(os.sep):  # realpath drops the slash: a missing directory would be written as a file
        raise UserError(f"{flag} {path}: names a directory; give a file path")
    if os.path.exists(real) and not os.path.isfile(real):
        raise UserError(f"{flag} {path}: is not a regular file (a device or a pipe); give a file path")
    given = os.path.abspath(path)  # /dev/stdout may resolve to the shell's redirection target: a rename there
    if (given in ("/dev/stdout", "/dev/stderr", "/dev/stdin") or given.startswith("/dev/fd/")
            or any(p.startswith(("/proc/", "/sys/")) for p in (given, real))):  # (/dev/shm is a folder like any)
        raise UserError(f"{flag} {path}: a device or process file, not a file path (the output is written "
                        f"to a temporary file and renamed into place)")
    folder = os.path.dirname(real)
    if not os.path.isdir(folder):
        raise UserError(f"{flag} {path}: directory {folder} does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(real) and not os.access(real, os.W_OK)):
        raise UserError(f"{flag} {path}: not writable")
    try:  # what the atomic write will do, now: a name too long, a folder that refuses files, ...
        fd, tmp = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(real) + ".", suffix=".tmp")
        try:
            os.close(fd)
        finally:  # (a signal landing here too)
            os.remove(tmp)
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot write there ({e.strerror})") from None


def folder_write_problem(folder: str) -> Optional[str]:
    """Why no file can be made in the existing `folder` (a read-only filesystem, no permission), or None;
    found without making one, so another process listing the folder (a torchrun rank) sees nothing."""
    try:
        if os.statvfs(folder).f_flag & os.ST_RDONLY:
            return "Read-only file system"
    except OSError as e:
        return e.strerror
    return None if os.access(folder, os.W_OK | os.X_OK) else "Permission denied"


# Names that loading reads from a model or checkpoint directory. A new output may sit beside a
# checkpoint (train.py --eval-every writes its evaluations there), but not under one of these names,
# which would change the model the next run loads (a stray index beside model.safetensors, a
# chat_template.jinja that replaces the tokenizer's template).
LOADED_NAMES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "chat_template.jinja", "latest")


def loaded_name(name: str) -> bool:
    return name in LOADED_NAMES or name.endswith(".safetensors") or name.endswith(".safetensors.index.json")


def check_outputs(outputs: dict, inputs=()):
    """Before any work: every output (flag -> path, None = not asked for) writable (`check_writable`),
    no two the same file, and none of them an input — a file the run reads (`inputs`: files, or
    directories whose files it reads, e.g. a checkpoint directory, where a file may be a link to one
    elsewhere, as in the Hugging Face cache), whatever links lie between; nor a new file an input
    directory's loading would read (`LOADED_NAMES`)."""
    seen = {}
    for flag, path in outputs.items():
        if path is None:
            continue
        check_writable(path, flag)
        real = os.path.realpath(path)
        if real in seen:
            raise UserError(f"{flag} {path}: is also {seen[real]}'s output; give each output its own file")
        seen[real] = flag
        for src in inputs:
            if src is None:
                continue
            inp = os.path.realpath(src)
            if real == inp:
                raise UserError(f"{flag} {path}: is an input of this run ({src}); refusing to overwrite it")
            if not os.path.isdir(inp):
                continue
            # its files with links followed (a Hugging Face snapshot's files are links to the cache's blobs)
            try:
                files = {os.path.realpath(os.path.join(inp, f)) for f in os.listdir(inp)}
            except OSError:  # unreadable: the run's loading says so
                files = set()
            if real in files or (os.path.dirname(real) == inp and os.path.exists(real)):
                raise UserError(f"{flag} {path}: would overwrite a file of the input directory {src}")
            if os.path.dirname(real) == inp and loaded_name(os.path.basename(real)):
                raise UserError(f"{flag} {path}: a file named so in the input directory {src} would be read "
                                f"as part of it by the next load; write it elsewhere")


def atomic_write(path: str, data: Union[str, bytes, Callable[[str], None]]):
    """Write `path` whole or not at all: a temporary file in the same directory, flushed and fsynced,
    then renamed over the target. `data` is the text or bytes, or a function that writes a given path
    (e.g. safetensors' save_file). A symbolic link keeps pointing at the (new) file it names."""
    path = os.path.realpath(path)
    folder = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            if not callable(data):
                f.write(data.encode() if isinstance(data, str) else data)
        if callable(data):
            data(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, _new_file_mode(path))  # mkstemp makes 0600; give the file the mode open() would
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _new_file_mode(path: str) -> int:
    """The mode of the file being replaced, or what open() would give a new one (0666 less the umask)."""
    try:
        return os.stat(path).st_mode & 0o777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def write_json(path: str, obj, indent: Optional[int] = 2):
    """`obj` as JSON (plus a newline) at `path`, atomically; NaN and infinities are refused (they are
    not JSON) rather than written."""
    atomic_write(path, json.dumps(obj, indent=indent, allow_nan=False) + "\n")


class StreamFile:
    """A text file written as a run goes (a trace, JSON lines), safely: lines go to a temporary file
    beside the target, flushed and fsynced at each `sync()` (a finished request), and the target
    appears only at `close()`, whole, by one rename. A run killed outright leaves the target as it was."""

    def __init__(self, path: str):
        self.path = os.path.realpath(path)
        fd, self.tmp = tempfile.mkstemp(dir=os.path.dirname(self.path), prefix="." + os.path.basename(self.path) + ".",
                                        suffix=".tmp")
        self.f = os.fdopen(fd, "w")

    def write(self, line: str):
        self.f.write(line)

    def sync(self):
        self.f.flush()
        os.fsync(self.f.fileno())

    def abort(self):
        """Drop the file: the run failed, the target stays as it was."""
        if not self.f.closed:
            self.f.close()
        if os.path.exists(self.tmp):
            os.remove(self.tmp)

    def close(self):
        """Publish the file (also after an interruption: what was written is kept)."""
        if self.f.closed:
            return
        self.sync()
        self.f.close()
        os.chmod(self.tmp, _new_file_mode(self.path))
        os.replace(self.tmp, self.path)


def save_tensors(path: str, tensors: dict, step: Optional[int] = None):
    """A safetensors file, written whole or not at all (a crash mid-write leaves the previous one);
    `step`, when given, goes into its metadata (a training checkpoint's files must agree on it)."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    metadata = {"format": "pt", **({"step": str(step)} if step is not None else {})}
    atomic_write(path, lambda p: save_file(tensors, p, metadata=metadata))


# ----------------------------------------------------------------------------------------
# torchrun

def torchrun_env(environ=None) -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's variables, (0, 1, 0) without them. Variables that
    contradict each other (WORLD_SIZE without RANK, a rank outside the world, no MASTER_ADDR/PORT for
    several processes, ...) are a one-line UserError, not a hang or a traceback."""
    env = os.environ if environ is None else environ
    vals = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        if name in env:
            try:
                vals[name] = int(env[name])
            except ValueError:
                raise UserError(f"torchrun environment: {name}={env[name]!r} is not an integer") from None
    if "WORLD_SIZE" not in vals:
        if vals:
            raise UserError(f"torchrun environment: {', '.join(vals)} set without WORLD_SIZE "
                            "(launch with torchrun, or unset them)")
        return 0, 1, 0
    world = vals["WORLD_SIZE"]
    if world < 1:
        raise UserError(f"torchrun environment: WORLD_SIZE={world} (valid: >= 1)")
    if "RANK" not in vals:
        if world == 1:
            return 0, 1, vals.get("LOCAL_RANK", 0)
        raise UserError(f"torchrun environment: WORLD_SIZE={world} but RANK is not set (launch with torchrun)")
    rank = vals["RANK"]
    if not 0 <= rank < world:
        raise UserError(f"torchrun environment: RANK={rank} is outside WORLD_SIZE={world} (valid: 0 to {world - 1})")
    if world > 1:
        missing = [n for n in ("LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if n not in env]
        if missing:
            raise UserError(f"torchrun environment: WORLD_SIZE={world} but {', '.join(missing)} not set "
                            "(launch with torchrun)")
        if vals["LOCAL_RANK"] < 0:
            raise UserError(f"torchrun environment: LOCAL_RANK={vals['LOCAL_RANK']} (valid: >= 0)")
    return rank, world, vals.get("LOCAL_RANK", 0)


def dist_init(device: str, timeout_s: float) -> tuple[int, int, str]:
    """(rank, world size, device) after joining torchrun's process group (gloo on cpu, nccl on cuda, the
    rank's LOCAL_RANK GPU); one process without torchrun's variables. Waiting for the other processes
    (and every later collective) gives up after timeout_s with a one-line UserError."""
    rank, world, local = torchrun_env()
    if world == 1:
        return 0, 1, device
    import datetime

    import torch.distributed as dist

    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UserError("--device cuda: no CUDA device is available")
        if local >= torch.cuda.device_count():
            raise UserError(f"torchrun environment: LOCAL_RANK={local} but only {torch.cuda.device_count()} GPU(s)")
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    if not dist.is_initialized():
        where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        try:
            dist.init_process_group("nccl" if device.startswith("cuda") else "gloo",
                                    timeout=datetime.timedelta(seconds=timeout_s))
        except Exception as e:  # rendezvous failures come as RuntimeError, DistError, TimeoutError, ...
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise UserError(f"rank {rank} of {world}: no process group at {where} within {timeout_s:g} s ({first}); "
                            "start every process (torchrun --nproc_per_node N) or raise --dist-timeout") from None
    return rank, world, device
