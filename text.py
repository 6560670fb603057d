"""Text and ids for a checkpoint directory: its tokenizer, its stop tokens, its chat template.

What is notable here:
- `tokenizer.json` goes through the `tokenizers` library; the chat template comes from
  `chat_template.jinja` or `tokenizer_config.json`. Without a template, conversations (system,
  user and assistant turns) are rendered in Qwen3's own ChatML, thinking off unless asked for
  (off is what the published drafters were trained on).
- A chat template is code shipped with a checkpoint: it is rendered in a box (`render_template`) —
  Jinja's immutable sandbox, a time limit, caps on its output and on the numbers and repetitions it
  computes — and whatever goes wrong is one line naming the template's file.
- Stop ids come from generation_config.json and config.json, each checked against the vocabulary;
  the default sampling settings come from generation_config.json (`generation_sampling`).
"""

from __future__ import annotations

import os
import re
import string
from typing import Optional, Sequence

from common import UserError, optional_file, read_json
from model import ModelArgs, _eos_ids

ROLES = ("system", "user", "assistant")  # the turns a conversation (a prompt, a training record) may hold
QWEN3_CHAT_FALLBACK = "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
EMPTY_THINK = "<think>\n\n</think>\n\n"  # Qwen3's non-thinking mode: the answer opens with an empty think block


class Tokenizer:
    """`tokenizer.json` through the `tokenizers` library, plus the directory's chat template."""

    def __init__(self, directory: str):
        from tokenizers import Tokenizer as HFTokenizer

        path = os.path.join(directory, "tokenizer.json")
        if not os.path.isfile(path):
            raise UserError(f"{path}: file not found")
        try:
            self.tok = HFTokenizer.from_file(path)
        except Exception as e:  # the library raises bare Exceptions for malformed files
            raise UserError(f"{path}: cannot load tokenizer ({str(e).splitlines()[0]})") from None
        # A WordLevel/WordPiece/BPE unk_token it does not have: the library would raise a bare Exception at the
        # first unknown word.
        unk = getattr(self.tok.model, "unk_token", None)
        if unk is not None and unk not in self.tok.get_vocab(with_added_tokens=True):
            raise UserError(f"{path}: the tokenizer's unk_token {unk!r} is not in its vocabulary")
        self.chat_template, self.template_source, self.template_problem = _read_chat_template(directory)
        self.special_texts = _special_token_texts(directory)  # bos_token, eos_token, ...: what templates read

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, prompt: str, thinking: bool = False, system: Optional[str] = None) -> str:
        """One user turn (after a system turn when `system` is given) with the generation prompt; Qwen3's
        format without a template."""
        messages = ([{"role": "system", "content": system}] if system is not None else []) + [
            {"role": "user", "content": prompt}]
        return self.render_messages(messages, add_generation_prompt=True, thinking=thinking)

    @property
    def thinking_switch(self) -> bool:
        """Whether thinking can be turned on: the template reads `enable_thinking` (the fallback does too)."""
        return self.chat_template is None or "enable_thinking" in self.chat_template

    def render_messages(self, messages: Sequence[dict], *, add_generation_prompt: bool, thinking: bool = False) -> str:
        """A conversation ([{"role", "content"}, ...]) through the chat template (in a box, as a template is
        code from the checkpoint: `render_template`), with `enable_thinking` set; add_generation_prompt
        opens the assistant's next turn. Without a template: ChatML as Qwen3 renders it (the last
        assistant turn after the last user turn carries an empty think block, and so does the
        generation prompt with thinking off)."""
        if self.template_problem is not None:  # a template was meant, but none can be used: not the fallback
            raise UserError(self.template_problem)
        if self.chat_template is None:
            return _chatml_fallback(messages, add_generation_prompt, thinking)
        text = render_template(self.chat_template, self.template_source, messages=[dict(m) for m in messages],
                               add_generation_prompt=add_generation_prompt, enable_thinking=thinking,
                               **self.special_texts)
        if not text.strip():  # the template's doing, not the prompt's
            raise UserError(f"{self.template_source}: the chat template renders this conversation as nothing")
        return text


