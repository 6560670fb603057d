"""Text and ids: a checkpoint's tokenizer and chat template (chat_template.jinja or tokenizer_config.json, else
Qwen3's format; code shipped with a checkpoint, so it renders in a box), prompts read and encoded, stop strings."""

from __future__ import annotations

import json
import numbers
import os
import re
import string
import time
from typing import Callable, Optional, Sequence

from support.cli import UserError, first_line, flag, parse_ints
from support.files import (
    BOM_PROBLEM,
    check_input,
    check_no_bom,
    file_problem,
    optional_file,
    read_json,
    read_jsonl,
)

ROLES = ("system", "user", "assistant")
# tokenizer_config.json's special tokens, which transformers passes a chat template by these names
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                      "mask_token")
# opens a non-thinking Qwen3 answer (the default: the drafters were trained so)
EMPTY_THINK = "<think>\n\n</think>\n\n"


def read_tokenizer_file(path: str):
    """A tokenizer.json through the `tokenizers` library, checked: a file it loads, whose unk token exists."""
    from tokenizers import Tokenizer as HFTokenizer

    problem = file_problem(path)
    if problem:
        raise UserError(f"{path}: {problem}")
    try:
        tok = HFTokenizer.from_file(path)
    except Exception as e:  # the library raises bare Exceptions for malformed files
        with open(path, "rb") as f:
            head = f.read(3)
        check_no_bom(head.decode("utf-8", errors="ignore"), path)  # a BOM it calls bad JSON
        raise UserError(f"{path}: cannot load tokenizer ({first_line(e)})") from None
    # else a bare Exception at the first unknown word
    unk = getattr(tok.model, "unk_token", None)
    if unk is not None and unk not in tok.get_vocab(with_added_tokens=True):
        raise UserError(f"{path}: the tokenizer's unk_token {unk!r} is not in its vocabulary")
    return tok


class Tokenizer:
    """tokenizer.json through the `tokenizers` library, plus the directory's chat template."""

    def __init__(self, directory: str):
        self.tok = read_tokenizer_file(os.path.join(directory, "tokenizer.json"))
        config_path = os.path.join(directory, "tokenizer_config.json")
        config = {}
        if optional_file(config_path):
            config = read_json(config_path)
        template = read_chat_template(directory, config)
        self.chat_template, self.template_source, self.template_problem = template
        self.special_texts = {}  # the special tokens' texts, which templates read
        for key in SPECIAL_TOKEN_KEYS:
            value = config.get(key)
            if value is None:
                continue
            text = value
            if isinstance(value, dict):  # an AddedToken: {"content": ..., ...}
                text = value.get("content")
            if not isinstance(text, str):
                raise UserError(f"{config_path}: {key!r} must be a string or {{\"content\": str}}, "
                                f"got {repr(value)[:80]}")
            check_text(text, f"{config_path}: {key!r}")  # templates print it into prompts
            self.special_texts[key] = text

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_messages(self, messages: Sequence[dict], *, add_generation_prompt: bool,
                        thinking: bool = False) -> str:
        if self.template_problem is not None:
            raise UserError(self.template_problem)
        if self.chat_template is None:
            return qwen3_chat(messages, add_generation_prompt=add_generation_prompt, thinking=thinking)
        copies = [dict(m) for m in messages]  # a template may not change the caller's
        # tools and documents: none, passed as transformers passes them (a template tests them)
        text = render_template(self.chat_template, self.template_source, messages=copies,
                               tools=None, documents=None, add_generation_prompt=add_generation_prompt,
                               enable_thinking=thinking, **self.special_texts)
        if not text.strip():
            raise UserError(f"{self.template_source}: "
                            f"the chat template renders this conversation as nothing")
        check_text(text, f"{self.template_source}: the chat template's output")  # e.g. "\ud800" in it
        return text


