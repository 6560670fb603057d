"""The compiled round equals the eager one and compiles once (CPU, Inductor's C++ backend); what
compiling prints and what a second compile takes from the cache.

Compiling takes tens of seconds on CPU, so the round tests share one pair, and the tests of the
compile wiring (recipe, modes, quiet autotuning, caches) compile a single Linear.
"""

from __future__ import annotations

import json
import os
import unittest.mock
from dataclasses import fields

import pytest
import torch
from drafters import make_drafter, make_eagle3, make_target

import scheduler
import speculate
from support import cli, flags

# For the tests whose subject is not the CPU recipe (Dynamo's graphs, guards and host reads): Inductor's
# cache keeps default mode's graphs, not the recipe's frozen ones, so a rerun loads them instead of
# lowering and building them again. The recipe's own tests compile with it.
CACHED = "default"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("compile")
    target = make_target(d / "target")
    drafter = make_drafter(d / "drafter", target, markov="vanilla", oracle=True, oracle_scale=4.0, norm_scale=0.05)
    return target, drafter


def test_compiled_round_equals_eager_and_never_recompiles(pair, tmp_path, capfd):
    """... and prints what the eager run prints: the completions on stdout, no autotuning tables (which
    Inductor writes to stderr while it autotunes, on a cold cache as in CI); after the warm-up, the
    compiled run decodes with guard evaluation cut to the guards that tell the graphs apart."""
    import torch._dynamo

    target, drafter = pair
    prompts = tmp_path / "p.jsonl"
    # Three requests at batch size 2: two batches, prompts of different lengths, the second
    # batch padded with an inactive row. Nothing of this may trigger a recompile.
    prompts.write_text("".join(json.dumps({"prompt_ids": p}) + "\n"
                               for p in ([5, 17, 33, 2, 8], [9, 1], [40, 41, 42, 43, 44, 45, 46])))
    traces, printed, stances = {}, {}, {}
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    set_stance = torch.compiler.set_stance

    def recording(*args, **kwargs):  # Engine.generate's stance: guards skipped once compiled and warmed up
        stances.setdefault(flag, []).append(kwargs.get("skip_guard_eval_unsafe"))
        return set_stance(*args, **kwargs)

    for flag in ("--no-compile", "--compile"):
        trace = tmp_path / f"{flag}.jsonl"
        with torch._dynamo.config.patch(error_on_recompile=True), \
                unittest.mock.patch.object(torch.compiler, "set_stance", recording):
            rc = speculate.main(["--target", target, "--drafter", drafter, "--prompts-file", str(prompts),
                                 "--batch-size", "2", "--max-new-tokens", "24", "--trace-file", str(trace), flag])
        out, err = capfd.readouterr()
        assert rc == 0, err
        printed[flag] = out, err
        lines = [json.loads(l) for l in open(trace)]
        summary = lines.pop()
        traces[flag] = lines
        if flag == "--compile":
            assert summary["compile_seconds"] > 0
    # Token for token identical; confidences are floats that a fused kernel may round differently.
    strip = lambda ls: [{k: v for k, v in l.items() if k != "confidence"} for l in ls]
    assert strip(traces["--compile"]) == strip(traces["--no-compile"])
    for a, b in zip(traces["--compile"], traces["--no-compile"]):
        if "confidence" in a:
            assert a["confidence"] == pytest.approx(b["confidence"], rel=1e-5, abs=1e-6)
    assert any(l.get("accepted", 0) >= 2 for l in traces["--compile"])
    # stdout: the same completions, line for line; only the figures line (times) differs.
    figures = lambda out: [l for l in out.splitlines() if not l.startswith("speculative: ")]
    assert figures(printed["--compile"][0]) == figures(printed["--no-compile"][0]) != []
    err = printed["--compile"][1]
    assert "AUTOTUNE" not in err and "Autotune" not in err and "TypedStorage" not in err, err
    assert "compiled the speculative round in" in err, err
    # Two graphs compiled, the round's halves: draft and verify (fullgraph=True would have raised on
    # a break; a recompile would have raised through error_on_recompile).
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    assert stances == {"--no-compile": [False], "--compile": [True]}  # ... with the guards cut to what tells them apart



