"""Decoding settings end to end, through `speculate.main` and `speculate.generate`: top-k, top-p and
min-p, exact under speculation; the target's generation_config.json as the default; per-request
reproducibility; stop strings; the output file; streaming; the Python API.

- The distribution tests of test_lossless.py, with filters: the first M generated tokens' joint
  distribution under speculative decoding equals the target's own filtered sampling, computed
  exactly from transformers' logits with test_sampling.py's by-definition filter — for each filter
  and their combination with a temperature, under the none, threshold and hardware schedules, in rows
  refilled by continuous batching, and with the Triton kernels (in Triton's interpreter, where installed).
  The filter parameters are chosen with a margin from every boundary (no cumulative probability or
  probability ratio within 2e-4 of the cut; float32 rounding is ~1e-6), so float32 against float64 cannot move a token across.
- A biased engine (the target's p not filtered in verification) fails the same check.
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import os
import re
import warnings

import pytest
import torch
from conftest import REPO_ROOT, chi2_pvalue, make_target_dir, run_captured
from drafters import make_any, make_drafter, make_target
from test_lossless import N_SAMPLES, P_MIN, SAMPLE_PROMPT, SV, M, read_trace, run_traced, seq_index, target_logits_after
from test_sampling import filtered_by_definition, margins
from test_scheduler import write_sps_table

import kernels
import sampling
import speculate
from sampling import Filters

torch.set_num_threads(1)


# ----------------------------------------------------------------------------------------
# Exactness under speculation: chi-square against the target's own filtered sampling

SAMPLE_DRAFTERS = {
    "oracle": dict(markov="vanilla", oracle=True, oracle_scale=1.0, norm_scale=0.05, block_size=2),
    "random": dict(markov="vanilla", oracle=False, block_size=2),
    "rnn-oracle": dict(markov="rnn", oracle=True, oracle_scale=1.0, norm_scale=0.05, block_size=2),
    "eagle3": dict(eagle3=True, ttt_length=2, norm_scale=0.05),
}


@pytest.fixture(scope="module")
def fenv(tmp_path_factory):
    d = tmp_path_factory.mktemp("sampling_filters")
    target = make_target(d / "target", vocab_size=SV, attn_scale=0.05)
    drafters = {name: make_any(d / name, target, **opts) for name, opts in SAMPLE_DRAFTERS.items()}
    prefixes, logits = target_logits_after(target, SAMPLE_PROMPT, M, SV)
    return dict(dir=str(d), target=target, drafters=drafters, prefixes=prefixes, logits=logits)


def filtered_joint(env, temperature: float, f: Filters) -> torch.Tensor:
    """P(t_1 .. t_M) under the target's own filtered sampling, from transformers' float64 logits."""
    prefixes, logits = env["prefixes"], env["logits"]
    rows = logits.reshape(-1, SV).tolist()
    assert min(margins(r, temperature, f) for r in rows) > 2e-4, "parameters too close to a cut: pick others"
    p = torch.tensor([filtered_by_definition(r, temperature, f) for r in rows], dtype=torch.float64)
    p = p.reshape(logits.shape)  # [V^(M-1), M, V]
    lp = p[:, :M - 1].gather(2, prefixes[:, :, None])[:, :, 0].prod(1)
    return (lp[:, None] * p[:, M - 1]).reshape(-1)


def flags(temperature: float, f: Filters) -> list:
    out = ["--temperature", temperature]
    if f.top_k:
        out += ["--top-k", f.top_k]
    if f.top_p < 1:
        out += ["--top-p", f.top_p]
    if f.min_p > 0:
        out += ["--min-p", f.min_p]
    return out


def sampled(env, drafter, temperature, f, *extra, prompt_args=None):
    args = ["--target", env["target"], "--drafter", env["drafters"][drafter], "--num-samples", N_SAMPLES,
            "--batch-size", N_SAMPLES, "--max-new-tokens", M, *flags(temperature, f), *extra]
    args += prompt_args or ["--prompt-ids", ",".join(map(str, SAMPLE_PROMPT))]
    return run_traced(env["dir"], args)


# (drafter, temperature, filters, schedule). The parameters sit at least 1e-3 from every cut
# (asserted in filtered_joint).
FILTER_CASES = [
    ("oracle", 1.0, Filters(0, 0.6), "threshold"),
    ("random", 1.0, Filters(0, 0.6), "none"),
    ("oracle", 1.0, Filters(0, 1.0, 0.26), "none"),
    ("rnn-oracle", 0.7, Filters(4, 0.7, 0.1), "none"),
    ("oracle", 1.0, Filters(3), "hardware"),
    ("eagle3", 0.8, Filters(5, 0.8, 0.05), "none"),
]


@pytest.mark.parametrize("drafter,temperature,f,schedule", FILTER_CASES,
                         ids=[f"{d}-T{t}-k{f.top_k}-p{f.top_p}-m{f.min_p}-{s}" for d, t, f, s in FILTER_CASES])
def test_filtered_sampling_follows_the_targets_filtered_distribution(fenv, drafter, temperature, f, schedule):
    extra = []
    if schedule == "threshold":
        extra = ["--confidence-threshold", 0.6]
    elif schedule == "hardware":  # a step time under which rounds verify 0, 1 or 2 drafts (test_scheduler.py)
        table = write_sps_table(os.path.join(fenv["dir"], "sps.json"), fenv["target"], fenv["drafters"][drafter],
                                N_SAMPLES, temperature, lambda b: N_SAMPLES + b, filters=f)
        extra = ["--scheduler", "hardware", "--sps-table", table]
    tr = sampled(fenv, drafter, temperature, f, *extra)
    outs = tr.outputs()
    assert all(len(o) == M for o in outs)
    p = chi2_pvalue(seq_index(outs, SV), filtered_joint(fenv, temperature, f))
    assert p > P_MIN, f"chi-square p = {p:.2e}"
    first = [r for r in tr.rounds if r["round"] == 0]
    acc = [r["accepted"] for r in first]
    # Rounds both accepted and rejected drafts (or were cut by the schedule), and a schedule varied.
    assert sum(1 for r in first if r["accepted"] < r["verified"]) + sum(1 for r in first if r["verified"] < 2) > 50
    assert sum(1 for a in acc if a > 0) > 50, collections.Counter((r["verified"], r["accepted"]) for r in first)
    if schedule != "none":  # the schedule cut verification short
        assert sum(1 for r in first if r["verified"] < 2) > 50, collections.Counter(r["verified"] for r in first)


def test_filtered_sampling_is_exact_in_rows_refilled_by_continuous_batching(fenv, tmp_path):
    f, T = Filters(3), 1.3
    long_prompt = [5, 6, 7, 1, 2, 4, 3, 0, 6, 5, 1, 1]
    pf = tmp_path / "mixed.jsonl"
    pf.write_text(json.dumps({"prompt_ids": long_prompt}) + "\n" + json.dumps({"prompt_ids": SAMPLE_PROMPT}) + "\n")
    half = N_SAMPLES // 2
    tr = run_traced(fenv["dir"], ["--target", fenv["target"], "--drafter", fenv["drafters"]["oracle"], "--prompts-file",
                                  pf, "--num-samples", half, "--batch-size", half // 2, "--max-new-tokens", M,
                                  *flags(T, f)])
    outs = tr.outputs()[half:]  # SAMPLE_PROMPT's samples, decoded in rows that held the long prompt
    joint = filtered_joint(fenv, T, f)
    p = chi2_pvalue(seq_index(outs, SV), joint)
    assert p > P_MIN / 2, f"chi-square p = {p:.2e}"


def test_chi_square_catches_verification_without_the_filters(fenv, monkeypatch):
    """The target's p left unfiltered in verification (the drafts still filtered): the check fails."""
    orig = sampling.accept_sampled

    def unfiltered(*args, filters=sampling.NO_FILTERS, **kwargs):
        return orig(*args, **kwargs)
    monkeypatch.setattr(sampling, "accept_sampled", unfiltered)
    f = Filters(3)
    tr = sampled(fenv, "random", 1.0, f)
    assert chi2_pvalue(seq_index(tr.outputs(), SV), filtered_joint(fenv, 1.0, f)) < P_MIN


