"""The GPU run: staged, checked, saved as it goes.

    python scripts/device_run.py --out DIR              # on a CUDA machine: needs torch, triton and numpy only
    python scripts/device_run.py --dry-run --out DIR    # on CPU: every stage with small shapes

Each stage runs in a process of its own under its own time cap; the default stages' caps sum to 520 s,
so a call ends by itself within 9 minutes. The caps come from a cold H100's compile times, which take
most of each stage (BENCHMARKS.md, "A cold H100 run"). In order, smallest first:
  env           torch, triton, CUDA and driver versions, the GPU (env.json)
  smoke         bench.py's constructed pair (bigram-35m, τ ≈ 5) in float32, compiled, batch 1 and 4:
                bench asserts the speculative tokens equal autoregressive decoding's (CUDA graphs,
                the fused weights and the folded SDPA, on the GPU)
  compiled-b1   first the compiled verify's logits against eager's on 4 layers of Qwen3-8B's widths in
                bf16 (check verify_logits); then bench.py on Qwen3-8B's shape, random weights, bf16,
                compiled, batch 1, autoregressive and speculative
  eagle3-b1     bench.py on Qwen3-8B's shape with a random Eagle3 drafter (one layer, a chain of 7),
                bf16, compiled, batch 1: the paper's baseline beside compiled-b1's DSpark row
  tree-b1       bench.py on Qwen3-8B's shape, DSpark drafter, a draft tree of 16 nodes (compiled-b1 is
                the chain), bf16, compiled, batch 1; a second budget, a bench run of its own with its
                own compiles, would not fit the stage's cap
  triton        kernels.py's Triton kernels against their torch references on Qwen3-8B's shapes, eager
                and inside torch.compile, each check with its bf16 tolerance; each eager check times
                the kernel beside its reference (the chain, the sampled verify, the cache attention),
                launched call by call and replayed from a CUDA graph as a compiled round runs them
and, asked for by --stages only:
  compiled-b32  bench.py at batch 32, compiled (whole blocks verified: one verify graph per engine)
  eager-b1      bench.py at batch 1, eager
  kernels-b1    compiled-b1's bench run with --kernels triton: the Triton chain, sampled verify and cache
                attention inside the compiled round (compare with compiled-b1's rows)
  tree-sampled-b1  tree-b1 sampled at temperature 1 (autoregressive decoding too): children
                drawn, multi-draft rejection sampling at every node; random weights, so the round's
                milliseconds and its split are the figures, not τ
A stage writes DIR/<stage>.json when it starts and again after every row and check, so a stage stopped
at its cap keeps what it finished: "checks" (name, max_diff, tolerance, ok), "rows" (bench.py's), "sdpa"
(the backend torch picks for the cache attention at the stage's shapes, and those that could run it)
and "warnings": what torch logged under TORCH_LOGS=perf_hints,recompiles,cudagraphs that makes a timing
suspect (skipped CUDA graphs, a recompile, a re-recorded graph); each row carries those logged while
bench ran up to it, and a note if its tokens differ from autoregressive decoding's (in bf16 reported,
not asserted). DIR/log.txt gets every stage's output; DIR/summary.json each stage's status (ok; skipped:
nothing to do here; exit N; timed out; interrupted; not run), seconds and failed checks. DIR and the
files the stages write are checked before the first stage. Ctrl-C or SIGTERM stops the running stage
and starts no other (exit 130 / 143).

--dry-run: the tiny preset (qwen3-tiny) for every model, batch 2 for 32, a few tokens, Triton in its
interpreter, torch.compile tracing with dynamo as on the GPU but running the graphs eagerly (Inductor's
CPU code would take minutes per graph to build), and three times the caps.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from support.cli import UserError
from support.files import check_writable, write_json, wrong_kind  # noqa: E402  (neither tyro nor wandb)

# stage -> its time cap in seconds, in the order they run
STAGES = {"env": 15, "smoke": 60, "compiled-b1": 150, "eagle3-b1": 100, "tree-b1": 150, "triton": 45,
          "compiled-b32": 125, "eager-b1": 50, "tree-sampled-b1": 180, "kernels-b1": 140}
# what a call runs unasked
DEFAULT_STAGES = ("env", "smoke", "compiled-b1", "eagle3-b1", "tree-b1", "triton")
TREE_BUDGETS = (16,)  # the tree stages', smallest first, a bench run each; the dry run's are 2 and 4
TREE_STAGES = ("tree-b1", "tree-sampled-b1")
DRY_CAPS = 3      # a dry run's caps are three times these: a small shared CPU is slower than the GPU
BUDGET = 530      # seconds for the default stages: the caps, and the time to stop the last one at its cap
STOP_GRACE = 5    # a stage past its cap gets SIGTERM, then SIGKILL this much later
SHORTEST_STAGE = 5  # a stage left less time than this is not started
MIN_BUDGET = 20   # the smallest --budget: time for the first stage to start, and to stop it
SKIPPED = 3       # a stage's exit status when it has nothing to do here
TORCH_LOGS = ("perf_hints", "recompiles", "cudagraphs")
FLAGGED = ("skipping cudagraphs", "Recompiling", "Re-recording")  # log lines that make a timing suspect


def stage_file(stage: str) -> str:
    return f"{stage}.json"


# ----------------------------------------------------------------------------------------
# In a stage's process

def bench_args(stage: str, dry: bool, out: str) -> dict:
    """bench.BenchArgs of a bench stage. The dry run's differ only in device, preset and sizes."""
    if stage == "smoke":
        a = dict(model="bigram-35m", dtype="float32", batch_sizes="1,4", prompt_len=32, max_new_tokens=64,
                 repeats=1, compile=True)
    else:
        a = dict(model="qwen3-8b", dtype="bfloat16", batch_sizes="1", prompt_len=128, max_new_tokens=128,
                 repeats=2, compile=True)
    if stage == "compiled-b32":
        a.update(batch_sizes="32")
    if stage in ("eager-b1", *TREE_STAGES):
        a.update(max_new_tokens=64)
    if stage == "eager-b1":
        a.update(compile=False)
    if stage == "eagle3-b1":
        a.update(drafter_kind="eagle3")
    if stage == "kernels-b1":
        a.update(kernels="triton")
    if stage in TREE_STAGES:
        a.update(repeats=1)
    if stage == "tree-sampled-b1":
        a.update(temperature=1.0)
    a.update(device="cuda", reference=False, out=out, compile_mode=None)
    if a["compile"]:
        # CUDA graphs without GEMM autotuning (which would take minutes for an 8B model's shapes)
        a.update(compile_mode="reduce-overhead")
    if dry:
        dry_batches = {"1,4": "1,2", "32": "2"}
        batches = dry_batches.get(a["batch_sizes"], a["batch_sizes"])
        a.update(device="cpu", prompt_len=8, max_new_tokens=4, repeats=1, batch_sizes=batches, model="qwen3-tiny")
    return a


