"""Files: JSON and JSON-lines reading that names the line at fault, outputs checked before any work and
written whole or not at all (a temporary file renamed into place)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, Union

from support.cli import UserError, first_line, refuse_standard_output

# Reading

# what each kind of input path may be
WANTED = {"file": os.path.isfile,
          "directory": os.path.isdir,
          "file or directory": lambda path: os.path.isfile(path) or os.path.isdir(path)}


def wrong_kind(path: str, wanted: str) -> str:
    """What stands at `path` where a `wanted` (a key of WANTED) was looked for (it exists, or is a link)."""
    if not os.path.exists(path):
        return "is a broken link"
    if os.path.isdir(path):
        return f"is a directory, not a {wanted}"
    if os.path.isfile(path):
        return f"is a file, not a {wanted}"
    if "file" in wanted:
        return f"is a device or a pipe, not a {wanted} (write it to a file first)"
    return f"is a device or a pipe, not a {wanted}"


def path_problem(path: str, wanted: str, what: str) -> Optional[str]:
    """Why `path` is not a `wanted` (a key of WANTED): "`what` not found", or what stands there; or None.
    "-" is not standard input here."""
    if path == "-":
        return f"standard input is not supported here; give a {wanted} path"
    if WANTED[wanted](path):
        return None
    if os.path.lexists(path):
        return wrong_kind(path, wanted)
    return f"{what} not found"


def file_problem(path: str, what: str = "file") -> Optional[str]:
    """Why `path` is not a file to read, or None."""
    return path_problem(path, "file", what)


def directory_problem(path: str, what: str = "directory") -> Optional[str]:
    """Why `path` is not a directory to read, or None."""
    return path_problem(path, "directory", what)


def check_input(path: str, flag: str, what: str = "file", wanted: str = "file"):
    """Refuse a `flag`'s path that is empty or not a `wanted` (a key of WANTED) to read."""
    if not path.strip():
        raise UserError(f"{flag}: empty path")
    problem = path_problem(path, wanted, what)
    if problem:
        raise UserError(f"{flag} {path}: {problem}")


def optional_file(path: str) -> bool:
    """True for a file, False for nothing; anything else under its name is an error."""
    problem = file_problem(path)
    if problem is None:
        return True
    if os.path.lexists(path):
        raise UserError(f"{path}: {problem}")
    return False


BOM_PROBLEM = "starts with a byte-order mark (save the file as UTF-8 without BOM)"


def check_no_bom(text: str, where: str):
    """Refuse a file's text that starts with a byte-order mark, which would be read as a character."""
    if text.startswith("\ufeff"):
        raise UserError(f"{where}: {BOM_PROBLEM}")


def _unique_keys(pairs: list) -> dict:
    out = {}
    for k, v in pairs:
        if k in out:  # json would keep the last one without a word
            raise ValueError(f"key {k!r} appears twice")
        out[k] = v
    return out


def _parse(text, where: str, one_line: bool = False):
    """JSON text; one_line: a line of a JSON-lines file, whose errors give the column (json's line count
    would restart at that line, beside `where`'s)."""
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as e:
        detail = first_line(e)
        if one_line:
            detail = f"{e.msg} at column {e.colno}"
        raise UserError(f"{where}: malformed JSON ({detail})") from None
    # not UTF-8, a 5000-digit number, nested too deep
    except (ValueError, RecursionError) as e:
        detail = first_line(e)
        if "integer string conversion" in detail:  # said without Python's advice to a programmer
            detail = f"an integer of more than {sys.get_int_max_str_digits()} digits"
        raise UserError(f"{where}: malformed JSON ({detail})") from None


