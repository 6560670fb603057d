"""Bad inputs as a corpus: every one exits 2 with exactly one stderr line naming the culprit, and
every input file is byte-identical afterwards (hashed before and after).

Each case names a program (speculate, eval, bench, concurrency = scripts/bench_concurrency.py, train),
its arguments (built from a small world of files: a tiny target with tokenizer and chat template,
a drafter, prompts, a dataset directory, a calibration file; cases that need a broken file make
their own copy) and a needle the error line must contain. All cases run in-process through the
program's `main()`; the ones marked `sub` also run as real subprocesses (a real exit status, real
stderr, and whatever a library prints outside pytest's capture): each program, and each kind of input a
library reads as the process starts or loads (argument bytes, the hub, devices, weights, tokenizer,
template). A process costs seconds (torch's import), so the others run in-process only.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO_ROOT, edit_config, edit_tensors, make_target_dir
from drafters import make_drafter

sys.path.insert(0, str(REPO_ROOT / "scripts"))

import bench  # noqa: E402
import bench_concurrency  # noqa: E402

import eval as ev  # noqa: E402
import speculate  # noqa: E402
import train  # noqa: E402
from support import text  # noqa: E402

PROGRAMS = {"speculate": (speculate.main, "speculate.py"), "eval": (ev.main, "eval.py"),
            "bench": (bench.main, "scripts/bench.py"), "concurrency": (bench_concurrency.main, "scripts/bench_concurrency.py"),
            "train": (train.main, "train.py")}
K = 4


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    w = tmp_path_factory.mktemp("world")
    make_target_dir(w / "target", vocab_size=64, max_position_embeddings=128)
    make_drafter(w / "drafter", str(w / "target"), block_size=K, oracle=True)
    (w / "prompts.jsonl").write_text(json.dumps({"prompt_ids": [1, 2, 3]}) + "\n")
    (w / "data").mkdir()
    (w / "data" / "gsm8k.jsonl").write_text(json.dumps({"turns": ["hello world"]}) + "\n")
    (w / "cal.json").write_text(json.dumps({"temperatures": [1.0] * K}))
    (w / "corpus.txt").write_text("hello world . " * 200)
    assert train.main([str(a) for a in T(w, w) + ["--out", w / "trained"]]) == 0  # a run to resume, broken below
    return w


def hashes(root: Path) -> dict:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


# ----------------------------------------------------------------------------------------
# Broken copies of the world's files (each case makes its own, in its own folder)

def target_with(w, tmp, edit=None, tensors=None, files=None):
    """A copy of the target with config.json edited (`edit(cfg)`), tensors replaced, or files written."""
    t = tmp / "target"
    shutil.copytree(w / "target", t)
    if edit is not None:
        edit_config(t, edit)
    if tensors is not None:
        from safetensors.torch import load_file, save_file
        ts = load_file(str(t / "model.safetensors"))
        tensors(ts)
        save_file(ts, str(t / "model.safetensors"))
    for name, content in (files or {}).items():
        (t / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    return str(t)


def folder_for(directory, name):
    """The checkpoint `directory` with a folder where its file `name` was (or would be)."""
    path = Path(directory) / name
    if path.is_file():
        path.unlink()
    path.mkdir()
    return str(directory)


def duplicated_key(w, key):
    """The target's config.json text with `key` given a second time (first)."""
    text = (w / "target" / "config.json").read_text()
    return text.replace("{", f'{{"{key}": 7, ', 1)


def drafter_with(w, tmp, edit=None, tensors=None):
    """A copy of the drafter with config.json edited (`edit(cfg)`) or tensors replaced (`tensors(ts)`)."""
    d = tmp / "drafter"
    shutil.copytree(w / "drafter", d)
    if edit is not None:
        edit_config(d, edit)
    if tensors is not None:
        edit_tensors(d, tensors)
    return str(d)