class TorchLog(logging.Handler):
    """What torch logs in this process (TORCH_LOGS); `flagged()`: the lines that make a timing suspect."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        from torch._logging._internal import log_registry

        self.lines = []
        self.last = None
        # torch's loggers keep their records from the root logger: a handler on each
        for name in log_registry.get_log_qnames():
            logging.getLogger(name).addHandler(self)

    def emit(self, record):
        if record is not self.last:  # a record may pass two of torch's loggers
            self.last = record
            self.lines.append(record.getMessage()[:1000])

    def mark(self) -> tuple[int, int]:
        from torch._dynamo.utils import counters

        return len(self.lines), counters["inductor"]["cudagraph_skips"]

    def flagged(self, since: tuple[int, int] = (0, 0)) -> list[str]:
        """The flagged lines logged since `mark()` gave `since`; and skipped CUDA graphs that torch
        counted without a line (the log's name for them changed between versions)."""
        out = []
        for line in self.lines[since[0]:]:
            if any(f in line for f in FLAGGED):
                out.append(line)
        skips = self.mark()[1] - since[1]
        counted = any("skipping cudagraphs" in line for line in out)
        if skips and not counted:
            out.append(f"skipping cudagraphs: {skips} graph(s), counted by torch")
        return out


class Stage:
    """A stage's JSON file, written whole at once and after every row and check."""

    def __init__(self, name: str, out: str, dry: bool):
        self.path = os.path.join(out, stage_file(name))
        self.log = TorchLog()
        self.doc = {"stage": name, "dry_run": dry, "complete": False, "warnings": [], "checks": [],
                    "sdpa": {}, "rows": []}
        self.save()

    def save(self):
        self.doc["warnings"] = self.log.flagged()
        write_json(self.path, self.doc, indent=1)

    def check(self, name: str, max_diff: float, tolerance: float, **info):
        max_diff = float(max_diff)
        tolerance = float(tolerance)
        ok = max_diff <= tolerance  # NaN fails
        recorded = max_diff
        if not math.isfinite(max_diff):  # JSON has no NaN or Inf
            recorded = str(max_diff)
        self.doc["checks"].append({"name": name, "max_diff": recorded, "tolerance": tolerance, "ok": ok, **info})
        verdict = "ok" if ok else "FAILED"
        print(f"check {name}: max diff {max_diff:.3g}, tolerance {tolerance:.3g}: {verdict}", flush=True)
        self.save()


def light_compile():
    """--dry-run: torch.compile traces with dynamo (fullgraph, guards, recompiles) and runs the graphs eagerly."""
    import torch

    real = torch.compile

    def compile(fn=None, **kw):
        fullgraph = kw.get("fullgraph", False)
        return real(fn, fullgraph=fullgraph, dynamic=kw.get("dynamic"), backend="eager")
    torch.compile = compile


def unit_roundoff(dtype) -> float:
    import torch

    return torch.finfo(dtype).eps / 2  # 2^-8 for bf16


@contextlib.contextmanager
def sdpa_spy():
    """The backend of each scaled_dot_product_attention call in the block, as torch chooses it."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend

    real = F.scaled_dot_product_attention
    seen = []

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        try:
            choice = torch._fused_sdp_choice(q, k, v, attn_mask, dropout_p, is_causal, scale=scale,
                                             enable_gqa=enable_gqa)
            seen.append(SDPBackend(choice).name)
        except (RuntimeError, TypeError, ValueError) as e:  # a diagnostic: it must not stop the stage
            seen.append(f"unknown ({type(e).__name__}: {str(e)[:200]})")
        return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)
    F.scaled_dot_product_attention = spy
    try:
        yield seen
    finally:
        F.scaled_dot_product_attention = real


def sdpa_backend(args, batch: int, T: int, S: int, dtype, dev) -> dict:
    """The SDPA backend of the cache attention (model.attend_cached, its mask folded for GQA as the model
    folds it) for T query tokens over S cache positions: torch's pick, and each one that can run alone."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import model

    H = args.num_attention_heads
    Hkv = args.num_key_value_heads
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = attention_inputs(batch, T, H, Hkv, args.head_dim, S, dtype, dev, g)
    bias, _ = attention_biases(batch, T, H, Hkv, S, S, dtype, dev)  # the last T of S positions
    folded = model.fold_gqa(dev) and H > Hkv
    with sdpa_spy() as seen:
        model.attend_cached(q, k, v, bias)
    can = []
    for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"):
        with contextlib.suppress(RuntimeError), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # each refusing backend warns why
            with sdpa_kernel([getattr(SDPBackend, name)]):
                model.attend_cached(q, k, v, bias)
            can.append(name)
    dtype_name = str(dtype).replace("torch.", "")
    return {"batch": batch, "query_tokens": T, "cache_positions": S, "dtype": dtype_name,
            "folded_gqa": folded, "runs": seen[0], "can_run": can}


def verify_logits(st: Stage, preset: str, layers: int, batch: int, dtype, dev, dry: bool):
    """The compiled verify forward's logits against eager's on the same cache and tokens: a random target
    of `preset`'s widths with `layers` layers (the tolerance grows with the depth; the layers are alike)."""
    import torch

    import speculate
    from model import ModelArgs, Transformer
    from support.checkpoint import PRESETS, init_random_

    a = ModelArgs(**{**PRESETS[preset], "num_hidden_layers": layers})
    with torch.device("meta"):
        target = Transformer(a)
    target = target.to(dtype).to_empty(device=dev)
    if a.tie_word_embeddings:
        target.lm_head.weight = target.embed_tokens.weight
    target = init_random_(target, 0).eval().requires_grad_(False)
    # a prompt of P tokens, then a verify of T (on the GPU 8: a block of 7 drafts)
    P = 128
    T = 8
    if dry:
        P = 8
        T = 4
    target.setup_caches(batch, P + 64)
    g = torch.Generator(device=dev).manual_seed(0)
    prompt = torch.randint(0, a.vocab_size, (batch, P), generator=g, device=dev)
    prompt_positions = torch.arange(P, device=dev).expand(batch, P)
    target(prompt, prompt_positions)  # the prompt into the cache, eagerly
    tokens = torch.randint(0, a.vocab_size, (batch, T), generator=g, device=dev)
    positions = P + torch.arange(T, device=dev).expand(batch, T)
    want = target(tokens, positions)[0].float()
    fn = speculate.compiled(lambda x, p: target(x, p)[0], dev, "reduce-overhead")
    t0 = time.perf_counter()
    diff = 0.0
    agree = 1.0
    for _ in range(3):  # with CUDA graphs: warm-up, recording, replay
        if dev == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        got = fn(tokens, positions).float()
        diff = max(diff, (got - want).abs().max().item())
        same_argmax = got.argmax(-1) == want.argmax(-1)
        agree = min(agree, same_argmax.float().mean().item())
    compile_seconds = round(time.perf_counter() - t0, 1)
    largest = want.abs().max().item()
    # Each side rounds the output of every residual branch (L attention, L MLP) and of the head to bf16,
    # relative u each, so 2u apart; the stream adds them up: at most (2L + 1) * 2u at the logits' scale.
    tol = (2 * layers + 1) * 2 * unit_roundoff(dtype) * largest
    st.check("verify_logits", diff, tol, preset=preset, layers=layers, batch=batch, query_tokens=T, cached=P,
             max_abs_logit=largest, argmax_agree=agree, compile_seconds=compile_seconds)


def bench_rows(st: Stage, args: dict):
    """bench.run with these BenchArgs; its document, rewritten after every row, goes into the stage's file,
    each row with the warnings logged up to it."""
    import bench

    from support.cli import from_flat

    since = st.log.mark()

    def keep(path, doc, indent=None):
        budget = args.get("tree_budget", 0)
        for row in doc["rows"]:
            if "warnings" not in row:
                row["warnings"] = st.log.flagged(since)
                differ = row.get("differing_requests") or []
                if differ:
                    row["warnings"].append(f"tokens differ from autoregressive decoding's in {len(differ)} "
                                           f"request runs (differing_requests)")
            row.setdefault("tree_budget", budget)
        for ratio in doc["ratios"]:
            ratio.setdefault("tree_budget", budget)
        # a tree stage's budgets, one bench run each: every budget's rows and ratios kept
        merged = {}
        for key in ("rows", "ratios"):
            earlier = [r for r in st.doc.get(key, []) if r["tree_budget"] != budget]
            merged[key] = earlier + doc[key]
        complete = st.doc["complete"]  # the stage's, set when it ends; not one bench run's
        st.doc.update(doc, complete=complete, **merged)
        st.save()
    bench.write_json = keep  # bench's only writer: its --out document
    bench.run(from_flat(bench.BenchArgs, args))


def bench_stage(st: Stage, stage: str, dry: bool):
    import bench
    import torch

    from model import ModelArgs
    from support.checkpoint import PRESETS

    args = bench_args(stage, dry, st.path)
    dev = args["device"]
    dtype = getattr(torch, args["dtype"])
    if args["model"] == "bigram-35m":
        margs = ModelArgs(**bench.BIGRAM_35M)
        verify = 6  # its drafter's block + the anchor
    else:
        margs = ModelArgs(**PRESETS[args["model"]])
        verify = 8
    budgets = [0]
    if stage in TREE_STAGES and dry:
        budgets = [2, 4]
    elif stage in TREE_STAGES:
        budgets = list(TREE_BUDGETS)
    for budget in budgets:  # the shapes each bench run's attention sees: a tree verifies its nodes and the anchor
        queries = verify
        name = "verify"
        if budget:
            queries = budget + 1
            name = f"tree {budget} verify"
        S = args["prompt_len"] + args["max_new_tokens"] + 2 * max(verify, queries)  # the engine's cache (max_seq)
        for b in map(int, args["batch_sizes"].split(",")):
            for what, T in ((name, queries), ("step", 1)):
                st.doc["sdpa"][f"b{b} {what}"] = sdpa_backend(margs, b, T, S, dtype, dev)
    st.save()
    if stage == "compiled-b1" and dry:
        verify_logits(st, "qwen3-tiny", 2, 1, dtype, dev, dry)
    elif stage == "compiled-b1":
        verify_logits(st, "qwen3-8b", 4, 1, dtype, dev, dry)
    try:
        for budget in budgets:
            if budget:
                args = dict(args, tree_budget=budget)
            bench_rows(st, args)
    except AssertionError as e:  # float32: bench asserts equal tokens
        st.check("speculative_tokens_equal", 1, 0, error=str(e)[:1000])
        raise
    if args["dtype"] == "float32":
        st.check("speculative_tokens_equal", 0, 0,
                 note="bench.py asserts every run's tokens equal autoregressive decoding's in float32")


# The Triton checks' shapes: Qwen3-8B's vocabulary, its drafter's block of 7 and Markov rank 256; its
# attention in a verify of 8 tokens over a cache for 2048 new tokens after a 256-token prompt.
CHAIN = [(1, 7, 151936, 256), (4, 7, 151936, 256)]  # (B, K, V, r); the Triton chain runs at B <= 4
VERIFY = [(1, 7, 151936), (32, 7, 151936)]  # (B, K, V)
ATTENTION = [(1, 8, 32, 8, 128, 2312, (300, 2000)), (32, 8, 32, 8, 128, 2312, (300, 1200, 2000))]
DRY = dict(chain=[(1, 3, 1000, 64), (2, 3, 1000, 64)], verify=[(2, 3, 1000)],
           attention=[(2, 4, 4, 2, 16, 70, (10, 60))])


@contextlib.contextmanager
def only_triton():
    """The Triton functions' fallbacks raise in the block: no check compares a reference with itself."""
    import model
    import sampling

    patched = [(sampling, "markov_chain"), (sampling, "accept_sampled"), (model, "attend_cached")]
    saved = {}
    for module, name in patched:
        saved[(module, name)] = getattr(module, name)

    def fell_back(*a, **kw):
        raise AssertionError("a Triton function fell back to its torch reference")
    for module, name in patched:
        setattr(module, name, fell_back)
    try:
        yield
    finally:
        for (module, name), f in saved.items():
            setattr(module, name, f)


def microseconds(fn, dev: str, reps: int) -> float:
    """Microseconds a call of `fn`: the mean of `reps` calls after one."""
    from support.cli import sync

    fn()
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(dev)
    seconds = (time.perf_counter() - t0) / reps
    return round(seconds * 1e6, 1)


def graph_microseconds(fn, reps: int) -> float:
    """Microseconds a replay of `fn` captured in a CUDA graph, as a compiled round runs it (no launch
    overhead between its kernels): the mean of `reps` replays after one."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture: Triton builds, the allocator settles
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return microseconds(graph.replay, "cuda", reps)


def timings(reference, triton, dev: str, reps: int) -> dict:
    """The torch reference's and the Triton function's microseconds a call, launched one by one; on a
    GPU also replayed from a CUDA graph (a function that cannot be captured: the error instead)."""
    speed = {"reference_us": microseconds(reference, dev, reps), "triton_us": microseconds(triton, dev, reps)}
    if dev != "cuda":
        return speed
    try:
        speed["reference_graph_us"] = graph_microseconds(reference, reps)
        speed["triton_graph_us"] = graph_microseconds(triton, reps)
    except Exception as e:  # noqa: BLE001 - a timing that could not be taken, said so
        speed["graph_error"] = f"{type(e).__name__}: {e}"[:500]
    return speed


def chain_inputs(B: int, K: int, V: int, r: int, dtype, dev: str, g):
    """A vanilla Markov head of rank r, and a chain's base logits U [B, K, V], anchors [B] and hidden
    states [B, K, 16] (the vanilla head does not read them)."""
    import torch

    from drafter import VanillaMarkov

    with torch.device(dev):
        markov = VanillaMarkov(16, V, r).to(dtype).requires_grad_(False)
    U = 2 * torch.randn((B, K, V), generator=g, device=dev)
    U = U.to(dtype)
    anchor = torch.randint(0, V, (B,), generator=g, device=dev)
    h = torch.zeros((B, K, 16), device=dev, dtype=dtype)
    return markov, U, anchor, h


def chain_gap(markov, U, anchor, drafts) -> tuple[float, float]:
    """How far the chain's greedy picks trail the best reference score, z_k = U_k + W2·W1[x_{k-1}] at
    the chain's own previous tokens, and the tolerance."""
    import torch

    previous = torch.cat([anchor[:, None], drafts[:, :-1]], dim=1)
    bias = markov.markov_w2(markov.markov_w1(previous))
    z = (U + bias).float()
    picked = z.gather(-1, drafts[..., None])[..., 0]
    gap = (z.amax(-1) - picked).max().item()
    # The bias, then z, are rounded to the dtype on each side from sums taken in other orders: up to one
    # unit in the last place (2u relative) apart each, so a pick may trail the best by twice that.
    largest = (bias.float().abs().max() + z.abs().max()).item()
    tolerance = 2 * 2 * unit_roundoff(U.dtype) * largest
    return gap, tolerance


def verify_inputs(B: int, K: int, V: int, dtype, dev: str, g):
    """A sampled verify's inputs: drafts [B, K] (the target's argmax, a fifth replaced at random), q
    [B, K, V], target logits [B, K+1, V], ℓ [B], the uniforms [B, K] and the bonus's Exp(1) [B, V]."""
    import torch

    logits = torch.randn((B, K + 1, V), generator=g, device=dev).to(dtype)
    drafts = torch.argmax(logits[:, :K], -1)
    replaced = torch.rand((B, K), generator=g, device=dev) < 0.2
    random_tokens = torch.randint(0, V, (B, K), generator=g, device=dev)
    drafts = torch.where(replaced, random_tokens, drafts)
    verify_len = torch.randint(0, K + 1, (B,), generator=g, device=dev)
    q_noise = torch.randn((B, K, V), generator=g, device=dev)
    q = torch.softmax(logits[:, :K].float() + q_noise, -1)
    u = torch.rand((B, K), generator=g, device=dev)
    bonus_noise = torch.empty((B, V), device=dev).exponential_(1, generator=g)
    return drafts, q, logits, verify_len, u, bonus_noise


def differing(got, want) -> float:
    """How many entries differ between two (accepted counts, next tokens) pairs."""
    count = 0
    for a, b in zip(got, want):
        count += int((a != b).sum())
    return float(count)


def attention_inputs(B: int, T: int, H: int, Hkv: int, hd: int, S: int, dtype, dev: str, g):
    """q [B, T, H, hd] and a cache's k, v [B, S, Hkv, hd]."""
    import torch

    q = torch.randn((B, T, H, hd), generator=g, device=dev).to(dtype)
    k = torch.randn((B, S, Hkv, hd), generator=g, device=dev).to(dtype)
    v = torch.randn((B, S, Hkv, hd), generator=g, device=dev).to(dtype)
    return q, k, v


def attention_biases(B: int, T: int, H: int, Hkv: int, S: int, filled: int, dtype, dev: str):
    """The cache bias of T query tokens ending at position `filled` over S cache positions: as the model
    folds it for the reference (GQA folded where it folds it), and unfolded for the Triton kernel."""
    import torch

    import model

    query_pos = filled - T + torch.arange(T, device=dev)
    allowed = query_pos[None, :, None] >= torch.arange(S, device=dev)
    allowed = allowed.expand(B, T, S)
    group = 1
    if model.fold_gqa(dev):
        group = H // Hkv
    reference_bias = model.cache_bias(allowed, group, dtype)
    triton_bias = model.cache_bias(allowed, 1, dtype)
    return reference_bias, triton_bias


def attention_tolerance(q, k, v, bias, want, backend: str) -> float:
    """The bound on two correct attentions of these inputs: each side rounds the weights p to the
    dtype before p·V (u·Σp|v| each), and the output (u·|o| each); a backend that keeps the scores s
    in the dtype moves each p by up to 2u·|s| more (math)."""
    import torch

    import model

    u = unit_roundoff(q.dtype)
    # Σ p|v|: the attention of |v|
    spread = model.attend_cached(q.float(), k.float(), v.float().abs(), bias.float()).max().item()
    scores = 0.0
    if backend == "MATH":
        group = q.shape[2] // k.shape[2]
        keys = k.float().repeat_interleave(group, 2)
        s = torch.einsum("bthd,bshd->bhts", q.float(), keys) * q.shape[-1] ** -0.5
        scores = s.abs().max().item()
    output = want.float().abs().max().item()
    return 2 * u * (spread * (1 + scores) + output)


def chain_checks(st: Stage, shapes: list, dtype, dev: str, g, reps: int):
    """The Triton Markov chain's greedy picks against the best reference score, and both timed."""
    import kernels
    import sampling

    for B, K, V, r in shapes:
        markov, U, anchor, h = chain_inputs(B, K, V, r, dtype, dev, g)
        with only_triton():
            drafts, _ = kernels.markov_chain(U, h, anchor, markov, 0.0, None)
        gap, tol = chain_gap(markov, U, anchor, drafts)
        speed = timings(lambda: sampling.markov_chain(U, h, anchor, markov, 0.0, None),
                        lambda: kernels.markov_chain(U, h, anchor, markov, 0.0, None), dev, reps)
        st.check(f"chain B={B} K={K} V={V} r={r}", gap, tol,
                 measure="best reference score minus the score of the pick", **speed)


def sampled_verify(accept, inputs):
    """`accept` (the reference or the Triton function) on `verify_inputs`' tensors at temperature 1."""
    drafts, q, logits, verify_len, u, bonus_noise = inputs
    return accept(drafts, q, logits, verify_len, 1.0, u, bonus_noise)


def verify_checks(st: Stage, shapes: list, dtype, dev: str, g, reps: int):
    """The Triton sampled verify's accepted counts and next tokens against the reference's, and both
    timed. The acceptance tests compare float32 probabilities that differ in the last bits only: no
    row may differ."""
    import kernels
    import sampling

    for B, K, V in shapes:
        inputs = verify_inputs(B, K, V, dtype, dev, g)
        with only_triton():
            got = sampled_verify(kernels.accept_sampled, inputs)
        want = sampled_verify(sampling.accept_sampled, inputs)
        speed = timings(lambda: sampled_verify(sampling.accept_sampled, inputs),
                        lambda: sampled_verify(kernels.accept_sampled, inputs), dev, reps)
        st.check(f"verify_sampled B={B} K={K} V={V}", differing(got, want), 0.0,
                 measure="accepted counts and next tokens that differ", **speed)


def attention_checks(st: Stage, shapes: list, dtype, dev: str, g, reps: int):
    """The Triton attention over the KV cache against the model's SDPA at each fill, and both timed."""
    import kernels
    import model

    for B, T, H, Hkv, hd, S, fills in shapes:
        q, k, v = attention_inputs(B, T, H, Hkv, hd, S, dtype, dev, g)
        for filled in fills:
            reference_bias, bias = attention_biases(B, T, H, Hkv, S, filled, dtype, dev)
            with sdpa_spy() as backends:
                want = model.attend_cached(q, k, v, reference_bias)
            with only_triton():
                got = kernels.cached_attention(q, k, v, bias)
            diff = (got.float() - want.float()).abs().max().item()
            tol = attention_tolerance(q, k, v, reference_bias, want, backends[0])
            speed = timings(lambda: model.attend_cached(q, k, v, reference_bias),
                            lambda: kernels.cached_attention(q, k, v, bias), dev, reps)
            st.check(f"attention B={B} T={T} H={H}/{Hkv} hd={hd} S={S} filled={filled}", diff, tol,
                     reference_backend=backends[0], **speed)


def compiled_checks(st: Stage, shapes: dict, dtype, adtype, dev: str, g, dry: bool):
    """The engine compiles the round whole (fullgraph, static shapes), so the kernels must trace: the
    chain and the sampled verify in one graph, the attention in another, each checked as above, and a
    graph that does not compile a failed check with its error. In the interpreter (the dry run), traced
    code takes the references: Triton's interpreter cannot run inside a graph."""
    import torch

    import kernels
    import model
    import sampling

    B, K, V, r = shapes["chain"][0]
    markov, U, anchor, h = chain_inputs(B, K, V, r, dtype, dev, g)
    logits = torch.randn((B, K + 1, V), generator=g, device=dev).to(dtype)
    verify_len = torch.full((B,), K, device=dev)
    q = torch.softmax(torch.randn((B, K, V), generator=g, device=dev), -1)
    u = torch.rand((B, K), generator=g, device=dev)
    bonus_noise = torch.empty((B, V), device=dev).exponential_(1, generator=g)

    def step(U, anchor, logits, verify_len):
        drafts, _ = kernels.markov_chain(U, h, anchor, markov, 0.0, None)
        accepted, next_token = kernels.accept_sampled(drafts, q, logits, verify_len, 1.0, u, bonus_noise)
        return drafts, accepted, next_token

    outputs = compiled_run(st, ("compiled chain", "compiled verify_sampled"), step, dry,
                           U, anchor, logits, verify_len)
    if outputs is not None:
        drafts, accepted, next_token = outputs
        st.check("compiled chain", *chain_gap(markov, U, anchor, drafts), triton_traced=not dry)
        reference = sampling.accept_sampled(drafts, q, logits, verify_len, 1.0, u, bonus_noise)
        st.check("compiled verify_sampled", differing((accepted, next_token), reference), 0.0,
                 triton_traced=not dry)
    B, T, H, Hkv, hd, S, fills = shapes["attention"][0]
    aq, ak, av = attention_inputs(B, T, H, Hkv, hd, S, adtype, dev, g)
    reference_bias, bias = attention_biases(B, T, H, Hkv, S, fills[-1], adtype, dev)
    with sdpa_spy() as backends:
        want = model.attend_cached(aq, ak, av, reference_bias)
    got = compiled_run(st, ("compiled attention",), kernels.cached_attention, dry, aq, ak, av, bias)
    if got is not None:
        diff = (got.float() - want.float()).abs().max().item()
        tol = attention_tolerance(aq, ak, av, reference_bias, want, backends[0])
        st.check("compiled attention", diff, tol, triton_traced=not dry)


def compiled_run(st: Stage, checks: tuple, fn, dry: bool, *args):
    """fn compiled whole and run on args, the Triton functions' fallbacks refused (on the GPU); where it
    fails, each of `checks` is recorded failed with the error, and None returned."""
    import torch

    guard = contextlib.nullcontext()
    if not dry:
        guard = only_triton()
    try:
        with guard:
            graph = torch.compile(fn, fullgraph=True, dynamic=False)
            return graph(*args)
    except Exception as e:  # noqa: BLE001 - recorded as the checks' failure, the stage goes on
        error = f"{type(e).__name__}: {e}"[:2000]
        for name in checks:
            st.check(name, math.inf, 0.0, error=error, triton_traced=not dry)
        return None


def triton_stage(st: Stage, dry: bool) -> int:
    """kernels.py's Triton kernels against their torch references, eager then compiled, each timed
    beside its reference (the dry run times one call in the interpreter: it runs the code, says
    nothing of the speed)."""
    import torch

    import kernels

    if not kernels.HAVE_TRITON:
        print("triton is not installed here: nothing to check")
        return SKIPPED
    dev = "cuda"
    reps = 20
    shapes = dict(chain=CHAIN, verify=VERIFY, attention=ATTENTION)
    if dry:
        dev = "cpu"
        reps = 1
        shapes = DRY
    dtype = torch.bfloat16
    adtype = dtype
    if dry:  # the interpreter's tl.dot multiplies bf16 as raw bits
        adtype = torch.float16
    kernels.check_backend("triton", dev)  # builds the kernels; raises where Triton cannot run
    g = torch.Generator(device=dev).manual_seed(0)
    chain_checks(st, shapes["chain"], dtype, dev, g, reps)
    verify_checks(st, shapes["verify"], dtype, dev, g, reps)
    attention_checks(st, shapes["attention"], adtype, dev, g, reps)
    compiled_checks(st, shapes, dtype, adtype, dev, g, dry)
    return 0


def env_stage(out: str, dry: bool):
    import importlib.metadata
    import platform

    import torch

    def driver():
        try:
            p = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return None
        said = p.stdout.strip()
        if p.returncode != 0 or not said:
            return None
        return said.splitlines()[0]

    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = None
    sdpa_enabled = {}  # which SDPA backends torch may pick
    for backend in ("flash", "mem_efficient", "cudnn", "math"):
        enabled = getattr(torch.backends.cuda, f"{backend}_sdp_enabled", None)
        if enabled is not None:
            sdpa_enabled[backend] = enabled()
    info = {"dry_run": dry, "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": triton, "driver_version": driver(),
            "cuda_available": torch.cuda.is_available(), "gpu": None, "torch_logs": os.environ.get("TORCH_LOGS"),
            "sdpa_enabled": sdpa_enabled}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, memory_gib=round(p.total_memory / 2**30, 1),
                    multiprocessors=p.multi_processor_count, capability=f"{p.major}.{p.minor}",
                    cudnn=torch.backends.cudnn.version())
    print(json.dumps(info))
    write_json(os.path.join(out, "env.json"), info)