def test_triton_kernels_apply_the_filters_alike(fenv, monkeypatch):
    """The Triton set under its interpreter gives the torch set's tokens with filters on (the chain
    falls back to the reference; verification filters the logits before its kernels)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    try:
        kernels.check_backend("triton", "cpu")
    except RuntimeError:
        pytest.skip("triton was imported outside its interpreter in this process")
    f = Filters(4, 0.9, 0.05)
    base = ["--target", fenv["target"], "--drafter", fenv["drafters"]["oracle"], "--num-samples", 24,
            "--batch-size", 8, "--max-new-tokens", 6, "--prompt-ids", "1,2,3", *flags(0.9, f), "--seed", 5]
    a = run_traced(fenv["dir"], base)
    b = run_traced(fenv["dir"], base + ["--kernels", "triton"])
    assert a.outputs() == b.outputs()


# ----------------------------------------------------------------------------------------
# A request's samples depend on the seed and its index only

def test_sampled_outputs_are_identical_across_batch_sizes_and_refills(fenv, tmp_path):
    pf = tmp_path / "p.jsonl"
    pf.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in ([1, 2, 3], [4], [5, 6, 7, 0, 1], [2, 2])))
    runs = {}
    for bs in (1, 3, 8):
        runs[bs] = run_traced(fenv["dir"], ["--target", fenv["target"], "--drafter", fenv["drafters"]["oracle"],
                                            "--prompts-file", pf, "--num-samples", 3, "--batch-size", bs,
                                            "--max-new-tokens", 9, "--temperature", 1.0, "--top-k", 5, "--top-p", 0.95,
                                            "--seed", 11])
    assert runs[1].outputs() == runs[3].outputs() == runs[8].outputs()
    assert len({tuple(o) for o in runs[1].outputs()}) > 6  # genuinely random samples


# ----------------------------------------------------------------------------------------
# generation_config.json as the default

@pytest.fixture(scope="module")
def chat_target(tmp_path_factory):
    d = tmp_path_factory.mktemp("gen_config")
    make_target_dir(d / "target", vocab_size=64, max_position_embeddings=256)
    drafter = make_drafter(d / "drafter", str(d / "target"), block_size=3, oracle=True, oracle_scale=2.0)
    return d, str(d / "target"), drafter


def with_generation_config(src, dst, **settings):
    import shutil
    shutil.copytree(src, dst)
    gen = json.load(open(os.path.join(dst, "generation_config.json")))
    gen.update(dict(do_sample=True), **settings)
    json.dump(gen, open(os.path.join(dst, "generation_config.json"), "w"))
    return str(dst)


def test_generation_config_sampling_is_the_default(chat_target, tmp_path):
    d, target, drafter = chat_target
    sampler = with_generation_config(target, tmp_path / "sampler", temperature=0.7, top_k=6,
                                     top_p=0.9)
    base = ["--drafter", drafter, "--prompt-ids", "5,6,7", "--max-new-tokens", 12, "--num-samples", 4,
            "--batch-size", 2, "--seed", 3]
    rc, out_default, err = run_captured(["--target", sampler, *base, "--output-file", tmp_path / "a.jsonl"])
    assert rc == 0, err
    assert f"sampling: temperature 0.7, top-k 6, top-p 0.9 (from {sampler}/generation_config.json)" in err
    rc, _, err2 = run_captured(["--target", sampler, *base, "--temperature", 0.7, "--top-k", 6, "--top-p", 0.9,
                                "--output-file", tmp_path / "b.jsonl"])
    assert rc == 0 and "(from --temperature, --top-k, --top-p)" in err2
    read = lambda p: [r["output_ids"] for r in sorted(map(json.loads, open(p)), key=lambda r: r["request"])]
    assert read(tmp_path / "a.jsonl") == read(tmp_path / "b.jsonl")  # the same settings, the same samples
    assert len({tuple(o) for o in read(tmp_path / "a.jsonl")}) > 1  # it sampled
    # --temperature 0 is greedy whatever the file says; the file's do_sample false is greedy too
    rc, _, err3 = run_captured(["--target", sampler, *base, "--temperature", 0, "--output-file", tmp_path / "c.jsonl"])
    rc, _, err4 = run_captured(["--target", target, *base, "--output-file", tmp_path / "d.jsonl"])
    assert "sampling: greedy (from --temperature)" in err3 and "does not set do_sample true" in err4
    assert read(tmp_path / "c.jsonl") == read(tmp_path / "d.jsonl")
    assert len({tuple(o) for o in read(tmp_path / "c.jsonl")}) == 1


def test_generation_config_sampling_not_applied_is_said(chat_target, tmp_path):
    """A penalty the file sets is not applied here: the sampling line says so (it was left out in silence);
    one set to the value that changes nothing is not named."""
    d, target, drafter = chat_target
    sampler = with_generation_config(target, tmp_path / "sampler", temperature=0.7, repetition_penalty=1.05,
                                     typical_p=1.0)
    rc, _, err = run_captured(["--target", sampler, "--prompt-ids", "5,6,7", "--max-new-tokens", 4])
    assert rc == 0, err
    assert (f"sampling: temperature 0.7 (from {sampler}/generation_config.json; not applied here: "
            f"repetition_penalty 1.05)") in err, err
    # greedy too: what changes transformers' greedy search is named, a sampling-only key is not
    greedy = with_generation_config(target, tmp_path / "greedy", do_sample=False, repetition_penalty=1.5,
                                    num_beams=4, suppress_tokens=[0, 200], typical_p=0.9, bad_words_ids=[])
    rc, _, err = run_captured(["--target", greedy, "--prompt-ids", "5,6,7", "--max-new-tokens", 4])
    assert rc == 0, err
    assert (f"sampling: greedy (no sampling flag, and {greedy}/generation_config.json does not set do_sample true; "
            f"not applied here: repetition_penalty 1.5, num_beams 4, suppress_tokens [0, 200])") in err, err


@pytest.mark.parametrize("key,value", [("top_p", 0), ("top_p", 1.5), ("top_k", 2.5), ("min_p", -0.1),
                                       ("temperature", 0), ("temperature", "hot"), ("do_sample", "yes")])
def test_bad_generation_config_values_are_one_line_errors(chat_target, tmp_path, key, value):
    d, target, drafter = chat_target
    bad = with_generation_config(target, tmp_path / "bad", **{key: value})
    rc, out, err = run_captured(["--target", bad, "--prompt-ids", "1,2", "--max-new-tokens", 2])
    assert rc == 2 and len(err.splitlines()) == 1 and "generation_config.json" in err and repr(key) in err, err
    assert "which replace the file" in err, err
    # a sampling flag replaces the file entirely: it is not read, so not refused
    rc, out, err = run_captured(["--target", bad, "--prompt-ids", "1,2", "--max-new-tokens", 2, "--temperature", 0.7])
    assert rc == 0, err


# ----------------------------------------------------------------------------------------
# Stop strings, --ignore-eos, text out

def test_stop_strings_cut_the_text_and_end_the_request(chat_target, tmp_path):
    from support.text import Tokenizer

    d, target, drafter = chat_target
    tok = Tokenizer(target)
    base = ["--target", target, "--drafter", drafter, "--prompt", "hello world", "--max-new-tokens", 40,
            "--ignore-eos"]
    rc, out, err = run_captured(base + ["--output-file", tmp_path / "full.jsonl"])
    assert rc == 0, err
    full = json.loads(open(tmp_path / "full.jsonl").read())
    words = full["text"].split()
    assert len(words) > 12 and full["finish_reason"] == "length"
    stop = " ".join(words[6:8])  # two words from the middle of the greedy text
    rc, out, err = run_captured(base + ["--stop", stop, "--stop", "never-generated", "--output-file",
                                        tmp_path / "cut.jsonl"])
    assert rc == 0, err
    cut = json.loads(open(tmp_path / "cut.jsonl").read())
    assert cut["finish_reason"] == "stop"
    assert cut["text"] == full["text"][:full["text"].find(stop)]
    ids = cut["output_ids"]
    assert ids == full["output_ids"][:len(ids)]  # greedy: the same tokens, cut
    assert stop in tok.decode(ids, skip_special_tokens=True)
    assert stop not in tok.decode(ids[:-1], skip_special_tokens=True)  # ends at the token completing it
    assert cut["num_rounds"] < full["num_rounds"]  # the request stopped decoding
    assert out.startswith(cut["text"]) and stop not in out.split("\n")[0]  # streamed, cut before the stop


def test_output_file_records_and_labelled_printing(chat_target, tmp_path):
    d, target, drafter = chat_target
    pf = tmp_path / "p.jsonl"
    pf.write_text(json.dumps({"prompt": "hello"}) + "\n" + json.dumps({"prompt_ids": [3, 4, 5]}) + "\n")
    rc, out, err = run_captured(["--target", target, "--drafter", drafter, "--prompts-file", pf, "--num-samples", 2,
                                 "--batch-size", 3, "--max-new-tokens", 8, "--temperature", 1.0, "--output-file",
                                 tmp_path / "o.jsonl", "--trace-file", tmp_path / "t.jsonl"])
    assert rc == 0, err
    recs = sorted(map(json.loads, open(tmp_path / "o.jsonl")), key=lambda r: r["request"])
    assert [(r["request"], r["prompt"], r["sample"]) for r in recs] == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    tr = read_trace(tmp_path / "t.jsonl")
    for r in recs:
        end = tr.requests[r["request"]]
        assert r["output_ids"] == end["output_ids"] and r["num_rounds"] == end["num_rounds"]
        assert r["acceptance_length"] == end["acceptance_length"] and r["finish_reason"] == end["finish_reason"]
        assert "<|im_end|>" not in r["text"] and isinstance(r["prompt_ids"], list)
    labels = re.findall(r"^--- request (\d+) of 4 \(prompt (\d+), sample (\d+)\): .* ---$", out, re.M)
    assert labels == [("1", "1", "1"), ("2", "1", "2"), ("3", "2", "1"), ("4", "2", "2")]  # counted from 1
    for r in recs:  # each text printed under its label
        assert f"): {len(r['output_ids'])} tokens, {r['finish_reason']}" in out
        assert r["text"] in out


def test_ignore_eos_runs_to_the_budget(chat_target):
    d, target, drafter = chat_target
    m = speculate.load(target, drafter)
    stop = sorted(m.stop_ids)[0]
    # a prompt after which EOS is likely: find one where the greedy output stops early
    for p in range(1, 64):
        c = speculate.generate(m, [p], max_new_tokens=30, temperature=0)[0]
        if c.finish_reason == "stop":
            break
    else:
        pytest.skip("no prompt of this tiny target stops early")
    assert c.output_ids[-1] == stop or c.output_ids[-1] in m.stop_ids
    d2 = speculate.generate(m, [p], max_new_tokens=30, temperature=0, ignore_eos=True)[0]
    assert d2.finish_reason == "length" and len(d2.output_ids) == 30
    assert d2.output_ids[:len(c.output_ids)] == c.output_ids


@pytest.mark.parametrize("flag,value,needle", [("--top-k", "-1", "--top-k"), ("--top-p", "0", "--top-p"),
                                               ("--top-p", "1.5", "--top-p"), ("--min-p", "2", "--min-p"),
                                               ("--min-p", "nan", "--min-p"), ("--stop", "", "--stop"),
                                               ("--threads", "0", "--threads")])
def test_bad_sampling_flags_are_one_line_errors(chat_target, flag, value, needle):
    d, target, drafter = chat_target
    rc, out, err = run_captured(["--target", target, "--prompt", "hi", "--max-new-tokens", 2, flag, value])
    assert rc == 2 and len(err.splitlines()) == 1 and needle in err, err


def test_stop_strings_without_a_tokenizer_are_an_error(fenv):
    rc, out, err = run_captured(["--target", fenv["target"], "--prompt-ids", "1,2", "--max-new-tokens", 2, "--stop",
                                 "x"])
    assert rc == 2 and "--stop" in err and "tokenizer" in err


# ----------------------------------------------------------------------------------------
# The Python API

@pytest.mark.parametrize("edit", [None, ("max_new_tokens=32", "max_new_tokens=1")], ids=["as_written", "no_round"])
def test_readme_api_example_runs(edit):
    """The README's Python example, run as written (it uses the committed demo pair), and with one argument
    changed so that every request ends before its first round (τ None)."""
    readme = (REPO_ROOT / "README.md").read_text()
    m = re.search(r"<!-- api-example -->\s*```python\n(.*?)```", readme, re.S)
    assert m, "README.md has no api-example block"
    code = m.group(1)
    if edit is not None:
        assert edit[0] in code
        code = code.replace(*edit)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md:api-example", "exec"), {"__name__": "readme"})
    assert out.getvalue().strip()


API_REFUSALS = [
    (dict(prompts=None), "prompts: expected a text"),
    (dict(prompts=5), "prompts: expected a text"),
    (dict(max_new_tokens=2.5), "--max-new-tokens: invalid value 2.5 (expected an integer)"),
    (dict(num_samples=2.0), "--num-samples: invalid value 2.0"),
    (dict(batch_size=1.5), "--batch-size: invalid value 1.5"),
    (dict(seed=-1), "--seed: invalid value -1"),
    (dict(seed=None), "--seed: invalid value None"),
    (dict(seed=2 ** 64), "--seed: invalid value"),
    (dict(temperature="0.5"), "--temperature: invalid value '0.5'"),
    (dict(confidence_threshold=2), "--confidence-threshold: invalid value 2.0"),
    (dict(confidence_threshold=-1), "--confidence-threshold: invalid value -1.0"),
    (dict(scheduler="none", confidence_threshold=0.5), "only --scheduler threshold uses it"),
    (dict(scheduler="hardware", confidence_threshold=0.5), "only --scheduler threshold uses it"),
    (dict(scheduler="threshold"), "needs --confidence-threshold above 0"),
    (dict(scheduler="bogus"), "--scheduler 'bogus': one of"),
    (dict(sps_table="x.json"), "--sps-table x.json: only --scheduler hardware or async"),
    (dict(stop=[5]), "--stop 5: a stop string must be a str"),
    (dict(stop=["\ud800"]), "lone surrogate"),
    (dict(compile_mode="default"), "--compile-mode default: only used with --compile"),
    (dict(kernels="bogus"), "--kernels 'bogus': one of torch, triton"),
    # None is no default of --kernels (it reached the backend check as a request for Triton)
    (dict(kernels=None), "--kernels None: one of torch, triton"),
    # NaN is no temperature: its own range, not the generic [0, 10000]
    (dict(temperature=float("nan")), "--temperature: invalid value nan (valid: 0 for greedy, or 0.0001 to 10000)"),
    (dict(stop=5), "--stop 5: a stop string or a list of them"),
    # the prompt's rendering, as --chat, --system-prompt and --enable-thinking (a system turn or thinking
    # without chat was dropped in silence; a non-string system prompt was a TypeError)
    (dict(prompts="hi", chat=False, system_prompt="Be brief."), "--system-prompt: prompts are not rendered as chat"),
    (dict(prompts="hi", chat=False, thinking=True), "--enable-thinking: prompts are not rendered as chat"),
    (dict(prompts="hi", system_prompt=""), "--system-prompt: empty"),
    (dict(prompts="hi", system_prompt=5), "--system-prompt: invalid value 5 (a string, or None)"),
    (dict(prompts="hi", thinking="no"), "--enable-thinking: invalid value 'no' (True or False)"),
    (dict(prompts="hi", thinking=None), "--enable-thinking: invalid value None (True or False)"),
    (dict(prompts="hi", chat="no"), "--chat: invalid value 'no' (True, False or None)"),
    # chat given where nothing is rendered, refused as --prompt-ids --chat is
    (dict(chat=True), "--chat: every prompt is token ids, never rendered; it would change nothing"),
    (dict(prompts=[[1, 2], [3]], chat=True), "--chat: every prompt is token ids, never rendered"),
    # an empty list is no prompt at all, not token ids
    (dict(prompts=[[]], chat=True), "prompt 0: empty prompt"),
    # a system turn or thinking for token ids: nothing is rendered, whatever the tokenizer's template
    (dict(thinking=True), "--enable-thinking: every prompt is token ids, not a rendered chat; it would change"),
    (dict(prompts=[[1, 2], [3]], system_prompt="Be brief."), "--system-prompt: every prompt is token ids"),
]


@pytest.mark.parametrize("bad,needle", API_REFUSALS, ids=[str(b) for b, _ in API_REFUSALS])
def test_api_checks_its_arguments_as_the_flags(chat_target, bad, needle):
    """What the command line refuses, generate() refuses too, before any work, naming the flag — it ran
    (a threshold of 2 verified nothing, a scheduler/threshold pair was quietly changed), or failed deep in
    torch (a float budget, a float or None seed)."""
    d, target, drafter = chat_target
    m = speculate.load(target, drafter)
    kw = dict(prompts=[1, 2, 3], max_new_tokens=4, temperature=0)
    kw.update(bad)
    with pytest.raises(speculate.UserError, match=re.escape(needle)):
        speculate.generate(m, kw.pop("prompts"), **kw)


def test_chat_with_token_ids_among_text_prompts_is_taken(chat_target, tmp_path):
    """--chat refused only where no prompt is rendered: token ids beside a text, in the API and in a prompts
    file, decode (the text rendered, the ids as given)."""
    d, target, drafter = chat_target
    m = speculate.load(target, drafter)
    done = speculate.generate(m, [[1, 2, 3], "hi"], chat=True, max_new_tokens=2, temperature=0)
    assert done[0].prompt_ids == [1, 2, 3] and done[1].prompt_ids == speculate.encode(m.tokenizer, "hi", "", chat=True)
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(json.dumps({"prompt_ids": [1, 2, 3]}) + "\n" + json.dumps({"prompt": "hi"}) + "\n")
    rc, _, err = run_captured(["--target", target, "--drafter", drafter, "--prompts-file", mixed, "--chat",
                               "--max-new-tokens", 2])
    assert rc == 0, err


def test_api_takes_what_a_python_caller_passes(chat_target):
    """A lone stop string is one stop string (it was split into characters); numpy numbers are numbers; the
    completions carry their rounds, so metrics.py pools them as the command line's summary does; load()
    checks its arguments too."""
    import numpy as np

    from support import metrics
    d, target, drafter = chat_target
    m = speculate.load(target, drafter)
    assert speculate.generate(m, "hello world", max_new_tokens=12, temperature=0, stop=None) == \
        speculate.generate(m, "hello world", max_new_tokens=12, temperature=0)
    one = speculate.generate(m, "hello world", max_new_tokens=12, temperature=0, stop="world")
    listed = speculate.generate(m, "hello world", max_new_tokens=12, temperature=0, stop=["world"])
    assert one == listed
    a = speculate.generate(m, [[7, 8, 9], [3, 4]], max_new_tokens=np.int64(10), temperature=np.float32(0.9),
                           seed=np.int32(4))
    b = speculate.generate(m, [[7, 8, 9], [3, 4]], max_new_tokens=10, temperature=0.9, seed=4)
    assert [c.output_ids for c in a] == [c.output_ids for c in b]
    c = metrics.count(b, m.drafter.cfg.num_drafts, m.stop_ids)
    assert c["num_rounds"] == sum(x.num_rounds for x in b) > 0
    assert metrics.acceptance_length(c) == pytest.approx(
        sum(x.acceptance_length * x.num_rounds for x in b) / c["num_rounds"])
    for kw, needle in ((dict(dtype="fp8"), "--dtype 'fp8': one of"), (dict(device="tpu"), "--device 'tpu'")):
        with pytest.raises(speculate.UserError, match=re.escape(needle)):
            speculate.load(target, drafter, **kw)
    for prompt, n, needle in (([1, 2, 10 ** 6], 8, "outside the vocabulary"), ([], 8, "empty prompt"),
                              ([1, 2], 0, "--max-new-tokens: invalid value 0")):
        with pytest.raises(speculate.UserError, match=re.escape(needle)):
            speculate.generate(m, [prompt], max_new_tokens=n)
    with pytest.raises(speculate.UserError, match=re.escape("--temperature: invalid value -1.0 (valid: 0 for greedy, "
                                                            "or 0.0001 to 10000)")):
        speculate.generate(m, [[1, 2]], temperature=-1.0)
    engine = speculate.Engine(m.target, m.drafter, batch_size=1, max_seq=32, temperature=np.float32(0.5))
    req = speculate.Request(0, [1, 2, 3])
    engine.generate([req], np.int64(5))  # the engine trusts what the API checked; numpy numbers work
    assert len(req.output_ids) == 5


def test_api_refuses_more_requests_than_the_command_line_takes(chat_target, monkeypatch):
    """Prompts x samples past 10,000,000 requests is one line from generate, make_engine and decode, as
    from the command line's prompts (they were built, all of them, and decoded)."""
    from support import flags
    d, target, drafter = chat_target
    m = speculate.load(target, drafter)
    small = flags.check_settings(speculate.Settings(max_new_tokens=2, temperature=0), "cpu")
    engine = speculate.make_engine(m, m.drafter, [[1, 2]], small, verbose=False)

    def built(prompts, num_samples):
        raise AssertionError(f"{len(prompts) * num_samples} requests built")

    monkeypatch.setattr(speculate, "requests_for", built)
    needle = "--num-samples 10000000: 3 prompts x 10000000 samples is more than 10,000,000 requests"
    prompts = [[1, 2], [3], [4, 5]]
    with pytest.raises(speculate.UserError, match=re.escape(needle)):
        speculate.generate(m, prompts, max_new_tokens=2, temperature=0, num_samples=10_000_000)
    many = flags.check_settings(speculate.Settings(max_new_tokens=2, temperature=0, num_samples=10_000_000), "cpu")
    with pytest.raises(speculate.UserError, match=re.escape(needle)):
        speculate.make_engine(m, m.drafter, prompts, many, verbose=False)
    with pytest.raises(speculate.UserError, match=re.escape(needle)):
        speculate.decode(m, prompts, many, engine)