@pytest.mark.parametrize("kind", ["eagle3", "tree", "sampled-tree"])
def test_compiled_eagle3_and_tree_rounds_equal_eager(pair, tmp_path, kind):
    """An Eagle3 chain and a draft tree (greedy, and sampled: its children drawn, multi-draft
    rejection sampling at each node) compile too, each round's two halves once, and decode what the
    eager round decodes, drafts included: the draft graph reads Eagle3's carried state as the verify
    graph left it (not as it was when compiled), and a tree keeps its static shapes."""
    import torch._dynamo

    target, drafter = pair
    flags = ["--drafter", drafter, "--tree-budget", "6"]
    if kind == "sampled-tree":
        flags += ["--temperature", "1"]
    if kind == "eagle3":
        flags = ["--drafter", make_eagle3(tmp_path / "eagle3", target, ttt_length=4, norm_scale=0.05)]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in ([5, 17, 33, 2, 8], [9, 1], [40, 41])))
    traces = {}
    torch._dynamo.reset()
    for flag in ("--no-compile", "--compile"):
        trace = tmp_path / f"{kind}{flag}.jsonl"
        with torch._dynamo.config.patch(error_on_recompile=True):
            rc = speculate.main(["--target", target, *flags, "--prompts-file", str(prompts), "--batch-size", "2",
                                 "--max-new-tokens", "16", "--trace-file", str(trace), flag])
        assert rc == 0
        traces[flag] = [json.loads(line) for line in open(trace)][:-1]
    assert traces["--compile"] == traces["--no-compile"]
    rounds = [r for r in traces["--compile"] if "draft" in r]
    assert rounds and all(len(r["draft"]) == (4 if kind == "eagle3" else 6) for r in rounds)

def test_two_compiled_engines_keep_their_own_graphs_with_guards_skipped(pair):
    """The demo's order: a speculative engine compiled, then an autoregressive one on the same target,
    each decoding with guard evaluation cut down. Each engine's round is code of its own
    (speculate.own_code), so the speculative engine never runs the autoregressive draft graph (which
    it did when both shared `draft`'s code: τ 1.00, every draft rejected)."""
    from support.checkpoint import load_drafter, load_target

    target = load_target(pair[0])
    drafter = load_drafter(pair[1], target)
    torch._dynamo.reset()
    prompt = [5, 17, 33, 2, 8]
    ar = [speculate.Request(0, prompt)]
    sp = [speculate.Request(0, prompt)]
    with torch.inference_mode():  # (as speculate.main runs both: a graph is compiled per grad mode)
        spec = speculate.Engine(target, drafter, batch_size=1, max_seq=64, compile=True, compile_mode=CACHED)
        spec.warmup()
        base = speculate.Engine(target, None, batch_size=1, max_seq=64, compile=True, compile_mode=CACHED)
        base.warmup()
        assert spec.draft_fn.__wrapped__.__code__ is not base.draft_fn.__wrapped__.__code__
        base.generate(ar, 16)
        spec.generate(sp, 16)
    assert sp[0].output_ids == ar[0].output_ids
    assert sum(r["accepted"] for r in sp[0].rounds) > 0, "the speculative engine ran a draft graph that drafts nothing"