def run_stage(stage: str, dry: bool, out: str) -> int:
    """One stage, in this process (the parent runs each in a child under its cap)."""
    if stage == "env":
        env_stage(out, dry)
        return 0
    import torch

    from support.cli import use_compile_cache

    if dry:
        light_compile()
    use_compile_cache(None)  # bench's cache directory, for the logits check's graph too
    st = Stage(stage, out, dry)
    try:
        with torch.inference_mode():
            if stage == "triton":
                status = triton_stage(st, dry)
            else:
                bench_stage(st, stage, dry)
                status = 0
    except BaseException as e:  # kept in the file too, then as Python reports it
        st.doc["error"] = f"{type(e).__name__}: {e}"[:2000]
        st.save()
        raise
    st.doc["complete"] = status == 0
    st.save()
    failed = failed_checks(st.doc)
    if failed:
        print(f"failed checks: {', '.join(failed)}", file=sys.stderr)
        return 1
    return status


def failed_checks(doc: dict) -> list[str]:
    """The names of a stage document's checks that failed."""
    return [c["name"] for c in doc.get("checks", []) if not c["ok"]]


# ----------------------------------------------------------------------------------------
# The parent: checks, then each stage in a child under its cap

def torch_logs() -> str:
    """TORCH_LOGS for the stages: the artifacts above that this torch has, after any given."""
    from torch._logging._internal import log_registry

    given = []
    for name in os.environ.get("TORCH_LOGS", "").split(","):
        if name.strip():
            given.append(name)
    for name in TORCH_LOGS:
        if log_registry.is_artifact(name) and name not in given:
            given.append(name)
    return ",".join(given)