def sharded(w, tmp, edit_index=None, files=None):
    """The target split into two shards with model.safetensors.index.json; `edit_index(weight_map)` then
    breaks the index (or `files` adds files, e.g. a stray shard)."""
    from safetensors.torch import load_file, save_file
    t = Path(target_with(w, tmp))
    ts = load_file(str(t / "model.safetensors"))
    os.remove(t / "model.safetensors")
    keys = sorted(ts)
    weight_map = {}
    for i, part in enumerate((keys[:len(keys) // 2], keys[len(keys) // 2:])):
        save_file({k: ts[k] for k in part}, str(t / f"model-{i + 1:05d}-of-00002.safetensors"))
        weight_map.update({k: f"model-{i + 1:05d}-of-00002.safetensors" for k in part})
    if edit_index is not None:
        edit_index(weight_map)
    (t / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for name, tensors in (files or {}).items():
        save_file(tensors, str(t / name))
    return str(t)


def first(weight_map, shard):  # a tensor the index maps to shard 1 or 2
    return sorted(k for k, f in weight_map.items() if f.startswith(f"model-0000{shard}"))[0]


def raw_config(w, tmp, text):
    """A target whose config.json is the given text (not necessarily JSON we would write)."""
    return target_with(w, tmp, files={"config.json": text})


def template(text):
    return lambda w, tmp: target_with(w, tmp, files={"chat_template.jinja": text})


def P(target, text="hi"):  # a text prompt (rendered with the chat template) and a budget that fits
    return ["--target", target, "--prompt", text, "--max-new-tokens", "2"]


def prompts_file(tmp, text, name="p.jsonl"):
    p = tmp / name
    p.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
    return str(p)


def nested(depth):
    return "[" * depth + "]" * depth


# ----------------------------------------------------------------------------------------
# The corpus: (id, program, args(w, tmp) -> list, needle, sub)

def S(w):  # speculate with the world's models and a prompt
    return ["--target", w / "target", "--drafter", w / "drafter", "--prompt-ids", "1,2,3", "--max-new-tokens", "4"]


def E(w):  # eval with the world's models and data
    return ["--target", w / "target", "--drafter", w / "drafter", "--data-dir", w / "data", "--datasets", "gsm8k",
            "--max-new-tokens", "4", "--no-progress"]


def T(w, tmp):  # train with the world's target and corpus
    return ["--target", w / "target", "--data", w / "corpus.txt", "--out", tmp / "out", "--steps", "2",
            "--seq-len", "16", "--batch-size", "1", "--block-size", "2", "--depth", "1", "--markov-rank", "8",
            "--no-progress"]


def nan_rope(cfg):
    cfg["rope_parameters"]["rope_theta"] = float("nan")


CASES = [
    # ---- speculate.py: flags
    ("max-new-0", "speculate", lambda w, t: S(w)[:-1] + ["0"], "--max-new-tokens: invalid value 0", True),
    ("max-new-neg", "speculate", lambda w, t: S(w)[:-1] + ["-5"], "--max-new-tokens", False),
    ("num-samples-0", "speculate", lambda w, t: S(w) + ["--num-samples", "0"], "--num-samples", False),
    ("num-samples-huge", "speculate", lambda w, t: S(w) + ["--num-samples", "1000000000"], "--num-samples", False),
    ("batch-0", "speculate", lambda w, t: S(w) + ["--batch-size", "0"], "--batch-size", False),
    ("temp-neg", "speculate", lambda w, t: S(w) + ["--temperature", "-1"], "--temperature", False),
    ("temp-nan", "speculate", lambda w, t: S(w) + ["--temperature", "nan"], "--temperature: invalid value nan", True),
    ("temp-inf", "speculate", lambda w, t: S(w) + ["--temperature", "inf"], "--temperature", False),
    ("temp-tiny", "speculate", lambda w, t: S(w) + ["--temperature", "1e-40"], "--temperature", False),
    ("top-k-neg", "speculate", lambda w, t: S(w) + ["--top-k", "-1"], "--top-k: invalid value -1", False),
    ("top-p-0", "speculate", lambda w, t: S(w) + ["--top-p", "0"], "--top-p: invalid value 0", False),
    ("top-p-big", "speculate", lambda w, t: S(w) + ["--top-p", "1.01"], "--top-p", False),
    ("min-p-big", "speculate", lambda w, t: S(w) + ["--min-p", "2"], "--min-p", False),
    ("min-p-nan", "speculate", lambda w, t: S(w) + ["--min-p", "nan"], "--min-p", False),
    ("stop-empty", "speculate", lambda w, t: S(w) + ["--stop", ""], "--stop: an empty stop string", False),
    ("stop-fffd", "speculate", lambda w, t: S(w) + ["--stop", "a\ufffd"], "holds U+FFFD", False),
    ("threads-0", "speculate", lambda w, t: S(w) + ["--threads", "0"], "--threads: invalid value 0", False),
    ("gen-config-top-p", "speculate", lambda w, t: ["--target", target_with(w, t, files={"generation_config.json":
     json.dumps({"do_sample": True, "top_p": 7})}), "--prompt-ids", "1", "--max-new-tokens", "2"],
     "generation_config.json: key 'top_p'", False),
    ("gen-config-do-sample", "speculate", lambda w, t: ["--target", target_with(w, t, files={"generation_config.json":
     json.dumps({"do_sample": "yes"})}), "--prompt-ids", "1", "--max-new-tokens", "2"],
     "generation_config.json: key 'do_sample'", False),
    ("output-is-prompts", "speculate", lambda w, t: ["--target", w / "target", "--prompts-file", w / "prompts.jsonl",
     "--max-new-tokens", "2", "--output-file", w / "prompts.jsonl"], "input of this run", False),
    ("output-is-trace", "speculate", lambda w, t: S(w) + ["--trace-file", t / "x.jsonl", "--output-file", t / "x.jsonl"],
     "--output-file", False),
    ("threshold-big", "speculate", lambda w, t: S(w) + ["--confidence-threshold", "1.5"], "--confidence-threshold", False),
    ("threshold-nan", "speculate", lambda w, t: S(w) + ["--confidence-threshold", "nan"], "--confidence-threshold", False),
    ("seed-neg", "speculate", lambda w, t: S(w) + ["--seed", "-1"], "--seed", False),
    ("seed-huge", "speculate", lambda w, t: S(w) + ["--seed", "99999999999999999999"], "--seed", False),
    # ---- speculate.py: prompts
    ("ids-empty-field", "speculate", lambda w, t: S(w)[:5] + ["5,,6"] + S(w)[6:], "--prompt-ids", False),
    ("ids-arabic-digits", "speculate", lambda w, t: S(w)[:5] + ["١,٢"] + S(w)[6:], "--prompt-ids", False),
    ("ids-letters", "speculate", lambda w, t: S(w)[:5] + ["1,x"] + S(w)[6:], "--prompt-ids", False),
    ("ids-5000-digits", "speculate", lambda w, t: S(w)[:5] + ["5" * 5000] + S(w)[6:], "too large", False),
    ("ids-outside-vocab", "speculate", lambda w, t: S(w)[:5] + ["1,99999"] + S(w)[6:], "outside the vocabulary", False),
    ("ids-negative", "speculate", lambda w, t: S(w)[:5] + ["-3"] + S(w)[6:], "outside the vocabulary", False),
    ("ids-trailing-comma", "speculate", lambda w, t: S(w)[:5] + ["1,2,"] + S(w)[6:], "--prompt-ids", False),
    ("two-prompt-flags", "speculate", lambda w, t: S(w) + ["--prompt", "hello"], "exactly one", True),
    ("no-prompt", "speculate", lambda w, t: S(w)[:4] + S(w)[6:], "exactly one", False),
    ("prompts-missing", "speculate", lambda w, t: S(w)[:4] + ["--prompts-file", t / "none.jsonl"] + S(w)[6:],
     "none.jsonl: prompts file not found", False),
    ("requests-over-the-limit", "speculate", lambda w, t: S(w)[:4] + ["--prompts-file", prompts_file(
        t, '{"prompt_ids": [1]}\n{"prompt_ids": [2]}\n')] + S(w)[6:] + ["--num-samples", "5000001"],
     "2 prompts x 5000001 samples is more than 10,000,000 requests", False),
    ("draft-length-block-drafter", "speculate", lambda w, t: S(w) + ["--draft-length", "3"],
     "--draft-length 3: only an Eagle3 drafter's chain length is chosen; a block drafter drafts its block", False),
    ("prompts-a-directory", "speculate", lambda w, t: S(w)[:4] + ["--prompts-file", t] + S(w)[6:],
     "is a directory, not a file", False),
    ("prompts-bad-json", "speculate", lambda w, t: S(w)[:4] + ["--prompts-file", prompts_file(t, '{"prompt": \n')]
     + S(w)[6:], "p.jsonl:1: malformed JSON", False),
    ("prompts-not-utf8", "speculate", lambda w, t: S(w)[:4] + ["--prompts-file", prompts_file(t, b'{"prompt": "\xff"}\n')]
     + S(w)[6:], "not UTF-8", False),
    ("prompts-two-kinds", "speculate", lambda w, t: S(w)[:4] + ["--prompts-file", prompts_file(
        t, json.dumps({"prompt": "hi", "prompt_ids": [1]}) + "\n")] + S(w)[6:], "prompt and prompt_ids", False),
    ("prompts-float-id", "speculate", lambda w, t: S(w)[:4] + ["--prompts-file", prompts_file(
        t, '{"prompt_ids": [1, 2.5]}\n')] + S(w)[6:], "'prompt_ids' must be a list of integers", False),
    ("prompts-5000-digit-id", "speculate", lambda w, t: S(w)[:4] + ["--prompts-file", prompts_file(
        t, '{"prompt_ids": [' + "7" * 5000 + ']}\n')] + S(w)[6:], "malformed JSON", False),
    ("prompts-empty", "speculate", lambda w, t: S(w)[:4] + ["--prompts-file", prompts_file(t, "\n\n")] + S(w)[6:],
     "no prompts", False),
    ("prompts-surrogate", "speculate", lambda w, t: S(w)[:4] + ["--prompts-file", prompts_file(
        t, '{"prompt": "a\\ud800b"}\n')] + S(w)[6:], "not valid Unicode", True),
    ("prompts-nested", "speculate", lambda w, t: S(w)[:4] + ["--prompts-file", prompts_file(
        t, '{"prompt": ' + nested(100000) + '}\n')] + S(w)[6:], "malformed JSON", False),
    ("prompts-list-record", "speculate", lambda w, t: S(w)[:4] + ["--prompts-file", prompts_file(t, "[1, 2]\n")]
     + S(w)[6:], "a JSON array, not a record: write one record per line (JSON lines)", False),
    ("prompts-empty-turns", "speculate", lambda w, t: S(w)[:4] + ["--prompts-file", prompts_file(
        t, '{"turns": []}\n')] + S(w)[6:], "'turns' must be a non-empty list of strings, got []", False),
    ("prompt-too-long", "speculate", lambda w, t: S(w)[:4] + ["--prompt", "hello " * 100000] + S(w)[6:],
     "longer than", False),
    ("prompt-ids-too-long", "speculate", lambda w, t: S(w)[:5] + [",".join(["5"] * 200)] + S(w)[6:],
     "exceed", False),
    ("budget-beyond-context", "speculate", lambda w, t: S(w)[:-1] + ["100000"], "exceed", False),
    # ---- speculate.py: outputs
    ("trace-empty", "speculate", lambda w, t: S(w) + ["--trace-file", ""], "--trace-file: empty path", False),
    ("trace-is-prompts", "speculate", lambda w, t: S(w)[:4] + ["--prompts-file", w / "prompts.jsonl"] + S(w)[6:]
     + ["--trace-file", w / "prompts.jsonl"], "input of this run", False),
    ("trace-is-config", "speculate", lambda w, t: S(w) + ["--trace-file", w / "target" / "config.json"],
     "input directory", False),
    ("trace-is-weights", "speculate", lambda w, t: S(w) + ["--trace-file", w / "drafter" / "model.safetensors"],
     "input directory", False),
    ("trace-is-calibration", "speculate", lambda w, t: S(w) + ["--confidence-threshold", "0.5", "--calibration",
                                                              w / "cal.json", "--trace-file", w / "cal.json"],
     "input of this run", False),
    ("trace-dev-full", "speculate", lambda w, t: S(w) + ["--trace-file", "/dev/full"],
     "is a device or a pipe, not a file", True),
    ("trace-directory", "speculate", lambda w, t: S(w) + ["--trace-file", t], "is a directory", False),
    ("trace-missing-folder", "speculate", lambda w, t: S(w) + ["--trace-file", t / "no" / "t.jsonl"],
     "does not exist", False),
    ("trace-symlink-to-input", "speculate", lambda w, t: S(w)[:4] + ["--prompts-file", w / "prompts.jsonl"] + S(w)[6:]
     + ["--trace-file", link(t, w / "prompts.jsonl")], "input of this run", False),
    ("sps-same-as-trace", "speculate", lambda w, t: S(w) + ["--scheduler", "hardware", "--sps-table", t / "x.json",
                                                           "--trace-file", t / "x.json"], "also", False),
    # ---- speculate.py: the target
    ("target-missing", "speculate", lambda w, t: ["--target", t / "nope", "--prompt-ids", "1"], "not found", True),
    ("target-is-file", "speculate", lambda w, t: ["--target", w / "cal.json", "--prompt-ids", "1"],
     "cal.json: is a file, not a directory", False),
    ("rope-nan", "speculate", lambda w, t: ["--target", target_with(w, t, nan_rope), "--prompt-ids", "1"],
     "rope_theta", False),
    ("rope-inf", "speculate", lambda w, t: ["--target", target_with(
        w, t, lambda c: c["rope_parameters"].update(rope_theta=float("inf"))), "--prompt-ids", "1"], "rope_theta", False),
    ("rope-tiny", "speculate", lambda w, t: ["--target", target_with(
        w, t, lambda c: c["rope_parameters"].update(rope_theta=1e-300)), "--prompt-ids", "1"], "rope_theta", False),
    ("eps-nan", "speculate", lambda w, t: ["--target", target_with(w, t, lambda c: c.update(rms_norm_eps=float("nan"))),
                                          "--prompt-ids", "1"], "rms_norm_eps", False),
    ("eps-negative", "speculate", lambda w, t: ["--target", target_with(w, t, lambda c: c.update(rms_norm_eps=-1)),
                                               "--prompt-ids", "1"], "rms_norm_eps", False),
    ("layers-billion", "speculate", lambda w, t: ["--target", target_with(
        w, t, lambda c: c.update(num_hidden_layers=1_000_000_000)), "--prompt-ids", "1"], "num_hidden_layers", False),
    ("vocab-zero", "speculate", lambda w, t: ["--target", target_with(w, t, lambda c: c.update(vocab_size=0)),
                                             "--prompt-ids", "1"], "vocab_size", False),
    ("hidden-string", "speculate", lambda w, t: ["--target", target_with(w, t, lambda c: c.update(hidden_size="32")),
                                                "--prompt-ids", "1"], "hidden_size", False),
    ("heads-float", "speculate", lambda w, t: ["--target", target_with(
        w, t, lambda c: c.update(num_attention_heads=4.0)), "--prompt-ids", "1"], "num_attention_heads", False),
    ("eos-outside-vocab", "speculate", lambda w, t: ["--target", target_with(
        w, t, lambda c: c.update(eos_token_id=10**9)), "--prompt-ids", "1"], "eos_token_id", False),
    ("gen-temperature-tiny", "speculate", lambda w, t: ["--target", target_with(
        w, t, files={"generation_config.json": json.dumps({"do_sample": True, "temperature": 1e-38})}),
        "--prompt-ids", "1"], "generation_config.json: key 'temperature' must be a number in [0.0001, 10000]", False),
    ("gen-top-k-huge", "speculate", lambda w, t: ["--target", target_with(
        w, t, files={"generation_config.json": json.dumps({"do_sample": True, "top_k": 1e300})}),
        "--prompt-ids", "1"], "key 'top_k' must be an integer from -1 to 1073741824", False),
    ("template-list-no-default", "speculate", lambda w, t: P(target_with(w, t, files={
        "tokenizer_config.json": json.dumps({"chat_template": [{"name": "tool_use", "template": "{{ 1 }}"}]})})),
     "tokenizer_config.json: 'chat_template' names no 'default' template with a text (it has 'tool_use')", False),
    ("template-not-a-string", "speculate", lambda w, t: P(target_with(w, t, files={
        "tokenizer_config.json": json.dumps({"chat_template": 5})})),
     "tokenizer_config.json: 'chat_template' must be a string, got int", False),
    ("template-list-default-null", "speculate", lambda w, t: P(target_with(w, t, files={
        "tokenizer_config.json": json.dumps({"chat_template": [{"name": "default", "template": None}]})})),
     "names no 'default' template with a text", False),
    ("template-renders-nothing", "speculate", lambda w, t: P(template("{# nothing #}")(w, t)),
     "chat_template.jinja: the chat template renders this conversation as nothing", False),
    ("stop-special-token", "speculate", lambda w, t: P(w / "target") + ["--stop", "<|im_start|>"],
     "--stop '<|im_start|>': holds the special token '<|im_start|>'", False),
    ("stop-holds-special-token", "speculate", lambda w, t: P(w / "target") + ["--stop", "<|im_end|>\n"],
     "holds the special token '<|im_end|>'", False),
    ("template-star-width", "speculate", lambda w, t: P(template("{{ '%*s' % (50000000, 'x') }}")(w, t)),
     "a format width is too large", False),
    ("template-nested-format-width", "speculate", lambda w, t: P(template("{{ '{:{}}'.format('x', 50000000) }}")(
        w, t)), "a format width is too large", False),
    ("template-center-keyword", "speculate", lambda w, t: P(template("{{ 'x' | center(width=50000000) }}")(w, t)),
     "a width is too large", False),
    ("template-list-not-objects", "speculate", lambda w, t: P(target_with(w, t, files={
        "tokenizer_config.json": json.dumps({"chat_template": [1, 2]})})), "as a list must hold", False),
    ("gen-eos-negative", "speculate", lambda w, t: ["--target", target_with(
        w, t, files={"generation_config.json": json.dumps({"eos_token_id": [-1]})}), "--prompt-ids", "1"],
     "generation_config.json", False),
    ("config-nested", "speculate", lambda w, t: ["--target", raw_config(w, t, nested(100000)), "--prompt-ids", "1"],
     "config.json: malformed JSON", False),
    ("config-list", "speculate", lambda w, t: ["--target", raw_config(w, t, "[1, 2]"), "--prompt-ids", "1"],
     "expected a JSON object", False),
    ("config-not-utf8", "speculate", lambda w, t: ["--target", raw_config(w, t, '{"a": "\xff"}'.encode("latin-1")),
                                                  "--prompt-ids", "1"], "config.json", False),
    ("config-no-rope", "speculate", lambda w, t: ["--target", target_with(w, t, lambda c: c.pop("rope_parameters")),
                                                 "--prompt-ids", "1"], "rope_theta", False),
    ("weights-int", "speculate", lambda w, t: ["--target", target_with(
        w, t, tensors=lambda ts: ts.update({"model.norm.weight": ts["model.norm.weight"].long()})), "--prompt-ids", "1"],
     "not a floating-point weight", False),
    ("weights-bool", "speculate", lambda w, t: ["--target", target_with(
        w, t, tensors=lambda ts: ts.update({"model.norm.weight": ts["model.norm.weight"] > 0})), "--prompt-ids", "1"],
     "not a floating-point weight", False),
    ("weights-nan", "speculate", lambda w, t: ["--target", target_with(
        w, t, tensors=lambda ts: ts["model.norm.weight"].fill_(float("nan"))), "--prompt-ids", "1"],
     "NaN or infinite", True),
    ("weights-inf", "speculate", lambda w, t: ["--target", target_with(
        w, t, tensors=lambda ts: ts["lm_head.weight"].__setitem__((0, 0), float("inf"))), "--prompt-ids", "1"],
     "NaN or infinite", False),
    ("shard-index-ints", "speculate", lambda w, t: ["--target", sharded_bad_index(w, t), "--prompt-ids", "1"],
     "weight_map", False),
    ("shard-index-names-absent", "speculate", lambda w, t: ["--target", sharded(
        w, t, lambda m: m.update({"model.extra.weight": "model-00001-of-00002.safetensors"})), "--prompt-ids", "1"],
     "model.safetensors.index.json: maps tensor 'model.extra.weight' to 'model-00001-of-00002.safetensors', which "
     "does not hold it", False),
    ("shard-index-omits", "speculate", lambda w, t: ["--target", sharded(
        w, t, lambda m: m.pop(first(m, 2))), "--prompt-ids", "1"], "model.safetensors.index.json does not list it", True),
    ("shard-index-wrong-shard", "speculate", lambda w, t: ["--target", sharded(
        w, t, lambda m: m.update({first(m, 1): "model-00002-of-00002.safetensors"})), "--prompt-ids", "1"],
     "maps it to 'model-00002-of-00002.safetensors'", False),
    ("shard-stray-file", "speculate", lambda w, t: ["--target", sharded(
        w, t, files={"model-00003-of-00003.safetensors": {"model.extra": torch.zeros(2)}}),
        "--prompt-ids", "1"], "model-00003-of-00003.safetensors: a weight file that", False),
    ("shard-index-and-single", "speculate", lambda w, t: ["--target", sharded(
        w, t, files={"model.safetensors": {"model.norm.weight": torch.ones(32)}}), "--prompt-ids", "1"],
     "both model.safetensors and model.safetensors.index.json", False),
    ("weights-fp8", "speculate", lambda w, t: ["--target", target_with(
        w, t, tensors=lambda ts: ts.update({"model.norm.weight": ts["model.norm.weight"].to(torch.float8_e4m3fn)})),
        "--prompt-ids", "1"], "'model.norm.weight' is float8_e4m3fn, a quantized format", True),
    ("config-quantized", "speculate", lambda w, t: ["--target", target_with(
        w, t, lambda c: c.update(quantization_config={"quant_method": "fp8"})), "--prompt-ids", "1"],
     "quantization_config ('fp8')", False),
    ("weights-overflow-fp16", "speculate", lambda w, t: ["--target", target_with(
        w, t, tensors=lambda ts: ts["lm_head.weight"].__setitem__((0, 0), 1e6)), "--prompt-ids", "1", "--dtype", "float16"],
     "tensor 'lm_head.weight' overflows float16", False),
    ("config-head-dim-odd", "speculate", lambda w, t: ["--target", target_with(
        w, t, lambda c: c.update(head_dim=15)), "--prompt-ids", "1"], "head_dim must be even", False),
    ("config-rope-type-hidden", "speculate", lambda w, t: ["--target", target_with(
        w, t, lambda c: c.update(rope_scaling={"rope_type": None, "type": "yarn", "factor": 4.0})), "--prompt-ids", "1"],
     "rope_scaling type 'yarn' is not supported", False),
    ("config-rope-factor-no-type", "speculate", lambda w, t: ["--target", target_with(
        w, t, lambda c: c.update(rope_scaling={"factor": 4.0})), "--prompt-ids", "1"],
     "rope_scaling has a 'factor' of 4.0 and no 'rope_type'", False),
    ("config-rope-per-layer-type", "speculate", lambda w, t: ["--target", target_with(
        w, t, lambda c: c.update(rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 4.0,
                                                                     "rope_theta": 10000.0}})),
        "--prompt-ids", "1"],
     "rope_parameters keyed by layer type ('full_attention') is not supported", False),
    ("config-model-type", "speculate", lambda w, t: ["--target", target_with(
        w, t, lambda c: c.update(model_type="llama")), "--prompt-ids", "1"], "model_type 'llama'", False),
    ("config-rope-theta-two-values", "speculate", lambda w, t: ["--target", target_with(
        w, t, lambda c: c.update(rope_theta=5.0)), "--prompt-ids", "1"], "conflicting values for 'rope_theta'", False),
    ("config-sliding-window-string", "speculate", lambda w, t: ["--target", target_with(
        w, t, lambda c: c.update(use_sliding_window="false")), "--prompt-ids", "1"],
     "key 'use_sliding_window' must be true or false, got 'false'", False),
    ("config-sliding-window-zero", "speculate", lambda w, t: ["--target", target_with(
        w, t, lambda c: c.update(use_sliding_window=0)), "--prompt-ids", "1"],
     "key 'use_sliding_window' must be true or false, got 0", False),
    ("drafter-markov-rank-without-head", "speculate", lambda w, t: S(w)[:2] + ["--drafter", drafter_with(
        w, t, lambda c: (c.pop("markov_head_type"), c.update(enable_confidence_head=False, markov_rank=8)),
        lambda ts: [ts.pop(k) for k in list(ts) if k.startswith(("markov_head.", "confidence_head."))])] + S(w)[4:],
     "markov_rank is 8", False),
    # a head key's type is checked with the head absent too (DeepSpec writes booleans, and a rank of 0)
    ("drafter-with-markov-string-no-heads", "speculate", lambda w, t: S(w)[:2] + ["--drafter", drafter_with(
        w, t, lambda c: (c.pop("markov_head_type"), c.update(enable_confidence_head=False, markov_rank=0,
                                                            confidence_head_with_markov="yes")),
        lambda ts: [ts.pop(k) for k in list(ts) if k.startswith(("markov_head.", "confidence_head."))])] + S(w)[4:], "'confidence_head_with_markov' must be true or false", False),
    ("drafter-markov-rank-false-no-heads", "speculate", lambda w, t: S(w)[:2] + ["--drafter", drafter_with(
        w, t, lambda c: (c.pop("markov_head_type"), c.pop("confidence_head_with_markov"),
                         c.update(enable_confidence_head=False, markov_rank=False)),
        lambda ts: [ts.pop(k) for k in list(ts) if k.startswith(("markov_head.", "confidence_head."))])] + S(w)[4:], "markov_rank is False", False),
    # layout keys that contradict each other (DeepSpec never writes projector_type; z-lab writes neither key)
    ("drafter-projector-dflash-on-dspark-arch", "speculate", lambda w, t: S(w)[:2] + ["--drafter", drafter_with(
        w, t, lambda c: c.update(projector_type="dflash"))] + S(w)[4:], "projector_type 'dflash' contradicts", False),
    ("drafter-projector-dflash-shift-label", "speculate", lambda w, t: S(w)[:2] + ["--drafter", drafter_with(
        w, t, lambda c: c.update(architectures=["DFlashDraftModel"], dflash_config={"projector_type": "dflash",
                                                                                      "shift_label": True}))] + S(w)[4:],
     "shift_label=true contradicts projector_type 'dflash'", False),
    ("drafter-hidden-size-not-the-weights", "speculate", lambda w, t: S(w)[:2] + ["--drafter", drafter_with(
        w, t, lambda c: c.update(hidden_size=2 * c["hidden_size"]))] + S(w)[4:], "hidden_size is 64 but tensor", False),
    ("config-duplicate-key", "speculate", lambda w, t: ["--target", target_with(
        w, t, files={"config.json": duplicated_key(w, "num_hidden_layers")}), "--prompt-ids", "1"],
     "config.json: malformed JSON (key 'num_hidden_layers' appears twice)", False),
    ("generation-config-folder", "speculate", lambda w, t: ["--target", folder_for(
        target_with(w, t), "generation_config.json"), "--prompt-ids", "1"],
     "generation_config.json: is a directory, not a file", False),
    ("chat-template-folder", "speculate", lambda w, t: P(folder_for(target_with(w, t), "chat_template.jinja")),
     "chat_template.jinja: is a directory, not a file", False),
    ("tokenizer-json-bom", "speculate", lambda w, t: P(target_with(w, t, files={
        "tokenizer.json": b"\xef\xbb\xbf" + (w / "target" / "tokenizer.json").read_bytes()})),
     "tokenizer.json: starts with a byte-order mark (save the file as UTF-8 without BOM)", False),
    ("tokenizer-json-folder", "speculate", lambda w, t: P(folder_for(target_with(w, t), "tokenizer.json")),
     "tokenizer.json: is a directory, not a file", False),
    ("tokenizer-unk-not-in-vocab", "speculate", lambda w, t: P(target_with(w, t, files={"tokenizer.json": json.dumps(
        {**json.loads((w / "target" / "tokenizer.json").read_text()), "model": {
            **json.loads((w / "target" / "tokenizer.json").read_text())["model"], "unk_token": "<nope>"}})})),
     "unk_token '<nope>' is not in its vocabulary", True),
    ("tied-embedding-missing", "speculate", lambda w, t: ["--target", target_with(
        w, t, lambda c: c.update(tie_word_embeddings=True), tensors=lambda ts: ts.pop("model.embed_tokens.weight")),
        "--prompt-ids", "1"], "'embed_tokens.weight' is missing", False),
    # ---- speculate.py: chat templates (text prompts are rendered with it)
    ("template-zero-division", "speculate", lambda w, t: P(template("{{ 1 / 0 }}")(w, t)),
     "chat_template.jinja: cannot render", True),
    ("template-huge-power", "speculate", lambda w, t: P(template("{{ 10 ** 100000 }}")(w, t)), "chat_template.jinja", False),
    ("template-huge-output", "speculate", lambda w, t: P(template("{{ 'x' * 400000000 }}")(w, t)), "chat_template.jinja", False),
    ("template-recursion", "speculate", lambda w, t: P(template(
        "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}")(w, t)), "chat_template.jinja", False),
    ("template-type-error", "speculate", lambda w, t: P(template("{{ messages + 1 }}")(w, t)), "chat_template.jinja", False),
    ("template-syntax", "speculate", lambda w, t: P(template("{% if %}")(w, t)),
     "chat_template.jinja", False),
    ("template-not-utf8", "speculate", lambda w, t: P(target_with(
        w, t, files={"chat_template.jinja": b"\xff\xfe{{ x }}"})), "not UTF-8", False),
    ("template-bom", "speculate", lambda w, t: P(target_with(w, t, files={"chat_template.jinja": (
        "\ufeff{% for m in messages %}{{ m.content }}{% endfor %}").encode()})),
     "chat_template.jinja: starts with a byte-order mark (save the file as UTF-8 without BOM)", False),
    # a lone surrogate ("\ud800" in a template's string or a JSON escape) in what reaches the tokenizer
    ("template-lone-surrogate", "speculate", lambda w, t: P(template(
        "{{ '\\ud800' }}{% for m in messages %}{{ m.content }}{% endfor %}")(w, t)),
     "chat_template.jinja: the chat template's output: the text is not valid Unicode (a lone surrogate, U+D800)",
     False),
    ("special-token-lone-surrogate", "speculate", lambda w, t: P(target_with(
        w, t, files={"tokenizer_config.json": '{"eos_token": "\\udc80"}'})),
     "tokenizer_config.json: 'eos_token': the text is not valid Unicode (a lone surrogate, U+DC80)",
     False),
    ("template-raises", "speculate", lambda w, t: P(template("{{ raise_exception('no system role') }}")(w, t)), "no system role", False),
    ("template-int-product", "speculate", lambda w, t: P(template(
        "{% set ns = namespace(n=2 ** 40000) %}{% for i in range(14) %}{% set ns.n = ns.n * ns.n %}{% endfor %}"
        "{{ ns.n }}")(w, t)), "a product is too large", False),
    ("template-center-filter", "speculate", lambda w, t: P(template("{{ 'x' | center(50000000) }}")(w, t)),
     "a width is too large", False),
    ("template-percent-width", "speculate", lambda w, t: P(template("{{ '%050000000d' % 1 }}")(w, t)),
     "a format width is too large", False),
    ("template-format-width", "speculate", lambda w, t: P(template("{{ '{:>50000000}'.format(1) }}")(w, t)),
     "a format width is too large", False),
    ("template-replace-growth", "speculate", lambda w, t: P(template(
        "{% set s = 'a' * 10000 %}{{ s.replace('a', s) }}")(w, t)), "a replacement is too long", False),
    ("template-join-growth", "speculate", lambda w, t: P(template(
        "{% set s = 'a' * 10000 %}{{ s.join([s] * 10000) }}")(w, t)), "a join is too long", False),
    ("template-overflow", "speculate", lambda w, t: P(template("{{ (10 ** 400) * 1.0 }}")(w, t)), "chat_template.jinja", False),
    # ---- speculate.py: chat prompts (messages records, --system-prompt, --enable-thinking)
    ("system-prompt-with-ids", "speculate", lambda w, t: S(w) + ["--system-prompt", "be brief"],
     "--system-prompt: --prompt-ids are token ids", False),
    ("system-prompt-no-chat", "speculate", lambda w, t: P(w / "target") + ["--no-chat", "--system-prompt", "hi"],
     "--system-prompt: prompts are not rendered as chat", False),
    ("system-prompt-empty", "speculate", lambda w, t: P(w / "target") + ["--system-prompt", " "],
     "--system-prompt: empty", False),
    ("system-prompt-surrogate", "speculate", lambda w, t: P(w / "target") + ["--system-prompt", "a\ud800"],
     "--system-prompt: the text is not valid Unicode", False),
    # a byte that is not UTF-8 in an argument (a Latin-1 terminal), which Python reads as U+DCE9
    ("prompt-argument-not-utf8", "speculate", lambda w, t: P(w / "target", "\udce9t\udce9"),
     "--prompt: the text is not valid Unicode (a lone surrogate, U+DCE9, which is how Python reads the byte 0xe9 "
     "in an argument that is not UTF-8)", True),
    ("system-prompt-too-long", "speculate", lambda w, t: P(w / "target") + ["--system-prompt", "hello " * 100000],
     "longer than", False),
    ("system-prompt-ids-record", "speculate", lambda w, t: S(w)[:4] + ["--prompts-file", w / "prompts.jsonl"]
     + S(w)[6:] + ["--system-prompt", "hi"], "prompts.jsonl:1: a prompt_ids record", False),
    ("chat-ids-records", "speculate", lambda w, t: S(w)[:4] + ["--prompts-file", w / "prompts.jsonl"] + S(w)[6:]
     + ["--chat"], "--chat: every record of --prompts-file", False),
    ("system-prompt-and-own-system", "speculate", lambda w, t: P(w / "target")[:2] + ["--prompts-file", prompts_file(
        t, messages([("system", "a"), ("user", "b")]))] + ["--system-prompt", "c"], "p.jsonl:1: the conversation has "
     "its own system turn", False),
    ("thinking-with-ids", "speculate", lambda w, t: S(w) + ["--enable-thinking"], "--enable-thinking", False),
    ("thinking-no-chat", "speculate", lambda w, t: P(w / "target") + ["--no-chat", "--enable-thinking"],
     "--enable-thinking: prompts are not rendered as chat", False),
    ("thinking-no-switch", "speculate", lambda w, t: P(template("{% for m in messages %}{{ m.content }}{% endfor %}")(
        w, t)) + ["--enable-thinking"], "chat_template.jinja) has no thinking switch", False),
    ("messages-last-assistant", "speculate", lambda w, t: M(w, t, messages([("user", "a"), ("assistant", "b")])),
     "p.jsonl:1: the last message must be the user's", False),
    ("messages-role-tool", "speculate", lambda w, t: M(w, t, messages([("tool", "a"), ("user", "b")])),
     "p.jsonl:1: messages[0]: role 'tool'", False),
    ("messages-role-list", "speculate", lambda w, t: M(w, t, messages([(["user"], "a")])), "role ['user']", False),
    ("messages-extra-key", "speculate", lambda w, t: M(w, t, json.dumps({"messages": [
        {"role": "user", "content": "a", "reasoning_content": "b"}]}) + "\n"), "p.jsonl:1: messages[0] must be", False),
    ("messages-not-object", "speculate", lambda w, t: M(w, t, '{"messages": ["hi"]}\n'), "got a str", False),
    ("messages-content-list", "speculate", lambda w, t: M(w, t, json.dumps({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}]}]}) + "\n"), "'content' must be a string", False),
    ("messages-empty", "speculate", lambda w, t: M(w, t, '{"messages": []}\n'), "'messages' must be a non-empty list",
     False),
    ("messages-not-list", "speculate", lambda w, t: M(w, t, '{"messages": "hi"}\n'), "'messages' must be", False),
    ("messages-and-prompt", "speculate", lambda w, t: M(w, t, json.dumps({"prompt": "a", "messages": [
        {"role": "user", "content": "b"}]}) + "\n"), "prompt and messages", False),
    ("messages-no-chat", "speculate", lambda w, t: M(w, t, messages([("user", "a")])) + ["--no-chat"],
     "p.jsonl:1: a messages record is a conversation", False),
    # the scripts have no --chat: their line says what they take instead
    ("bench-prompts-messages", "bench", lambda w, t: ["--target", w / "target", "--drafter", w / "drafter",
     "--no-compile", "--prompts-file", prompts_file(t, '{"messages": [{"role": "user", "content": "hi"}]}\n')],
     "prompts are not rendered as chat here (bench.py takes prompts as they are: prompt, prompt_ids or turns "
     "records)", False),
    ("messages-surrogate", "speculate", lambda w, t: M(w, t, '{"messages": [{"role": "user", "content": "a\\udc80"}]}\n'),
     "p.jsonl:1: the text is not valid Unicode (a lone surrogate, U+DC80)", False),
    ("prompt-empty-under-chat", "speculate", lambda w, t: M(w, t, '{"turns": [""]}\n'), "p.jsonl:1: empty prompt",
     False),
    ("prompt-vocab-by-line", "speculate", lambda w, t: M(w, t, '{"prompt_ids": [1]}\n\n\n{"prompt_ids": [99]}\n'),
     "p.jsonl:4: token id 99 is outside the vocabulary", False),
    ("prompt-too-long-by-line", "speculate", lambda w, t: M(w, t, '{"prompt_ids": [1]}\n{"prompt_ids": [%s]}\n'
                                                            % ",".join(["1"] * 200)), "p.jsonl:2: 200 tokens", False),
    ("prompt-record-setting", "speculate", lambda w, t: M(w, t, '{"prompt": "hi", "system": "be brief"}\n'),
     "p.jsonl:1: a record cannot set 'system'; that is the run's --system-prompt", False),
    ("prompt-record-tree-budget", "speculate", lambda w, t: M(w, t, '{"prompt_ids": [1], "tree_budget": 4}\n'),
     "p.jsonl:1: a record cannot set 'tree_budget'; that is the run's --tree-budget", False),
    # a request's settings as OpenAI, vLLM and transformers spell them were ignored as metadata
    *[(f"prompt-record-{key}", "speculate", lambda w, t, key=key: M(w, t, '{"prompt": "hi", "%s": 1}\n' % key),
       f"p.jsonl:1: a record cannot set '{key}'; that is the run's {flag}", False)
      for key, flag in (("n", "--num-samples"), ("max_length", "--max-new-tokens"), ("do_sample", "--temperature"),
                        ("stop_token_ids", "--stop"), ("chat_template_kwargs", "--enable-thinking"),
                        ("stop_sequences", "--stop"))],
    # ... and what no flag does, a penalty or a minimum length, decoded as if it were not there
    *[(f"prompt-record-{key}", "speculate", lambda w, t, key=key, value=value: M(
        w, t, '{"prompt": "hi", "%s": %s}\n' % (key, value)),
       f"p.jsonl:1: {key} {value} is not applied here", False)
      for key, value in (("repetition_penalty", "1.3"), ("min_tokens", "4"), ("logprobs", "true"),
                         ("tools", '[{"type": "function"}]'), ("tool_choice", '"required"'),
                         ("response_format", '{"type": "json_object"}'), ("add_generation_prompt", "false"),
                         ("continue_final_message", "true"), ("echo", "true"))],
    ("prompt-not-text", "speculate", lambda w, t: M(w, t, '{"prompt": 5}\n'),
     "p.jsonl:1: 'prompt' must be a string, got 5", False),
    ("record-without-a-prompt", "speculate", lambda w, t: M(w, t, '{"text": "hi", "id": 3}\n'),
     "...]} (this record's keys: id, text)", False),
    ("turns-later-not-text", "speculate", lambda w, t: M(w, t, '{"turns": ["hi", 5]}\n'),
     "p.jsonl:1: 'turns' must be a non-empty list of strings, got [\"hi\", 5]",
     False),
    ("jsonl-not-utf8-by-line", "speculate", lambda w, t: M(w, t, b'{"prompt_ids": [1, 2]}\n' * 499
                                                          + b'{"prompt": "caf\xe9"}\n' + b'{"prompt_ids": [1]}\n' * 99),
     "p.jsonl:500: not UTF-8 text", False),
    ("jsonl-bom", "speculate", lambda w, t: M(w, t, b'\xef\xbb\xbf{"prompt_ids": [1, 2]}\n'), "p.jsonl:1: starts with a "
     "byte-order mark", False),
    ("messages-second-line", "speculate", lambda w, t: M(w, t, messages([("user", "a")]) + messages([("system", "a")])),
     "p.jsonl:2: the last message", False),
    # ---- speculate.py: hub ids (the tests' Hugging Face cache is empty and offline: conftest.py)
    ("target-hub-malformed", "speculate", lambda w, t: ["--target", "a/b/c", "--prompt-ids", "1"],
     "--target a/b/c: not found as a directory, and not a Hugging Face hub id", False),
    ("target-hub-empty-revision", "speculate", lambda w, t: ["--target", "org/name@", "--prompt-ids", "1"],
     "not a Hugging Face hub id", False),
    ("target-hub-revision-dots", "speculate", lambda w, t: ["--target", "org/name@../../x", "--prompt-ids", "1"],
     "not a Hugging Face hub id", False),
    ("target-hub-not-cached", "speculate", lambda w, t: ["--target", "org/none", "--prompt-ids", "1"],
     "--target org/none: no such local directory, and not in the Hugging Face cache", True),
    ("drafter-hub-not-cached", "speculate", lambda w, t: S(w)[:2] + ["--drafter", "org/none@v1"] + S(w)[4:],
     "--drafter org/none@v1", False),
    ("target-empty", "speculate", lambda w, t: ["--target", "", "--prompt-ids", "1"], "--target: empty", False),
    # ---- speculate.py: the drafter
    ("drafter-missing", "speculate", lambda w, t: S(w)[:2] + ["--drafter", t / "nope"] + S(w)[4:], "not found", False),
    ("drafter-dup-layers", "speculate", lambda w, t: S(w)[:2] + ["--drafter", drafter_with(
        w, t, lambda c: c.update(target_layer_ids=[0, 0]))] + S(w)[4:], "names a layer twice", True),
    ("drafter-rank-float", "speculate", lambda w, t: S(w)[:2] + ["--drafter", drafter_with(
        w, t, lambda c: c.update(markov_rank=64.0))] + S(w)[4:], "markov_rank", False),
    ("drafter-dspark-config-string", "speculate", lambda w, t: S(w)[:2] + ["--drafter", drafter_with(
        w, t, lambda c: c.update(dspark_config="x"))] + S(w)[4:], "dspark_config", False),
    ("drafter-block-huge", "speculate", lambda w, t: S(w)[:2] + ["--drafter", drafter_with(
        w, t, lambda c: c.update(block_size=10_000_000))] + S(w)[4:], "block_size", False),
    ("drafter-max-positions", "speculate", lambda w, t: S(w)[:2] + ["--drafter", drafter_with(
        w, t, lambda c: c.update(max_position_embeddings=8))] + S(w)[4:-1] + ["10"], "drafter's context", False),
    ("drafter-vocab", "speculate", lambda w, t: S(w)[:2] + ["--drafter", drafter_with(
        w, t, lambda c: c.update(vocab_size=65))] + S(w)[4:], "has shape", False),
    ("drafter-num-target-layers", "speculate", lambda w, t: S(w)[:2] + ["--drafter", drafter_with(
        w, t, lambda c: c.update(num_target_layers=36))] + S(w)[4:], "num_target_layers 36 differs", False),
    ("drafter-num-target-layers-str", "speculate", lambda w, t: S(w)[:2] + ["--drafter", drafter_with(
        w, t, lambda c: c.update(num_target_layers="3"))] + S(w)[4:], "'num_target_layers' must be", False),
    ("drafter-alias-types", "speculate", lambda w, t: S(w)[:2] + ["--drafter", drafter_with(
        w, t, lambda c: c.update(dspark_config={"block_size": float(c["block_size"])}))] + S(w)[4:],
     "conflicting values for 'block_size'", False),
    ("drafter-architectures-string", "speculate", lambda w, t: S(w)[:2] + ["--drafter", drafter_with(
        w, t, lambda c: c.update(architectures="Qwen3DSparkModel"))] + S(w)[4:], "'architectures' must be a list", False),
    ("drafter-markov-1d", "speculate", lambda w, t: S(w)[:2] + ["--drafter", drafter_with(
        w, t, tensors=lambda ts: ts.update({"markov_head.markov_w1.weight": ts["markov_head.markov_w1.weight"][:, 0]}))]
     + S(w)[4:], "the Markov head expects [vocab_size, rank >= 1]", False),
    ("drafter-markov-rank-0", "speculate", lambda w, t: S(w)[:2] + ["--drafter", drafter_with(
        w, t, tensors=lambda ts: ts.update({k: ts[k][:, :0].contiguous() for k in (
            "markov_head.markov_w1.weight", "markov_head.markov_w2.weight")}))] + S(w)[4:],
     "has shape [64, 0], the Markov head expects", False),
    ("drafter-confidence-0d", "speculate", lambda w, t: S(w)[:2] + ["--drafter", drafter_with(
        w, t, tensors=lambda ts: ts.update({"confidence_head.proj.weight": ts["confidence_head.proj.weight"][0, 0]}))]
     + S(w)[4:], "the confidence head expects [1, features]", False),
    ("out-name-too-long", "speculate", lambda w, t: S(w) + ["--trace-file", t / ("o" * 245)], "cannot write there",
     False),
    ("out-new-index-in-target", "speculate", lambda w, t: (lambda d: ["--target", d, "--prompt-ids", "1", "--output-file",
                                                                    os.path.join(d, "model.safetensors.index.json")])(target_with(w, t)),
     "model.safetensors.index.json: a file named so in the input directory", False),
    ("out-new-template-in-target", "speculate", lambda w, t: (lambda d: ["--target", d, "--prompt-ids", "1", "--trace-file",
                                                                       os.path.join(d, "chat_template.jinja")])(target_with(w, t)),
     "chat_template.jinja: a file named so in the input directory", False),
    ("out-dev-stdout", "speculate", lambda w, t: S(w) + ["--trace-file", "/dev/stdout"],
     "--trace-file /dev/stdout: a device or process file", False),
    ("out-trailing-slash", "speculate", lambda w, t: S(w) + ["--output-file", f"{t}/newdir/"], "names a directory",
     False),
    ("log-every-without-wandb", "speculate", lambda w, t: S(w) + ["--log-every", "3"], "--log-every 3", False),
    ("chat-with-ids", "speculate", lambda w, t: S(w) + ["--chat"], "--chat: --prompt-ids are token ids", False),
    ("stop-not-unicode", "speculate", lambda w, t: S(w) + ["--stop", "a\udcff"], "--stop 'a\\udcff': the text is not "
     "valid Unicode", False),
    ("random-init-text", "speculate", lambda w, t: ["--random-init", "qwen3-4b", "--prompt", "hi"],
     "--random-init qwen3-4b has none", False),
    ("drafter-without-target", "speculate", lambda w, t: ["--drafter", w / "drafter", "--prompt-ids", "1"],
     "--target", False),
    # ---- speculate.py: flags that depend on each other
    ("calibration-unscheduled", "speculate", lambda w, t: S(w) + ["--calibration", w / "cal.json"],
     "changes nothing", False),
    ("calibration-length", "speculate", lambda w, t: S(w) + ["--confidence-threshold", "0.5", "--calibration",
                                                            prompts_file(t, '{"temperatures": [1.0]}', "c.json")],
     "temperatures", False),
    ("calibration-nan", "speculate", lambda w, t: S(w) + ["--confidence-threshold", "0.5", "--calibration",
                                                         prompts_file(t, '{"temperatures": [NaN, 1, 1, 1]}', "c.json")],
     "temperatures", False),
    # float32 is what the temperatures are applied in: a 400-digit integer overflowed (a traceback), 1e39 became
    # inf and 1e-46 became 0 (every confidence 0.5, or 0/1/NaN), silently
    ("calibration-400-digits", "speculate", lambda w, t: S(w) + ["--confidence-threshold", "0.5", "--calibration",
                                                                prompts_file(t, '{"temperatures": [%s, 1, 1, 1]}' % ("9" * 400),
                                                                             "c.json")], "'temperatures' must be", True),
    ("calibration-float32-inf", "speculate", lambda w, t: S(w) + ["--confidence-threshold", "0.5", "--calibration",
                                                                 prompts_file(t, '{"temperatures": [1e39, 1, 1, 1]}', "c.json")],
     "'temperatures' must be", False),
    ("calibration-float32-zero", "speculate", lambda w, t: S(w) + ["--confidence-threshold", "0.5", "--calibration",
                                                                  prompts_file(t, '{"temperatures": [1e-46, 1, 1, 1]}', "c.json")],
     "'temperatures' must be", False),
    # the keys a note reads: a list as the scheduler, counts for 2 of 4 positions (the note checked those 2)
    ("calibration-scheduler-list", "speculate", lambda w, t: S(w) + ["--confidence-threshold", "0.5", "--calibration",
                                                                    prompts_file(t, '{"temperatures": [1, 1, 1, 1], "scheduler": ["x"]}', "c.json")],
     "'scheduler' (the --scheduler it was fitted under) must be a name, got ['x']", False),
    ("calibration-counts-short", "speculate", lambda w, t: S(w) + ["--confidence-threshold", "0.5", "--calibration",
                                                                  prompts_file(t, '{"temperatures": [1, 1, 1, 1], "fit_rounds_by_position": [5, 0]}', "c.json")],
     "'fit_rounds_by_position' must be a list of 4 counts (the rounds each position was fitted on), got [5, 0]", False),
    # a well-formed file of another drafter: the line says whose it is
    ("calibration-other-drafter", "speculate", lambda w, t: S(w) + ["--confidence-threshold", "0.5", "--calibration",
                                                                   prompts_file(t, '{"temperatures": [1, 1, 1, 1, 1, 1, 1], "drafter_dir": "/d7"}', "c.json")],
     "got [1, 1, 1, 1, 1, 1, 1]; it was fitted on drafter /d7, which drafts 7", False),
    # a temperature this large makes every confidence 0.5 in float32, whose logit is then 0: the head's
    # confidences, their report and a refit on them were flattened in silence
    ("calibration-flattening", "speculate", lambda w, t: S(w) + ["--confidence-threshold", "0.5", "--calibration",
                                                                prompts_file(t, '{"temperatures": [1e9, 1, 1, 1]}', "c.json")],
     "of 4 positive numbers from 1.18e-38 to 1000", False),
    # what the file was fitted on, compared with the run in a note: a 400-digit temperature overflowed there
    ("calibration-fitted-temperature-huge", "speculate", lambda w, t: S(w) + [
        "--confidence-threshold", "0.5", "--calibration",
        prompts_file(t, '{"temperatures": [1, 1, 1, 1], "temperature": %s}' % ("9" * 400), "c.json")],
     "'temperature' (the sampling temperature it was fitted at) must be a number from 0 to 10000", False),
    ("calibration-fitted-temperature-nan", "eval", lambda w, t: E(w) + [
        "--confidence-threshold", "0.5", "--calibration", prompts_file(t, '{"temperatures": [1, 1, 1, 1], "temperature": NaN}', "c.json")],
     "'temperature' (the sampling temperature it was fitted at) must be", False),
    ("calibration-fitted-drafter-not-a-path", "speculate", lambda w, t: S(w) + [
        "--confidence-threshold", "0.5", "--calibration",
        prompts_file(t, '{"temperatures": [1, 1, 1, 1], "drafter_dir": 5}', "c.json")],
     "'drafter_dir' (the drafter it was fitted on) must be a path, got 5", False),
    ("scheduler-threshold-no-value", "speculate", lambda w, t: S(w) + ["--scheduler", "threshold"],
     "--confidence-threshold", False),
    ("sps-table-unscheduled", "speculate", lambda w, t: S(w) + ["--sps-table", t / "s.json"], "--sps-table", False),
    ("buckets-unscheduled", "speculate", lambda w, t: S(w) + ["--verify-buckets", "4,8"], "--verify-buckets", False),
    ("buckets-zero", "speculate", lambda w, t: S(w) + ["--scheduler", "hardware", "--verify-buckets", "0,10"],
     "--verify-buckets", False),
    ("triton-on-cpu", "speculate", lambda w, t: S(w) + ["--kernels", "triton"], "--kernels triton", False),
    ("compile-mode-eager", "speculate", lambda w, t: S(w) + ["--compile-mode", "default"], "--compile-mode", False),
    ("verbose-eager", "speculate", lambda w, t: S(w) + ["--verbose"], "--verbose", False),
    ("compile-cache-eager", "speculate", lambda w, t: S(w) + ["--compile-cache", t / "cc"], "--compile-cache", False),
    ("compile-cache-stdout", "speculate", lambda w, t: S(w) + ["--compile", "--compile-cache", "-"],
     "--compile-cache -: standard output is not supported here; give a directory path", False),
    ("compile-cache-file", "speculate", lambda w, t: S(w) + ["--compile", "--compile-cache",
                                                            prompts_file(t, "x", "cc")], "not a directory", False),
    # the compile cache is made as a directory when compiling starts: an output of its name failed at the end
    ("trace-file-is-the-compile-cache", "speculate", lambda w, t: S(w) + [
        "--compile", "--compile-cache", t / "cc", "--trace-file", t / "cc"], "is an input of this run", False),
    ("eval-out-is-the-compile-cache", "eval", lambda w, t: E(w) + [
        "--compile", "--compile-cache", t / "cc", "--out", t / "cc"], "is an input of this run", False),
    ("bench-out-is-the-compile-cache", "bench", lambda w, t: [
        "--target", w / "target", "--drafter", w / "drafter", "--compile-cache", t / "cc", "--out", t / "cc"],
     "is an input of this run", False),
    ("concurrency-out-is-the-compile-cache", "concurrency", lambda w, t: [
        "--target", w / "target", "--drafter", w / "drafter", "--concurrency", "1", "--compile",
        "--compile-cache", t / "cc", "--out", t / "cc"], "is an input of this run", False),
    # an existing --sps-table is read as a table: one of the run's own inputs would be taken for one
    ("sps-table-is-the-target-config", "speculate", lambda w, t: S(w) + [
        "--scheduler", "hardware", "--sps-table", w / "target" / "config.json"], "is an input of this run", False),
    ("eval-sps-table-is-a-dataset", "eval", lambda w, t: E(w) + [
        "--scheduler", "hardware", "--sps-table", w / "data" / "gsm8k.jsonl"], "is an input of this run", False),
    ("random-init-and-target", "speculate", lambda w, t: S(w) + ["--random-init", "qwen3-8b"], "--random-init", False),
    ("cuda-without-gpu", "speculate", lambda w, t: S(w) + ["--device", "cuda"], "--device cuda", False),
    ("memory-too-big", "speculate", lambda w, t: ["--target", target_with(
        w, t, lambda c: c.update(max_position_embeddings=10_000_000)), "--prompt-ids", "1", "--max-new-tokens",
        "9000000", "--num-samples", "4096", "--batch-size", "4096"], "GiB", True),

    # ---- eval.py
    ("eval-verbose-eager", "eval", lambda w, t: E(w) + ["--verbose"], "--verbose", False),
    ("eval-compile-cache-eager", "eval", lambda w, t: E(w) + ["--compile-cache", t / "cc"], "--compile-cache", False),
    ("eval-calibration-no-rounds", "eval", lambda w, t: E(w)[:9] + ["1"] + E(w)[10:] + [
        "--calibration-out", t / "c.json"], "--max-new-tokens 1 ends every request", False),
    ("eval-turns-later-not-text", "eval", lambda w, t: E(w)[:5] + [data_dir(t, '{"turns": ["a", 5]}\n')] + E(w)[6:],
     "gsm8k.jsonl:1: 'turns' must be a non-empty list of strings", False),
    ("eval-prompt-named-by-line", "eval", lambda w, t: E(w)[:5] + [data_dir(
        t, '{"turns": ["a"]}\n' * 3 + '{"prompt_ids": [99]}\n')] + E(w)[6:], "gsm8k.jsonl:4: token id 99", False),
    ("eval-datasets-twice", "eval", lambda w, t: E(w)[:7] + ["gsm8k,gsm8k"] + E(w)[8:], "named twice", True),
    ("eval-datasets-path", "eval", lambda w, t: E(w)[:7] + ["../p"] + E(w)[8:], "not a dataset name", False),
    ("eval-datasets-empty", "eval", lambda w, t: E(w)[:7] + [","] + E(w)[8:], "no dataset named", False),
    ("eval-datasets-file-name", "eval", lambda w, t: E(w)[:7] + ["gsm8k.jsonl"] + E(w)[8:],
     "--datasets: 'gsm8k.jsonl' is a file's name; the dataset is named without .jsonl ('gsm8k': its <name>.jsonl "
     "in --data-dir)", False),
    ("eval-datasets-unknown", "eval", lambda w, t: E(w)[:7] + ["nosuch"] + E(w)[8:], "unknown dataset", False),
    ("train-eval-flag-without-eval-every", "train", lambda w, t: T(w, t) + ["--eval-data-dir", w / "data"],
     "--eval-data-dir", False),
    ("train-alpha-conf-without-confidence", "train", lambda w, t: T(w, t) + ["--no-confidence", "--alpha-conf", "2"],
     "--alpha-conf 2.0: changes nothing with --no-confidence", False),
    ("train-min-lr-frac-constant", "train", lambda w, t: T(w, t) + ["--schedule", "constant", "--min-lr-frac", "0.1"],
     "--min-lr-frac 0.1: changes nothing with --schedule constant", False),
    ("bench-model-with-target", "bench", lambda w, t: ["--target", w / "target", "--drafter", w / "drafter",
     "--no-compile", "--model", "qwen3-8b"], "--model qwen3-8b: --target gives the models", False),
    ("eval-data-dir-empty", "eval", lambda w, t: E(w)[:5] + [""] + E(w)[6:], "--data-dir: empty value", False),
    ("eval-datasets-empty-string", "eval", lambda w, t: E(w)[:7] + [""] + E(w)[8:], "--datasets: empty value", False),
    ("train-eval-data-dir-empty", "train", lambda w, t: T(w, t) + ["--eval-every", "1", "--eval-data-dir", ""],
     "--eval-data-dir: empty path", False),
    ("calibration-empty-path", "speculate", lambda w, t: S(w) + ["--confidence-threshold", "0.5", "--calibration", ""],
     "--calibration: empty path", False),
    ("eval-calibration-empty-path", "eval", lambda w, t: E(w) + ["--confidence-threshold", "0.5", "--calibration", ""],
     "--calibration: empty path", False),
    # nothing reads the confidences here: the empty path is said, not that the flag changes nothing
    ("calibration-empty-unread", "speculate", lambda w, t: S(w) + ["--calibration", ""],
     "--calibration: empty path", False),
    ("eval-calibration-empty-unread", "eval", lambda w, t: E(w) + ["--calibration", ""],
     "--calibration: empty path", False),
    ("prompts-file-empty-path", "speculate", lambda w, t: S(w)[:4] + ["--prompts-file", ""] + S(w)[6:],
     "--prompts-file: empty path", False),
    ("train-resume-empty-path", "train", lambda w, t: T(w, t) + ["--resume", ""], "--resume: empty path", False),
    ("train-layer-ids-empty", "train", lambda w, t: T(w, t) + ["--target-layer-ids", ""],
     "--target-layer-ids: '' is not a comma-separated list", False),
    ("train-data-a-device", "train", lambda w, t: T(w, t) + ["--data", "/dev/null"],
     "--data /dev/null: is a device or a pipe, not a file or directory", False),
    ("train-out-a-device", "train", lambda w, t: T(w, t) + ["--out", "/dev/null"],
     "--out /dev/null: is a device or a pipe, not a directory", False),
    ("train-out-stdout", "train", lambda w, t: T(w, t)[:4] + ["--out", "-"] + T(w, t)[6:],
     "--out -: standard output is not supported here; give a directory path", False),
    ("train-resume-a-file", "train", lambda w, t: T(w, t) + ["--resume", w / "corpus.txt"],
     "corpus.txt: is a file, not a directory", False),
    ("train-eval-data-dir-a-file", "train", lambda w, t: T(w, t) + ["--eval-every", "1", "--eval-data-dir",
     w / "corpus.txt"], "corpus.txt: is a file, not a directory", False),
    ("train-eval-datasets-none", "train", lambda w, t: T(w, t) + ["--eval-every", "1", "--eval-data-dir", w / "data",
     "--eval-datasets", ","], "--eval-datasets ',': no dataset named", False),
    ("train-eval-datasets-empty-name", "train", lambda w, t: T(w, t) + ["--eval-every", "1", "--eval-data-dir",
     w / "data", "--eval-datasets", "gsm8k,,gsm8k"], "--eval-datasets gsm8k,,gsm8k: an empty name between commas",
     False),
    ("train-eval-datasets-twice", "train", lambda w, t: T(w, t) + ["--eval-every", "1", "--eval-data-dir",
     w / "data", "--eval-datasets", "gsm8k, gsm8k"], "--eval-datasets: 'gsm8k' is named twice", False),
    ("train-data-empty-path", "train", lambda w, t: T(w, t) + ["--data", ""], "--data: empty path", False),
    ("calibration-folder", "speculate", lambda w, t: S(w) + ["--confidence-threshold", "0.5", "--calibration", t],
     "is a directory, not a file", False),
    ("eval-dataset-file-is-a-folder", "eval", lambda w, t: E(w)[:5] + [folder_for(
        shutil.copytree(w / "data", t / "data"), "gsm8k.jsonl")] + E(w)[6:], "gsm8k.jsonl: is a directory, not a file", False),
    ("eval-data-dir-missing", "eval", lambda w, t: E(w)[:5] + [t / "nope"] + E(w)[6:], "directory not found", False),
    ("eval-data-dir-a-file", "eval", lambda w, t: E(w)[:5] + [w / "target" / "config.json"] + E(w)[6:],
     "config.json: is a file, not a directory", False),
    ("eval-out-is-dataset", "eval", lambda w, t: E(w) + ["--out", w / "data" / "gsm8k.jsonl"], "input of this run", False),
    ("eval-out-empty", "eval", lambda w, t: E(w) + ["--out", ""], "--out: empty path", False),
    ("eval-out-dev", "eval", lambda w, t: E(w) + ["--out", "/dev/full"], "is a device or a pipe, not a file",
     True),
    ("eval-out-dir", "eval", lambda w, t: E(w) + ["--out", t], "is a directory", False),
    ("eval-out-symlink-to-dataset", "eval", lambda w, t: E(w) + ["--out", link(t, w / "data" / "gsm8k.jsonl")],
     "input of this run", False),
    ("eval-cal-out-is-out", "eval", lambda w, t: E(w) + ["--out", t / "r.json", "--calibration-out", t / "r.json"],
     "also", False),
    ("eval-cal-out-is-dataset", "eval", lambda w, t: E(w) + ["--out", t / "r.json", "--calibration-out",
                                                            w / "data" / "gsm8k.jsonl"], "input of this run", False),
    ("eval-plot-is-weights", "eval", lambda w, t: E(w) + ["--out", t / "r.json", "--calibration-plot",
                                                         w / "target" / "model.safetensors"], "input directory", False),
    ("eval-plot-pdf", "eval", lambda w, t: E(w) + ["--out", t / "r.json", "--calibration-plot", t / "r.pdf"],
     ".png or .svg", False),
    ("eval-max-samples-0", "eval", lambda w, t: E(w) + ["--max-samples", "0"], "--max-samples", False),
    ("eval-batch-0", "eval", lambda w, t: E(w) + ["--batch-size", "0"], "--batch-size", False),
    ("eval-temp-nan", "eval", lambda w, t: E(w) + ["--temperature", "nan"], "--temperature", False),
    ("eval-temp-tiny", "eval", lambda w, t: E(w) + ["--temperature", "1e-30"], "--temperature", False),
    ("eval-split-1", "eval", lambda w, t: E(w) + ["--calibration-split", "1"], "--calibration-split", False),
    ("eval-bins-0", "eval", lambda w, t: E(w) + ["--ece-bins", "0"], "--ece-bins", False),
    ("eval-step-neg", "eval", lambda w, t: E(w) + ["--step", "-1"], "--step", False),
    ("eval-seed-neg", "eval", lambda w, t: E(w) + ["--seed", "-5"], "--seed", False),
    ("eval-timeout-0", "eval", lambda w, t: E(w) + ["--dist-timeout", "0"], "--dist-timeout", False),
    ("eval-dataset-bad-json", "eval", lambda w, t: E(w)[:5] + [data_dir(t, "{\n")] + E(w)[6:], "gsm8k.jsonl:1", False),
    ("eval-dataset-no-turns", "eval", lambda w, t: E(w)[:5] + [data_dir(t, '{"text": "x"}\n')] + E(w)[6:],
     "gsm8k.jsonl:1", False),
    ("eval-cal-out-no-sts", "eval", lambda w, t: E(w) + ["--out", t / "r.json", "--calibration-split", "0",
                                                        "--calibration-out", t / "c.json"], "needs STS", False),
    ("eval-cal-out-nothing-to-fit", "eval", lambda w, t: E(w) + ["--out", t / "r.json", "--calibration-split", "0.5",
                                                                "--calibration-out", t / "c.json"], "none to fit", False),
    ("eval-cal-out-nothing-held-out", "eval", lambda w, t: E(w) + ["--out", t / "r.json", "--calibration-split",
                                                                  "0.9999999999", "--calibration-out", t / "c.json"],
     "none held out", False),
    ("eval-hardware-threshold", "eval", lambda w, t: E(w) + ["--scheduler", "hardware", "--confidence-threshold", "0.5"],
     "--confidence-threshold", False),
    ("eval-target-missing", "eval", lambda w, t: ["--target", t / "nope", "--data-dir", w / "data", "--datasets",
                                                  "gsm8k"], "not found", False),
    ("eval-target-hub-not-cached", "eval", lambda w, t: ["--target", "org/none"] + E(w)[2:], "HF_HUB_OFFLINE", True),
    ("eval-drafter-hub-malformed", "eval", lambda w, t: E(w)[:2] + ["--drafter", "org/x/y"] + E(w)[4:],
     "not a Hugging Face hub id", False),
    ("eval-prompt-too-long", "eval", lambda w, t: E(w)[:5] + [data_dir(t, json.dumps({"turns": ["hello " * 300]})
                                                                       + "\n")] + E(w)[6:], "exceed", False),

    # ---- bench.py
    ("bench-batch-dup", "bench", lambda w, t: ["--batch-sizes", "1,1"], "--batch-sizes: '1,1' must be distinct", False),
    ("bench-batch-0", "bench", lambda w, t: ["--batch-sizes", "0"], "--batch-sizes", False),
    ("bench-batch-x", "bench", lambda w, t: ["--batch-sizes", "x"], "--batch-sizes", False),
    ("bench-repeats-0", "bench", lambda w, t: ["--repeats", "0"], "--repeats", False),
    ("bench-new-0", "bench", lambda w, t: ["--max-new-tokens", "0"], "--max-new-tokens", False),
    ("bench-threads-0", "bench", lambda w, t: ["--threads", "0"], "--threads", False),
    ("bench-threads-neg", "bench", lambda w, t: ["--threads", "-1"], "--threads", False),
    ("bench-prompt-0", "bench", lambda w, t: ["--prompt-len", "0"], "--prompt-len", False),
    ("bench-drafter-alone", "bench", lambda w, t: ["--drafter", w / "drafter"], "--drafter", True),
    ("bench-mode-no-compile", "bench", lambda w, t: ["--compile-mode", "default", "--no-compile"], "--compile-mode",
     False),
    ("bench-verbose-no-compile", "bench", lambda w, t: ["--verbose", "--no-compile"], "--verbose", False),
    ("bench-model-unknown", "bench", lambda w, t: ["--model", "gpt5"], "--model", False),
    ("bench-out-root", "bench", lambda w, t: ["--out", "/"], "is a directory", False),
    ("bench-out-empty", "bench", lambda w, t: ["--out", ""], "empty path", False),
    ("bench-out-in-target", "bench", lambda w, t: ["--target", w / "target", "--out", w / "target" / "config.json"],
     "input directory", False),
    ("bench-seed-neg", "bench", lambda w, t: ["--seed", "-1"], "--seed", False),
    ("bench-target-missing", "bench", lambda w, t: ["--target", t / "nope", "--no-compile"], "not found", False),
    ("bench-target-hub-not-cached", "bench", lambda w, t: ["--target", "org/none", "--no-compile"], "HF_HUB_OFFLINE",
     False),
    # ---- scripts/bench_concurrency.py
    ("conc-zero", "concurrency", lambda w, t: ["--concurrency", "0"], "--concurrency", False),
    ("conc-letters", "concurrency", lambda w, t: ["--concurrency", "1,x"], "--concurrency", False),
    ("conc-scheduler", "concurrency", lambda w, t: ["--concurrency", "2", "--schedulers", "none,fast"], "--schedulers",
     False),
    ("conc-threshold-0", "concurrency", lambda w, t: ["--concurrency", "2", "--confidence-threshold", "0"],
     "--confidence-threshold", False),
    ("conc-plot-pdf", "concurrency", lambda w, t: ["--concurrency", "2", "--plot", t / "c.pdf"], ".png or .svg", False),
    ("conc-out-is-prompts", "concurrency", lambda w, t: ["--concurrency", "2", "--prompts-file", w / "prompts.jsonl",
                                                         "--out", w / "prompts.jsonl"], "input of this run", True),
    ("conc-prompts-missing", "concurrency", lambda w, t: ["--concurrency", "2", "--target", w / "target", "--drafter",
                                                          w / "drafter", "--prompts-file", t / "n.jsonl"],
     "not found", False),
    ("conc-target-only", "concurrency", lambda w, t: ["--concurrency", "2", "--target", w / "target"], "give both",
     False),
    ("conc-mode-no-compile", "concurrency", lambda w, t: ["--concurrency", "2", "--compile-mode", "default",
                                                          "--no-compile"], "--compile-mode", False),
    ("conc-mode-eager-cpu", "concurrency", lambda w, t: ["--concurrency", "2", "--compile-mode", "default"],
     "--compile-mode", False),  # cpu runs eager unless --compile: the mode would be ignored
    ("conc-drafter-hub-not-cached", "concurrency", lambda w, t: ["--concurrency", "2", "--target", w / "target",
                                                                 "--drafter", "org/none", "--prompts-file",
                                                                 w / "prompts.jsonl"], "--drafter org/none", False),

    # ---- train.py
    ("train-steps-0", "train", lambda w, t: T(w, t) + ["--steps", "0"], "--steps", False),
    ("train-markov-none-with-its-confidence-feature", "train", lambda w, t: T(w, t)[:-3] + [
        "--markov", "none", "--confidence-with-markov"],
     "--confidence-with-markov needs a Markov head (--markov none given): add --no-confidence-with-markov", False),
    ("eval-num-samples", "eval", lambda w, t: E(w) + ["--num-samples", "2"],
     "--num-samples 2: eval.py decodes each prompt once, as the authors do", False),
    ("train-lr-inf", "train", lambda w, t: T(w, t) + ["--lr", "inf"], "--lr: invalid value inf", True),
    ("train-lr-nan", "train", lambda w, t: T(w, t) + ["--lr", "nan"], "--lr", False),
    ("train-alpha-ce-nan", "train", lambda w, t: T(w, t) + ["--alpha-ce", "nan"], "--alpha-ce", False),
    ("train-alpha-tv-neg", "train", lambda w, t: T(w, t) + ["--alpha-tv", "-5"], "--alpha-tv", False),
    ("train-alpha-conf-inf", "train", lambda w, t: T(w, t) + ["--alpha-conf", "inf"], "--alpha-conf", False),
    ("train-weight-decay-neg", "train", lambda w, t: T(w, t) + ["--weight-decay", "-1"], "--weight-decay", False),
    ("train-init-std-neg", "train", lambda w, t: T(w, t) + ["--init-std", "-1"], "--init-std", False),
    ("train-warmup-1", "train", lambda w, t: T(w, t) + ["--warmup-frac", "1"], "--warmup-frac", False),
    ("train-clip-neg", "train", lambda w, t: T(w, t) + ["--grad-clip", "-1"], "--grad-clip", False),
    ("train-block-0", "train", lambda w, t: T(w, t) + ["--block-size", "0"], "--block-size", False),
    ("train-depth-0", "train", lambda w, t: T(w, t) + ["--depth", "0"], "--depth", False),
    ("train-gamma-0", "train", lambda w, t: T(w, t) + ["--gamma", "0"], "--gamma", False),
    ("train-anchors-0", "train", lambda w, t: T(w, t) + ["--anchors-per-seq", "0"], "--anchors-per-seq", False),
    ("train-rank-0", "train", lambda w, t: T(w, t) + ["--markov-rank", "0"], "--markov-rank", False),
    ("train-seq-1", "train", lambda w, t: T(w, t) + ["--seq-len", "1"], "--seq-len", False),
    ("train-layer-ids-empty-field", "train", lambda w, t: T(w, t) + ["--target-layer-ids", "0,,1"],
     "--target-layer-ids", False),
    ("train-layer-ids-order", "train", lambda w, t: T(w, t) + ["--target-layer-ids", "1,0"], "--target-layer-ids",
     False),
    ("train-mask-id", "train", lambda w, t: T(w, t) + ["--mask-token-id", "999999"], "--mask-token-id", False),
    ("train-out-is-target", "train", lambda w, t: T(w, t) + ["--out", w / "target"], "--out", False),
    ("train-out-is-file", "train", lambda w, t: T(w, t) + ["--out", w / "cal.json"], "--out", False),
    ("train-out-empty", "train", lambda w, t: T(w, t) + ["--out", ""], "--out", False),
    ("train-out-broken-link", "train", lambda w, t: T(w, t) + ["--out", link(t, t / "missing")],
     "link.json: is a broken link", False),
    ("train-out-dev-stdout", "train", lambda w, t: T(w, t) + ["--out", "/dev/stdout"], "--out /dev/stdout: is a", True),
    ("train-out-in-target", "train", lambda w, t: T(w, t) + ["--out", w / "target" / "sub"], "--out", False),
    ("train-data-missing", "train", lambda w, t: T(w, t)[:2] + ["--data", t / "nope.txt"] + T(w, t)[4:],
     "not found", False),
    ("train-two-data", "train", lambda w, t: T(w, t) + ["--data-ids", w / "prompts.jsonl"], "exactly one", False),
    ("train-resume-empty", "train", lambda w, t: T(w, t) + ["--resume", t], "--resume", False),
    ("train-target-missing", "train", lambda w, t: ["--target", t / "nope"] + T(w, t)[2:], "not found", False),
    ("train-target-hub-not-cached", "train", lambda w, t: ["--target", "org/none"] + T(w, t)[2:], "HF_HUB_OFFLINE",
     True),
    ("train-stop-at-0", "train", lambda w, t: T(w, t) + ["--stop-at", "0"], "--stop-at", False),
    ("train-log-every-0", "train", lambda w, t: T(w, t) + ["--log-every", "0"], "--log-every", False),
    ("train-resume-torn", "train", lambda w, t: T(w, t) + ["--resume", broken_run(
        w, t, state=lambda s: s.update(step=1))], "torn checkpoint", True),
    ("train-resume-negative-step", "train", lambda w, t: T(w, t) + ["--resume", broken_run(
        w, t, state=lambda s: s.update(step=-5))], "'step'", False),
    ("train-resume-nan-moments", "train", lambda w, t: T(w, t) + ["--steps", "3", "--resume", broken_run(
        w, t, moments=lambda m: next(v for k, v in m.items() if k.startswith("exp_avg.")).fill_(float("nan")))],
     "NaN or infinite", False),
    ("train-resume-moment-shape", "train", lambda w, t: T(w, t) + ["--steps", "3", "--resume", broken_run(
        w, t, moments=lambda m: m.update({k: m[k][:1] for k in [next(k for k in m if k.startswith("exp_avg.")
                                                                       and m[k].shape[0] > 1)]}))],
     "has shape", False),
    ("train-resume-moment-missing", "train", lambda w, t: T(w, t) + ["--steps", "3", "--resume", broken_run(
        w, t, moments=lambda m: m.pop(next(k for k in m if k.startswith("exp_avg_sq."))))],
     "optimizer state 'exp_avg_sq.", False),
    ("train-resume-step-missing", "train", lambda w, t: T(w, t) + ["--steps", "3", "--resume", broken_run(
        w, t, moments=lambda m: m.pop(next(k for k in m if k.startswith("step."))))],
     "optimizer state 'step.", False),
    ("train-resume-step-not-scalar", "train", lambda w, t: T(w, t) + ["--steps", "3", "--resume", broken_run(
        w, t, moments=lambda m: m.update({next(k for k in m if k.startswith("step.")): torch.tensor([2., 2.])}))],
     "has 2 elements", False),
    ("train-resume-state-unknown", "train", lambda w, t: T(w, t) + ["--steps", "3", "--resume", broken_run(
        w, t, moments=lambda m: m.update({"bogus" + next(k for k in m if k.startswith("step."))[4:]:
                                          torch.tensor(2.)}))],
     "none of AdamW's", False),
    ("train-resume-latest-bad", "train", lambda w, t: T(w, t) + ["--resume", broken_run(w, t, latest="../x")],
     "not a checkpoint directory", False),
    ("train-resume-other-flags", "train", lambda w, t: T(w, t) + ["--depth", "2", "--resume", w / "trained"],
     "--depth", False),
    # ---- train.py --drafter-kind eagle3
    ("train-eagle3-dspark-flag", "train", lambda w, t: T3(w, t) + ["--depth", "2"],
     "--depth 2: changes nothing with --drafter-kind eagle3", True),
    ("train-eagle3-no-confidence", "train", lambda w, t: T3(w, t) + ["--no-confidence"],
     "--no-confidence: changes nothing with --drafter-kind eagle3", False),
    ("train-eagle3-markov", "train", lambda w, t: T3(w, t) + ["--markov", "none"],
     "--markov none: changes nothing with --drafter-kind eagle3", False),
    ("train-ttt-length-with-dspark", "train", lambda w, t: T(w, t) + ["--ttt-length", "5"],
     "--ttt-length 5: changes nothing with --drafter-kind dspark", False),
    ("train-step-loss-decay-with-dspark", "train", lambda w, t: T(w, t) + ["--step-loss-decay", "0.5"],
     "--step-loss-decay 0.5: changes nothing with --drafter-kind dspark", False),
    ("train-eagle3-ttt-length-0", "train", lambda w, t: T3(w, t) + ["--ttt-length", "0"], "--ttt-length", False),
    ("train-eagle3-decay-nan", "train", lambda w, t: T3(w, t) + ["--step-loss-decay", "nan"], "--step-loss-decay",
     False),
    ("train-eagle3-embeddings-feature", "train", lambda w, t: T3(w, t) + ["--target-layer-ids=-1,0"],
     "Eagle3 reads decoder layers' outputs", False),
    ("train-eagle3-resumes-dspark-run", "train", lambda w, t: T3(w, t) + ["--resume", w / "trained"],
     "--drafter-kind was 'dspark', now 'eagle3'", False),
]


