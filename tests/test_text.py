"""Chat prompts: {"messages"} records, --system-prompt and --enable-thinking (text.load_prompts, text.py),
rendered as transformers renders them and wired through speculate.py."""

from __future__ import annotations

import json
import re

import pytest
from conftest import REPO_ROOT, copy_target, edit_json, render_chat

import speculate
from support import text
from support.cli import UserError

# Qwen3's chat format, written here from its documented behaviour: a leading system message first; user
# (and later system) turns as ChatML; an assistant turn keeps only the text after any </think>, and the
# one that ends a conversation after its last user turn gets an empty think block; the generation
# prompt closes an empty think block when enable_thinking is false.
QWEN3_STYLE_TEMPLATE = """\
{%- if messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}
    {%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for m in messages %}
    {%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}
    {%- elif m.role == 'assistant' %}
        {%- set answer = m.content.split('</think>')[-1].lstrip('\\n') %}
        {%- if loop.last and loop.index0 > ns.last_user %}
{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + answer + '<|im_end|>\\n' }}
        {%- else %}
{{- '<|im_start|>assistant\\n' + answer + '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

# The published Qwen3 chat template (Qwen/Qwen3-8B's tokenizer_config.json), its branches for system, user and
# assistant turns as written there (the tools' system block, tool calls and tool turns left out).
QWEN3_TEMPLATE = """\
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') \
and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}
                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\\n').split('<think>')[-1]\
.lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + \
'\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

CONVERSATIONS = [
    [{"role": "system", "content": "x = 1"}, {"role": "user", "content": "hello world"}],
    [{"role": "user", "content": "hello"}],
    [{"role": "system", "content": "the world"}, {"role": "user", "content": "print ( x )"},
     {"role": "assistant", "content": "x is 1"}, {"role": "user", "content": "for y in z"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "y"}, {"role": "system", "content": "z"},
     {"role": "user", "content": "if x : return y"}],
]


@pytest.fixture(scope="module")
def qwen3_style(target_factory, tmp_path_factory):
    """A tiny target whose tokenizer_config.json holds QWEN3_STYLE_TEMPLATE."""
    d = copy_target(target_factory().path, tmp_path_factory.mktemp("qwen3-style") / "target")
    edit_json(d / "tokenizer_config.json", lambda c: c.update(chat_template=QWEN3_STYLE_TEMPLATE))
    return d


def hf_ids(directory, messages, thinking):
    """transformers' apply_chat_template on the same tokenizer.json and template: (text, ids)."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"), chat_template=QWEN3_STYLE_TEMPLATE)
    kw = dict(add_generation_prompt=True, enable_thinking=thinking)
    ids = tok.apply_chat_template(messages, tokenize=True, **kw)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # a BatchEncoding in transformers 5, a list before
    return tok.apply_chat_template(messages, tokenize=False, **kw), list(ids)


def write_records(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize("thinking", [False, True])
def test_messages_records_render_as_transformers_does(qwen3_style, tmp_path, thinking):
    pf = write_records(tmp_path / "m.jsonl", [{"messages": c} for c in CONVERSATIONS])
    tok = text.Tokenizer(str(qwen3_style))
    ours = text.load_prompts(tokenizer=tok, chat=True, prompts_file=str(pf), thinking=thinking)
    for conv, ids in zip(CONVERSATIONS, ours):
        want_text, want_ids = hf_ids(qwen3_style, conv, thinking)
        assert tok.render_messages(conv, add_generation_prompt=True, thinking=thinking) == want_text
        assert ids == want_ids
    assert "<|im_start|>system\nx = 1<|im_end|>\n<|im_start|>user\nhello world" in hf_ids(
        qwen3_style, CONVERSATIONS[0], thinking)[0]


def test_a_template_reading_special_tokens_and_loop_controls_renders_as_transformers_does(qwen3_style, tmp_path):
    """bos_token / eos_token from tokenizer_config.json, and {% break %} (transformers' loopcontrols)."""
    from transformers import PreTrainedTokenizerFast

    template = ("{{ bos_token }}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
                "{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}{% endfor %}")
    d = copy_target(qwen3_style, tmp_path / "t")
    edit_json(d / "tokenizer_config.json", lambda c: c.update(chat_template=template, bos_token="<|endoftext|>",
                                                              eos_token={"content": "<|im_end|>"}))
    conv = CONVERSATIONS[0]
    hf = PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"), chat_template=template,
                                 bos_token="<|endoftext|>", eos_token="<|im_end|>")
    want = hf.apply_chat_template(conv, tokenize=False)
    assert text.Tokenizer(str(d)).render_messages(conv, add_generation_prompt=False) == want
    assert want.startswith("<|endoftext|>") and want.count("<|im_end|>") == 2