def stop(p: subprocess.Popen):
    """End a stage's process and whatever it started (its process group): SIGTERM, then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:  # none left
            break
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=STOP_GRACE if p.returncode is None else 0.5)
    p.wait()


def now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def stage_command(stage: str, out: str, dry: bool) -> list[str]:
    command = [sys.executable, os.path.abspath(__file__), "--stage", stage, "--out", out]
    if dry:
        command.append("--dry-run")
    return command


def run_stages(stages: list[str], out: str, dry: bool, budget: float, caps: dict = STAGES) -> int:
    t_start = time.monotonic()
    t_end = t_start + budget
    logs = torch_logs()
    entries = []
    for stage in stages:
        entries.append({"stage": stage, "status": "not run", "cap_s": caps[stage]})
        path = os.path.join(out, stage_file(stage))
        if os.path.exists(path):  # an earlier call's, which a stage not run this time would leave as its own
            os.remove(path)
    summary = {"dry_run": dry, "budget_s": budget, "started": now(), "torch_logs": logs, "stages": entries}
    summary_path = os.path.join(out, "summary.json")
    log_path = os.path.join(out, "log.txt")
    dry_flag = ""
    if dry:
        dry_flag = " --dry-run"
    with open(log_path, "a") as log:
        log.write(f"##### {summary['started']}: --stages {','.join(stages)}{dry_flag}\n")
    signals = []  # SIGINT / SIGTERM: the running stage is stopped, no other starts
    handlers = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        handlers[sig] = signal.signal(sig, lambda signum, frame: signals.append(signum))
    try:
        for entry in entries:
            stage = entry["stage"]
            left = t_end - time.monotonic() - STOP_GRACE
            if signals:
                entry["status"] = "not run: interrupted"
                continue
            if left < SHORTEST_STAGE:
                entry["status"] = "not run: budget spent"
                print(f"=== {stage}: not run, the budget is spent", flush=True)
                continue
            limit = min(caps[stage], left)
            path = os.path.join(out, stage_file(stage))
            entry.update(status="running", started=now(), limit_s=round(limit))
            write_json(summary_path, summary)
            print(f"=== {stage} (at most {limit:.0f} s)", flush=True)
            t0 = time.monotonic()
            status = run_child(stage, out, dry, limit, logs, log_path, signals)
            entry.update(status=status, seconds=round(time.monotonic() - t0, 1))
            entry.update(stage_outcome(path))
            print(f"=== {stage}: {status} in {entry['seconds']:.0f} s", flush=True)
            write_json(summary_path, summary)
        summary["seconds"] = round(time.monotonic() - t_start, 1)
        write_json(summary_path, summary)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    if signals:
        name = signal.Signals(signals[0]).name
        print(f"interrupted by {name}: stopped; {summary_path} lists what finished", file=sys.stderr)
        return 128 + signals[0]
    for entry in entries:
        if entry["status"] not in ("ok", "skipped"):
            return 1
    return 0


def run_child(stage: str, out: str, dry: bool, limit: float, logs: str, log_path: str, signals: list) -> str:
    """One stage in a process of its own, its output echoed and appended to log.txt, stopped at `limit`
    seconds or at a signal. Returns its status."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TORCH_LOGS=logs)
    if dry:  # the CPU kernels are not what a GPU runs; Triton on CPU is its interpreter
        interpret = "0"
        if stage in ("triton", "kernels-b1"):
            interpret = "1"
        env.update(DSPARK_CPU_KERNELS="0", TRITON_INTERPRET=interpret)
    t0 = time.monotonic()
    with open(log_path, "a") as log:
        log.write(f"=== {stage}\n")
        log.flush()
        # its own process group, out of reach of a terminal's Ctrl-C: stopped here with what it started
        p = subprocess.Popen(stage_command(stage, out, dry), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stdin=subprocess.DEVNULL, stderr=subprocess.STDOUT, text=True, errors="replace",
                             process_group=0)

        def pump():  # echo the stage's output and keep it
            for line in p.stdout:
                print(line, end="", flush=True)
                log.write(line)
                log.flush()
        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        while p.returncode is None and not signals and time.monotonic() - t0 <= limit:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=0.2)
        stopped = p.returncode is None
        stop(p)  # and what it left running (compile workers)
        # a Ctrl-C can reach a stage started that instant, before it has a process group of its own
        if signals:
            status = "interrupted"
        elif stopped:
            status = "timed out"
        elif p.returncode == 0:
            status = "ok"
        elif p.returncode == SKIPPED:
            status = "skipped"
        else:
            status = f"exit {p.returncode}"
        reader.join(timeout=5)
    return status