def messages(turns) -> str:
    """One {"messages"} record (a line) of (role, content) pairs."""
    return json.dumps({"messages": [{"role": r, "content": c} for r, c in turns]}) + "\n"


def M(w, tmp, text):  # speculate on a prompts file of the given text, rendered with the world's chat template
    return ["--target", w / "target", "--prompts-file", prompts_file(tmp, text), "--max-new-tokens", "2"]


def T3(w, tmp):  # train an Eagle3 drafter with the world's target and corpus
    return ["--drafter-kind", "eagle3", "--target", w / "target", "--data", w / "corpus.txt", "--out", tmp / "out",
            "--steps", "2", "--seq-len", "16", "--batch-size", "1", "--ttt-length", "2", "--no-progress"]


def broken_run(w, tmp, state=None, moments=None, latest=None):
    """A copy of the world's trained run with its checkpoint's state edited."""
    run = tmp / "run"
    shutil.copytree(w / "trained", run)
    ckpt = run / (run / "latest").read_text().strip()
    if state is not None:
        s = json.loads((ckpt / "training_state.json").read_text())
        state(s)
        (ckpt / "training_state.json").write_text(json.dumps(s))
    if moments is not None:
        from safetensors.torch import load_file, save_file
        m = load_file(str(ckpt / "training_state.safetensors"))
        moments(m)
        save_file({k: v.contiguous() for k, v in m.items()}, str(ckpt / "training_state.safetensors"),
                  metadata={"format": "pt", "step": "2"})
    if latest is not None:
        (run / "latest").write_text(latest)
    return str(run)