def qwen3_chat(messages: Sequence[dict], *, add_generation_prompt: bool, thinking: bool) -> str:
    """Qwen3's chat template written out for system, user and assistant turns: ChatML; an assistant turn's
    reasoning (up to </think>) dropped before the last user turn, and after it kept in a think block (an
    empty one for a last turn without); with thinking off the generation prompt opens an empty one. Unlike
    the template, an answer after the last user turn keeps its leading newlines: training reads the
    response as written (a response the rendering changes is not trained on)."""
    last_query = len(messages) - 1  # the last user turn that is not a tool's response
    for i in reversed(range(len(messages))):
        content = messages[i]["content"]
        tool_response = content.startswith("<tool_response>") and content.endswith("</tool_response>")
        if messages[i]["role"] == "user" and not tool_response:
            last_query = i
            break
    out = []
    for i, m in enumerate(messages):
        content = m["content"]
        if m["role"] != "assistant":
            out.append(f"<|im_start|>{m['role']}\n{content}<|im_end|>\n")
            continue
        reasoning = ""
        if "</think>" in content:
            reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
            content = content.split("</think>")[-1].lstrip("\n")
        last = i == len(messages) - 1
        if i > last_query and (last or reasoning):
            reasoning = reasoning.strip("\n")
            out.append(f"<|im_start|>assistant\n<think>\n{reasoning}\n</think>\n\n{content}<|im_end|>\n")
        else:
            out.append(f"<|im_start|>assistant\n{content}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
        if not thinking:
            out.append(EMPTY_THINK)
    return "".join(out)


def read_chat_template(directory: str,
                       config: dict) -> tuple[Optional[str], Optional[str], Optional[str]]:
    """(template, its file, None); (None, None, None) without one; (None, file, why) if unusable (said at a render).
    `config`: the directory's tokenizer_config.json ({} without one)."""
    jinja = os.path.join(directory, "chat_template.jinja")
    if optional_file(jinja):
        try:
            with open(jinja, encoding="utf-8") as f:
                template = f.read()
        except UnicodeDecodeError:  # refused where a chat is rendered, as any unusable template
            return None, jinja, f"{jinja}: not UTF-8 text"
        if template.startswith("\ufeff"):  # else rendered at the start of every prompt
            return None, jinja, f"{jinja}: {BOM_PROBLEM}"
        return template, jinja, None
    path = os.path.join(directory, "tokenizer_config.json")
    t = config.get("chat_template")
    if isinstance(t, list):  # [{"name": ..., "template": ...}]: a chat uses "default"
        if not all(isinstance(d, dict) and isinstance(d.get("name"), str) for d in t):
            return None, path, (f"{path}: 'chat_template' as a list must hold "
                                f"{{\"name\": ..., \"template\": ...}} objects")
        named = {d["name"]: d.get("template") for d in t}
        if not isinstance(named.get("default"), str):
            return None, path, (f"{path}: 'chat_template' names no 'default' template with a text "
                                f"(it has {', '.join(map(repr, named)) or 'none'}); "
                                f"rendering a chat needs one (--no-chat sends the raw text)")
        t = named["default"]
    if t is None:
        return None, None, None
    if not isinstance(t, str):
        return None, path, f"{path}: 'chat_template' must be a string, got {type(t).__name__}"
    return t, path, None


# The box a chat template renders in: Jinja's immutable sandbox, a time limit, and caps on what it computes, checked
# on every value, and before single C calls the timer cannot stop (repetition, powers, products, widths, replace, join).

TEMPLATE_SECONDS = 10        # wall time a render may take
TEMPLATE_CHARS = 10_000_000  # the longest string or list it may make
TEMPLATE_BITS = 100_000      # the largest integer it may make
TEMPLATE_INDENT = 64         # the widest indent its tojson may take
_COMPILED: dict = {}  # the last template, compiled


def _refuse(why: str):
    from jinja2.sandbox import SecurityError

    raise SecurityError(why)


def _int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)  # numpy's integers too


def _bounded(value):
    """`value`, unless it is a string or list past TEMPLATE_CHARS or an integer past TEMPLATE_BITS."""
    if isinstance(value, (str, list, tuple)) and len(value) > TEMPLATE_CHARS:
        _refuse(f"a value of {len(value):,} items is too large")
    if _int(value) and value.bit_length() > TEMPLATE_BITS:
        _refuse("a number is too large")
    return value