def stage_outcome(path: str) -> dict:
    """What a stage's file says for the summary: its failed checks, warnings and rows (nothing when the
    file is absent or unreadable)."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return {}
    return {"failed_checks": failed_checks(doc), "warnings": len(doc.get("warnings", [])),
            "rows": len(doc.get("rows", []))}


class Flags(argparse.ArgumentParser):
    def error(self, message):  # one line, as every program here says a bad flag
        raise UserError(message)


def parse(argv) -> argparse.Namespace:
    ap = Flags(prog="scripts/device_run.py", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "device_out"),
                    help="the folder the results go to (default: $OUT, else device_out)")
    ap.add_argument("--dry-run", action="store_true",
                    help="run the stages on CPU with small shapes (no CUDA needed)")
    ap.add_argument("--budget", type=float, default=BUDGET,
                    help=f"seconds for all stages together (default {BUDGET})")
    defaults = ",".join(DEFAULT_STAGES)
    others = ", ".join(s for s in STAGES if s not in DEFAULT_STAGES)
    ap.add_argument("--stages", default=defaults,
                    help=f"comma-separated stages, run in the order given (default: {defaults}; also: {others})")
    # a child: run one stage in this process
    ap.add_argument("--stage", choices=STAGES, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    stages = []
    for name in a.stages.split(","):
        if name.strip():
            stages.append(name.strip())
    a.stages = stages
    unknown = [s for s in a.stages if s not in STAGES]
    if unknown:
        raise UserError(f"--stages: unknown stage {unknown[0]!r} (known: {', '.join(STAGES)})")
    if not a.stages:
        raise UserError("--stages: none given")
    if len(set(a.stages)) < len(a.stages):
        raise UserError(f"--stages {','.join(a.stages)}: a stage given twice")
    if not MIN_BUDGET <= a.budget <= 3600:  # NaN fails too
        raise UserError(f"--budget {a.budget:g}: must be a number of seconds from {MIN_BUDGET} to 3600")
    if not a.out.strip():
        raise UserError("--out: empty path")
    if os.path.exists(a.out) and not os.path.isdir(a.out):
        raise UserError(f"--out {a.out}: {wrong_kind(a.out, 'directory')}")
    a.out = os.path.abspath(a.out)  # the stages run from the repository root
    return a


def check_out(out: str, stages: list[str]):
    """--out before any stage: made if missing, and every file this run writes there writable."""
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out}: cannot create it ({e.strerror or e})") from None
    for name in ("summary.json", "log.txt", *map(stage_file, stages)):
        check_writable(os.path.join(out, name), "--out")


def main(argv=None) -> int:
    try:
        a = parse(argv)
        if a.stage:
            return run_stage(a.stage, a.dry_run, a.out)
        if not a.dry_run:
            import torch
            if not torch.cuda.is_available():
                raise UserError("no CUDA device here (--dry-run runs the stages on CPU)")
        check_out(a.out, a.stages)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    caps = STAGES
    if a.dry_run:
        caps = {stage: cap * DRY_CAPS for stage, cap in STAGES.items()}
    return run_stages(a.stages, a.out, a.dry_run, a.budget, caps)


if __name__ == "__main__":
    sys.exit(main())