@pytest.mark.parametrize("value", [5, ["<|im_end|>"], {"content": 7}, {"lstrip": False}])
def test_a_special_token_of_another_type_is_one_line(qwen3_style, tmp_path, value):
    """A special token a template reads is a string or an AddedToken {"content": str}; another value was
    dropped without a word, and the template rendered it as nothing."""
    d = copy_target(qwen3_style, tmp_path / "t")
    edit_json(d / "tokenizer_config.json", lambda c: c.update(eos_token=value))
    with pytest.raises(UserError, match=r"tokenizer_config.json: 'eos_token' must be a string or "
                                        r"\{\"content\": str\}, got ") as e:
        text.Tokenizer(str(d))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("template", [
    # {% generation %} marks the assistant's tokens for transformers' training masks (it was an unknown tag)
    "{% for m in messages %}{{ m['role'] }}: {% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
    "{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}\n{% endfor %}",
    # transformers' tojson keeps the characters and the keys' order (jinja's escaped them and sorted the keys)
    "{% for m in messages %}{{ m['content'] | tojson }}{{ m | tojson(indent=2) }}{% endfor %}",
    # strftime_now, as Llama 3's templates date the system turn (it was undefined)
    "{{ strftime_now('%Y') }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
])
def test_transformers_template_extensions_render_as_transformers_does(qwen3_style, tmp_path, template):
    from transformers import PreTrainedTokenizerFast

    d = copy_target(qwen3_style, tmp_path / "t")
    edit_json(d / "tokenizer_config.json", lambda c: c.update(chat_template=template))
    conv = [{"role": "user", "content": "a<b & 'c' é"}, {"role": "assistant", "content": "ok"}]
    hf = PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"), chat_template=template)
    want = hf.apply_chat_template(conv, tokenize=False)
    assert text.Tokenizer(str(d)).render_messages(conv, add_generation_prompt=False) == want


def test_a_templates_tojson_indent_is_bounded():
    with pytest.raises(UserError, match="cannot render the chat template .*tojson's indent 10000000 is too wide"):
        text.render_template("{{ messages | tojson(indent=10000000) }}", "t.json", messages=[{"role": "user"}])


@pytest.mark.parametrize("thinking", [False, True])
def test_without_a_template_the_fallback_renders_qwen3s_format(qwen3_style, target_factory, thinking):
    """No template: text.py's ChatML fallback gives what Qwen3's format gives, system turns included."""
    plain = text.Tokenizer(str(target_factory(chat_template=False).path))
    assert plain.chat_template is None
    for conv in CONVERSATIONS:
        assert plain.render_messages(conv, add_generation_prompt=True, thinking=thinking) == \
            hf_ids(qwen3_style, conv, thinking)[0]
    assert render_chat(plain, "hello", system="x = 1", thinking=thinking) == (
        "<|im_start|>system\nx = 1<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
        + ("" if thinking else "<think>\n\n</think>\n\n"))