def test_compiled_scheduled_round_equals_eager_one_graph_per_bucket(pair, tmp_path, capsys):
    """The hardware-scheduled round (draft + Algorithm 1 graph, host read, ragged verify graph per
    bucket) compiles once per graph at warm-up and never again, across batches of different
    prompt lengths, and decides exactly as the eager one."""
    import torch._dynamo
    from test_scheduler import write_sps_table

    target, drafter = pair
    tables = {flag: write_sps_table(tmp_path / f"sps{flag}.json", target, drafter, 2, 0.0, lambda b: 1 + 0.3 * b,
                                    buckets=[4, 10], compile=flag == "--compile")
              for flag in ("--no-compile", "--compile")}
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": p}) + "\n"
                               for p in ([5, 17, 33, 2, 8], [9, 1], [40, 41, 42, 43, 44, 45, 46])))
    traces = {}
    for flag in ("--no-compile", "--compile"):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        trace = tmp_path / f"{flag}.jsonl"
        rc = speculate.main(["--target", target, "--drafter", drafter, "--prompts-file", str(prompts),
                             "--batch-size", "2", "--max-new-tokens", "24", "--trace-file", str(trace),
                             "--scheduler", "hardware", "--sps-table", tables[flag],
                             "--verify-buckets", "4,10", flag])
        assert rc == 0, capsys.readouterr().err
        lines = [json.loads(l) for l in open(trace)]
        lines.pop()
        traces[flag] = lines
        if flag == "--compile":
            # The draft graph and one verify graph per bucket, all made by the warm-up; any
            # recompile later (a new prompt length, a new batch) would add a graph.
            assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1 + 2
    strip = lambda ls: [{k: v for k, v in l.items() if k != "confidence"} for l in ls]
    assert strip(traces["--compile"]) == strip(traces["--no-compile"])
    verified = [l["verified"] for l in traces["--compile"] if "verified" in l]
    assert min(verified) < 4 and max(verified) >= 2, "the schedule should vary the ragged batch's size"


def test_cpu_recipe_freezes_the_weights_into_the_graph(capfd):
    """The CPU default of `speculate.compiled` freezes parameters (what lets max-autotune pick
    Inductor's packed C++ GEMMs): the graph sees the weights it compiled with, so an in-place edit
    afterwards is not seen (the documented contract), while a different module recompiles. With
    `verbose`, on an empty cache, Inductor's autotuning table is shown."""
    torch._dynamo.reset()
    lin, other = torch.nn.Linear(8, 8).requires_grad_(False), torch.nn.Linear(8, 8).requires_grad_(False)
    x = torch.randn(3, 8)
    fn = speculate.compiled(lambda m, x: m(x).relu(), "cpu", verbose=True)
    before = lin(x).relu()
    with fresh_inductor_cache():
        assert torch.allclose(fn(lin, x), before, atol=1e-5)
    assert "AUTOTUNE" in capfd.readouterr().err
    assert torch.allclose(fn(other, x), other(x).relu(), atol=1e-5)  # a new model: recompiled, not reused
    with torch.no_grad():
        lin.weight.mul_(-1)
    assert torch.allclose(fn(lin, x), before, atol=1e-5)  # frozen: still the compile-time weights
    assert not torch.allclose(lin(x).relu(), before, atol=1e-5)


def test_compiled_async_round_reads_nothing_between_draft_and_verify(pair, monkeypatch):
    """--scheduler async compiled (buckets 4 and 10 at batch 2): the warm-up compiles the draft graph
    and one verify graph per bucket; decoding two batches of different prompt lengths then neither
    recompiles nor reads a tensor's value on the host between draft and verify (test_async_scheduler's
    probe on every Python-level read), and emits the eager engine's tokens, capacities and schedule."""
    import torch._dynamo
    from test_async_scheduler import HostReads

    from support.checkpoint import load_drafter, load_target

    target_dir, drafter_dir = pair
    prompts = [[5, 17, 33, 2, 8], [9, 1], [40, 41, 42, 43, 44, 45, 46]]
    probe, results = HostReads(monkeypatch), {}
    for compile in (False, True):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        target = load_target(target_dir)
        engine = speculate.Engine(target, load_drafter(drafter_dir, target), batch_size=2, max_seq=64,
                                  scheduler="async", buckets=[4, 10], compile=compile,
                                  compile_mode=CACHED)
        # Four tokens twice as fast as ten: the capacity is 2 drafts or all 8, as the history says.
        engine.scheduler.set_sps(dict(scheduler.sps_identity(engine), steps_per_second=[1.0, 0.55]))
        reqs, rounds = [speculate.Request(i, p) for i, p in enumerate(prompts)], []
        with torch.inference_mode():
            if compile:
                engine.warmup()
            probe.watch(engine)
            probe.reads, probe.rounds = [], 0
            with torch._dynamo.config.patch(error_on_recompile=True):
                engine.generate(reqs, 24, on_round=lambda req, rec: rounds.append(rec))
        assert probe.rounds > 5 and probe.reads == [], probe.reads
        if compile:
            assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1 + 2
        results[compile] = ([r.output_ids for r in reqs],
                            [(r["batch_round"], r["capacity"], r["verified"], r["accepted"]) for r in rounds])
    assert results[True] == results[False]
    assert {c for _, c, _, _ in results[True][1]} >= {2, 8}, "both verify graphs should run"