@pytest.mark.parametrize("device", [None, "", 0, False])
def test_load_refuses_a_device_that_is_no_name(chat_target, device):
    """load's device is "cpu" by default; None, "" and other non-names were taken as the command line's
    default (cuda where there is one)."""
    d, target, drafter = chat_target
    with pytest.raises(speculate.UserError, match=re.escape(f"load(): device={device!r} (\"cpu\" or \"cuda\")")):
        speculate.load(target, drafter, device=device)


@pytest.mark.parametrize("kw,needle", [
    (dict(temperature=-1.0), "Engine temperature: invalid value -1.0 (valid: 0 for greedy, or 0.0001 to 10000)"),
    (dict(temperature=None), "Engine temperature: invalid value None"),
    (dict(filters=speculate.Filters(top_p=0.0)), "--top-p: invalid value 0.0"),
    (dict(filters=None), "filters: a sampling.Filters, got NoneType None"),
    (dict(backend="Triton"), "--kernels 'Triton': one of torch, triton"),
    # a batch of 0 returned the requests undecoded; a negative one, or max_seq, failed inside torch
    (dict(batch_size=0), "--batch-size: invalid value 0"),
    (dict(batch_size=2.0), "--batch-size: invalid value 2.0 (expected an integer)"),
    (dict(max_seq=-1), "Engine max_seq: invalid value -1 (a positive integer)"),
    (dict(seed=-1), "--seed: invalid value -1"),
    (dict(seed="x"), "--seed: invalid value 'x' (expected an integer)"),
    (dict(stop_ids="0"), "Engine stop_ids: invalid value '0' (token ids, integers)"),
])
def test_engine_built_by_hand_checks_its_arguments(chat_target, kw, needle):
    """An engine's size, seed, stop ids, temperature, filters and kernels are checked as the flags' values
    are, when it is built (a negative temperature was a TypeError inside sampling; an unknown backend
    decoded with torch's; stop_ids "0" stopped on nothing)."""
    d, target, drafter = chat_target
    m = speculate.load(target, drafter)
    given = dict(batch_size=1, max_seq=64)
    given.update(kw)
    with pytest.raises(speculate.UserError, match=re.escape(needle)):
        speculate.Engine(m.target, m.drafter, **given)