def _chatml_fallback(messages: Sequence[dict], add_generation_prompt: bool, thinking: bool = False) -> str:
    """Qwen3's ChatML without its template: every turn, a system turn included, is
    `<|im_start|>ROLE\nCONTENT<|im_end|>\n`; one user turn with the generation prompt, thinking off,
    is exactly QWEN3_CHAT_FALLBACK. With thinking on, the generation prompt leaves the think block to
    the model."""
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    out = []
    for i, m in enumerate(messages):
        think = EMPTY_THINK if m["role"] == "assistant" and i == len(messages) - 1 and i > last_user else ""
        out.append(f"<|im_start|>{m['role']}\n{think}{m['content']}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n" + ("" if thinking else EMPTY_THINK))
    return "".join(out)


TEMPLATE_SECONDS = 10            # a chat template that renders longer than this is refused ...
TEMPLATE_CHARS = 10_000_000      # ... and so is one whose output, or any string or list it makes, grows past this
TEMPLATE_BITS = 100_000          # the largest integer (in bits) a template may compute
_COMPILED: dict = {}             # the last template, compiled


def _too_wide(fmt: str, args=(), kwargs=None) -> bool:
    """Whether a format string (%-style or str.format) pads past TEMPLATE_CHARS: a width or precision in its
    conversion specs (not any number in its text), or one taken from the arguments (`%*s`, `{:{}}`)."""
    specs = [m.group(1, 2) for m in re.finditer(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[a-zA-Z%]", fmt)]
    try:
        parsed = [spec for _, field, spec, _ in string.Formatter().parse(fmt) if field is not None and spec]
    except ValueError:  # not a valid format string: str.format will say so
        parsed = []
    numbers = [int(n) for pair in specs for n in pair if n and n.isdigit()]
    numbers += [int(n) for spec in parsed for n in re.findall(r"\d+", re.sub(r"\{[^}]*\}", "", spec))]
    from_args = any("*" in (a or "") for pair in specs for a in pair) or any("{" in spec for spec in parsed)
    if from_args:  # the width is one of the arguments: any integer among them
        values = list(args) + list((kwargs or {}).values())
        values += [v for a in args if isinstance(a, (tuple, list)) for v in a]
        numbers += [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
    return any(n > TEMPLATE_CHARS for n in numbers)


# What a template may compute, checked before the operations that could pass the caps in one C call (the
# timer cannot stop one) and, by `_bounded`, on every value after. Each raises jinja's SecurityError.

def _refuse(why: str):
    from jinja2.sandbox import SecurityError

    raise SecurityError(why)


def _bounded(value):
    """`value`, unless it is a string or list past TEMPLATE_CHARS or an integer past TEMPLATE_BITS."""
    if isinstance(value, (str, list, tuple)) and len(value) > TEMPLATE_CHARS:
        _refuse(f"a value of {len(value):,} items is too large")
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > TEMPLATE_BITS:
        _refuse("a number is too large")
    return value


def _check_width(width, lines: int = 1):  # center, ljust, rjust, zfill, indent
    if isinstance(width, int) and not isinstance(width, bool) and width * lines > TEMPLATE_CHARS:
        _refuse("a width is too large")


def _check_format(fmt: str, args=(), kwargs=None):  # %, str.format, the format filter
    if _too_wide(fmt, args, kwargs):
        _refuse("a format width is too large")


def _check_replace(s: str, old: str, new: str):  # str.replace, the replace filter
    hits = s.count(old) if old else len(s) + 1
    if len(s) + hits * max(0, len(new) - len(old)) > TEMPLATE_CHARS:
        _refuse("a replacement is too long")


def _joinable(items) -> list:  # str.join, the join filter: the pieces' total, before joining them
    items = list(items)
    if sum(len(str(x)) for x in items) > TEMPLATE_CHARS:
        _refuse("a join is too long")
    return items


def _bounded_filter(f, name: str):
    """A Jinja filter that could grow a value past the box's caps, checked before it runs and after."""
    skip = 1 if hasattr(f, "jinja_pass_arg") else 0  # a filter that takes the context / environment first

    def checked(*args, **kwargs):
        value, rest = (args[skip], list(args[skip + 1:])) if len(args) > skip else (None, [])
        if name in ("center", "indent"):
            _check_width(kwargs.get("width", rest[0] if rest else None),
                         str(value).count("\n") + 1 if name == "indent" else 1)
        elif name == "format" and isinstance(value, str):
            _check_format(value, rest, kwargs)
        elif name == "join" and value is not None and not isinstance(value, str) and hasattr(value, "__iter__"):
            args = args[:skip] + (_joinable(value),) + args[skip + 1:]
        elif name == "replace" and isinstance(value, str) and len(rest) >= 2:
            _check_replace(value, str(rest[0]), str(rest[1]))
        return _bounded(f(*args, **kwargs))

    if skip:  # keep how jinja passes the environment / context / eval context
        checked.jinja_pass_arg = f.jinja_pass_arg
    return checked


def _check_str_method(obj, args, kwargs):
    """A bound str method a template calls, checked by what it would make."""
    s, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
    if not isinstance(s, str):
        return args
    if name in ("center", "ljust", "rjust", "zfill") and args:
        _check_width(args[0])
    elif name in ("format", "format_map"):
        _check_format(s, args, kwargs)
    elif name == "replace" and len(args) >= 2 and all(isinstance(a, str) for a in args[:2]):
        _check_replace(s, args[0], args[1])
    elif name == "expandtabs" and args:
        _check_width(args[0], s.count("\t"))
    elif name == "join" and args:
        args = (_joinable(args[0]),) + tuple(args[1:])
    return args


def render_template(template: str, source: str, **context) -> str:
    """A chat template rendered in a box: Jinja's immutable sandbox, a time limit, a cap on the output
    and on every string, list and number it computes — checked before the operations that could make
    one too large in a single C call the time limit cannot stop (`*`, `**`, `%`, str.format, center,
    replace, join, ...), and after every operator and call. Whatever goes wrong — a template error, a
    ZeroDivisionError, a runaway loop or power — is one UserError naming `source` (the file)."""
    import signal
    import threading

    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

    class Boxed(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"**", "*", "%"})

        def call_binop(self, context, operator, left, right):
            ints = all(isinstance(x, int) and not isinstance(x, bool) for x in (left, right))
            if operator == "**" and ints and abs(left) > 1 and right > 0 and right * abs(left).bit_length() > TEMPLATE_BITS:
                raise SecurityError(f"{left} ** {right} is too large")
            if operator == "*" and ints and left.bit_length() + right.bit_length() > TEMPLATE_BITS:
                raise SecurityError("a product is too large")
            if operator == "*" and any(isinstance(x, (str, list, tuple)) for x in (left, right)):
                seq, n = (left, right) if isinstance(left, (str, list, tuple)) else (right, left)
                if isinstance(n, int) and len(seq) * n > TEMPLATE_CHARS:
                    raise SecurityError("a repetition is too long")
            if operator == "%" and isinstance(left, str):
                _check_format(left, right if isinstance(right, (tuple, list)) else (right,))
            return _bounded(super().call_binop(context, operator, left, right))

        def wrap_str_format(self, value):  # jinja2 >= 3.1.5 wraps str.format at attribute access: check at the call
            wrapped = super().wrap_str_format(value)
            if wrapped is None:
                return None

            def checked(*args, **kwargs):
                _check_format(value.__self__, args, kwargs)
                return _bounded(wrapped(*args, **kwargs))
            return checked

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805  (jinja2's own signature)
            args = _check_str_method(__obj, args, kwargs)
            return _bounded(super().call(__context, __obj, *args, **kwargs))

    def raise_exception(msg):
        raise TemplateError(msg)

    def out_of_time(signum, frame):
        raise TimeoutError(f"took longer than {TEMPLATE_SECONDS} s")

    timed = threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")
    if timed:
        previous = signal.signal(signal.SIGALRM, out_of_time)
        signal.setitimer(signal.ITIMER_REAL, TEMPLATE_SECONDS)
    try:
        if template not in _COMPILED:  # compiled once per template (training renders many conversations)
            env = Boxed(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])  # as transformers
            env.globals["raise_exception"] = raise_exception
            for name in ("center", "format", "indent", "join", "replace", "wordwrap"):  # filters that can grow a value
                env.filters[name] = _bounded_filter(env.filters[name], name)
            _COMPILED.clear()
            _COMPILED[template] = env.from_string(template)
        parts, size = [], 0
        for chunk in _COMPILED[template].generate(**context):
            parts.append(chunk)
            size += len(chunk)
            if size > TEMPLATE_CHARS:
                raise SecurityError(f"its output grew past {TEMPLATE_CHARS:,} characters")
        return "".join(parts)
    except Exception as e:  # every way a template can fail is the template's, and the user's to fix
        raise UserError(f"{source}: cannot render the chat template ({type(e).__name__}: "
                        f"{str(e).splitlines()[0][:200] if str(e) else ''})") from None
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


def _special_token_texts(directory: str) -> dict:
    """tokenizer_config.json's special tokens as texts ({"bos_token": "<s>", ...}), which transformers hands
    a chat template: a string, or an object with its "content"."""
    path = os.path.join(directory, "tokenizer_config.json")
    if not optional_file(path):
        return {}
    cfg = read_json(path)
    out = {}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        v = cfg.get(key)
        v = v.get("content") if isinstance(v, dict) else v
        if isinstance(v, str):
            out[key] = v
    return out


def _read_chat_template(directory: str) -> tuple[Optional[str], Optional[str], Optional[str]]:
    """(template, the file it came from, None), (None, None, None) without one, or (None, the file, why it
    cannot be used) for a list of named templates without a usable "default"."""
    jinja = os.path.join(directory, "chat_template.jinja")
    if optional_file(jinja):
        try:
            with open(jinja, encoding="utf-8") as f:
                return f.read(), jinja, None
        except UnicodeDecodeError:
            raise UserError(f"{jinja}: not UTF-8 text") from None
    path = os.path.join(directory, "tokenizer_config.json")
    if not optional_file(path):
        return None, None, None
    t = read_json(path).get("chat_template")
    if isinstance(t, list):  # named templates: [{"name": ..., "template": ...}]; a chat uses "default"
        # Without a usable "default" no prompt can be rendered: said when one is (token ids and --no-chat
        # never render, and run as before).
        if not all(isinstance(d, dict) and isinstance(d.get("name"), str) for d in t):
            return None, path, (f"{path}: 'chat_template' as a list must hold {{\"name\": ..., \"template\": ...}} "
                                f"objects")
        named = {d["name"]: d.get("template") for d in t}
        if not isinstance(named.get("default"), str):
            return None, path, (f"{path}: 'chat_template' names no 'default' template with a text (it has "
                                f"{', '.join(map(repr, named)) or 'none'}); rendering a chat needs one (--no-chat "
                                f"sends the raw text)")
        t = named["default"]
    if t is not None and not isinstance(t, str):
        raise UserError(f"{path}: 'chat_template' must be a string")
    return t, path, None


def stop_token_ids(directory: str, args: ModelArgs) -> tuple[int, ...]:
    """EOS ids from generation_config.json (often a list) and config.json, in that order, deduplicated."""
    ids = []
    gen = os.path.join(directory, "generation_config.json")
    if optional_file(gen):
        ids += _eos_ids(read_json(gen).get("eos_token_id"), gen, "eos_token_id", args.vocab_size)
    ids += args.eos_token_ids
    return tuple(dict.fromkeys(ids))


SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p")
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-4, 1e4  # beyond these, logits / T overflow float32 or sampling is uniform noise
MAX_TOP_K = 2**30  # the flag's and the file's bound


def generation_sampling(directory: str) -> tuple[Optional[dict], Optional[str]]:
    """The checkpoint's recommended sampling, from generation_config.json: (settings, path).

    settings: None for greedy — no file, or `do_sample` false or absent (transformers' rule) — else
    the keys of SAMPLING_KEYS the file gives (a missing key stays off; temperature 1.0 when missing),
    each checked as the flags are: temperature in [1e-4, 1e4], top_k an integer up to 2^30 (0 or -1: off),
    top_p in (0, 1], min_p in [0, 1]."""
    path = os.path.join(directory, "generation_config.json")
    if not optional_file(path):
        return None, None
    cfg = read_json(path)
    do_sample = cfg.get("do_sample", False)
    if not isinstance(do_sample, bool):
        raise UserError(f"{path}: key 'do_sample' must be true or false, got {do_sample!r}")
    if not do_sample:
        return None, path
    out = {"temperature": 1.0}
    for key in SAMPLING_KEYS:
        v = cfg.get(key)
        if v is None:
            continue
        number = isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")
        ok = number and {"temperature": lambda x: MIN_TEMPERATURE <= x <= MAX_TEMPERATURE,
                         "top_k": lambda x: x == int(x) and -1 <= x <= MAX_TOP_K,
                         "top_p": lambda x: 0 < x <= 1, "min_p": lambda x: 0 <= x <= 1}[key](v)
        if not ok:
            valid = {"temperature": f"a number in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]",
                     "top_k": f"an integer from -1 to {MAX_TOP_K} (0 or -1: off)",
                     "top_p": "a number in (0, 1]", "min_p": "a number in [0, 1]"}[key]
            raise UserError(f"{path}: key {key!r} must be {valid}, got {v!r}")
        out[key] = max(int(v), 0) if key == "top_k" else float(v)
    return out, path


class StopStrings:
    """--stop: a request ends at the first of these strings in its text (decoded with special tokens
    skipped, as printed). The tokens are kept up to the one that completes the string; the text is cut
    before it."""

    def __init__(self, tokenizer: Tokenizer, strings: Sequence[str]):
        self.tokenizer, self.strings = tokenizer, tuple(strings)

    @staticmethod
    def check(strings: Sequence[str]):
        """--stop's strings on their own, before anything loads: texts, none empty, valid Unicode."""
        for s in strings:
            if not isinstance(s, str):
                raise UserError(f"--stop {s!r}: a stop string must be a str")
            if not s:
                raise UserError("--stop: an empty stop string would end every request at once")
            try:
                s.encode("utf-8")
            except UnicodeEncodeError:  # bytes that are not UTF-8 arrive as lone surrogates: never in decoded text
                raise UserError(f"--stop {s!r}: the text is not valid Unicode (a lone surrogate)") from None

    @staticmethod
    def build(tokenizer: Optional[Tokenizer], strings: Sequence[str]) -> Optional["StopStrings"]:
        """--stop's strings checked (None when there are none)."""
        StopStrings.check(strings)
        if not strings:
            return None
        if tokenizer is None:
            raise UserError("--stop: stop strings need the target's tokenizer.json (to read the text)")
        special = {t.content for t in tokenizer.tok.get_added_tokens_decoder().values() if t.special}
        for s in strings:  # matched in the text without special tokens: it could never be found there
            held = next((t for t in special if t and t in s), None)
            if held is not None:
                raise UserError(f"--stop {s!r}: holds the special token {held!r}, which the text a stop string is "
                                f"matched in leaves out; requests end at the target's stop tokens "
                                f"(generation_config.json's eos_token_id), or --ignore-eos")
        return StopStrings(tokenizer, strings)

    def text(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def find(self, text: str) -> Optional[int]:
        """Where the earliest stop string starts in text (None: nowhere)."""
        hits = [i for i in (text.find(s) for s in self.strings) if i >= 0]
        return min(hits) if hits else None

    def keep(self, ids: Sequence[int], checked: int) -> Optional[int]:
        """None while no stop string is in the text of ids; else the fewest leading tokens whose text
        holds one. `checked`: a count of leading tokens already known to hold none."""
        if self.find(self.text(ids)) is None:
            return None
        lo, hi = checked, len(ids)  # the text of ids[:lo] holds no stop string, that of ids[:hi] does
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.find(self.text(ids[:mid])) is None:
                lo = mid
            else:
                hi = mid
        return hi

    def cut(self, text: str) -> str:
        """The text before the earliest stop string."""
        at = self.find(text)
        return text if at is None else text[:at]