def _check_format(fmt: str, args, kwargs: dict):
    """Refuse a format string (%, str.format, |format) whose widths (in specs or arguments) pass TEMPLATE_CHARS."""
    widths = []  # %-style widths and precisions: digits, or "*" (taken from the arguments)
    for m in re.finditer(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[a-zA-Z%]", fmt):
        widths += [w for w in m.group(1, 2) if w]
    specs = []  # str.format's format specs
    try:
        for _, field, spec, _ in string.Formatter().parse(fmt):
            if field is not None and spec:
                specs.append(spec)
    except ValueError:  # not a valid format string: str.format will say so
        specs = []
    sizes = [int(w) for w in widths if w != "*"]  # every width or precision the format may ask for
    for spec in specs:
        literal = re.sub(r"\{[^}]*\}", "", spec)  # a nested {field} is an argument, counted below
        sizes += [int(n) for n in re.findall(r"\d+", literal)]
    if "*" in widths or any("{" in spec for spec in specs):
        values = list(args) + list(kwargs.values())  # the width is one of the arguments
        for a in args:
            if isinstance(a, (tuple, list)):
                values += list(a)
        sizes += [v for v in values if _int(v)]
    if any(n > TEMPLATE_CHARS for n in sizes):
        _refuse("a format width is too large")


def _joinable(items) -> list:
    """A join's pieces as a list, refused when together they pass TEMPLATE_CHARS."""
    items = list(items)
    if sum(len(str(x)) for x in items) > TEMPLATE_CHARS:
        _refuse("a join is too long")
    return items


def _precheck(name: str, s, args, kwargs):
    """Refuse a str method or filter `name` on `s` that would make more than TEMPLATE_CHARS."""
    width = None
    if args:
        width = args[0]
    width = kwargs.get("width", width)
    if name in ("center", "ljust", "rjust", "zfill", "indent", "expandtabs") and _int(width):
        lines = 1  # how many times the width is paid: per line for indent, per tab for expandtabs
        if name == "indent":
            lines = str(s).count("\n") + 1
        elif name == "expandtabs":
            lines = s.count("\t")
        if width * lines > TEMPLATE_CHARS:
            _refuse("a width is too large")
    elif name in ("format", "format_map") and isinstance(s, str):
        _check_format(s, args, kwargs)
    elif name == "replace" and isinstance(s, str) and len(args) >= 2:
        old = str(args[0])
        new = str(args[1])
        replaced = len(s) + 1  # "" matches between every character and at both ends
        if old:
            replaced = s.count(old)
        growth = max(0, len(new) - len(old))
        if len(s) + replaced * growth > TEMPLATE_CHARS:
            _refuse("a replacement is too long")


def _bounded_filter(f, name: str):
    """A Jinja filter that could grow a value past the caps, checked before it runs and after."""
    skip = 0
    if hasattr(f, "jinja_pass_arg"):  # a filter that takes the context / environment first
        skip = 1

    def checked(*args, **kwargs):
        if len(args) > skip:
            value = args[skip]
            rest = args[skip + 1:]
            if name == "join" and hasattr(value, "__iter__"):
                args = args[:skip] + (_joinable(value),) + rest
            _precheck(name, value, rest, kwargs)
        return _bounded(f(*args, **kwargs))

    if skip:  # keep how jinja passes the environment / context / eval context
        checked.jinja_pass_arg = f.jinja_pass_arg
    return checked


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' `tojson` filter: the JSON as it is (jinja's own escapes HTML characters and sorts keys)."""
    if _int(indent) and indent > TEMPLATE_INDENT:
        _refuse(f"tojson's indent {indent} is too wide")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    """transformers' `strftime_now` global: today's date in a template (Llama 3's say it)."""
    from datetime import datetime

    return datetime.now().strftime(format)


def render_template(template: str, source: str, **context) -> str:
    import signal
    import threading

    from jinja2 import TemplateError
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """{% generation %} .. {% endgeneration %}: transformers marks the assistant's tokens with it (for
        training masks); rendered here as what it holds."""
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    class Boxed(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"**", "*", "%"})

        def call_binop(self, context, operator, left, right):
            ints = _int(left) and _int(right)
            if operator == "**" and ints and abs(left) > 1 and right > 0:
                if right * abs(left).bit_length() > TEMPLATE_BITS:
                    _refuse(f"{left} ** {right} is too large")
            if operator == "*" and ints and left.bit_length() + right.bit_length() > TEMPLATE_BITS:
                _refuse("a product is too large")
            sequences = (str, list, tuple)
            if operator == "*" and (isinstance(left, sequences) or isinstance(right, sequences)):
                seq = left  # the sequence repeated, and how many times
                n = right
                if not isinstance(left, sequences):
                    seq = right
                    n = left
                if isinstance(n, int) and len(seq) * n > TEMPLATE_CHARS:
                    _refuse("a repetition is too long")
            if operator == "%" and isinstance(left, str):
                values = right
                if not isinstance(right, (tuple, list)):
                    values = (right,)
                _check_format(left, values, {})
            return _bounded(super().call_binop(context, operator, left, right))

        # jinja2 >= 3.1.5 wraps str.format at attribute access: check at the call
        def wrap_str_format(self, value):
            wrapped = super().wrap_str_format(value)

            def checked(*args, **kwargs):
                _check_format(value.__self__, args, kwargs)
                return _bounded(wrapped(*args, **kwargs))

            if wrapped is None:
                return None
            return checked

        # jinja2's own signature
        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805
            if isinstance(getattr(__obj, "__self__", None), str):  # a str method
                name = getattr(__obj, "__name__", "")
                if name == "join" and args:
                    args = (_joinable(args[0]),) + tuple(args[1:])
                _precheck(name, __obj.__self__, args, kwargs)
            return _bounded(super().call(__context, __obj, *args, **kwargs))

    def raise_exception(msg):
        raise TemplateError(msg)

    def out_of_time(signum, frame):
        raise TimeoutError(f"took longer than {TEMPLATE_SECONDS} s")

    timed = threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")
    if timed:
        previous = signal.signal(signal.SIGALRM, out_of_time)
        # the caller's own timer (seconds left, interval), re-armed afterwards
        callers = signal.setitimer(signal.ITIMER_REAL, TEMPLATE_SECONDS)
        started = time.monotonic()
    try:
        # compiled once per template (training renders many conversations)
        if template not in _COMPILED:
            # the settings transformers renders chat templates with
            env = Boxed(trim_blocks=True, lstrip_blocks=True,
                        extensions=[GenerationTag, "jinja2.ext.loopcontrols"])
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = _strftime_now
            env.filters["tojson"] = _bounded_filter(_tojson, "tojson")
            # filters that can grow a value
            for name in ("center", "format", "indent", "join", "replace", "wordwrap"):
                env.filters[name] = _bounded_filter(env.filters[name], name)
            _COMPILED.clear()
            _COMPILED[template] = env.from_string(template)
        parts = []  # the rendered chunks so far, and how many characters they hold
        size = 0
        for chunk in _COMPILED[template].generate(**context):
            parts.append(chunk)
            size += len(chunk)
            if size > TEMPLATE_CHARS:
                _refuse(f"its output grew past {TEMPLATE_CHARS:,} characters")
        return "".join(parts)
    # every way a template can fail is the template's, and the user's to fix
    except Exception as e:
        detail = ""
        if str(e):
            detail = str(e).splitlines()[0][:200]
        raise UserError(f"{source}: cannot render the chat template ({type(e).__name__}: {detail})") from None
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            left, interval = callers
            if left > 0:  # less the render's time; one due meanwhile fires now
                left = max(left - (time.monotonic() - started), 1e-6)
                signal.setitimer(signal.ITIMER_REAL, left, interval)