def fresh_inductor_cache():
    """An empty Inductor cache for the block (autotuning must run; in-memory caches cleared too)."""
    import torch._inductor.utils as inductor_utils
    return (getattr(inductor_utils, "fresh_cache", None) or inductor_utils.fresh_inductor_cache)()  # 2.11's name


def test_autotuning_is_silent_unless_verbose(capfd):
    """On an empty cache (so autotuning must run) a recipe compile of one Linear prints nothing:
    no AUTOTUNE table, no choices-stats JSON, no deprecation warning (the verbose side is in
    test_cpu_recipe_freezes_the_weights_into_the_graph)."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    lin, x = torch.nn.Linear(24, 40).requires_grad_(False), torch.randn(3, 24)
    with fresh_inductor_cache():
        fn = speculate.compiled(lambda m, x: m(x).relu(), "cpu")
        assert torch.allclose(fn(lin, x), lin(x).relu(), atol=1e-5)
    out, err = capfd.readouterr()
    assert torch._dynamo.utils.counters["inductor"]["select_algorithm_autotune"] > 0  # it did autotune
    assert out == "" and "AUTOTUNE" not in err and "Autotune" not in err and "TypedStorage" not in err, err


def test_a_second_compile_of_the_same_graph_starts_from_the_cache(tmp_path, monkeypatch):
    """`use_compile_cache` (--compile-cache) points Inductor at a directory, and a later compile of the
    same graph (another process; here after dynamo and Inductor's in-memory caches forget it) starts
    from what it wrote: --compile-mode default loads the graph from the FX-graph and AOTAutograd caches;
    the CPU recipe's frozen graph is refused by those caches (torch 2.13) and lowered again, but its
    autotuning results are reused: no GEMM is timed twice."""
    import torch._dynamo
    import torch._inductor.utils as inductor_utils

    clear_memory = getattr(inductor_utils, "clear_caches", None) or inductor_utils.clear_inductor_caches
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "not-this"))
    where = cli.use_compile_cache(str(tmp_path / "cc"))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == where == str(tmp_path / "cc")
    lin, x = torch.nn.Linear(16, 56).requires_grad_(False), torch.randn(2, 16)
    for mode in ("default", None):
        runs = []
        for _ in range(2):
            torch._dynamo.reset()
            clear_memory()
            torch._dynamo.utils.counters.clear()
            fn = speculate.compiled(lambda m, x: m(x).relu(), "cpu", mode)
            assert torch.allclose(fn(lin, x), lin(x).relu(), atol=1e-5)
            runs.append(dict(torch._dynamo.utils.counters["inductor"]))
        first, second = runs
        if mode == "default":
            assert first.get("fxgraph_cache_miss") == 1 and second.get("fxgraph_cache_hit") == 1, runs
        else:
            assert first.get("select_algorithm_autotune", 0) > 0, runs
            assert second.get("select_algorithm_autotune", 0) == 0 and second.get("fxgraph_cache_hit", 0) == 0, runs
    assert os.listdir(where) and not os.path.exists(tmp_path / "not-this")


def test_compile_modes_are_checked_and_run():
    from support.cli import UserError
    with pytest.raises(UserError, match="one of default"):
        flags.check_settings(speculate.Settings(compile=True, compile_mode="fastest"), "cpu")
    torch._dynamo.reset()
    fn = speculate.compiled(lambda x: (x * 2).sin(), "cpu", "max-autotune-no-cudagraphs")
    x = torch.randn(5)
    assert torch.allclose(fn(x), (x * 2).sin(), atol=1e-6)


def test_cuda_graphs_only_where_the_compile_mode_captures_them():
    """An engine marks a CUDA-graph step and clones what must outlive a replay only when `compiled`
    really captures graphs: on CUDA, with the recipe or a mode that turns them on."""
    for mode in (None, "reduce-overhead", "max-autotune"):
        assert speculate.captures_cuda_graphs("cuda", mode)
        assert not speculate.captures_cuda_graphs("cpu", mode)
    for mode in ("default", "max-autotune-no-cudagraphs"):
        assert not speculate.captures_cuda_graphs("cuda:0", mode)


def test_skipped_guards_still_tell_warmed_graphs_apart():
    """bench.py times compiled runs with guard evaluation cut to the differentiating guards
    (BenchArgs.skip_guards): the engines' graphs share code (draft with and without a drafter, verify
    per bucket), told apart by their arguments — which must still pick the right graph."""
    torch._dynamo.reset()

    def fn(x, y=None, scale: int = 2):
        return x * scale if y is None else x + y

    f = speculate.compiled(fn, "cpu", "default")
    x, y = torch.randn(4), torch.randn(4)
    for args in ((x,), (x, y), (x, None, 3)):  # the warm-up: every variant compiled
        f(*args)
    with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
        assert torch.equal(f(x), x * 2) and torch.equal(f(x, y), x + y) and torch.equal(f(x, None, 3), x * 3)


def test_compiled_panel_linear_calls_the_few_row_kernel_as_one_op():
    """A compiled layer on the CPU kernels runs dspark::panel_linear as one opaque op — the eager
    result, bit for bit (the same kernel), with one thread or two."""
    from support import cpu_kernels

    if cpu_kernels.unavailable() is not None:
        pytest.skip(f"the CPU kernels are unavailable: {cpu_kernels.unavailable()}")
    g = torch.Generator().manual_seed(60)
    layer = torch.nn.Sequential(torch.nn.Linear(32, 48)).requires_grad_(False)
    with torch.no_grad():
        layer[0].weight.copy_(torch.randn(48, 32, generator=g))
    assert cpu_kernels.install(layer) and type(layer[0]) is cpu_kernels.PanelLinear
    x = torch.randn(1, 6, 32, generator=g)
    ops = []

    def count(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    def f(x):
        return torch.relu(layer(x))

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with torch.no_grad():
            compiled = torch.compile(f, fullgraph=True)
            assert torch.equal(compiled(x), f(x))
            torch.set_num_threads(2)
            assert torch.equal(compiled(x), f(x))
            torch.set_num_threads(1)
            torch._dynamo.reset()
            torch.compile(f, backend=count, fullgraph=True)(x)
            assert any("panel_linear" in op for op in ops)
    finally:
        torch.set_num_threads(before)
        torch._dynamo.reset()


def test_compiled_attention_calls_the_few_token_kernel_as_one_op():
    """A compiled `cpu_kernels.attend` of a few tokens runs dspark::cached_attention as one opaque op —
    the eager result, bit for bit, with one thread or two."""
    import model
    from support import cpu_kernels

    if cpu_kernels.unavailable() is not None:
        pytest.skip(f"the CPU kernels are unavailable: {cpu_kernels.unavailable()}")
    g = torch.Generator().manual_seed(61)
    q, k, v = torch.randn(1, 6, 8, 16, generator=g), torch.randn(1, 30, 4, 16, generator=g), torch.randn(1, 30, 4, 16, generator=g)
    positions = torch.arange(14, 20)[None]
    bias = model.cache_bias(positions[:, :, None] >= torch.arange(30), 1, torch.float32)
    ops = []

    def count(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        eager = cpu_kernels.attend(q, k, v, bias)
        assert torch.allclose(eager, model.attend_cached(q, k, v, bias), atol=1e-5)
        compiled = torch.compile(cpu_kernels.attend, fullgraph=True)
        assert torch.equal(compiled(q, k, v, bias), eager)
        torch.set_num_threads(2)
        assert torch.equal(compiled(q, k, v, bias), eager) and torch.equal(cpu_kernels.attend(q, k, v, bias), eager)
        torch._dynamo.reset()
        torch.compile(cpu_kernels.attend, backend=count, fullgraph=True)(q, k, v, bias)
        assert any("cached_attention" in op for op in ops)
    finally:
        torch.set_num_threads(before)
        torch._dynamo.reset()


def test_importing_the_programs_leaves_the_compiler_alone():
    """Importing the engine and the programs neither imports torch's compiler stack (about 1.5 s of
    every start) nor sets TORCHINDUCTOR_CACHE_DIR, which cli.use_compile_cache reads as the
    user's choice."""
    import subprocess
    import sys

    from conftest import REPO_ROOT

    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    code = ("import os, sys; sys.path.insert(0, 'scripts'); import speculate, bench, eval, train, model, kernels; "
            "from support import cpu_kernels; "
            "assert 'torch._dynamo' not in sys.modules, 'dynamo imported'; "
            "assert 'TORCHINDUCTOR_CACHE_DIR' not in os.environ, os.environ['TORCHINDUCTOR_CACHE_DIR']")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_a_warmed_engine_reused_after_another_engine_resized_the_caches(tmp_path):
    """Engines on the same models share their caches, and building one of another size re-allocates
    them (setup_caches). A compiled engine reused after that decodes as the eager one: it puts its own
    caches back. Before, its graphs (the CPU recipe's hold the cache tensors they were compiled with;
    guard evaluation cut down checks nothing else) went on with the old caches while the eager prefill
    wrote the new ones: rounds read another prompt's context, with no error and no recompile."""
    import torch._dynamo

    from support.checkpoint import load_drafter, load_target

    target_dir = make_target(tmp_path / "target", attn_scale=1.0)  # the context matters: a stale one shows
    target = load_target(target_dir)
    drafter = load_drafter(make_drafter(tmp_path / "drafter", target_dir, oracle=False), target)
    first, second = [[5, 17, 33, 2, 8], [9, 1]], [[40, 41, 42, 43, 44, 45, 46], [30, 12, 7]]

    def run(engine, prompts):
        reqs = [speculate.Request(i, p) for i, p in enumerate(prompts)]
        engine.generate(reqs, 20)
        return [(r.output_ids, [(x["draft"], x["accepted"]) for x in r.rounds]) for r in reqs]

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch.inference_mode():
        eager = speculate.Engine(target, drafter, batch_size=2, max_seq=64)
        expected = run(eager, second)
        engine = speculate.Engine(target, drafter, batch_size=2, max_seq=64, compile=True)
        engine.warmup()
        run(engine, first)
        speculate.Engine(target, drafter, batch_size=3, max_seq=96)  # another size: the shared caches re-allocated
        with torch._dynamo.config.patch(error_on_recompile=True):
            got = run(engine, second)
        written = target.layers[0].self_attn.kv_cache.k[0, len(second[0]):len(second[0]) + 8]
        assert bool((written != 0).any()), "the rounds wrote caches the models no longer hold"
        assert got == expected
        assert run(eager, second) == expected  # (and the eager engine, after the compiled one took them back)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2