def read_json(path: str) -> dict:
    """A JSON object file; every failure one line naming the file."""
    problem = file_problem(path)
    if problem:
        raise UserError(f"{path}: {problem}")
    with open(path, "rb") as f:
        obj = _parse(f.read(), path)
    if not isinstance(obj, dict):
        raise UserError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def read_jsonl(path: str, records: Optional[str] = None):
    """(where, object) for every non-blank line of a JSON-lines file; `where` is "path:line". `records`: the
    shapes a line may take, named when one is not JSON (without it the error is the bare one)."""
    lineno = 0
    first = None  # the first non-blank line
    with open(path, "rb") as f:
        for raw in f:
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                crs = len(re.findall(rb"\r(?!\n)", raw[:e.start]))  # lone-CR line ends before the byte
                raise UserError(f"{path}:{lineno + 1 + crs}: not UTF-8 text") from None
            # a lone CR ends a line too, as text mode reads it
            for line in re.split(r"\r(?!\n)", text):
                lineno += 1
                if lineno == 1:
                    check_no_bom(line, f"{path}:1")
                if not line.strip():
                    continue
                if first is None:
                    first = line.lstrip()
                try:
                    obj = _parse(line.rstrip("\r\n"), f"{path}:{lineno}", one_line=True)
                except UserError as e:
                    if records is None:
                        raise
                    hint = f"each line is one whole JSON record, one of {records}"
                    # the first line opens no object or array: plain text
                    if not first.startswith(("{", "[")):
                        hint = ("the file looks like plain text, not JSON lines: "
                                f"write one JSON object per line, each one of {records}")
                    raise UserError(f"{e}; {hint}") from None
                if records is not None and isinstance(obj, list):  # a whole file's records as one array
                    raise UserError(f"{path}:{lineno}: a JSON array, not a record: write one record per line "
                                    f"(JSON lines), each one of {records}")
                yield f"{path}:{lineno}", obj


def files_digest(paths: list[str]) -> str:
    """sha256 over the files' names and sha256s: the same for a copy or a move, whatever their dates."""

    def one(path):
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()

    with ThreadPoolExecutor(max(1, min(8, len(paths)))) as pool:
        digests = list(pool.map(one, paths))
    listing = ""
    for path, digest in zip(paths, digests):
        listing += f"{os.path.basename(path)} {digest}\n"
    return hashlib.sha256(listing.encode()).hexdigest()


# Writing