# Prompts

# a text this many characters per allowed token is tokenized only that far before refusing
CHARS_PER_TOKEN = 64
PROMPT_KINDS = ("prompt", "prompt_ids", "turns", "messages")
# keys only a flag sets: the prompt's rendering and every decode setting (flags.Settings' fields,
# a test holds them equal; text.py cannot import flags.py, which imports it)
DECODE_SETTINGS = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "stop", "ignore_eos",
                   "seed", "num_samples", "batch_size", "scheduler", "confidence_threshold",
                   "sps_table", "verify_buckets", "compile", "compile_mode", "verbose", "kernels",
                   "tree_budget", "tree_temperature", "draft_length")
# a record's key that would set what a flag sets: ours, and the spellings of OpenAI's, vLLM's and
# transformers' requests
RECORD_SETTINGS = {"system": "--system-prompt", "max_tokens": "--max-new-tokens",
                   "max_completion_tokens": "--max-new-tokens", "max_length": "--max-new-tokens",
                   "n": "--num-samples", "do_sample": "--temperature", "stop_token_ids": "--stop",
                   "thinking": "--enable-thinking", "chat_template_kwargs": "--enable-thinking"} | {
    k: flag(k) for k in ("system_prompt", "enable_thinking") + DECODE_SETTINGS} | {"stop_sequences": "--stop"}
# a request's key for what this decoding does not do, with the value that asks for nothing
UNAPPLIED_REQUEST_KEYS = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                          "min_tokens": 0, "min_new_tokens": 0, "no_repeat_ngram_size": 0, "num_beams": 1,
                          "best_of": 1, "logit_bias": {}, "logprobs": False, "top_logprobs": 0,
                          # what the prompt is rendered from or the output holds
                          "tools": [], "tool_choice": "none", "response_format": {"type": "text"},
                          "add_generation_prompt": True, "continue_final_message": False, "echo": False}


def auto_chat(chat: Optional[bool], tokenizer: Optional[Tokenizer]) -> bool:
    """--chat's default: on when the tokenizer has a template (or names ones it cannot use)."""
    if chat is not None:
        return chat
    if tokenizer is None:
        return False
    return tokenizer.chat_template is not None or tokenizer.template_problem is not None