def link(tmp, to):
    p = tmp / "link.json"
    os.symlink(to, p)
    return str(p)


def data_dir(tmp, gsm8k_text):
    d = tmp / "data"
    d.mkdir()
    (d / "gsm8k.jsonl").write_text(gsm8k_text)
    return str(d)


def sharded_bad_index(w, tmp):
    t = target_with(w, tmp)
    os.rename(os.path.join(t, "model.safetensors"), os.path.join(t, "shard-1.safetensors"))
    from safetensors import safe_open
    with safe_open(os.path.join(t, "shard-1.safetensors"), "pt") as f:
        keys = list(f.keys())
    weight_map = {k: "shard-1.safetensors" for k in keys}
    weight_map[keys[0]] = 7
    with open(os.path.join(t, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": weight_map}, f)
    return t


def test_the_corpus_is_large_enough():
    assert len(CASES) >= 150 and len({c[0] for c in CASES}) == len(CASES)
    assert sum(1 for c in CASES if c[4]) >= 20
    assert {c[1] for c in CASES} == {c[1] for c in CASES if c[4]} == set(PROGRAMS)


def _check(err: str, needle: str, rc: int):
    lines = err.splitlines()
    assert rc == 2, f"exit {rc}, stderr: {err[-2000:]}"
    assert len(lines) == 1 and lines[0].startswith("error: "), f"not one error line: {err[-2000:]!r}"
    assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_in_process(case, world, tmp_path, capsys, monkeypatch):
    name, program, build, needle, _ = case
    monkeypatch.setattr(text, "TEMPLATE_SECONDS", 2)
    monkeypatch.chdir(tmp_path)  # default outputs (eval's results.json) land here, never in the repository
    args = [str(a) for a in build(world, tmp_path)]
    before = hashes(world), hashes(tmp_path)
    rc = PROGRAMS[program][0](args)
    err = capsys.readouterr().err
    _check(err, needle, rc)
    assert (hashes(world), hashes(tmp_path)) == before, "an input file changed"


@pytest.mark.parametrize("case", [c for c in CASES if c[4]], ids=[c[0] for c in CASES if c[4]])
def test_bad_input_as_a_process(case, world, tmp_path):
    name, program, build, needle, _ = case
    args = [str(a) for a in build(world, tmp_path)]
    before = hashes(world), hashes(tmp_path)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run([sys.executable, str(REPO_ROOT / PROGRAMS[program][1])] + args, capture_output=True, text=True,
                       env=env, cwd=tmp_path, timeout=300)
    _check(p.stderr, needle, p.returncode)
    assert (hashes(world), hashes(tmp_path)) == before, "an input file changed"


@pytest.mark.parametrize("table", ['{"x": 1}', "not json", "[]"])
def test_demo_mode_reads_the_sps_table_before_any_decoding(tmp_path, capsys, monkeypatch, table):
    """Demo mode decodes autoregressively first, for the side-by-side figures: a bad --sps-table is
    still refused before that pass, with nothing decoded."""
    bad = tmp_path / "sps.json"
    bad.write_text(table)
    calls = []
    generate = speculate.Engine.generate
    monkeypatch.setattr(speculate.Engine, "generate", lambda self, *a, **k: calls.append(1) or generate(self, *a, **k))
    rc = speculate.main(["--scheduler", "hardware", "--sps-table", str(bad), "--max-new-tokens", "8"])
    cap = capsys.readouterr()
    _check(cap.err, str(bad), rc)
    assert calls == [] and "--- autoregressive ---" not in cap.out and bad.read_text() == table


@pytest.mark.parametrize("given", [["--system-prompt", "Write short code."], ["--enable-thinking"]])
def test_demo_mode_refuses_a_system_prompt_naming_the_demos_prompts(capsys, given):
    """The demo's held-out prompts are token ids: a system prompt or thinking would reach its lead prompt
    alone. The error names the demo's prompts, not a --prompts-file the user never gave."""
    rc = speculate.main(["--chat", *given, "--max-new-tokens", "8"])
    err = capsys.readouterr().err
    _check(err, f"{given[0]}: the demo's held-out prompts (", rc)
    assert "reach the demo prompt alone" in err and "a prompt_ids record" not in err


def test_demo_mode_chat_renders_its_lead_prompt():
    """--chat in the demo renders its lead prompt (a text) and leaves the held-out token ids as they are:
    taken, not refused as changing nothing."""
    import tyro

    from support import flags

    args = tyro.cli(flags.Args, args=["--chat", "--max-new-tokens", "8"])
    args, _, lead = flags.resolve_demo(args, str(REPO_ROOT / "demo"))
    s = flags.check_command_line(args)
    m = speculate.load(args.target)
    prompts, sources = flags.read_prompts(args.prompts, args.rendering, m, s, lead)
    rendered = m.tokenizer.render_messages([{"role": "user", "content": lead}], add_generation_prompt=True)
    assert prompts[0] == m.tokenizer.encode(rendered) and sources[0] == "the demo prompt"
    held = [json.loads(line)["prompt_ids"] for line in open(REPO_ROOT / "demo" / "heldout.jsonl")]
    assert prompts[1:] == held


@pytest.mark.parametrize("key,value", [("sampling", 0), ("batch_capacity", True), ("verify_width", 5.0)])
def test_an_sps_table_key_of_another_type_is_refused(world, tmp_path, capsys, key, value):
    """0 is not false, true is not 1, 5.0 is not 5: the identity keys are compared as the JSON values they are."""
    table = tmp_path / "sps.json"
    args = [str(a) for a in S(world)] + ["--scheduler", "hardware", "--sps-table", str(table)]
    assert speculate.main(args) == 0
    saved = json.loads(table.read_text())
    assert saved[key] == value and type(saved[key]) is not type(value)  # equal in Python, another JSON value
    saved[key] = value
    table.write_text(json.dumps(saved))
    capsys.readouterr()
    rc = speculate.main(args)
    err = capsys.readouterr().err
    _check(err, f" is {value!r} in the table but", rc)
    assert f"sps.json: {key}" in err, err


def test_demo_mode_with_a_good_sps_table_shares_the_target_caches(tmp_path, capsys, monkeypatch):
    """Written by the first run, read by the second; the baseline's engine is as large as the speculative
    one, so the target's caches are kept between them (not reallocated under the speculative engine)."""
    import model

    sizes = []
    setup = model.Transformer.setup_caches
    monkeypatch.setattr(model.Transformer, "setup_caches", lambda self, b, n: sizes.append((b, n)) or setup(self, b, n))
    table = tmp_path / "sps.json"
    for _ in range(2):
        assert speculate.main(["--scheduler", "hardware", "--sps-table", str(table), "--max-new-tokens", "16"]) == 0
    assert len(sizes) >= 4 and len(set(sizes)) == 1, sizes
    cap = capsys.readouterr()
    assert "SPS table written to" in cap.err and "SPS table read from" in cap.err
    assert cap.out.count("greedy outputs identical: True") == 2


def test_chat_template_running_too_long_is_stopped(world, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(text, "TEMPLATE_SECONDS", 1)
    t = template("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}")(world, tmp_path)
    rc = speculate.main(P(t))
    _check(capsys.readouterr().err, "took longer than 1 s", rc)


def test_waiting_for_a_missing_peer_times_out(world, tmp_path):
    """WORLD_SIZE=2 with rank 0 alone: eval.py gives up after --dist-timeout with one line."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT), WORLD_SIZE="2", RANK="0", LOCAL_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    p = subprocess.run([sys.executable, str(REPO_ROOT / "eval.py")] + [str(a) for a in E(world)]
                       + ["--out", str(tmp_path / "r.json"), "--dist-timeout", "3"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    _check(p.stderr.splitlines()[-1] + "\n", "no process group", p.returncode)  # torch's own C++ log lines come first


@pytest.mark.parametrize("env,needle", [({"WORLD_SIZE": "2"}, "RANK"), ({"WORLD_SIZE": "2", "RANK": "5"}, "RANK=5"),
                                        ({"WORLD_SIZE": "2", "RANK": "0"}, "MASTER_ADDR"),
                                        ({"WORLD_SIZE": "x", "RANK": "0"}, "WORLD_SIZE")])
def test_inconsistent_torchrun_variables(world, tmp_path, capsys, monkeypatch, env, needle):
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    rc = ev.main([str(a) for a in E(world)] + ["--out", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and err.count("\n") == 1, err


@pytest.mark.parametrize("value", ["abc", "0", "-1"])
def test_a_bad_omp_num_threads_is_refused(world, monkeypatch, capsys, value):
    """OpenMP warns and runs on every CPU; the start line credited the variable. One line instead."""
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    rc = speculate.main([str(a) for a in S(world)])
    _check(capsys.readouterr().err, f"OMP_NUM_THREADS={value!r}: not a positive integer", rc)


def test_a_bad_omp_num_threads_is_refused_by_training(world, monkeypatch, capsys, tmp_path):
    """train.py has no --threads (torch's threads: every core, or OMP_NUM_THREADS): an invalid value is
    one line there too, not OpenMP's fallback with a training run after it."""
    monkeypatch.setenv("OMP_NUM_THREADS", "abc")
    rc = train.main([str(a) for a in T(world, tmp_path)])
    _check(capsys.readouterr().err, "OMP_NUM_THREADS='abc': not a positive integer (unset it)", rc)
    assert not (tmp_path / "out").exists()


def test_a_terminal_that_cannot_show_tau_gets_an_escape_not_a_traceback(world, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT), PYTHONIOENCODING="latin-1")
    p = subprocess.run([sys.executable, str(REPO_ROOT / "speculate.py")] + [str(a) for a in S(world)],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "\\u03c4=" in p.stdout


@pytest.mark.parametrize("chat_template,needle", [
    ([{"name": "tool_use", "template": "{{ 1 }}"}], "names no 'default' template"),
    (5, "'chat_template' must be a string, got int"),
])
def test_unusable_templates_refuse_only_what_they_would_render(world, tmp_path, capsys, chat_template, needle):
    """Token ids and --no-chat never render a template: they run as before; a text prompt is refused."""
    t = target_with(world, tmp_path, files={"tokenizer_config.json": json.dumps({"chat_template": chat_template})})
    assert speculate.main(["--target", t, "--prompt-ids", "1,2", "--max-new-tokens", "2"]) == 0
    assert speculate.main(["--target", t, "--prompt", "hi", "--no-chat", "--max-new-tokens", "2"]) == 0
    capsys.readouterr()
    _check_rc = speculate.main(["--target", t, "--prompt", "hi", "--max-new-tokens", "2"])
    _check(capsys.readouterr().err, needle, _check_rc)


def test_an_interruption_while_rendering_a_template_is_the_runs_not_the_templates(monkeypatch):
    """Ctrl-C inside a template's rendering ends the run as interrupted (130), not as a template error (2)."""
    from support.cli import Interrupted

    class Stuck:
        def generate(self, **context):
            raise Interrupted(2)
            yield ""

    monkeypatch.setitem(text._COMPILED, "{{ x }}", Stuck())
    with pytest.raises(Interrupted):
        text.render_template("{{ x }}", "chat_template.jinja", x=1)


def test_streaming_never_prints_the_start_of_a_stop_string_in_a_multibyte_character(capsys):
    """A stop string's first character decoded, its second still bytes short of a character: what is
    streamed holds back the character as well as the hold-back, so the stop's start is never printed."""
    from support.report import Printer

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", errors="replace")

    class Stop:
        strings = ["\u4e2d\u6587"]

        def cut(self, t):
            i = t.find(self.strings[0])
            return t if i < 0 else t[:i]

    printer = Printer(Tok(), Stop(), 1, 1)
    data = list("hi ".encode()) + list("\u4e2d\u6587".encode())
    req = type("Req", (), {})()
    for n in range(1, len(data) + 1):
        req.output_ids, req.finish_reason = data[:n], "stop" if n == len(data) else None
        printer.on_round(req)
    assert capsys.readouterr().out == "hi "


def test_the_template_box_leaves_ordinary_templates_as_jinja_renders_them():
    """Undefined values through the wrapped filters, numbers in format strings that are not widths, the
    filters with their usual arguments: the same text as jinja2's own sandbox, unwrapped."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    for t in ["{{ nothere | replace('a','b') }}|{{ nothere | join(', ') }}|{{ nothere | center(5) }}|{{ ['a'] | join(sep) }}",
              "{{ 'Date: 20240615 %s' % 'x' }}|{{ 'id 123456789: {}'.format('x') }}|{{ 'build 123456789 %s' | format('x') }}",
              "{{ ['a','b'] | join(', ') }}|{{ 'a-b' | replace('-', '+') }}|{{ 'x\ny' | indent(2, true) }}|"
              "{{ '%s-%s' | format(1, 2) }}|{{ 'x' | center(9) }}|{{ '{:>5}'.format(1) }}|{{ '%05d' % 3 }}|{{ 3 * 4 }}"]:
        assert text.render_template(t, "t.jinja") == plain.from_string(t).render(), t


def test_a_checkpoint_path_that_is_not_a_directory_names_its_flag(world, capsys):
    """The flag is named, as for a hub id: `--drafter PATH: is a file, not a directory`."""
    cal = world / "cal.json"
    cases = {"--target": ["--target", cal], "--drafter": ["--target", world / "target", "--drafter", cal]}
    for flag, argv in cases.items():
        rc = speculate.main([str(a) for a in argv] + ["--prompt-ids", "1"])
        _check(capsys.readouterr().err, f"error: {flag} {cal}: is a file, not a directory", rc)


@pytest.mark.parametrize("flags,needle", [
    (["--target-layer-ids", "none"], "--target-layer-ids: 'none' is not a comma-separated list"),
    (["--markov", "none", "--markov-rank", "256", "--confidence-with-markov"],
     "--confidence-with-markov needs a Markov head"),
    (["--mask-token-id", "100000"], "--mask-token-id: 100000 is outside the vocabulary"),
])
def test_the_drafter_flags_are_checked_before_the_data_is_read(world, tmp_path, capsys, monkeypatch, flags, needle):
    """The drafter's flags against the target come before the corpus is read (reading a chat corpus says what
    it packed: a line before the error, and minutes on a large one)."""
    monkeypatch.setattr(train.data, "load_corpus", lambda *a, **k: pytest.fail("the data was read first"))
    rc = train.main([str(a) for a in T(world, tmp_path) + flags])
    _check(capsys.readouterr().err, needle, rc)