def test_load_without_a_target_says_where_the_demo_pair_is(monkeypatch, tmp_path):
    """Installed without -e, the demo pair is not beside the modules: one line saying so (it was 'target
    directory not found' for a path the user never gave)."""
    monkeypatch.setattr(speculate, "DEMO_DIR", str(tmp_path / "demo"))
    with pytest.raises(speculate.UserError, match=re.escape(f"the demo pair is not at {tmp_path / 'demo'}")):
        speculate.load()


def test_generate_warns_of_a_calibration_only_where_the_call_reads_it(chat_target, tmp_path):
    """A calibration fitted at another temperature is noted by a call that reads the confidences (a
    schedule), not by one that leaves it unread (no schedule, greedy), as api.md says."""
    d, target, drafter = chat_target
    cal = tmp_path / "sts.json"
    cal.write_text(json.dumps({"temperatures": [1.0] * 3, "temperature": 1.0}))
    m = speculate.load(target, drafter, calibration=cal)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        speculate.generate(m, [[1, 2, 3]], max_new_tokens=4, temperature=0)
    with pytest.warns(UserWarning, match=re.escape("was fitted at temperature 1 (this run: 0)")):
        speculate.generate(m, [[1, 2, 3]], max_new_tokens=4, temperature=0, confidence_threshold=0.5)