def check_text(text: str, where: str):
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # tokenizers refuse a lone surrogate with a TypeError
        code = ord(text[e.start])
        why = f"a lone surrogate, U+{code:04X}"
        # a flag's value: Python reads a byte of an argument that is not UTF-8 as U+DC80..U+DCFF
        if where.startswith("--") and 0xDC80 <= code <= 0xDCFF:
            why += (f", which is how Python reads the byte 0x{code - 0xDC00:02x} "
                    f"in an argument that is not UTF-8")
        raise UserError(f"{where}: the text is not valid Unicode ({why})") from None


def is_token_ids(prompt) -> bool:
    """A prompt given as token ids, never rendered."""
    return isinstance(prompt, (list, tuple)) and all(_int(t) for t in prompt)


def all_token_ids(prompts: list) -> bool:
    """Every prompt is token ids (an empty one is left to the prompt's own check)."""
    return all(is_token_ids(p) and len(p) > 0 for p in prompts)


def check_chat_renders(chat: Optional[bool], prompts: list, what: str):
    """--chat given (True, not its default) where every prompt is token ids: nothing is rendered, so it
    would change nothing, as with --prompt-ids. `what`: which prompts, for the message. An empty
    prompt is left to the prompt's own check."""
    if chat and all_token_ids(prompts):
        raise UserError(f"--chat: {what} is token ids, never rendered; it would change nothing")


def check_chat_flags(*, chat: Optional[bool], ids: Optional[str], system_prompt: Optional[str],
                     thinking: bool) -> list[str]:
    """--system-prompt / --enable-thinking (returned if given): an error with token ids or without chat.
    ids: the prompts that are all token ids, as the message names them (None: not so)."""
    flags = []
    if system_prompt is not None:
        flags.append("--system-prompt")
    if thinking:
        flags.append("--enable-thinking")
    if flags and ids is not None:
        raise UserError(f"{flags[0]}: {ids} token ids, not a rendered chat; "
                        f"it would change nothing")
    if flags and chat is False:
        raise UserError(f"{flags[0]}: prompts are not rendered as chat here "
                        f"(--no-chat, or a tokenizer without a chat template: "
                        f"--chat renders Qwen3's format); it would change nothing")
    if system_prompt is not None:
        check_text(system_prompt, "--system-prompt")
        if not system_prompt.strip():
            raise UserError("--system-prompt: empty (leave the flag out for no system turn)")
    return flags