def test_system_prompt_is_a_system_turn_for_every_text_prompt(qwen3_style, tmp_path):
    tok = text.Tokenizer(str(qwen3_style))
    system = "the world is a world"
    want = [hf_ids(qwen3_style, [{"role": "system", "content": system}, {"role": "user", "content": u}], False)[1]
            for u in ("hello world", "print ( x )", "for y in z")]
    assert text.load_prompts(tokenizer=tok, chat=True, prompt="hello world", system_prompt=system) == want[:1]
    pf = write_records(tmp_path / "p.jsonl", [{"prompt": "hello world"}, {"turns": ["print ( x )", "unused"]},
                                              {"messages": [{"role": "user", "content": "for y in z"}]}])
    assert text.load_prompts(tokenizer=tok, chat=True, prompts_file=str(pf), system_prompt=system) == want
    # without it: no system turn, as before
    assert text.load_prompts(tokenizer=tok, chat=True, prompt="hello world") == \
        [hf_ids(qwen3_style, [{"role": "user", "content": "hello world"}], False)[1]]


def test_the_flags_reach_the_run(qwen3_style, tmp_path, capsys):
    """speculate.py: --system-prompt / --enable-thinking decode exactly what the equivalent messages record
    decodes, and change the output from the plain prompt's."""
    def output(*args):
        trace = tmp_path / "t.jsonl"
        rc = speculate.main([str(a) for a in ["--target", qwen3_style, "--max-new-tokens", 8, "--trace-file", trace,
                                              *args]])
        assert rc == 0, capsys.readouterr().err
        return [json.loads(line)["output_ids"] for line in open(trace) if "output_ids" in line]

    system = "x = 1 + 2"
    record = write_records(tmp_path / "m.jsonl", [{"messages": [{"role": "system", "content": system},
                                                                {"role": "user", "content": "hello world"}]}])
    with_flag = output("--prompt", "hello world", "--system-prompt", system)
    assert with_flag == output("--prompts-file", record)
    tok = text.Tokenizer(str(qwen3_style))
    assert text.load_prompts(tokenizer=tok, chat=True, prompt="hello world", system_prompt=system) != \
        text.load_prompts(tokenizer=tok, chat=True, prompt="hello world")
    thinking = text.load_prompts(tokenizer=tok, chat=True, prompt="hello world", thinking=True)
    assert thinking == [hf_ids(qwen3_style, [{"role": "user", "content": "hello world"}], True)[1]]
    assert thinking != text.load_prompts(tokenizer=tok, chat=True, prompt="hello world")
    thinking_record = write_records(tmp_path / "ids.jsonl", [{"prompt_ids": thinking[0]}])
    assert output("--prompt", "hello world", "--enable-thinking") == output("--prompts-file", thinking_record)