def check_writable(path: str, flag: str):
    """Fail now if `path` cannot be written as a regular file (a link is judged by its target)."""
    if not path.strip():
        raise UserError(f"{flag}: empty path")
    refuse_standard_output(path, flag, "file")
    real = os.path.realpath(path)
    if os.path.isdir(real):
        raise UserError(f"{flag} {path}: is a directory, not a file")
    if path.endswith(os.sep):
        raise UserError(f"{flag} {path}: names a directory; give a file path")
    if os.path.exists(real) and not os.path.isfile(real):
        raise UserError(f"{flag} {path}: is a device or a pipe, not a file; give a file path")
    given = os.path.abspath(path)
    if (given in ("/dev/stdout", "/dev/stderr", "/dev/stdin") or given.startswith("/dev/fd/")
            or any(p.startswith(("/proc/", "/sys/")) for p in (given, real))):
        raise UserError(f"{flag} {path}: a device or process file, not a file path "
                        "(the output is written to a temporary file and renamed into place)")
    folder = os.path.dirname(real)
    if not os.path.isdir(folder):
        raise UserError(f"{flag} {path}: directory {folder} does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(real) and not os.access(real, os.W_OK)):
        raise UserError(f"{flag} {path}: not writable")
    try:  # what the atomic write will do, now
        StreamFile(path).abort()
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot write there ({e.strerror})") from None


# what loading reads in a checkpoint directory besides the weights (and a training run's "latest")
CHECKPOINT_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json",
                    "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
LOADED_NAMES = CHECKPOINT_FILES + ("latest",)


def loaded_from_checkpoint(name: str) -> bool:
    """Whether a file of this name in a checkpoint directory is read when the directory loads."""
    weights = name.endswith((".safetensors", ".safetensors.index.json"))
    return name in LOADED_NAMES or weights


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
            raise UserError(f"{flag} {path}: is also {seen[real]}'s output; "
                            "give each output its own file")
        seen[real] = flag
        for src in filter(None, inputs):
            inp = os.path.realpath(src)
            if real == inp:
                raise UserError(f"{flag} {path}: is an input of this run ({src}); "
                                "refusing to overwrite it")
            if not os.path.isdir(inp):
                continue
            try:
                files = {os.path.realpath(os.path.join(inp, f)) for f in os.listdir(inp)}
            except OSError:
                files = set()
            inside = os.path.dirname(real) == inp
            if real in files or (inside and os.path.exists(real)):
                raise UserError(f"{flag} {path}: would overwrite a file "
                                f"of the input directory {src}")
            if inside and loaded_from_checkpoint(os.path.basename(real)):
                raise UserError(f"{flag} {path}: a file named so in the input directory {src} "
                                "would be read as part of it by the next load; "
                                "write it elsewhere")


def check_read_apart(path: Optional[str], flag: str, inputs=()):
    """A file a run reads that is its own (an --sps-table that exists) is none of the run's other inputs,
    nor a file that loading an input directory reads."""
    if path is None:
        return
    real = os.path.realpath(path)
    loaded = loaded_from_checkpoint(os.path.basename(real))
    for src in filter(None, inputs):
        inp = os.path.realpath(src)
        of_checkpoint = os.path.isdir(inp) and os.path.dirname(real) == inp and loaded
        if real == inp or of_checkpoint:
            raise UserError(f"{flag} {path}: is an input of this run ({src}); "
                            f"give {flag} a file of its own")


def atomic_write(path: str, data: Union[str, bytes, Callable[[str], None]]):
    """`path` whole or not at all (a synced temporary file renamed over it); `data`: text, bytes or `f(path)`."""
    f = StreamFile(path, "wb")
    try:
        if callable(data):
            data(f.tmp)
        elif isinstance(data, str):
            f.write(data.encode())
        else:
            f.write(data)
        f.close()
    finally:
        f.abort()


def write_json(path: str, obj, indent: Optional[int] = 2):
    atomic_write(path, json.dumps(obj, indent=indent, allow_nan=False) + "\n")


class StreamFile:
    """A file written as a run goes, into a temporary file beside it: whole at `close()`, never at `abort()`."""

    def __init__(self, path: str, mode: str = "w"):
        self.path = os.path.realpath(path)
        folder = os.path.dirname(self.path)
        prefix = "." + os.path.basename(self.path) + "."
        fd, self.tmp = tempfile.mkstemp(dir=folder, prefix=prefix, suffix=".tmp")
        if "b" in mode:
            self.f = os.fdopen(fd, mode)
        else:  # UTF-8 whatever the locale: the records hold text as it is (ensure_ascii=False)
            self.f = os.fdopen(fd, mode, encoding="utf-8")

    def failed(self, e: OSError) -> OSError:
        """A write's error (a full disk, a folder removed meanwhile) named by the path given, not the
        temporary file's."""
        return OSError(e.errno, e.strerror, self.path)

    def write(self, data):
        try:
            self.f.write(data)
        except OSError as e:
            raise self.failed(e) from None

    def sync(self):
        try:
            self.f.flush()
            os.fsync(self.f.fileno())
        except OSError as e:
            raise self.failed(e) from None

    def abort(self):
        """Drop the temporary file, whatever its last buffered write does (a full disk fails it again)."""
        with contextlib.suppress(OSError):
            self.f.close()
        if os.path.exists(self.tmp):
            os.remove(self.tmp)

    def close(self):
        try:
            self.publish()
        except OSError as e:
            raise self.failed(e) from None

    def publish(self):
        self.f.close()
        # synced by name: atomic_write's `data(tmp)` may have made a new file
        with open(self.tmp, "rb+") as f:
            os.fsync(f.fileno())
        try:
            mode = os.stat(self.path).st_mode & 0o777
        except OSError:  # a new file: what open() gives it
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(self.tmp, mode)
        os.replace(self.tmp, self.path)