def test_a_compiled_engine_built_by_hand_compiles_before_its_clock_starts(pair):
    """Engine(compile=True) without warmup(): generate warms it up first, so the compile is counted in
    compile_seconds, not in decode_seconds, and the round decodes with guards cut as make_engine's does."""
    from support.checkpoint import load_drafter, load_target

    target_dir, drafter_dir = pair
    target = load_target(target_dir)
    engine = speculate.Engine(target, load_drafter(drafter_dir, target), batch_size=1, max_seq=64,
                              compile=True)
    order = []

    class Stop(Exception):
        pass

    def warmup():
        order.append("warmup")
        raise Stop  # what came before it is what this test checks; no graph is compiled
    engine.warmup = warmup
    engine.step = lambda *args: order.append("round")
    with pytest.raises(Stop):
        engine.generate([speculate.Request(0, [5, 6, 7])], 8)
    assert order == ["warmup"] and engine.decode_seconds == 0.0


def test_a_compile_cache_error_names_where_its_path_came_from(tmp_path, monkeypatch):
    """A bad $TORCHINDUCTOR_CACHE_DIR is named as itself, not as a --compile-cache nobody gave; an empty one is
    refused, not replaced by the default in silence."""
    afile = tmp_path / "afile"
    afile.write_text("")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(afile))
    with pytest.raises(cli.UserError, match=f"^\\$TORCHINDUCTOR_CACHE_DIR {afile}: not a directory$"):
        cli.use_compile_cache(None)
    with pytest.raises(cli.UserError, match=f"^--compile-cache {afile}: not a directory$"):
        cli.use_compile_cache(str(afile))
    with pytest.raises(cli.UserError, match="^--compile-cache: empty"):
        cli.use_compile_cache("  ")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "")
    with pytest.raises(cli.UserError, match="^\\$TORCHINDUCTOR_CACHE_DIR: empty"):
        cli.use_compile_cache(None)
    # a path-like directory as the API's other path arguments take it (it was an AttributeError)
    assert cli.use_compile_cache(tmp_path / "cc") == str(tmp_path / "cc")
    with pytest.raises(cli.UserError, match="^--compile-cache: invalid value 5 \\(a directory: a str or an "
                                            "os.PathLike\\)$"):
        cli.use_compile_cache(5)


