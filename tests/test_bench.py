"""bench.py's loops agree with each other, and the random real-shaped presets have the right shapes."""

from __future__ import annotations

import json
import logging
import sys
import warnings

import bench
import pytest
from drafters import make_drafter, make_eagle3, make_target

from support.checkpoint import random_drafter, random_target


def test_presets_on_meta():
    t = random_target("qwen3-8b", device="meta")
    assert sum(p.numel() for p in t.parameters()) == 8_190_735_360
    d = random_drafter(t)
    assert d.cfg.target_layer_ids == (1, 9, 17, 25, 33) and d.cfg.block_size == 7
    assert d.cfg.layers.num_hidden_layers == 5 and d.cfg.markov_rank == 256 and d.cfg.confidence_with_markov
    assert random_drafter(random_target("qwen3-14b", device="meta")).cfg.target_layer_ids == (1, 10, 19, 28, 37)
    t4 = random_target("qwen3-4b", device="meta")
    assert t4.lm_head.weight is t4.embed_tokens.weight


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_bench_rows_and_reference_agree(tmp_path, capsys):
    target = make_target(tmp_path / "t")
    drafter = make_drafter(tmp_path / "d", target, oracle=True, oracle_scale=4.0, norm_scale=0.05)
    out = tmp_path / "bench.json"
    # The reference loop hands transformers a cache object under the keyword it wants: no deprecation
    # warning, neither a Python one nor one through transformers' (once-only, so reset) logger.
    once = getattr(logging.Logger, "warning_once", None)
    if hasattr(once, "cache_clear"):
        once.cache_clear()
    logged = _Records()
    logging.getLogger("transformers").addHandler(logged)
    try:
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            # bench.run raises if speculative != autoregressive output, or the reference loop differs.
            rc = bench.main(["--target", target, "--drafter", drafter, "--no-compile", "--batch-sizes", "1,2",
                             "--prompt-len", "6", "--max-new-tokens", "20", "--reference", "True", "--repeats", "2",
                             "--out", str(out)])
    finally:
        logging.getLogger("transformers").removeHandler(logged)
    assert rc == 0, capsys.readouterr().err
    assert [str(w.message) for w in warned] == [] and logged.messages == []
    rows = json.load(open(out))["rows"]
    assert [(r["mode"], r["batch"]) for r in rows] == [
        ("autoregressive", 1), ("speculative", 1), ("reference (transformers target, eager drafter)", 1),
        ("autoregressive", 2), ("speculative", 2)]
    spec = [r for r in rows if r["mode"] == "speculative"]
    assert all(r["acceptance_length"] > 2 for r in spec)
    assert all(r["bytes_per_round"] > 0 and r["round_ms"] > 0 for r in spec)
    for r in rows:  # the split comes from one run's own rounds: its parts add up to that round, none negative
        if "draft_ms" in r:
            assert min(r["draft_ms"], r["verify_ms"], r["rest_ms"]) >= 0 and r["verify_ms"] > 0
            assert r["draft_ms"] + r["verify_ms"] + r["rest_ms"] == pytest.approx(r["split_round_ms"], rel=1e-9)
            assert (r["draft_ms"] > 0) == (r["mode"] == "speculative")
    result = json.load(open(out))
    assert result["complete"] is True  # rewritten after each batch size; the last one marks it complete
    assert all(len(r["tokens_per_second_runs"]) == 2 for r in rows)
    assert [r["ratio"] for r in result["ratios"]] == [
        "speculative / autoregressive at batch 1", "this engine / the reference loop at batch 1",
        "speculative / autoregressive at batch 2"]
    assert all(len(r["runs"]) == 2 and r["median"] > 0 for r in result["ratios"])
    printed = capsys.readouterr().out
    assert "speculative / autoregressive at batch 1" in printed and "copy bandwidth" in printed
    assert "models built in" in printed  # what the start line's seconds timed
    ratio_lines = [l for l in printed.splitlines() if l.startswith("speculative / autoregressive")]
    assert all("runs under a second: noise" in l for l in ratio_lines), ratio_lines  # 20 tokens: far under
    assert "at batch > 1 eager speculation on a CPU" in ratio_lines[-1], ratio_lines