def test_api_takes_paths_and_numpy_booleans_and_names_a_wrong_type(chat_target, tmp_path):
    """load() takes pathlib paths as it takes strings (a Path calibration was an AttributeError) and names a
    wrong type (an int target was a TypeError from posixpath); numpy booleans are booleans, as numpy numbers
    are numbers (np.True_ was refused as 'not True or False')."""
    import pathlib

    import numpy as np
    d, target, drafter = chat_target
    cal = tmp_path / "sts.json"
    cal.write_text(json.dumps({"temperatures": [1.0] * 3}))
    m = speculate.load(pathlib.Path(target), pathlib.Path(drafter), calibration=cal)
    assert m.calibration == str(cal)
    for kw, needle in ((dict(target=5), "--target: invalid value 5 (a path or hub id"),
                       (dict(target=target, drafter=[drafter]), "--drafter: invalid value ["),
                       (dict(target=target, drafter=drafter, calibration=3), "--calibration: invalid value 3")):
        with pytest.raises(speculate.UserError, match=re.escape(needle)):
            speculate.load(**kw)
    plain = speculate.load(target, drafter)
    want = speculate.generate(plain, "hello world", max_new_tokens=6, temperature=0, ignore_eos=True, chat=False)
    got = speculate.generate(plain, "hello world", max_new_tokens=6, temperature=0, ignore_eos=np.bool_(True),
                             chat=np.bool_(False), thinking=np.bool_(False), compile=np.bool_(False))
    assert [c.output_ids for c in got] == [c.output_ids for c in want]