def test_a_template_without_a_thinking_switch_refuses_enable_thinking(target_factory, tmp_path, capsys):
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    t = target_factory(chat_template=template, chat_template_file=True).path
    capsys.readouterr()
    rc = speculate.main(["--target", str(t), "--prompt", "hello", "--enable-thinking", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "chat_template.jinja" in err and "enable_thinking" in err, err


SHAPES = ('{"prompt": str}, {"prompt_ids": [int]}, {"turns": [str]} or '
          '{"messages": [{"role": str, "content": str}, ...]}')


@pytest.mark.parametrize("content,where,plain", [
    ("def f(x):\n    return x\n", "p.txt:1", True),  # plain text: a prompt per line, or a source file
    ("\n  hello world\n", "p.txt:2", True),  # the first non-blank line is the one that counts
    ('{"prompt": "a"}\n{"prompt": "b",}\n', "p.txt:2", False),  # JSON lines with one bad line
    ('{\n  "prompt": "a"\n}\n', "p.txt:1", False),  # one record spread over lines
])
def test_a_prompts_file_that_is_not_json_lines_names_the_accepted_records(tmp_path, capsys, content, where, plain):
    """A malformed line's error names the records a prompts file may hold and, when the file looks like
    plain text (its first line opens no JSON object or array), says so and asks for one JSON object a line."""
    from support.cli import UserError

    capsys.readouterr()
    path = tmp_path / "p.txt"
    path.write_text(content)
    with pytest.raises(UserError) as e:
        text.read_prompts_file(str(path))
    line = str(e.value)
    assert line.startswith(f"{tmp_path / where}: malformed JSON (") and line.endswith(SHAPES) and "\n" not in line
    said = "the file looks like plain text, not JSON lines: write one JSON object per line, each one of "
    assert (said in line) == plain and ("each line is one whole JSON record, one of " in line) != plain, line
    from conftest import REPO_ROOT

    target = str(REPO_ROOT / "demo" / "target")
    rc = speculate.main(["--target", target, "--prompts-file", str(path), "--max-new-tokens", "2"])
    assert rc == 2 and capsys.readouterr().err == f"error: {line}\n"


def test_other_json_lines_readers_keep_the_bare_error(tmp_path):
    """read_jsonl's other callers (training data, regenerate.py) get the error they had: no prompt shapes."""
    from support.cli import UserError
    from support.files import read_jsonl

    path = tmp_path / "d.jsonl"
    path.write_text("plain text\n")
    with pytest.raises(UserError) as e:
        list(read_jsonl(str(path)))
    assert str(e.value) == f"{path}:1: malformed JSON (Expecting value at column 1)"
    # the position is the line's own column: json's "line 2 column 1" of a line cut short read as the file's
    path.write_text('{"a": 1}\n{"a": 1,\n')
    with pytest.raises(UserError) as e:
        list(read_jsonl(str(path)))
    assert str(e.value) == f"{path}:2: malformed JSON (Expecting property name enclosed in double quotes at column 9)"


def test_rendering_a_template_keeps_the_callers_alarm(monkeypatch):
    """The render's time limit borrows SIGALRM's timer: the caller's handler and running timer (less the
    time spent) are back afterwards, and one due during the render fires at once."""
    import signal
    import time

    fired = []
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: fired.append(signum))
    try:
        signal.setitimer(signal.ITIMER_REAL, 30.0, 5.0)
        assert text.render_template("{{ x }}", "t.jinja", x=1) == "1"
        left, interval = signal.getitimer(signal.ITIMER_REAL)
        assert 25.0 < left <= 30.0 and interval == 5.0
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        monkeypatch.setitem(text._COMPILED, "{{ x }}", type("Slow", (), {
            "generate": lambda self, **context: iter([time.sleep(0.2) or "1"])})())
        assert text.render_template("{{ x }}", "t.jinja", x=1) == "1"
        time.sleep(0.01)
        assert fired == [signal.SIGALRM]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_a_template_that_refuses_a_prompt_names_the_prompt(target_factory, tmp_path):
    """A template's raise_exception for one record (Gemma's "System role not supported"): the error names
    the record's file:line (or the API's `prompt i`) before the template."""
    template = ("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('System role not supported') }}"
                "{% endif %}{{ m.content }}{% endfor %}")
    d = target_factory(chat_template=template, chat_template_file=True).path
    tok = text.Tokenizer(str(d))
    pf = write_records(tmp_path / "p.jsonl", [{"prompt": "a"}, {"prompt": "b"}, {"messages": [
        {"role": "system", "content": "s"}, {"role": "user", "content": "c"}]}])
    why = f"{d / 'chat_template.jinja'}: cannot render the chat template (TemplateError: System role not supported)"
    with pytest.raises(UserError) as e:
        text.load_prompts(tokenizer=tok, chat=True, prompts_file=str(pf))
    assert str(e.value) == f"{pf}:3: {why}"
    with pytest.raises(UserError) as e:
        text.encode(tok, "hi", "prompt 1", chat=True, system_prompt="s")
    assert str(e.value) == f"prompt 1: {why}"


@pytest.mark.parametrize("thinking", [False, True])
def test_without_a_template_assistant_reasoning_is_handled_as_qwen3s_template_does(target_factory, thinking):
    """The hand-written format against the published template (transformers renders it): reasoning dropped
    before the last user turn, kept after it in the last turn or where there is some, a tool response not
    the last user turn; conversations that end with the user's turn (prompts) or the assistant's (training)."""
    from transformers import PreTrainedTokenizerFast

    plain = text.Tokenizer(str(target_factory(chat_template=False).path))
    hf = PreTrainedTokenizerFast(tokenizer_file=str(target_factory(chat_template=False).path / "tokenizer.json"),
                                 chat_template=QWEN3_TEMPLATE)

    def turn(role, content):
        return {"role": role, "content": content}

    thought = "<think>\nhmm\n</think>\n\nhello"
    prompts = [
        [turn("user", "hi"), turn("assistant", thought), turn("user", "more")],
        [turn("system", "s"), turn("user", "hi"), turn("assistant", "\n\nno think</think>x"), turn("system", "t"),
         turn("user", "more")],
        [turn("user", "hi"), turn("assistant", thought), turn("user", "<tool_response>r</tool_response>")],
        [turn("user", "hi"), turn("assistant", "plain"), turn("user", "<tool_response>r</tool_response>")],
    ]
    answers = [
        [turn("user", "hi"), turn("assistant", thought)],
        [turn("user", "hi"), turn("assistant", "plain"), turn("assistant", "again")],
        [turn("user", "hi"), turn("assistant", thought), turn("assistant", "again")],
        [turn("user", "a"), turn("assistant", thought), turn("user", "b"), turn("assistant", "<think>x</think>y")],
    ]
    for conv, generation in [(c, True) for c in prompts] + [(c, False) for c in answers]:
        kw = dict(add_generation_prompt=generation, enable_thinking=thinking)
        want = hf.apply_chat_template(conv, tokenize=False, **kw)
        assert plain.render_messages(conv, add_generation_prompt=generation, thinking=thinking) == want, conv
    # the reasoning of an earlier answer is dropped from a prompt, as Qwen3 drops it
    assert "hmm" not in plain.render_messages(prompts[0], add_generation_prompt=True, thinking=thinking)
    # an answer's leading newlines are kept, where the template strips them: a response trains as written
    answer = [turn("user", "hi"), turn("assistant", "\n\nplain")]
    ours = plain.render_messages(answer, add_generation_prompt=False, thinking=thinking)
    theirs = hf.apply_chat_template(answer, tokenize=False, add_generation_prompt=False, enable_thinking=thinking)
    assert ours == theirs.replace("</think>\n\nplain", "</think>\n\n\n\nplain") != theirs


def whole_output_keep(stop, ids, checked):
    """StopStrings.keep as one id a round checks it, each prefix's whole text: the slow reference."""
    for n in range(checked + 1, len(ids) + 1):
        if stop.find(stop.tokenizer.decode(ids[:n], skip_special_tokens=True)) is not None:
            return n
    return None


def byte_fallback_tokenizer():
    """Llama-2's decoder over a vocabulary of two words and the 256 byte tokens <0x00> .. <0xFF> (ids 3 ..
    258): a run of byte tokens decodes as one group, all U+FFFD where the group is not UTF-8."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders
    from tokenizers.models import BPE

    vocab = {"<unk>": 0, "\u2581a": 1, "b": 2}
    for i in range(256):
        vocab[f"<0x{i:02X}>"] = 3 + i
    tok = HFTokenizer(BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok


@pytest.mark.parametrize("stop,note", [
    ("\\n", "note: --stop '\\n': holds \\n as written, a backslash and a letter, not a newline; in bash a "
              "newline is written $'\\n'"),
    ("a\\tb", "note: --stop 'a\\tb': holds \\t as written, a backslash and a letter, not a tab; in bash a "
               "tab is written $'\\t'"),
    ("\n", None),  # a newline, as $'\n' passes it
    ("C:\\path", None),
])
def test_a_stop_string_holding_a_backslash_escape_as_written_gets_a_note(stop, note, capsys):
    """`--stop '\\n'` is a backslash and an n, which a completion seldom holds: speculate.py says so in one
    note on stderr (the run goes on: the text may be meant)."""
    import tyro

    from support import flags

    args = tyro.cli(flags.Args, args=["--target", str(REPO_ROOT / "demo" / "target"), "--prompt-ids", "1,2",
                                      "--stop", stop])
    s = flags.check_command_line(args)
    assert s.stop == (stop,)
    err = capsys.readouterr().err.splitlines()
    assert err == ([note] if note else []), err


def test_a_stop_string_after_a_long_run_of_byte_tokens_is_found():
    """A byte-fallback decoder turns a run of byte tokens cut inside a character into U+FFFD all along: a
    window that started there read none of the run's characters, and a stop string the output held was
    missed (then the ids kept disagreed with the text cut)."""
    tok = byte_fallback_tokenizer()
    chars = "中文字符测试一二三四五六七八九十百千万亿"
    ids = [3 + b for ch in chars for b in ch.encode()]
    stop = text.StopStrings(tok, ["十"])  # it reads the tokenizer's decode alone
    out = []
    for start in range(0, len(ids), 4):  # rounds of 4 ids, as the engine appends them
        before = len(out)
        out += ids[start:start + 4]
        keep = stop.keep(out, before)
        assert keep == whole_output_keep(stop, out, before), (before, len(out))
        if keep is not None:
            break
    assert tok.decode(out[:keep]).endswith("十") and not tok.decode(out[:keep - 1]).endswith("十")


@pytest.mark.parametrize("tail", [[0xC3, 0xA9, 0xC3, 0xA9, 1], [0x80, 1, 1]])
def test_a_round_of_several_ids_keeps_those_one_id_a_round_keeps(tail):
    """A byte-fallback decoder's text can lose a stop string at a later id: " aé" holds "é", " aé" and the
    first byte of the next character, or a stray byte, decode as " a" and U+FFFDs. A round that accepts
    several ids keeps up to the id completing it, as a decode of one id a round does, and finds it."""
    tok = byte_fallback_tokenizer()
    ids = [1, 3 + 0xC3, 3 + 0xA9] + [3 + b for b in tail]
    stop = text.StopStrings(tok, ["é"])
    one_a_round = next(n for n in range(1, len(ids) + 1) if stop.keep(ids[:n], n - 1))
    assert one_a_round == 3
    assert stop.keep(ids, 0) == 3
    assert stop.keep(ids, 1) == 3


def test_stop_strings_in_a_window_are_found_as_in_the_whole_output(target_factory):
    """keep decodes a window at the output's end: on random outputs (bytes cut inside characters, special
    tokens, words joined by a decoder, Metaspace's leading space) and random stop strings, growing as the
    engine grows them, it keeps exactly what a search of the whole output keeps."""
    import random

    from conftest import REPO_ROOT
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders
    from tokenizers.models import WordLevel

    class Tok:
        def __init__(self, tok):
            self.tok = tok

        def decode(self, ids, skip_special_tokens=False):
            return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    pieces = ["<unk>", "\u2581a", "b", "\u2581cd", "\u2581", "e"]
    metaspace = HFTokenizer(WordLevel({w: i for i, w in enumerate(pieces)}, unk_token="<unk>"))
    metaspace.decoder = decoders.Metaspace()
    fallback = byte_fallback_tokenizer()
    tokenizers = [Tok(text.Tokenizer(str(REPO_ROOT / "demo" / "target")).tok), Tok(metaspace),
                  Tok(text.Tokenizer(str(target_factory(chat_template=False).path)).tok), Tok(fallback)]
    rng = random.Random(0)
    hits = 0
    for trial in range(300):
        tok = tokenizers[trial % len(tokenizers)]
        vocab = tok.tok.get_vocab_size(with_added_tokens=True)
        low = min(vocab, 300)  # byte-level BPE's single bytes, and the added tokens after them

        def draw():
            return rng.randrange(low) if rng.random() < 0.5 else rng.randrange(vocab)

        sample = tok.decode([draw() for _ in range(40)], skip_special_tokens=True)
        strings = []
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(max(1, len(sample)))
            strings.append(sample[i:i + rng.randint(1, 12)] or "x")
        stop = text.StopStrings(tok, strings)
        out = []
        for _ in range(rng.randint(1, 100)):  # rounds
            before = len(out)
            out += [draw() for _ in range(rng.randint(1, 6))]
            keep = stop.keep(out, before)
            assert keep == whole_output_keep(stop, out, before), (trial, strings, out, before)
            if keep is not None:
                hits += 1
                break
    assert hits > 100


def test_a_stop_check_decodes_the_outputs_end_not_all_of_it():
    """A round's stop check decodes the new ids and a window before them, whatever the output's length
    (the whole output every round made a long request's checks grow with its square). A window whose
    start decodes as U+FFFD reaches further back (`test_a_stop_string_after_a_long_run_of_byte_tokens_is_found`),
    so these ids are whole characters."""
    from conftest import REPO_ROOT

    tok = text.Tokenizer(str(REPO_ROOT / "demo" / "target"))
    decoded = []
    decode = tok.decode
    tok.decode = lambda ids, skip_special_tokens=False: decoded.append(len(ids)) or decode(ids, skip_special_tokens)
    stop = text.StopStrings(tok, ["ZZQXZZQX"])
    out = []
    for i in range(1000):
        before = len(out)
        out += [300 + (7 * i + j) % 3000 for j in range(4)]  # merged tokens: whole characters
        assert stop.keep(out, before) is None
    assert len(out) == 4000 and max(decoded) <= 2 * 8 + stop.SLACK + 4, max(decoded)


def test_a_stop_check_after_a_round_ending_inside_a_character_decodes_the_outputs_end():
    """Chinese text in byte-level BPE (the demo's, Qwen3's kind) is 3 byte tokens a character, so most rounds
    end inside one, and the checked text ends in U+FFFD whatever window is decoded: only a U+FFFD at the
    window's start says it was cut, else every such round decoded the whole output again."""
    from conftest import REPO_ROOT

    tok = text.Tokenizer(str(REPO_ROOT / "demo" / "target"))
    ids = tok.encode("这是一个测试，你好世界。" * 200)[:4000]
    assert tok.decode(ids[:4]).endswith("\ufffd")  # a character is split across ids
    decoded = []
    decode = tok.decode
    tok.decode = lambda ids, skip_special_tokens=False: decoded.append(len(ids)) or decode(ids, skip_special_tokens)
    stop = text.StopStrings(tok, ["ZZQXZZQX"])
    out = []
    for i in range(0, len(ids), 4):
        before = len(out)
        out += ids[i:i + 4]
        assert stop.keep(out, before) is None
    assert len(out) == 4000 and max(decoded) <= 8 * (2 * 8 + stop.SLACK), max(decoded)


def test_a_null_key_in_a_prompts_file_record_counts_as_absent(tmp_path):
    """A table's JSON-lines export (pandas, datasets) writes every column on every row, null where a row
    has none: a null prompt key is not a second prompt, a null setting is not a setting; a record whose
    every prompt key is null gives none."""
    from support.cli import UserError

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hello", "prompt_ids": null, "messages": null, "turns": null}\n'
                    '{"prompt": null, "prompt_ids": [5, 6], "temperature": null, "system": null}\n')
    assert [p for _, p in text.read_prompts_file(str(path))] == ["hello", [5, 6]]
    path.write_text('{"prompt": null, "messages": null}\n')
    with pytest.raises(UserError, match=r"p.jsonl:1: 'prompt' must be a string, got null$"):
        text.read_prompts_file(str(path))


def test_a_template_with_a_byte_order_mark_is_refused_only_when_a_chat_is_rendered(target_factory, tmp_path):
    """A BOM in chat_template.jinja would be rendered into every prompt: refused in one line naming the file
    where a chat is rendered, as any unusable template is; --no-chat and token ids never read it."""

    d = copy_target(target_factory(chat_template_file=True).path, tmp_path / "target")
    jinja = d / "chat_template.jinja"
    jinja.write_text("\ufeff" + jinja.read_text(encoding="utf-8"), encoding="utf-8")
    tok = text.Tokenizer(str(d))
    assert text.auto_chat(None, tok) is True  # a template it names, unusable: chat stays on, and says why
    assert text.encode(tok, "hello", "p", chat=False) == tok.encode("hello")
    with pytest.raises(text.UserError, match=re.escape(f"p: {jinja}: starts with a byte-order mark")):
        text.encode(tok, "hello", "p", chat=True)


def test_a_template_that_is_not_utf8_is_refused_only_when_a_chat_is_rendered(target_factory, tmp_path):
    """A chat_template.jinja that is not UTF-8 is refused in one line naming the file where a chat is
    rendered, as a BOM is; --no-chat and token ids never read it."""
    d = copy_target(target_factory(chat_template_file=True).path, tmp_path / "target")
    jinja = d / "chat_template.jinja"
    jinja.write_bytes(b"\xe9" + jinja.read_bytes())
    tok = text.Tokenizer(str(d))
    assert text.auto_chat(None, tok) is True
    assert text.encode(tok, "hello", "p", chat=False) == tok.encode("hello")
    with pytest.raises(text.UserError, match=re.escape(f"p: {jinja}: not UTF-8 text")):
        text.encode(tok, "hello", "p", chat=True)


def test_a_template_sees_what_transformers_passes_it(target_factory, tmp_path):
    """transformers renders a chat template with tools and documents set to None and every special token
    of tokenizer_config.json (sep, cls and mask too): a template that tests them renders as there."""
    from transformers import AutoTokenizer

    template = ("{% if tools is not none %}T{% endif %}{% if documents is not none %}D{% endif %}"
                "{% if tools is defined %}t{% endif %}{% if documents is defined %}d{% endif %}"
                "[{{ bos_token }}|{{ eos_token }}|{{ sep_token }}|{{ cls_token }}|{{ mask_token }}]"
                "{{ messages[0].content }}")
    d = copy_target(target_factory(chat_template=template).path, tmp_path / "target")
    edit_json(d / "tokenizer_config.json", lambda c: c.update(sep_token="<|im_end|>", cls_token="<|im_start|>",
                                                              mask_token="<|endoftext|>"))
    conv = [{"role": "user", "content": "hello"}]
    ours = text.Tokenizer(str(d)).render_messages(conv, add_generation_prompt=True)
    theirs = AutoTokenizer.from_pretrained(str(d)).apply_chat_template(conv, tokenize=False,
                                                                      add_generation_prompt=True)
    assert ours == theirs
    assert ours.startswith("td[") and "|<|im_end|>|<|im_start|>|<|endoftext|>]hello" in ours, ours


def test_a_record_choosing_tools_automatically_among_none_is_taken(tmp_path):
    """OpenAI's request logs carry "tool_choice": "auto" beside "tools": [] or null: a choice among no tools
    asks for nothing, so the record is taken; with tools it is refused, as tools are."""
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "tool_choice": "auto", "tools": []}\n'
                    '{"prompt": "b", "tool_choice": "auto", "tools": null}\n'
                    '{"prompt": "c", "tool_choice": "auto"}\n')
    assert [p for _, p in text.read_prompts_file(str(path))] == ["a", "b", "c"]
    path.write_text('{"prompt": "a", "tool_choice": "auto", "tools": [{"type": "function"}]}\n')
    with pytest.raises(UserError, match=r"p.jsonl:1: tools \[\{\"type\": \"function\"\}\] is not applied here"):
        text.read_prompts_file(str(path))