def test_without_a_drafter_the_engine_is_compared_with_the_reference_target(tmp_path, capsys):
    """No --drafter: the reference loop is transformers' target decoding alone, and the engine's
    autoregressive mode is what it is compared with."""
    pytest.importorskip("transformers")
    target = make_target(tmp_path / "t")
    out = tmp_path / "bench.json"
    rc = bench.main(["--target", target, "--no-compile", "--batch-sizes", "1", "--prompt-len", "6",
                     "--max-new-tokens", "8", "--reference", "True", "--repeats", "2", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    result = json.load(open(out))
    assert [r["mode"] for r in result["rows"]] == ["autoregressive", "reference (transformers target)"]
    (ratio,) = result["ratios"]
    assert ratio["ratio"] == "this engine / the reference loop at batch 1" and len(ratio["runs"]) == 2
    printed = capsys.readouterr().out
    assert "this engine / the reference loop at batch 1: " in printed and "M params, no drafter, " in printed


@pytest.mark.parametrize("broken", ["autoregressive", "reference (transformers target)"])
def test_a_row_is_saved_before_it_is_printed(tmp_path, monkeypatch, broken):
    """stdout's reader gone (`| head`) while a row is printed, the engine's or the reference loop's:
    --out already holds that row."""
    pytest.importorskip("transformers")

    def fake_print(*args, **kwargs):
        if str(args[0]).startswith(broken):
            raise BrokenPipeError

    monkeypatch.setattr(bench, "print", fake_print, raising=False)
    monkeypatch.setattr(sys, "stdout", open(tmp_path / "stdout", "w"))  # cli_main points it at /dev/null
    out = tmp_path / "bench.json"
    rc = bench.main(["--target", make_target(tmp_path / "t"), "--no-compile", "--batch-sizes", "1",
                     "--prompt-len", "6", "--max-new-tokens", "4", "--reference", "True", "--repeats", "1",
                     "--out", str(out)])
    assert rc == 141
    assert json.load(open(out))["rows"][-1]["mode"] == broken


def test_the_reference_loop_decodes_every_prompt_the_engine_does(tmp_path, capsys, monkeypatch):
    """With a --prompts-file at batch 1 the engine's row takes every prompt in turn; the reference loop's
    timed run does too (its tokens/s over all of them, its outputs checked against each)."""
    pytest.importorskip("transformers")
    target = make_target(tmp_path / "t")
    drafter = make_drafter(tmp_path / "d", target, oracle=True)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": ids}) + "\n" for ids in ([1, 2, 3], [4, 5], [6, 7, 8, 9])))
    decoded = []
    generate = bench.reference_generate

    def recording(hf, drafter, prompt, max_new_tokens, *rest):
        if max_new_tokens == 9:  # the timed runs (the warm-up decodes min(8, the budget))
            decoded.append(prompt)
        return generate(hf, drafter, prompt, max_new_tokens, *rest)

    monkeypatch.setattr(bench, "reference_generate", recording)
    capsys.readouterr()
    flags = ["--target", target, "--drafter", drafter, "--no-compile", "--prompts-file", str(prompts),
             "--max-new-tokens", "9", "--repeats", "1", "--reference", "True", "--out", str(tmp_path / "b.json")]
    assert bench.main(flags) == 0, capsys.readouterr().err
    assert decoded == [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    # more rows than prompts: a row would never hold a request, and the batch would not be what it says
    assert bench.main(flags + ["--reference", "False", "--batch-sizes", "1,4"]) == 2
    err = capsys.readouterr().err
    assert "--batch-sizes 1,4: more rows than the 3 prompts of --prompts-file" in err and err.count("\n") == 1, err


def test_sampled_modes_are_timed_without_the_greedy_reference(tmp_path, capsys, monkeypatch):
    """--temperature T: every mode samples at T (trees too), the tokens are not compared, the reference
    loop (greedy) is left out, and asked for it is refused; a filter would change nothing timed."""
    engines = []
    engine_class = bench.Engine

    def recorded(*args, **kwargs):
        engine = engine_class(*args, **kwargs)
        engines.append(engine)
        return engine

    monkeypatch.setattr(bench, "Engine", recorded)
    target = make_target(tmp_path / "t")
    drafter = make_drafter(tmp_path / "d", target, oracle=True, oracle_scale=4.0, norm_scale=0.05)
    out = tmp_path / "bench.json"
    flags = ["--target", target, "--drafter", drafter, "--no-compile", "--prompt-len", "6",
             "--max-new-tokens", "16", "--repeats", "1", "--temperature", "1"]
    capsys.readouterr()
    rc = bench.main(flags + ["--batch-sizes", "1,2", "--tree-budgets", "3", "--out", str(out)])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    assert "sampled at temperature 1" in printed.out.splitlines()[0]
    result = json.load(open(out))
    assert result["config"]["temperature"] == 1
    assert [(r["mode"], r["batch"]) for r in result["rows"]] == [
        ("autoregressive", 1), ("speculative", 1), ("tree 3", 1),
        ("autoregressive", 2), ("speculative", 2), ("tree 3", 2)]
    assert all(r["acceptance_length"] > 1 for r in result["rows"] if r["mode"] != "autoregressive")
    assert len(engines) == 6 and all(e.temperature == 1.0 for e in engines)
    assert bench.main(flags + ["--reference", "True"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --reference: the reference loop decodes greedily"), err
    assert bench.main(flags + ["--top-k", "5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --top-k 5: bench.py does not time decoding with it; speculate.py"), err
    # the drafter's confidence head shapes its sampled trees: a tree temperature would rank nothing
    assert bench.main(flags + ["--tree-budgets", "3", "--tree-temperature", "0.5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --tree-temperature 0.5: a sampled tree from a drafter"), err


def test_reference_loop_without_transformers(tmp_path, capsys, monkeypatch):
    """transformers is test-only: without it the default skips the reference loop with one line on
    stderr, and asking for it (--reference True) is a one-line error before anything is built."""
    target = make_target(tmp_path / "t")
    drafter = make_drafter(tmp_path / "d", target, oracle=True)
    capsys.readouterr()  # (building them printed a progress bar)
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now fails
    out = tmp_path / "bench.json"
    flags = ["--target", target, "--drafter", drafter, "--no-compile", "--prompt-len", "6", "--max-new-tokens", "8",
             "--repeats", "1"]
    assert bench.main(flags + ["--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "reference loop" in err and "skipped: transformers is not installed" in err, err
    assert [r["mode"] for r in json.load(open(out))["rows"]] == ["autoregressive", "speculative"]
    assert bench.main(flags + ["--reference", "True"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --reference") and "not installed" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("flags,needle", [
    (["--repeats", "0"], "--repeats: invalid value 0 (valid: 1 to 1000)"),
    (["--batch-sizes", "1,1"], "--batch-sizes: '1,1' must be distinct positive"),
    (["--batch-sizes", "1,x"], "--batch-sizes: '1,x' is not"),
    (["--max-new-tokens", "0"], "--max-new-tokens: invalid"),
    (["--threads", "-1"], "--threads: invalid"),
    (["--out", "/"], "--out /: is a directory"),
    (["--kernels", "triton"], "--kernels triton: the Triton kernels need"),  # cpu, outside the interpreter
    (["--tree-budgets", "4,2000"], "--tree-budgets 4,2000: at most 1024 nodes"),
    (["--tree-temperature", "0.5"], "--tree-temperature 0.5: ranks the branches of a draft tree"),
    # decode flags bench.py does not time with: what does, where something does
    (["--temperature", "1", "--top-k", "5"], "--top-k 5: bench.py does not time decoding with it; speculate.py "
                                             "decodes with it and reports tokens/s"),
    (["--stop", "foo"], "--stop 'foo': bench.py does not time decoding with it; speculate.py decodes with it"),
    (["--scheduler", "threshold", "--confidence-threshold", "0.5"],
     "--scheduler threshold: bench.py does not time decoding with it; scripts/bench_concurrency.py times the "
     "schedulers"),
    (["--confidence-threshold", "0.5"], "--confidence-threshold 0.5: bench.py does not time decoding with it; "
                                        "scripts/bench_concurrency.py times the threshold scheduler"),
    (["--batch-size", "4"], "--batch-size 4: bench.py does not time decoding with it; it times each batch size "
                            "of --batch-sizes"),
    (["--ignore-eos"], "--ignore-eos: bench.py does not time decoding with it; its requests never stop at an EOS"),
    # flags that would change nothing in this run
    (["--no-compile", "--no-skip-guards"], "--no-skip-guards: only used with --compile (the run is eager)"),
    (["--prompts-file", "demo/heldout.jsonl", "--prompt-len", "8"],
     "--prompt-len 8: the random prompts' length, and --prompts-file demo/heldout.jsonl gives the prompts"),
])
def test_bad_flags(flags, needle, capsys):
    assert bench.main(flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err and err.count("\n") == 1, err


def test_guards_and_prompt_len_are_refused_only_where_unused():
    """--no-skip-guards is a compiled run's (bench.py compiles by default), and --prompt-len at its default
    says nothing beside a --prompts-file: both pass the flags' checks."""
    from support.cli import parse_flags

    args = parse_flags(bench.BenchArgs, ["--no-skip-guards", "--prompts-file", "demo/heldout.jsonl"])
    batch_sizes, s = bench.check_args(args)
    assert s.compile and not args.skip_guards and batch_sizes == [1]


def test_a_prompts_files_own_prompts_must_fit_the_context(tmp_path, capsys):
    """With --prompts-file the file's prompts are timed, so each of them (not --prompt-len's random length)
    must fit the models' context with --max-new-tokens: named file:line, as speculate.py names it."""
    target = make_target(tmp_path / "t", max_position_embeddings=64)
    drafter = make_drafter(tmp_path / "d", target)
    capsys.readouterr()  # what building the checkpoints printed
    prompts = tmp_path / "p.jsonl"
    flags = ["--target", target, "--drafter", drafter, "--no-compile", "--repeats", "1", "--reference", "False",
             "--prompts-file", str(prompts)]
    prompts.write_text(json.dumps({"prompt_ids": [1, 2]}) + "\n" + json.dumps({"prompt_ids": [5] * 61}) + "\n")
    assert bench.main(flags + ["--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: {prompts}:2: 61 tokens + --max-new-tokens 4 exceed the target's context of 64 "
                   f"(max_position_embeddings)\n"), err
    # short prompts leave room for a budget that --prompt-len's 64 random tokens would not: timed
    prompts.write_text(json.dumps({"prompt_ids": [1, 2]}) + "\n")
    out = tmp_path / "b.json"
    assert bench.main(flags + ["--max-new-tokens", "40", "--out", str(out)]) == 0, capsys.readouterr().err
    assert [r["mode"] for r in json.load(open(out))["rows"]] == ["autoregressive", "speculative"]


def test_a_prompts_files_ids_are_checked_as_speculate_py_checks_them(tmp_path, capsys):
    """An empty prompt, or an id outside the target's vocabulary, is one line naming the file's line (and
    the id), before anything is timed."""
    target = make_target(tmp_path / "t")  # a vocabulary of 48
    capsys.readouterr()
    prompts = tmp_path / "p.jsonl"
    flags = ["--target", target, "--no-compile", "--repeats", "1", "--reference", "False", "--max-new-tokens", "4",
             "--prompts-file", str(prompts)]
    for ids, why in [([1, 48, 2], "token id 48 is outside the vocabulary (0..47)"), ([], "empty prompt")]:
        prompts.write_text(json.dumps({"prompt_ids": [1, 2]}) + "\n" + json.dumps({"prompt_ids": ids}) + "\n")
        assert bench.main(flags) == 2
        printed = capsys.readouterr()
        assert printed.err == f"error: {prompts}:2: {why}\n", printed.err
        assert printed.out == ""  # refused before the bandwidth probe and the header


def test_an_eagle3_checkpoint_is_timed_without_the_dspark_reference(tmp_path, capsys, monkeypatch):
    """A loaded Eagle3 drafter says its kind only once loaded: the reference loop (a DSpark chain's) is
    left out unasked, and asked for, or with --tree-budgets, is one line. (The run's peak memory
    counts from after the bandwidth probe.)"""
    target = make_target(tmp_path / "t")
    eagle3 = make_eagle3(tmp_path / "e", target)
    out = tmp_path / "bench.json"
    flags = ["--target", target, "--drafter", eagle3, "--no-compile", "--batch-sizes", "1",
             "--prompt-len", "6", "--max-new-tokens", "12", "--repeats", "1"]
    calls = []
    for name in ("copy_bandwidth", "reset_peak_memory", "peak_memory"):
        def spy(*args, _name=name, _real=getattr(bench, name)):
            calls.append(_name)
            return _real(*args)
        monkeypatch.setattr(bench, name, spy)
    assert bench.main(flags + ["--out", str(out)]) == 0, capsys.readouterr().err
    assert calls[:2] == ["copy_bandwidth", "reset_peak_memory"] and calls.count("copy_bandwidth") == 1
    assert "peak_memory" in calls and "peak_memory" not in calls[:2]
    modes = [r["mode"] for r in json.load(open(out))["rows"]]
    assert "reference" not in modes and "speculative" in modes, modes
    for extra, needle in [(["--reference", "True"], "is an Eagle3 drafter"),
                          (["--tree-budgets", "4"], "is an Eagle3 drafter, which drafts a chain"),
                          (["--tree-budget", "4"], "an Eagle3 drafter drafts a chain")]:
        capsys.readouterr()
        assert bench.main(flags + extra) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {extra[0]}") and needle in err and err.count("\n") == 1, err


def test_settings_a_pair_cannot_use_are_refused_once_it_is_loaded(tmp_path, capsys):
    """As speculate.py: --draft-length is an Eagle3 chain's (a block drafter's engine would draft part
    of its block and decode other tokens), and trees need a drafter; the results name no --model
    when the checkpoints are the pair."""
    target = make_target(tmp_path / "t")
    drafter = make_drafter(tmp_path / "d", target)
    capsys.readouterr()  # what building the checkpoints printed
    base = ["--target", target, "--no-compile", "--prompt-len", "6", "--max-new-tokens", "4", "--repeats", "1",
            "--reference", "False"]
    for extra, needle in [(["--drafter", drafter, "--draft-length", "3"], "a block drafter drafts its block"),
                          (["--draft-length", "3"], "without a --drafter"),
                          (["--tree-budget", "4"], "a tree is drafted by a --drafter"),
                          (["--tree-budgets", "4"], "a tree is drafted by a --drafter")]:
        assert bench.main(base + extra) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {extra[-2]} ") and needle in err and err.count("\n") == 1, err
    out = tmp_path / "b.json"
    assert bench.main(base + ["--drafter", drafter, "--out", str(out)]) == 0
    config = json.load(open(out))["config"]
    assert config["model"] is None and config["temperature"] == 0  # what ran: greedy, no temperature given
    # what ran beside the flags: the dtype and the drafter's layout and drafts (an Eagle3 checkpoint was
    # recorded as drafter_kind dspark, with dtype and draft_length null); no tree temperature without a tree
    assert config["drafter_kind"] is None and config["tree_temperature"] is None
    assert (config["dtype_resolved"], config["drafter_layout"], config["num_drafts"]) == ("float32", "dspark", 4)
    # the decode settings bench.py refuses are not recorded as if they had run (batch_size 1 beside --batch-sizes)
    assert not {"batch_size", "scheduler", "num_samples", "top_k"} & set(config) and "batch_sizes" in config
    # --tree-budget makes the speculative mode a tree: said in the header, never drawn as the chain
    capsys.readouterr()
    assert bench.main(base + ["--drafter", drafter, "--tree-budget", "3", "--tree-budgets", "4,8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --tree-budget 3: makes the speculative mode a tree") and err.count("\n") == 1, err
    assert bench.main(base + ["--drafter", drafter, "--tree-budget", "3"]) == 0
    assert "speculative: a tree of 3 nodes" in capsys.readouterr().out.splitlines()[0]


def test_outputs_must_match_in_float32_and_are_counted_otherwise(tmp_path):
    """bench.compare_outputs: float32 raises on any difference; bf16 reports each differing request with
    the target's top-2 logit gap where it starts (K+1-token verify vs 1-token step rounding)."""
    from support.checkpoint import load_target

    target = load_target(make_target(tmp_path / "t"))
    prompts = [[1, 2, 3], [4, 5]]
    runs = {"autoregressive": [{"outputs": [[7, 8, 9], [10, 11]]}],
            "speculative": [{"outputs": [[7, 8, 9], [10, 12]]}]}
    with pytest.raises(AssertionError, match="speculative .* different tokens"):
        bench.compare_outputs(runs, prompts, target, exact=True, what="batch 2")
    differ = bench.compare_outputs(runs, prompts, target, exact=False, what="batch 2")
    assert list(differ) == ["speculative"]
    (d,) = differ["speculative"]
    assert d["request"] == 1 and d["first_token"] == 1 and d["logit_gap"] >= 0
    runs["speculative"][0]["outputs"][1] = [10, 11]
    assert bench.compare_outputs(runs, prompts, target, exact=True, what="batch 2") == {}


def test_reference_drafter_is_plain_and_equal(monkeypatch):
    """The reference loop's drafter is the engine's weights in plain modules — no CPU kernels (this
    project's speed-up, which the loop it is measured against does not have) — reading transformers'
    embedding and lm_head, and it drafts what the engine's drafter drafts."""
    pytest.importorskip("transformers")
    import torch

    import model
    from support import cpu_kernels
    target, drafter = bench.bigram_pair("cpu", torch.float32, 0)
    hf = bench.transformers_copy(target)
    installed = cpu_kernels.install(drafter)
    plain = bench.reference_drafter(drafter, hf)
    assert not installed or any(type(m) is cpu_kernels.PanelLinear for m in drafter.modules())
    assert all(type(m) is not cpu_kernels.PanelLinear for m in plain.modules())
    assert all(layer.self_attn.cache_attention is model.attend_cached for layer in plain.layers)
    assert plain.target.lm_head is hf.lm_head and plain.target.embed_tokens is hf.model.embed_tokens
    tokens = torch.randint(0, target.args.vocab_size - 1, (1, 12))
    with torch.no_grad():
        feats = torch.randn(1, 12, len(drafter.cfg.target_layer_ids) * target.args.hidden_size)
        outs = []
        for d in (drafter, plain):
            d.setup_caches(1, 64)
            d.commit_context(feats, torch.arange(12)[None])
            outs.append(d(tokens[:, -1], torch.tensor([12])))
    for a, b in zip(*outs):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4)


def test_a_round_is_the_engines_own_when_prompts_outnumber_rows(tmp_path):
    """More prompts than rows stream through them: a round's time divides by the rounds the engine ran
    (at one row, every request's rounds in turn), and decode tokens leave out each request's first
    token (its prefill's), not one a row."""
    import torch

    import speculate
    from support.checkpoint import load_models
    from support.flags import Settings

    target_dir = make_target(tmp_path / "t")
    models = load_models(target_dir, make_drafter(tmp_path / "d", target_dir))
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    for rows, rounds_of in ((1, sum), (3, max)):
        engine = speculate.Engine(models.target, models.drafter, batch_size=rows, max_seq=64)
        with torch.no_grad():
            r = bench.timed_generate(engine, prompts, 12)
        per_request = [len(q.rounds) for q in r["requests"]]
        assert r["rounds"] == rounds_of(per_request), (rows, per_request)
        row = bench.mode_row("speculative", rows, [r], engine, prompts, Settings(max_new_tokens=12),
                             skip_guards=False, differ={})
        decoded = sum(len(q.output_ids) - 1 for q in r["requests"])
        assert row["decode_tokens_per_second"] * r["decode_seconds"] == pytest.approx(decoded)
        assert row["round_ms"] == pytest.approx(1e3 * r["decode_seconds"] / r["rounds"])
        # the bytes a round reads: the KV its rows hold round by round (greedy: the split's run is this one)
        cached = bench.cached_per_round(r["requests"], r["rounds"])
        want = bench.round_bytes(models.target, models.drafter, cached, engine.K)
        assert row["bytes_per_round"] == want
    # a tree shallower than the block reads the Markov head's W2 once a depth
    engine = speculate.Engine(models.target, models.drafter, batch_size=1, max_seq=64, tree_budget=2)
    parts = bench.round_split(engine, prompts, 12, skip_guards=False)
    r = bench.timed_generate(engine, prompts, 12)
    cached = bench.cached_per_round(r["requests"], r["rounds"])
    assert parts["bytes_per_round"] == bench.round_bytes(models.target, models.drafter, cached, engine.K, 2)


def test_a_rounds_bytes_count_every_read_of_a_weight():
    """round_bytes by hand, for a DSpark drafter: the target's weights once, the drafter's once, the
    lm_head again for the block's logits, W2 at each of K - 1 more Markov steps, every layer's kv_proj
    again for the committed features; lookup tables (the untied input embedding, W1) not at all. With
    no cache positions, no KV."""
    import torch

    target = random_target("qwen3-tiny", dtype=torch.float32)
    drafter = random_drafter(target, block_size=4, num_layers=2, rank=16)
    K = drafter.cfg.num_drafts

    def size(tensors):
        return sum(t.numel() * t.element_size() for t in tensors)

    assert target.lm_head.weight is not target.embed_tokens.weight
    target_weights = [p for p in target.parameters() if p is not target.embed_tokens.weight]
    assert bench.round_bytes(target, None, 0) == size(target_weights)
    markov = drafter.markov_head
    drafter_weights = [p for p in drafter.parameters() if p is not markov.markov_w1.weight]
    kv_projections = [layer.self_attn.kv_proj.weight for layer in drafter.layers]
    want = size(target_weights) + size(drafter_weights) + size([target.lm_head.weight])
    w2 = size([markov.markov_w2.weight])
    want += (K - 1) * w2 + size(kv_projections)
    assert bench.round_bytes(target, drafter, 0) == want
    for budget in (1, 2, K, K + 3):  # a tree reads W2 once a depth, and has min(K, budget) depths
        depths = min(K, budget)
        assert bench.round_bytes(target, drafter, 0, K, budget) == want - (K - depths) * w2


PROBE_THEN_PEAK = """
import bench
import torch

bench.copy_bandwidth("cpu", 1 << 28)
with_probe = bench.peak_memory("cpu")
bench.reset_peak_memory("cpu")
after = bench.peak_memory("cpu")
assert after < with_probe - 0.3, (with_probe, after)  # the probe's 2 x 256 MiB are gone
x = torch.ones(2**27 // 4)  # 128 MiB more than now
assert bench.peak_memory("cpu") > after + 0.1, (after, bench.peak_memory("cpu"))
"""


def test_the_bandwidth_probe_is_not_the_runs_peak_memory():
    """bench.py measures the copy bandwidth with two large buffers before the run; the peak it reports
    starts after them (on Linux, where a process can reset its peak resident set). In a fresh process: in
    one that ran other tests, the 128 MiB can come from freed heap pages that are still resident."""
    import os
    import subprocess

    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("the peak resident set can be reset only on Linux")
    scripts = os.path.dirname(bench.__file__)
    path = os.pathsep.join([scripts, os.path.dirname(scripts)])
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", PROBE_THEN_PEAK], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_a_rounds_cache_is_what_its_rows_hold():
    """The KV a round reads: each request's cache at each of its rounds (prompt, the prefill's token, the
    tokens committed before), summed over the rows and averaged over the rounds the engine ran; a row
    without a request holds none."""
    from speculate import Request

    first = Request(0, [1, 2, 3], [7, 8, 9, 1, 2, 3], [{"accepted": 1}, {"accepted": 2}])
    second = Request(1, [4, 5], [6], [{"accepted": 0}])
    # batch 2: round 1 holds 4 + 3 positions, round 2 only the first request's 4 + 2
    assert bench.cached_per_round([first, second], rounds=2) == (4 + 3 + 6) / 2
    # one row, the requests in turn: three rounds
    assert bench.cached_per_round([first, second], rounds=3) == (4 + 6 + 3) / 3


def test_the_reference_rows_differences_are_recorded_as_the_engines_are():
    """In bf16 the reference loop may differ from autoregressive decoding at a near-tie: its row in --out
    names the differing request runs, as an engine row does (it printed them and recorded nothing)."""
    runs = [{"total_tokens_per_second": 9.0}, {"total_tokens_per_second": 11.0}]
    differing = [{"request": 0, "repeat": 1, "first_token": 5, "logit_gap": 0.0}]
    row = bench.reference_row(runs, True, {"reference": differing})
    assert row == {"mode": "reference (transformers target, eager drafter)", "batch": 1, "tokens_per_second": 11.0,
                   "tokens_per_second_runs": [9.0, 11.0], "differing_requests": differing}
    assert bench.reference_row(runs, False, {"speculative": differing})["differing_requests"] is None
    assert "differing_requests" not in bench.reference_row(runs, False, {})  # every mode agreed


def test_caches_past_free_memory_are_refused_before_any_timing(monkeypatch, capsys):
    """The largest batch's KV caches are checked against free memory as speculate.py checks its batch: one
    line naming --batch-sizes (an allocator traceback came after the models were built)."""
    from support import flags

    monkeypatch.setattr(flags, "free_memory", lambda device: 1 << 20)
    from speculate import DEMO_DIR

    rc = bench.main(["--target", f"{DEMO_DIR}/target", "--drafter", f"{DEMO_DIR}/drafter", "--no-compile",
                     "--batch-sizes", "1,8", "--max-new-tokens", "4", "--reference", "False"])
    err = capsys.readouterr().err
    assert rc == 2 and "error: the KV caches for --batch-sizes 8 x " in err and "lower --batch-sizes" in err, err


def test_a_trees_round_counts_against_free_memory(monkeypatch, capsys):
    """A tree's logits and distributions over the vocabulary (a sampled tree's races too) are added to the
    caches' need, as speculate.py adds them (bench.py checked the caches alone and ran out of memory while
    timing)."""
    from support import flags

    monkeypatch.setattr(flags, "free_memory", lambda device: 1 << 20)
    from speculate import DEMO_DIR

    base = ["--target", f"{DEMO_DIR}/target", "--drafter", f"{DEMO_DIR}/drafter", "--no-compile",
            "--batch-sizes", "2", "--max-new-tokens", "4", "--reference", "False", "--tree-budgets", "4,16"]
    for temperature in ("0", "1"):
        rc = bench.main(base + ["--temperature", temperature])
        err = capsys.readouterr().err
        assert rc == 2 and "error: the KV caches for --batch-sizes 2 x " in err, err
        assert "a tree's logits and distributions over the vocabulary" in err, err


def test_the_default_reference_loop_says_when_it_is_skipped(capsys):
    """On a CPU the reference loop runs by default, a DSpark chain greedy at batch 1: for a tree or an Eagle3
    checkpoint it was left out without a word; asked for with an Eagle3 checkpoint it was dropped too."""
    from speculate import DEMO_DIR

    base = ["--target", f"{DEMO_DIR}/target", "--no-compile", "--max-new-tokens", "4", "--repeats", "1",
            "--prompt-len", "4"]
    for extra, rc_want in ((["--drafter", f"{DEMO_DIR}/drafter", "--tree-budget", "3"], 0),
                           (["--drafter", f"{DEMO_DIR}/eagle3"], 0)):
        assert bench.main(base + extra) == rc_want
        err = capsys.readouterr().err
        assert "note: the reference loop is skipped: it times a DSpark drafter's chain" in err, err
    assert bench.main(base + ["--drafter", f"{DEMO_DIR}/eagle3", "--reference", "True"]) == 2
    err = capsys.readouterr().err
    assert "--reference: the reference loop is a DSpark drafter's chain, and --drafter" in err, err
    # no drafter: the loop times the target alone (the note named a drafter's chain)
    assert bench.main(base + ["--temperature", "0.5"]) == 0
    err = capsys.readouterr().err
    assert "note: the reference loop is skipped: it times the target alone, greedy, at batch 1" in err, err


def test_a_tokenizer_json_that_is_a_directory_is_named(tmp_path, capsys):
    """A target whose tokenizer.json is a directory was read as one without a tokenizer ('a text prompt needs
    the target's tokenizer.json'); it is named for what it is, as speculate.py names it."""
    import shutil

    from speculate import DEMO_DIR

    target = tmp_path / "target"
    shutil.copytree(f"{DEMO_DIR}/target", target)
    (target / "tokenizer.json").unlink()
    (target / "tokenizer.json").mkdir()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def f():"}\n')
    rc = bench.main(["--target", str(target), "--no-compile", "--prompts-file", str(prompts), "--max-new-tokens", "4",
                     "--reference", "False"])
    err = capsys.readouterr().err
    assert rc == 2 and "tokenizer.json: is a directory" in err and err.count("\n") == 1, err


def test_a_batchs_random_prompts_do_not_depend_on_the_batch_sizes_before_it(monkeypatch, capsys):
    """--batch-sizes 1 and 2,1 time batch 1 on the same prompt, the first of batch 2's (one generator drawn
    from batch after batch gave b=1 other prompts, and another τ, after b=2)."""
    seen = []
    real = bench.interleaved_runs

    def record(modes, engines, reference, prompts, *args):
        seen.append(prompts)
        return real(modes, engines, reference, prompts, *args)

    monkeypatch.setattr(bench, "interleaved_runs", record)
    flags = ["--target", "demo/target", "--drafter", "demo/drafter", "--no-compile", "--prompt-len", "6",
             "--max-new-tokens", "4", "--repeats", "1", "--reference", "False"]
    assert bench.main(flags + ["--batch-sizes", "1"]) == 0
    assert bench.main(flags + ["--batch-sizes", "2,1"]) == 0
    capsys.readouterr()
    alone, two, after = seen
    assert len(two) == 2 and alone == after == two[:1]


def test_an_interrupted_bench_says_what_it_kept(tmp_path, monkeypatch, capsys):
    """Ctrl-C before the first row: "nothing was written" with how to keep rows (it said "what was finished
    is kept"); after one with --out, the file."""
    import signal

    from support.cli import Interrupted

    calls = []
    real = bench.interleaved_runs

    def interrupt_second(*args):
        calls.append(1)
        if len(calls) == 2:
            raise Interrupted(signal.SIGINT)
        return real(*args)

    monkeypatch.setattr(bench, "interleaved_runs", interrupt_second)
    out = tmp_path / "b.json"
    flags = ["--target", "demo/target", "--drafter", "demo/drafter", "--no-compile", "--prompt-len", "6",
             "--max-new-tokens", "4", "--repeats", "1", "--reference", "False", "--batch-sizes", "1,2"]
    assert bench.main(flags) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "interrupted by SIGINT: stopped; nothing was written (--out FILE keeps each measured row)")
    calls.clear()
    assert bench.main(flags + ["--out", str(out)]) == 130
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == f"interrupted by SIGINT: stopped; what was written: {out}"
    assert json.loads(out.read_text())["complete"] is False
    # the tree plot, drawn after the first batch size, is named too
    calls.clear()
    plot = tmp_path / "trees.png"
    assert bench.main(flags + ["--tree-budgets", "4", "--tree-plot", str(plot)]) == 130
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == f"interrupted by SIGINT: stopped; what was written: {plot}" and plot.is_file()
    # ... and before any batch size (the models loading): nothing was written
    def stop(*args, **kwargs):
        raise Interrupted(signal.SIGINT)

    monkeypatch.setattr(bench, "load_target", stop)
    assert bench.main(flags) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "interrupted by SIGINT: stopped; nothing was written (--out FILE keeps each measured row)")


def test_the_reference_loop_counts_its_copies_of_the_models(monkeypatch, capsys):
    """The reference loop builds transformers' copy of the models in float32 before casting them: counted
    against free memory, skipped with a note by default and refused when asked for (it was built, and a
    large preset ran out of memory)."""
    monkeypatch.setattr(bench, "free_memory", lambda device: 2**20)  # the models are loaded; 1 MiB left
    monkeypatch.setattr(bench, "transformers_copy", None)  # building the copy would be a TypeError
    flags = ["--target", "demo/target", "--drafter", "demo/drafter", "--no-compile", "--prompt-len", "6",
             "--max-new-tokens", "4", "--repeats", "1", "--batch-sizes", "1"]
    assert bench.main(flags) == 0
    err = capsys.readouterr().err
    assert "note: the reference loop is skipped: its copies of the models need" in err, err
    assert bench.main(flags + ["--reference", "True"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --reference: its copies of the models need"), err