def test_load_without_the_cpu_kernels_runs_every_module_as_written(chat_target):
    """cpu_kernels=False: the plain model, so a hook on q_proj is reached (the kernels' stacked projection
    never calls q_proj), with the same tokens; performance.md's `cpu_kernels=False` was a TypeError here."""
    from support import cpu_kernels

    d, target, drafter = chat_target
    calls = []
    outputs = []
    for on in (True, False):
        m = speculate.load(target, drafter, cpu_kernels=on)
        m.target.layers[0].self_attn.q_proj.register_forward_hook(lambda *a, on=on: calls.append(on))
        done = speculate.generate(m, "hello world", max_new_tokens=6, temperature=0, chat=False)
        outputs.append(done[0].output_ids)
        installed = any(type(x) is cpu_kernels.PanelLinear for x in m.target.modules())
        assert installed == (on and cpu_kernels.unavailable() is None)
    assert outputs[0] == outputs[1] and False in calls
    with pytest.raises(speculate.UserError, match=re.escape("load(): cpu_kernels='no' (True or False)")):
        speculate.load(target, drafter, cpu_kernels="no")


def test_make_engine_and_decode_check_their_prompts_and_settings(chat_target):
    """The documented driver checks what it is given as generate does: an empty list, an empty prompt, text,
    an id outside the vocabulary and unchecked settings were a ValueError, IndexError or TypeError from deep
    inside (the embedding's own, for the id)."""
    from support import flags
    from support.flags import Settings
    d, target, drafter = chat_target
    m = speculate.load(target, drafter)
    s = flags.check_settings(Settings(max_new_tokens=4, temperature=0), "cpu")
    ids = [[10, 20, 30], [5, 6]]
    engine = speculate.make_engine(m, m.drafter, ids, s, verbose=False)
    assert len(speculate.decode(m, ids, s, engine)) == 2
    cases = [(m, [], s, "prompts: a non-empty list of token-id lists"),
             (m, [[]], s, "prompt 0: empty prompt"),
             (m, ["abc"], s, "prompt 0: a list of token ids, got 'abc'"),
             (m, [[1, 2], [True]], s, "prompt 1: a list of token ids"),
             (m, [[99999]], s, "prompt 0: token id 99999 is outside the vocabulary"),
             (m, ids, Settings(), "settings: not checked"),
             ("demo", ids, s, "models: speculate.load()'s result, got str 'demo'"),
             (m.target, ids, s, "models: speculate.load()'s result, got Transformer")]
    for models, prompts, settings, needle in cases:
        with pytest.raises(speculate.UserError, match=re.escape(needle)):
            speculate.decode(models, prompts, settings, engine)
        with pytest.raises(speculate.UserError, match=re.escape(needle)):
            speculate.make_engine(models, m.drafter, prompts, settings, verbose=False)
    for models in ("demo", m.target):
        with pytest.raises(speculate.UserError, match=re.escape("models: speculate.load()'s result, got ")):
            speculate.generate(models, "def f():", max_new_tokens=4)
    # an engine or a drafter of the wrong kind was an AttributeError; an engine of other models decoded
    # with those models' target and drafter in silence
    for bad in (None, "engine", m.target):
        with pytest.raises(speculate.UserError, match=re.escape("engine: an Engine (speculate.make_engine(")):
            speculate.decode(m, ids, s, bad)
    other = speculate.load(target, drafter)
    with pytest.raises(speculate.UserError, match=re.escape("engine: built on other models; make_engine(m")):
        speculate.decode(other, ids, s, engine)
    for bad, name in ((drafter, "str"), (m.target, "Transformer"), (m, "Models")):
        with pytest.raises(speculate.UserError, match=re.escape(f"drafter: None or a loaded drafter (the "
                                                                f"models' m.drafter), got {name} ")):
            speculate.make_engine(m, bad, ids, s, verbose=False)
    # an engine without a drafter: what only a drafter reads (an IndexError or AttributeError inside)
    for kw, needle in ((dict(tree_budget=4), "--tree-budget 4: a tree is drafted by a drafter"),
                       (dict(tree_budget=4, temperature=1.0), "--tree-budget 4: a tree is drafted by a drafter"),
                       (dict(draft_length=3), "--draft-length 3: sets how many drafts")):
        settings = flags.check_settings(Settings(max_new_tokens=4, **kw), "cpu")
        with pytest.raises(speculate.UserError, match=re.escape(needle)):
            speculate.make_engine(m, None, ids, settings, verbose=False)