def test_a_budget_of_one_token_compiles_no_round(pair, monkeypatch, capsys):
    """--max-new-tokens 1 ends every request at the prefill's token: the engine compiles, warms up and
    profiles nothing (a cold compile costs minutes), by make_engine or by hand, and says so once; with
    --sps-table asked, the table is still read or written."""
    target_dir, drafter_dir = pair
    m = speculate.load(target_dir, drafter_dir)
    called = []
    monkeypatch.setattr(speculate.Engine, "warmup", lambda self: called.append("warmup"))
    monkeypatch.setattr(speculate.Engine, "dummy_round", lambda self, n: called.append("round"))

    class Stop(Exception):
        pass

    def load_or_profile(*args, **kwargs):
        called.append("sps")
        raise Stop  # the table is asked for: no need to profile one here
    monkeypatch.setattr(scheduler, "load_or_profile", load_or_profile)
    s = flags.check_settings(flags.Settings(max_new_tokens=1, compile=True, temperature=0),
                             torch.device("cpu"))
    engine = speculate.make_engine(m, m.drafter, [[5, 6, 7]], s)
    assert called == [] and engine.is_compiled
    assert capsys.readouterr().err == ""  # the run says so once, before its models load (start_machine)
    assert flags.compiling_line("c", 1) == ("--compile: --max-new-tokens 1 ends every request at its first "
                                            "token, before any round: nothing is compiled")
    done = engine.generate([speculate.Request(0, [5, 6, 7])], 1)
    assert called == [] and len(done[0].output_ids) == 1
    # a schedule that reads an SPS table has none to read, and needs none (it was refused as unprofiled)
    for kind in scheduler.SPS_KINDS:
        sps = flags.derived(s, scheduler=kind, compile=False)
        [done] = speculate.generate(m, [[5, 6, 7]], **{f.name: getattr(sps, f.name) for f in fields(sps)})
        assert called == [] and len(done.output_ids) == 1
    table = flags.derived(s, scheduler="hardware", sps_table="sps.json")
    with pytest.raises(Stop):
        speculate.make_engine(m, m.drafter, [[5, 6, 7]], table, verbose=False)
    assert called == ["warmup", "sps"]


def test_a_budget_of_one_token_says_once_that_nothing_compiles(capsys, tmp_path, monkeypatch):
    """The demo with --compile --max-new-tokens 1 builds two engines, neither compiled: one line says so,
    where "compiling the round next" was printed, then "nothing compiled" for each engine."""
    monkeypatch.chdir(tmp_path)  # the compile cache's default folder, unused
    rc = speculate.main(["--compile", "--max-new-tokens", "1", "--prompt", "def f(x):"])
    err = capsys.readouterr().err
    assert rc == 0, err
    line = "--compile: --max-new-tokens 1 ends every request at its first token, before any round: nothing is compiled"
    assert err.splitlines().count(line) == 1 and "compiling the round next" not in err, err