def read_messages(messages, where: str) -> list[dict]:
    """A conversation: {"role", "content"} objects, known roles, text content, the user's turn last."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise UserError(f"{where}: 'messages' must be a non-empty list of "
                        f"{{\"role\": str, \"content\": str}}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            got = f"a {type(m).__name__}"
            if isinstance(m, dict):
                got = f"keys {', '.join(map(repr, m))}"
            raise UserError(f"{where}: messages[{i}] must be {{\"role\": str, \"content\": str}}, "
                            f"got {got}")
        if m["role"] not in ROLES:
            raise UserError(f"{where}: messages[{i}]: role {repr(m['role'])[:60]} "
                            f"is not one of {', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise UserError(f"{where}: messages[{i}]: 'content' must be a string, "
                            f"got {type(m['content']).__name__}")
    if messages[-1]["role"] != "user":
        raise UserError(f"{where}: the last message must be the user's "
                        f"(the turn the model answers), not the {messages[-1]['role']}'s")
    return [dict(m) for m in messages]


# why a conversation is not rendered, in a program whose --chat decides
NO_CHAT_WHY = "--no-chat, or a tokenizer without a chat template: --chat renders Qwen3's format"


def encode(tokenizer: Optional[Tokenizer], prompt, where: str, *, chat: bool,
           system_prompt: Optional[str] = None, thinking: bool = False,
           max_len: Optional[int] = None, no_chat_why: str = NO_CHAT_WHY) -> list[int]:
    """One prompt as ids: token ids as given; a text (a user turn) or a conversation, rendered if `chat`."""
    if is_token_ids(prompt):
        if system_prompt is not None or thinking:
            raise UserError(f"{where}: token ids are not a rendered chat; "
                            f"the system prompt or thinking would change nothing")
        return [int(t) for t in prompt]
    if isinstance(prompt, (list, tuple)) and any(isinstance(t, numbers.Integral) for t in prompt):
        odd = next(t for t in prompt if not _int(t))
        raise UserError(f"{where}: token ids hold {odd!r}, which is not a token id")
    conversation = isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) for m in prompt)
    if not (isinstance(prompt, str) or conversation):  # a tensor, an array, a list of lists
        raise UserError(f"{where}: expected a text, a list of token ids or a conversation (a list of "
                        f"{{\"role\", \"content\"}} messages), got {type(prompt).__name__} {repr(prompt)[:60]}")
    if tokenizer is None:
        raise UserError(f"{where}: a text prompt needs the target's tokenizer.json")
    template = tokenizer.chat_template
    if thinking and template is not None and "enable_thinking" not in template:
        raise UserError(f"--enable-thinking: the chat template ({tokenizer.template_source}) "
                        f"has no thinking switch (it never reads enable_thinking)")
    if not isinstance(prompt, str) and not chat:
        raise UserError(f"{where}: a messages record is a conversation, "
                        f"rendered only with a chat template, "
                        f"and prompts are not rendered as chat here ({no_chat_why})")
    if isinstance(prompt, str):
        turns = [{"role": "user", "content": prompt}]
    else:
        turns = read_messages(prompt, where)
    messages = turns
    if system_prompt is not None:
        if any(m["role"] == "system" for m in turns):
            raise UserError(f"{where}: the conversation has its own system turn, "
                            f"and --system-prompt gives another; drop one")
        messages = [{"role": "system", "content": system_prompt}] + turns
    texts = [m["content"] for m in messages]
    joined = "\n".join(texts)
    check_text(joined, where)
    if not texts[-1].strip():  # before rendering: a template would dress an empty question up
        raise UserError(f"{where}: empty prompt")
    if max_len is not None:  # e.g. 100 MB: refused from a prefix, not tokenized whole
        most_chars = CHARS_PER_TOKEN * max_len
        past_chars = sum(map(len, texts)) > most_chars
        if past_chars and len(tokenizer.encode(joined[:most_chars])) > max_len:
            raise UserError(f"{where}: the prompt is longer than the {max_len} tokens "
                            f"the context leaves it")
    if not chat:
        return tokenizer.encode(texts[-1])
    try:
        text = tokenizer.render_messages(messages, add_generation_prompt=True, thinking=thinking)
    except UserError as e:  # a template that refuses this prompt (raise_exception): say which
        raise UserError(f"{where}: {e}") from None
    return tokenizer.encode(text)


# a prompts file's records, as errors name them
RECORD_SHAPES = ('{"prompt": str}, {"prompt_ids": [int]}, {"turns": [str]} or '
                 '{"messages": [{"role": str, "content": str}, ...]}')
KIND_SHAPES = {"prompt": "a string", "prompt_ids": "a list of integers",
               "turns": "a non-empty list of strings"}


def the_runs_flag(key: str) -> str:
    """Where a record's setting goes instead: the run's flag."""
    return f"that is the run's {RECORD_SETTINGS[key]}"


def check_record_keys(row: dict, where: str, instead: Callable[[str], str] = the_runs_flag):
    """A record's key that would set what the run sets (instead(key) says where it goes) or ask for what
    this decoding does not do is an error; a null one is absent, as a table's export writes a column a
    row leaves empty."""
    setting = sorted(k for k in RECORD_SETTINGS if row.get(k) is not None)
    if setting:
        raise UserError(f"{where}: a record cannot set {setting[0]!r}; {instead(setting[0])} "
                        f"(other keys are metadata, ignored)")
    for key, nothing in UNAPPLIED_REQUEST_KEYS.items():
        value = row.get(key, nothing)
        if key == "tool_choice" and value == "auto" and not row.get("tools"):
            continue  # a choice among no tools asks for nothing
        if value is not None and value != nothing:
            shown = json.dumps(value)[:40]
            raise UserError(f"{where}: {key} {shown} is not applied here (no such control in this "
                            f"decoding); drop it (other keys are metadata, ignored)")


def read_prompts_file(prompts_file: str) -> list[tuple[str, object]]:
    """(where, prompt) of every record of a JSON-lines file: a prompt, prompt_ids, turns or messages."""
    check_input(prompts_file, "--prompts-file", "prompts file")
    out = []
    for where, row in read_jsonl(prompts_file, records=RECORD_SHAPES):
        if not isinstance(row, dict):
            raise UserError(f"{where}: expected {RECORD_SHAPES}")
        check_record_keys(row, where)
        kinds = [k for k in PROMPT_KINDS if row.get(k) is not None]
        if not kinds:  # every prompt key null: said as the first one's wrong value
            kinds = [k for k in PROMPT_KINDS if k in row][:1]
        if len(kinds) > 1:
            raise UserError(f"{where}: a record gives one prompt, "
                            f"as one of {', '.join(PROMPT_KINDS)}; "
                            f"this one has {' and '.join(kinds)}")
        kind = None
        if kinds:
            kind = kinds[0]
        v = row.get(kind)
        if kind == "turns" and isinstance(v, list) and v and all(isinstance(t, str) for t in v):
            v = v[0]  # the first turn, as the authors' evaluation
        elif kind == "messages":
            v = read_messages(v, where)
        elif kind is None:
            keys = ", ".join(sorted(row)) or "none"
            raise UserError(f"{where}: expected {RECORD_SHAPES} (this record's keys: {keys})")
        elif not (kind == "prompt" and isinstance(v, str)
                  or kind == "prompt_ids" and isinstance(v, list) and all(_int(i) for i in v)):
            got = json.dumps(v, ensure_ascii=False)[:80]
            raise UserError(f"{where}: {kind!r} must be {KIND_SHAPES[kind]}, got {got}")
        out.append((where, v))
    if not out:
        raise UserError(f"{prompts_file}: no prompts")
    return out


def load_prompts(*, tokenizer: Optional[Tokenizer], chat: bool, prompt: Optional[str] = None,
                 prompt_ids: Optional[str] = None, prompts_file: Optional[str] = None,
                 max_len: Optional[int] = None, system_prompt: Optional[str] = None,
                 thinking: bool = False, sources: Optional[list] = None, no_chat_why: str = NO_CHAT_WHY,
                 choose: Optional[Callable[[list], list]] = None, chat_given: Optional[bool] = None):
    """The prompts of one of --prompt, --prompt-ids, --prompts-file as ids; `sources` gets where each came from
    (`no_chat_why`: why a conversation is not rendered, as the program decides; `choose`: which of the
    records, (where, prompt) in order, to encode, e.g. eval.py's subset: every one by default;
    `chat_given`: --chat as given, refused for a file of token ids only)."""
    sources_given = (("--prompt", prompt), ("--prompt-ids", prompt_ids),
                     ("--prompts-file", prompts_file))
    given = [name for name, value in sources_given if value is not None]
    if len(given) != 1:
        got = ""
        if given:
            got = f" (got {', '.join(given)})"
        raise UserError(f"give exactly one of --prompt, --prompt-ids, --prompts-file{got}")
    ids = None
    if prompt_ids is not None:
        ids = "--prompt-ids are"
    flags = check_chat_flags(chat=chat, ids=ids, system_prompt=system_prompt, thinking=thinking)
    if prompts_file is not None:
        records = read_prompts_file(prompts_file)
    elif prompt is not None:
        records = [("--prompt", prompt)]
    else:
        records = [("--prompt-ids", parse_ints(prompt_ids, "--prompt-ids"))]
    for where, p in records:  # every record, chosen or not: a file is taken or refused whatever the subset
        # (--prompt-ids with a flag: refused above)
        if flags and isinstance(p, list) and all(_int(i) for i in p):
            raise UserError(f"{where}: a prompt_ids record is token ids, not a rendered chat; "
                            f"{flags[0]} would change nothing for it")
    if prompts_file is not None:
        check_chat_renders(chat_given, [p for _, p in records], f"every record of --prompts-file {prompts_file}")
    if choose is not None:
        records = choose(records)
    out = []
    for where, p in records:
        out.append(encode(tokenizer, p, where, chat=chat, system_prompt=system_prompt,
                          thinking=thinking, max_len=max_len, no_chat_why=no_chat_why))
        if sources is not None:
            sources.append(where)
    return out


def check_prompts(prompts: list[list[int]], target, max_new_tokens: Optional[int], drafter=None,
                  sources=None):
    """Every prompt non-empty, inside the vocabulary, and fitting the target's and drafter's context with its
    budget (None: a budget not chosen yet, so room for one new token)."""
    V = target.args.vocab_size
    context = target.args.max_position_embeddings
    whose = "target"
    if drafter is not None and drafter.cfg.layers.max_position_embeddings < context:
        context = drafter.cfg.layers.max_position_embeddings
        whose = "drafter"
    for i, p in enumerate(prompts):
        name = f"prompt {i}"
        if sources is not None:
            name = sources[i]
        if not p:
            raise UserError(f"{name}: empty prompt")
        bad = [t for t in p if not 0 <= t < V]
        if bad:
            raise UserError(f"{name}: token id {bad[0]} is outside the vocabulary (0..{V - 1})")
        if max_new_tokens is None and len(p) >= context:
            raise UserError(f"{name}: {len(p)} tokens fill the {whose}'s context of {context} "
                            f"(max_position_embeddings): no room for a new token")
        if max_new_tokens is not None and len(p) + max_new_tokens > context:
            raise UserError(f"{name}: {len(p)} tokens + --max-new-tokens {max_new_tokens} "
                            f"exceed the {whose}'s context of {context} (max_position_embeddings)")


class StopStrings:
    """--stop: a request ends at the first in its printed text: ids kept to the token completing it, text cut before."""

    # characters of checked text a window keeps before a stop string could start: what decoding from
    # inside the text changes at the window's first ids (a space, a character's trailing bytes)
    SLACK = 16

    def __init__(self, tokenizer: Tokenizer, strings: Sequence[str]):
        self.tokenizer = tokenizer
        self.strings = tuple(strings)
        self.longest = max(map(len, self.strings), default=0)

    @staticmethod
    def check(strings: Sequence[str]):
        for s in strings:
            if not isinstance(s, str):
                raise UserError(f"--stop {s!r}: a stop string must be a str")
            if not s:
                raise UserError("--stop: an empty stop string would end every request at once")
            check_text(s, f"--stop {s!r}")
            if "\ufffd" in s:  # its text could match a character cut at a round's end, then not
                raise UserError(f"--stop {s!r}: holds U+FFFD, which decoding writes for bytes that are not "
                                f"(yet) a whole character; a stop string cannot hold it")

    @staticmethod
    def escape_note(strings: Sequence[str]) -> Optional[str]:
        """A note for the command line when a stop string holds a backslash escape as written (a shell
        passes '\\n' as a backslash and an n), else None."""
        escapes = {"\\n": "newline", "\\t": "tab", "\\r": "carriage return"}
        for s in strings:
            for escape, character in escapes.items():
                if escape not in s:
                    continue
                shown = f"'{s}'"
                if not s.isprintable():
                    shown = repr(s)
                return (f"note: --stop {shown}: holds {escape} as written, a backslash and a letter, "
                        f"not a {character}; in bash a {character} is written $'{escape}'")
        return None

    @staticmethod
    def build(tokenizer: Optional[Tokenizer], strings: Sequence[str]) -> Optional["StopStrings"]:
        if not strings:
            return None
        if tokenizer is None:
            raise UserError("--stop: stop strings need the target's tokenizer.json "
                            "(to read the text)")
        added = tokenizer.tok.get_added_tokens_decoder().values()
        special = {t.content for t in added if t.special}
        for s in strings:
            held = next((t for t in special if t and t in s), None)
            if held is not None:  # the text it is matched in leaves special tokens out
                raise UserError(f"--stop {s!r}: holds the special token {held!r}, "
                                f"which the text a stop string is matched in leaves out; "
                                f"requests end at the target's stop tokens "
                                f"(generation_config.json's eos_token_id), or --ignore-eos")
        return StopStrings(tokenizer, strings)

    def find(self, text: str) -> Optional[int]:
        """Where the first stop string in `text` starts, or None."""
        found = [text.find(s) for s in self.strings]
        starts = [i for i in found if i >= 0]
        return min(starts, default=None)

    def window_start(self, ids: Sequence[int], checked: int) -> int:
        """Where a window of the ids starts that holds any stop string the ids after `checked` complete:
        enough checked ids before them for the longest stop string and the slack, whose text does not
        start with U+FFFD: a window cut inside a character, which a byte-fallback decoder turns into
        U+FFFD along its whole run of byte tokens. A start cut so steps back to the character's first
        byte; one on bytes that are not UTF-8 (or in such a run) goes further back, up to the whole."""
        back = 2 * self.longest + self.SLACK  # ids, doubled until their text is long and whole enough
        steps = 0  # ids stepped back from a start cut inside a character
        while True:
            start = max(0, checked - back)
            before = self.tokenizer.decode(ids[start:checked], skip_special_tokens=True)
            if start == 0:
                return start
            if len(before) < self.longest + self.SLACK:
                back *= 2
            elif not before.startswith("\ufffd"):
                return start
            elif steps < 3:  # a character's first byte is at most 3 bytes back
                back += 1
                steps += 1
            else:
                back *= 2
                steps = 0

    def keep(self, ids: Sequence[int], checked: int) -> Optional[int]:
        """The fewest leading ids whose text holds a stop string (the first `checked` hold none), else None:
        each of the new ids checked in turn, as a decode of one id a round checks it (a byte-fallback
        decoder's text can lose a stop string at a later id, so a longer text says nothing of a shorter
        one). Each decodes a window at the output's end, not the whole output; the whole when it holds one."""
        start = self.window_start(ids, checked)
        for n in range(checked + 1, len(ids) + 1):
            window = self.tokenizer.decode(ids[start:n], skip_special_tokens=True)
            if self.find(window) is None:
                continue
            if start == 0:
                return n
            whole = self.tokenizer.decode(ids[:n], skip_special_tokens=True)
            if self.find(whole) is not None:  # not a string the window's cut start made
                return n
        return None

    def cut(self, text: str) -> str:
        return text[:self.find(text)]  # all of it when it holds none