def test_weights_edited_between_calls_decode_as_edited(chat_target):
    """An ablation between two calls (every MLP's down_proj zeroed in place) decodes as the plain model with
    that edit does: the CPU kernels' panel copies follow (they decoded the unedited weights in silence), on
    an engine reused across the edit too."""
    from support import flags
    from support.flags import Settings
    d, target, drafter = chat_target
    prompts = [[7, 8, 9], [3, 4]]
    from support.checkpoint import load_models
    plain = load_models(target, drafter, cpu_kernels=False)
    m = speculate.load(target, drafter)
    project = m.target.layers[0].self_attn.project
    before = [c.output_ids for c in speculate.generate(m, prompts, max_new_tokens=12, temperature=0)]
    assert m.target.layers[0].self_attn.project is project  # unedited: installed once (what a graph traced)
    s = flags.check_settings(Settings(max_new_tokens=12, temperature=0), "cpu")
    engine = speculate.make_engine(m, m.drafter, prompts, s, verbose=False)
    with torch.no_grad():
        for models in (plain, m):
            for layer in models.target.layers:
                layer.mlp.down_proj.weight.zero_()
    want = [c.output_ids for c in speculate.generate(plain, prompts, max_new_tokens=12, temperature=0)]
    assert want != before
    assert [c.output_ids for c in speculate.generate(m, prompts, max_new_tokens=12, temperature=0)] == want
    with torch.no_grad():
        for models in (plain, m):
            for layer in models.target.layers:
                layer.mlp.down_proj.weight.fill_(0.01)
    want = [c.output_ids for c in speculate.generate(plain, prompts, max_new_tokens=12, temperature=0)]
    assert [c.output_ids for c in speculate.decode(m, prompts, s, engine)] == want


def test_threads_sharing_models_take_turns(chat_target):
    """Two threads calling generate on one Models (a thread pool, a web server): each call's output is the
    one it gives alone. The models' caches belong to one engine at a time; a second thread's engine put
    its own in mid-decode (other tokens in silence, or an error from the attention kernel)."""
    import threading
    d, target, drafter = chat_target
    m = speculate.load(target, drafter)
    calls = {"a": ([[7, 8, 9], [3, 4]], dict(max_new_tokens=24, temperature=0)),
             "b": ([[5, 6], [1, 2, 3], [9]], dict(max_new_tokens=32, temperature=0, batch_size=2))}
    want = {name: [c.output_ids for c in speculate.generate(m, p, **kw)] for name, (p, kw) in calls.items()}
    got = {name: [] for name in calls}

    def work(name):
        prompts, kw = calls[name]
        for _ in range(4):
            try:
                got[name].append([c.output_ids for c in speculate.generate(m, prompts, **kw)])
            except Exception as e:  # noqa: BLE001 - recorded, compared below
                got[name].append(repr(e))

    threads = [threading.Thread(target=work, args=(name,)) for name in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == {name: [want[name]] * 4 for name in calls}


def test_a_decode_callback_calling_the_api_on_the_same_models_is_refused(chat_target):
    """A callback (on_finish, on_round) calling generate on the models that are decoding re-entered the
    per-Models lock on the same thread: the nested engine replaced the caches the running decode read (an
    IndexError, or other greedy tokens in silence). It is one UserError, and the models decode as before."""
    from support import flags
    from support.flags import Settings
    d, target, drafter = chat_target
    m = speculate.load(target, drafter)
    nested = "generate, make_engine or decode called from a decode callback on the same models"
    s = flags.check_settings(Settings(max_new_tokens=8, batch_size=2, temperature=0), "cpu")
    ids = [[34, 16, 25, 10], [5, 6, 7], [30, 31, 32], [7, 8, 9]]
    e = speculate.make_engine(m, m.drafter, ids, s, verbose=False)

    def follow_up(c):
        speculate.generate(m, [c.prompt_ids + c.output_ids], max_new_tokens=4, temperature=0)

    with pytest.raises(speculate.UserError, match=re.escape(nested)):
        speculate.decode(m, ids, s, e, on_finish=follow_up)
    s1 = flags.check_settings(Settings(max_new_tokens=8, batch_size=1, temperature=0), "cpu")
    P = [[34, 16, 25, 10], [5, 6, 7, 8], [30, 31, 32, 33]]
    e1 = speculate.make_engine(m, m.drafter, P, s1, verbose=False)
    ref = [c.output_ids for c in speculate.decode(m, P, s1, e1)]
    calls = [lambda: speculate.generate(m, [list(range(10, 38))], max_new_tokens=4, temperature=0),
             lambda: speculate.make_engine(m, None, P, s1, verbose=False),
             lambda: speculate.decode(m, P, s1, e1)]
    for call in calls:
        with pytest.raises(speculate.UserError, match=re.escape(nested)):
            speculate.decode(m, P, s1, e1, on_round=lambda req, entry: call())
    assert [c.output_ids for c in speculate.decode(m, P, s1, e1)] == ref
    fresh = speculate.load(target, drafter)
    assert [c.output_ids for c in speculate.generate(m, P, max_new_tokens=8, temperature=0)] == \
        [c.output_ids for c in speculate.generate(fresh, P, max_new_tokens=8, temperature=0)]


def test_drafts_per_round_is_the_drafters_unless_an_eagle3_chain_is_given_one(chat_target, tmp_path):
    """api.md passes draft_length to drafts_per_round before metrics.count: a block drafter drafts its block
    whatever is passed (it returned the number passed), an Eagle3 chain the number asked for."""
    from drafters import make_eagle3
    d, target, drafter = chat_target
    block = speculate.load(target, drafter).drafter
    eagle3 = speculate.load(target, make_eagle3(tmp_path / "eagle3", target, ttt_length=4)).drafter
    assert speculate.drafts_per_round(block, 2) == speculate.drafts_per_round(block) == block.cfg.num_drafts
    assert speculate.drafts_per_round(eagle3, 2) == 2 and speculate.drafts_per_round(eagle3) == 4
    assert speculate.drafts_per_round(None, 2) == 0


def test_the_callbacks_time_is_not_decoding_time(chat_target):
    """What on_round and on_finish take (a trace's writes and fsyncs, a progress bar) stays out of the
    engine's prefill and decode seconds, and so out of the tokens/s a run reports: the demo's speculative
    decode paid for its files and the autoregressive baseline, which writes none, did not."""
    import time
    d, target, drafter = chat_target
    m = speculate.load(target, drafter)
    engine = speculate.Engine(m.target, m.drafter, batch_size=2, max_seq=64)
    requests = [speculate.Request(i, [3 + i, 4, 5]) for i in range(3)]
    slept = []

    def slow(*args):
        time.sleep(0.05)
        slept.append(0.05)

    engine.generate(requests, 12, on_round=slow, on_finish=slow)
    assert len(slept) > 5 and all(len(r.output_ids) == 12 for r in requests)
    assert engine.prefill_seconds + engine.decode_seconds < 0.5 * sum(slept)


def test_api_matches_the_cli_and_refuses_what_cannot_fit(chat_target, tmp_path):
    d, target, drafter = chat_target
    m = speculate.load(target, drafter)
    api = speculate.generate(m, ["hello world", [7, 8, 9]], max_new_tokens=10, temperature=0.9, top_k=5, seed=4,
                             num_samples=2, batch_size=3)
    pf = tmp_path / "p.jsonl"
    pf.write_text(json.dumps({"prompt": "hello world"}) + "\n" + json.dumps({"prompt_ids": [7, 8, 9]}) + "\n")
    rc, out, err = run_captured(["--target", target, "--drafter", drafter, "--prompts-file", pf, "--max-new-tokens", 10,
                                 "--temperature", 0.9, "--top-k", 5, "--seed", 4, "--num-samples", 2, "--batch-size", 1,
                                 "--output-file", tmp_path / "o.jsonl"])
    assert rc == 0, err
    recs = sorted(map(json.loads, open(tmp_path / "o.jsonl")), key=lambda r: r["request"])
    assert [c.output_ids for c in api] == [r["output_ids"] for r in recs]
    assert [c.text for c in api] == [r["text"] for r in recs]
    conv = speculate.generate(m, [{"role": "user", "content": "hello world"}], max_new_tokens=10, temperature=0)
    text = speculate.generate(m, "hello world", max_new_tokens=10, temperature=0)
    assert conv[0].output_ids == text[0].output_ids  # one user turn = the text through the template
    with pytest.raises(speculate.UserError, match="context"):
        speculate.generate(m, [1] * 250, max_new_tokens=10)


def test_the_round_record_is_read_in_the_order_it_is_packed():
    """pack_record and unpack both follow RoundRecord's fields: the widths' own order does not matter (unpack
    followed it, so a reordering read the `finite` flag as a confidence, in silence)."""
    columns = dict(drafts=torch.tensor([[5, 6, 7]]), verified=torch.tensor([2]), accepted=torch.tensor([1]),
                   bonus=torch.tensor([9]), finite=torch.tensor([True]), confidence=torch.tensor([[0.5, 0.25, 0.125]]))
    packed = speculate.pack_record(**columns)
    widths = speculate.record_widths(draft_width=3, confidence=True)
    want = speculate.RoundRecord([5, 6, 7], 2, 1, 9, True, [0.5, 0.25, 0.125])
    assert speculate.unpack(packed, widths) == [want]
    assert speculate.unpack(packed, dict(reversed(widths.items()))) == [want]


def test_api_md_recipe_gives_each_completions_tau_with_and_without_ignore_eos(tmp_path):
    """api.md's recipe for the run's figures counts with the stop ids the run ended rounds at: the target's,
    or none under ignore_eos (counted with the target's there, a round went on past an accepted EOS in the
    run but ended at it in the recipe, and τ came out lower)."""
    import shutil

    from support import metrics
    target = tmp_path / "target"
    shutil.copytree(os.path.join(speculate.DEMO_DIR, "target"), target)
    for name, eos in (("generation_config.json", [15]), ("config.json", 15)):  # a frequent token as EOS
        path = target / name
        config = json.loads(path.read_text())
        config["eos_token_id"] = eos
        path.write_text(json.dumps(config))
    m = speculate.load(str(target), os.path.join(speculate.DEMO_DIR, "drafter"))
    K = speculate.drafts_per_round(m.drafter)
    heldout = [json.loads(line)["prompt_ids"] for line in open(os.path.join(speculate.DEMO_DIR, "heldout.jsonl"))]
    for ignore_eos in (True, False):
        stop_ids = m.stop_ids
        if ignore_eos:  # as api.md says
            stop_ids = ()
        for prompt in heldout[:3]:
            [done] = speculate.generate(m, [prompt], max_new_tokens=40, ignore_eos=ignore_eos)
            tau = metrics.acceptance_length(metrics.count([done], K, stop_ids))
            assert tau == pytest.approx(done.acceptance_length)
