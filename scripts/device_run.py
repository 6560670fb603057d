"""The GPU run: staged, checked, saved as it goes.

    python scripts/device_run.py --out DIR              # on a CUDA machine: needs torch and triton only
    python scripts/device_run.py --dry-run --out DIR    # on CPU: every stage with small shapes

Each stage runs in a process of its own under its own time cap; the default stages' caps sum to 520 s,
so a call ends by itself within 9 minutes. In order, smallest first:
  env           torch, triton, CUDA and driver versions, the GPU (env.json)
  smoke         bench.py's constructed pair (bigram-35m, τ ≈ 5) in float32, compiled, batch 1 and 4:
                bench asserts the speculative tokens equal autoregressive decoding's (CUDA graphs,
                the fused weights and the folded SDPA, on the GPU)
  compiled-b1   first the compiled verify's logits against eager's on 4 layers of Qwen3-8B's widths in
                bf16 (check verify_logits); then bench.py on Qwen3-8B's shape, random weights, bf16,
                compiled, batch 1, autoregressive and speculative
  eagle3-b1     bench.py on Qwen3-8B's shape with a random Eagle3 drafter (one layer, a chain of 7),
                bf16, compiled, batch 1: the paper's baseline beside compiled-b1's DSpark row
  tree-b1       bench.py on Qwen3-8B's shape, DSpark drafter, draft trees of 16, 32 and 64 nodes
                (compiled-b1 is the chain), bf16, compiled, batch 1
  triton        kernels.py's Triton kernels against their torch references on Qwen3-8B's shapes, eager
                and inside torch.compile, each check with its bf16 tolerance
and, asked for by --stages only (measured on 2026-11-30):
  compiled-b32  bench.py at batch 32, compiled (whole blocks verified: one verify graph per engine)
  eager-b1      bench.py at batch 1, eager
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
from support.files import check_writable, write_json  # noqa: E402  (neither tyro nor wandb)

# stage -> its time cap in seconds, in the order they run
STAGES = {"env": 15, "smoke": 50, "compiled-b1": 140, "eagle3-b1": 70, "tree-b1": 200, "triton": 45,
          "compiled-b32": 125, "eager-b1": 50}
DEFAULT_STAGES = ("env", "smoke", "compiled-b1", "eagle3-b1", "tree-b1", "triton")  # what a call runs unasked
TREE_BUDGETS = (16, 32, 64)  # tree-b1's; the dry run's are 2 and 4
DRY_CAPS = 3      # a dry run's caps are three times these: a small shared CPU is slower than the GPU
BUDGET = 530      # seconds for the default stages: the caps, and the time to stop the last one at its cap
STOP_GRACE = 5    # a stage past its cap gets SIGTERM, then SIGKILL this much later
SKIPPED = 3       # a stage's exit status when it has nothing to do here
TORCH_LOGS = ("perf_hints", "recompiles", "cudagraphs")
FLAGGED = ("skipping cudagraphs", "Recompiling", "Re-recording")  # log lines that make a timing suspect


def stage_file(stage: str) -> str:
    return "env.json" if stage == "env" else f"{stage}.json"


# ----------------------------------------------------------------------------------------
# In a stage's process

def bench_args(stage: str, dry: bool, out: str) -> dict:
    """bench.BenchArgs of a bench stage. The dry run's differ only in device, preset and sizes."""
    if stage == "smoke":
        a = dict(model="bigram-35m", dtype="float32", batch_sizes="1,4", prompt_len=32, max_new_tokens=64,
                 repeats=1, compile=True)
    else:
        a = dict(model="qwen3-8b", dtype="bfloat16", batch_sizes="32" if stage == "compiled-b32" else "1",
                 prompt_len=128, max_new_tokens=64 if stage in ("eager-b1", "tree-b1") else 128, repeats=2,
                 compile=stage != "eager-b1")
    if stage == "eagle3-b1":
        a.update(drafter_kind="eagle3")
    if stage == "tree-b1":
        a.update(repeats=1)
    # reduce-overhead: CUDA graphs without GEMM autotuning (which would take minutes for an 8B model's shapes)
    a.update(device="cuda", reference=False, out=out, compile_mode="reduce-overhead" if a["compile"] else None)
    if dry:
        a.update(device="cpu", prompt_len=8, max_new_tokens=4, repeats=1,
                 batch_sizes={"1,4": "1,2", "32": "2"}.get(a["batch_sizes"], a["batch_sizes"]),
                 model="qwen3-tiny")
    return a


class TorchLog(logging.Handler):
    """What torch logs in this process (TORCH_LOGS); `flagged()`: the lines that make a timing suspect."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        from torch._logging._internal import log_registry

        self.lines, self.last = [], None
        for name in log_registry.get_log_qnames():  # torch's loggers keep their records from the root logger
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
        out = [line for line in self.lines[since[0]:] if any(f in line for f in FLAGGED)]
        skips = self.mark()[1] - since[1]
        if skips and not any("skipping cudagraphs" in line for line in out):
            out.append(f"skipping cudagraphs: {skips} graph(s), counted by torch")
        return out


class Stage:
    """A stage's JSON file, written whole at once and after every row and check."""

    def __init__(self, name: str, out: str, dry: bool):
        self.path, self.log = os.path.join(out, stage_file(name)), TorchLog()
        self.doc = {"stage": name, "dry_run": dry, "complete": False, "warnings": [], "checks": [], "sdpa": {},
                    "rows": []}
        self.save()

    def save(self):
        self.doc["warnings"] = self.log.flagged()
        write_json(self.path, self.doc, indent=1)

    def check(self, name: str, max_diff: float, tolerance: float, **info):
        max_diff, tolerance = float(max_diff), float(tolerance)
        ok = max_diff <= tolerance  # NaN fails
        self.doc["checks"].append({"name": name, "max_diff": max_diff if math.isfinite(max_diff) else str(max_diff),
                                   "tolerance": tolerance, "ok": ok, **info})
        print(f"check {name}: max diff {max_diff:.3g}, tolerance {tolerance:.3g}: {'ok' if ok else 'FAILED'}",
              flush=True)
        self.save()


def light_compile():
    """--dry-run: torch.compile traces with dynamo (fullgraph, guards, recompiles) and runs the graphs eagerly."""
    import torch

    real = torch.compile

    def compile(fn=None, **kw):
        return real(fn, fullgraph=kw.get("fullgraph", False), dynamic=kw.get("dynamic"), backend="eager")
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

    real, seen = F.scaled_dot_product_attention, []

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        try:
            seen.append(SDPBackend(torch._fused_sdp_choice(q, k, v, attn_mask, dropout_p, is_causal, scale=scale,
                                                           enable_gqa=enable_gqa)).name)
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

    H, Hkv, hd = args.num_attention_heads, args.num_key_value_heads, args.head_dim
    q = torch.randn((batch, T, H, hd), device=dev).to(dtype)
    k, v = (torch.randn((batch, S, Hkv, hd), device=dev).to(dtype) for _ in range(2))
    allowed = (S - T + torch.arange(T, device=dev))[None, :, None] >= torch.arange(S, device=dev)
    group = H // Hkv if model.fold_gqa(dev) else 1
    bias = model.cache_bias(allowed.expand(batch, T, S), group, dtype)
    with sdpa_spy() as seen:
        model.attend_cached(q, k, v, bias)
    can = []
    for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"):
        with contextlib.suppress(RuntimeError), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # each refusing backend warns why
            with sdpa_kernel([getattr(SDPBackend, name)]):
                model.attend_cached(q, k, v, bias)
            can.append(name)
    return {"batch": batch, "query_tokens": T, "cache_positions": S, "dtype": str(dtype).replace("torch.", ""),
            "folded_gqa": group > 1, "runs": seen[0], "can_run": can}


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
    P, T = (8, 4) if dry else (128, 8)  # a prompt, then a verify of 8 tokens (a block of 7 drafts)
    target.setup_caches(batch, P + 64)
    g = torch.Generator(device=dev).manual_seed(0)
    target(torch.randint(0, a.vocab_size, (batch, P), generator=g, device=dev),
           torch.arange(P, device=dev).expand(batch, P))  # the prompt into the cache, eagerly
    tokens = torch.randint(0, a.vocab_size, (batch, T), generator=g, device=dev)
    positions = P + torch.arange(T, device=dev).expand(batch, T)
    want = target(tokens, positions)[0].float()
    fn = speculate.compiled(lambda x, p: target(x, p)[0], dev, "reduce-overhead")
    t0, diff, agree = time.perf_counter(), 0.0, 1.0
    for _ in range(3):  # with CUDA graphs: warm-up, recording, replay
        if dev == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        got = fn(tokens, positions).float()
        diff = max(diff, (got - want).abs().max().item())
        agree = min(agree, (got.argmax(-1) == want.argmax(-1)).float().mean().item())
    # Each side rounds the output of every residual branch (L attention, L MLP) and of the head to bf16,
    # relative u each, so 2u apart; the stream adds them up: at most (2L + 1) * 2u at the logits' scale.
    tol = (2 * layers + 1) * 2 * unit_roundoff(dtype) * want.abs().max().item()
    st.check("verify_logits", diff, tol, preset=preset, layers=layers, batch=batch, query_tokens=T, cached=P,
             max_abs_logit=want.abs().max().item(), argmax_agree=agree,
             compile_seconds=round(time.perf_counter() - t0, 1))


def bench_rows(st: Stage, args: dict):
    """bench.run with these BenchArgs; its document, rewritten after every row, goes into the stage's file,
    each row with the warnings logged up to it."""
    import bench

    from support.cli import from_flat

    since = st.log.mark()

    def keep(path, doc, indent=None):
        for row in doc["rows"]:
            if "warnings" not in row:
                differ = row.get("differing_requests") or []
                row["warnings"] = st.log.flagged(since) + ([f"tokens differ from autoregressive decoding's in "
                                                       f"{len(differ)} request runs (differing_requests)"]
                                                      if differ else [])
            row.setdefault("tree_budget", args.get("tree_budget", 0))
        earlier = [row for row in st.doc.get("rows", []) if row["tree_budget"] != args.get("tree_budget", 0)]
        st.doc.update(doc)
        st.doc["rows"] = earlier + doc["rows"]  # a tree stage's budgets, one bench run each
        st.save()
    bench.write_json = keep  # bench's only writer: its --out document
    bench.run(from_flat(bench.BenchArgs, args))


def bench_stage(st: Stage, stage: str, dry: bool):
    import bench
    import torch

    from model import ModelArgs
    from support.checkpoint import PRESETS

    args = bench_args(stage, dry, st.path)
    dev, dtype = args["device"], getattr(torch, args["dtype"])
    margs = ModelArgs(**(bench.BIGRAM_35M if args["model"] == "bigram-35m" else PRESETS[args["model"]]))
    verify = 6 if args["model"] == "bigram-35m" else 8  # its drafter's block + the anchor
    S = args["prompt_len"] + args["max_new_tokens"] + 2 * verify  # the engine's cache (bench's max_seq)
    for b in map(int, args["batch_sizes"].split(",")):
        for what, T in (("verify", verify), ("step", 1)):
            st.doc["sdpa"][f"b{b} {what}"] = sdpa_backend(margs, b, T, S, dtype, dev)
    st.save()
    if stage == "compiled-b1":
        verify_logits(st, "qwen3-tiny" if dry else "qwen3-8b", 2 if dry else 4, 1, dtype, dev, dry)
    budgets = [0]
    if stage == "tree-b1":
        budgets = list(TREE_BUDGETS) if not dry else [2, 4]
    try:
        for budget in budgets:
            if budget:
                args = dict(args, tree_budget=budget)
            bench_rows(st, args)
    except AssertionError as e:  # float32: bench asserts equal tokens
        st.check("speculative_tokens_equal", 1, 0, error=str(e)[:1000])
        raise
    if args["dtype"] == "float32":
        st.check("speculative_tokens_equal", 0, 0, note="bench.py asserts every run's tokens equal autoregressive "
                                                        "decoding's in float32")


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
    import kernels
    import model

    saved = {(m, n): getattr(m, n) for m, n in ((kernels, "markov_chain_reference"),
                                                (kernels, "accept_sampled_reference"), (model, "attend_cached"))}

    def fell_back(*a, **kw):
        raise AssertionError("a Triton function fell back to its torch reference")
    for m, n in saved:
        setattr(m, n, fell_back)
    try:
        yield
    finally:
        for (m, n), f in saved.items():
            setattr(m, n, f)


def chain_gap(markov, U, anchor, drafts) -> tuple[float, float]:
    """How far the chain's greedy picks trail the best reference score, z_k = U_k + W2·W1[x_{k-1}] at
    the chain's own previous tokens, and the tolerance."""
    import torch

    bias = markov.markov_w2(markov.markov_w1(torch.cat([anchor[:, None], drafts[:, :-1]], 1)))
    z = (U + bias).float()
    gap = (z.amax(-1) - z.gather(-1, drafts[..., None])[..., 0]).max().item()
    # The bias, then z, are rounded to the dtype on each side from sums taken in other orders: up to one
    # unit in the last place (2u relative) apart each, so a pick may trail the best by twice that.
    return gap, 2 * 2 * unit_roundoff(U.dtype) * (bias.float().abs().max() + z.abs().max()).item()


def attention_tolerance(q, k, v, bias, want, backend: str) -> float:
    """The bound on two correct attentions of these inputs: each side rounds the weights p to the
    dtype before p·V (u·Σp|v| each), and the output (u·|o| each); a backend that keeps the scores s
    in the dtype moves each p by up to 2u·|s| more (math)."""
    import torch

    import model

    u = unit_roundoff(q.dtype)
    spread = model.attend_cached(q.float(), k.float(), v.float().abs(), bias.float()).max().item()  # Σ p|v|
    scores = 0.0
    if backend == "MATH":
        g = q.shape[2] // k.shape[2]
        s = torch.einsum("bthd,bshd->bhts", q.float(), k.float().repeat_interleave(g, 2)) * q.shape[-1] ** -0.5
        scores = s.abs().max().item()
    return 2 * u * (spread * (1 + scores) + want.float().abs().max().item())


def triton_stage(st: Stage, dry: bool) -> int:
    import torch

    import kernels
    import model
    import sampling
    from drafter import VanillaMarkov
    from support.cli import sync

    if not kernels.HAVE_TRITON:
        print("triton is not installed here: nothing to check")
        return SKIPPED
    dev, dtype, reps = ("cpu" if dry else "cuda"), torch.bfloat16, (0 if dry else 20)
    kernels.check_backend("triton", dev)  # builds the kernels; raises where Triton cannot run
    ref_chain, ref_sampled = sampling.markov_chain, sampling.accept_sampled
    ref_attention = model.attend_cached
    shapes = DRY if dry else dict(chain=CHAIN, verify=VERIFY, attention=ATTENTION)
    g = torch.Generator(device=dev).manual_seed(0)

    def us(fn):  # microseconds a call, the mean of `reps` after one
        fn()
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync(dev)
        return round((time.perf_counter() - t0) / reps * 1e6, 1)

    def timings(ref, fast):
        return dict(reference_us=us(ref), triton_us=us(fast)) if reps else {}

    for B, K, V, r in shapes["chain"]:
        with torch.device(dev):
            markov = VanillaMarkov(16, V, r).to(dtype).requires_grad_(False)
        U = (2 * torch.randn((B, K, V), generator=g, device=dev)).to(dtype)
        anchor = torch.randint(0, V, (B,), generator=g, device=dev)
        h = torch.zeros((B, K, 16), device=dev, dtype=dtype)
        with only_triton():
            drafts, _ = kernels.markov_chain(U, h, anchor, markov, 0.0, None)
        gap, tol = chain_gap(markov, U, anchor, drafts)
        st.check(f"chain B={B} K={K} V={V} r={r}", gap, tol, measure="best reference score minus the score of "
                 "the pick", **timings(lambda: ref_chain(U, h, anchor, markov, 0.0, None),
                                      lambda: kernels.markov_chain(U, h, anchor, markov, 0.0, None)))
    for B, K, V in shapes["verify"]:
        logits = torch.randn((B, K + 1, V), generator=g, device=dev).to(dtype)
        drafts = torch.argmax(logits[:, :K], -1)
        drafts = torch.where(torch.rand((B, K), generator=g, device=dev) < 0.2,
                             torch.randint(0, V, (B, K), generator=g, device=dev), drafts)
        vl = torch.randint(0, K + 1, (B,), generator=g, device=dev)
        q = torch.softmax(logits[:, :K].float() + torch.randn((B, K, V), generator=g, device=dev), -1)
        u = torch.rand((B, K), generator=g, device=dev)
        noise = torch.empty((B, V), device=dev).exponential_(1, generator=g)
        with only_triton():
            sampled = kernels.accept_sampled(drafts, q, logits, vl, 1.0, None, u, noise)
        # The acceptance tests compare float32 probabilities that differ in the last bits only: no row may differ.
        want = ref_sampled(drafts, q, logits, vl, 1.0, None, u, noise)
        st.check(f"verify_sampled B={B} K={K} V={V}", float(sum(int((a != b).sum()) for a, b in zip(sampled, want))),
                 0.0, measure="accepted counts and next tokens that differ")
    adtype = torch.float16 if dry else dtype  # the interpreter's tl.dot multiplies bf16 as raw bits
    for B, T, H, Hkv, hd, S, filled in shapes["attention"]:
        q = torch.randn((B, T, H, hd), generator=g, device=dev).to(adtype)
        k, v = (torch.randn((B, S, Hkv, hd), generator=g, device=dev).to(adtype) for _ in range(2))
        for n in filled:
            allowed = (n - T + torch.arange(T, device=dev))[None, :, None] >= torch.arange(S, device=dev)
            allowed = allowed.expand(B, T, S)
            ref_bias = model.cache_bias(allowed, H // Hkv if model.fold_gqa(dev) else 1, adtype)
            bias = model.cache_bias(allowed, 1, adtype)
            with sdpa_spy() as backend:
                want = ref_attention(q, k, v, ref_bias)
            with only_triton():
                got = kernels.cached_attention(q, k, v, bias)
            st.check(f"attention B={B} T={T} H={H}/{Hkv} hd={hd} S={S} filled={n}",
                     (got.float() - want.float()).abs().max().item(),
                     attention_tolerance(q, k, v, ref_bias, want, backend[0]), reference_backend=backend[0],
                     **timings(lambda: ref_attention(q, k, v, ref_bias),
                               lambda: kernels.cached_attention(q, k, v, bias)))
    # The engine compiles the round whole (fullgraph, static shapes): the kernels must trace. In the
    # interpreter, traced code takes the references (Triton's interpreter cannot run inside a graph).
    B, K, V, r = shapes["chain"][0]
    with torch.device(dev):
        markov = VanillaMarkov(16, V, r).to(dtype).requires_grad_(False)
    U = (2 * torch.randn((B, K, V), generator=g, device=dev)).to(dtype)
    anchor = torch.randint(0, V, (B,), generator=g, device=dev)
    h = torch.zeros((B, K, 16), device=dev, dtype=dtype)
    logits = torch.randn((B, K + 1, V), generator=g, device=dev).to(dtype)
    vl = torch.full((B,), K, device=dev)
    qd = torch.softmax(torch.randn((B, K, V), generator=g, device=dev), -1)
    ud, nd = torch.rand((B, K), generator=g, device=dev), torch.empty((B, V), device=dev).exponential_(1, generator=g)

    def step(U, anchor, logits, vl):
        drafts, _ = kernels.markov_chain(U, h, anchor, markov, 0.0, None)
        return (drafts, *kernels.accept_sampled(drafts, qd, logits, vl, 1.0, None, ud, nd))
    with only_triton() if not dry else contextlib.nullcontext():
        drafts, n, nxt = torch.compile(step, fullgraph=True, dynamic=False)(U, anchor, logits, vl)
        got = torch.compile(kernels.cached_attention, fullgraph=True, dynamic=False)(q, k, v, bias)
    st.check("compiled chain", *chain_gap(markov, U, anchor, drafts), triton_traced=not dry)
    st.check("compiled verify_sampled", float(sum(int((a != b).sum()) for a, b in zip((n, nxt), ref_sampled(
        drafts, qd, logits, vl, 1.0, None, ud, nd)))), 0.0, triton_traced=not dry)
    st.check("compiled attention", (got.float() - want.float()).abs().max().item(),
             attention_tolerance(q, k, v, ref_bias, want, backend[0]), triton_traced=not dry)
    return 0


def env_stage(out: str, dry: bool):
    import importlib.metadata
    import platform

    import torch

    def driver():
        try:
            p = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=20)
            return p.stdout.strip().splitlines()[0] if p.returncode == 0 and p.stdout.strip() else None
        except (OSError, subprocess.TimeoutExpired):
            return None

    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = None
    info = {"dry_run": dry, "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": triton, "driver_version": driver(),
            "cuda_available": torch.cuda.is_available(), "gpu": None, "torch_logs": os.environ.get("TORCH_LOGS"),
            "sdpa_enabled": {b: getattr(torch.backends.cuda, f"{b}_sdp_enabled")()
                             for b in ("flash", "mem_efficient", "cudnn", "math")
                             if hasattr(torch.backends.cuda, f"{b}_sdp_enabled")}}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, memory_gib=round(p.total_memory / 2**30, 1), multiprocessors=p.multi_processor_count,
                    capability=f"{p.major}.{p.minor}", cudnn=torch.backends.cudnn.version())
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
            status = triton_stage(st, dry) if stage == "triton" else bench_stage(st, stage, dry) or 0
    except BaseException as e:  # kept in the file too, then as Python reports it
        st.doc["error"] = f"{type(e).__name__}: {e}"[:2000]
        st.save()
        raise
    st.doc["complete"] = status == 0
    st.save()
    failed = [c["name"] for c in st.doc["checks"] if not c["ok"]]
    if failed:
        print(f"failed checks: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else status


# ----------------------------------------------------------------------------------------
# The parent: checks, then each stage in a child under its cap

def torch_logs() -> str:
    """TORCH_LOGS for the stages: the artifacts above that this torch has, after any given."""
    from torch._logging._internal import log_registry

    given = [x for x in os.environ.get("TORCH_LOGS", "").split(",") if x.strip()]
    return ",".join(given + [a for a in TORCH_LOGS if log_registry.is_artifact(a) and a not in given])


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
    return [sys.executable, os.path.abspath(__file__), "--stage", stage, "--out", out] + (["--dry-run"] if dry else [])


def run_stages(stages: list[str], out: str, dry: bool, budget: float, caps: dict = STAGES) -> int:
    t_start = time.monotonic()
    t_end, logs = t_start + budget, torch_logs()
    summary = {"dry_run": dry, "budget_s": budget, "started": now(), "torch_logs": logs,
               "stages": [{"stage": s, "status": "not run", "cap_s": caps[s]} for s in stages]}
    summary_path, log_path = os.path.join(out, "summary.json"), os.path.join(out, "log.txt")
    with open(log_path, "a") as log:
        log.write(f"##### {summary['started']}: --stages {','.join(stages)}{' --dry-run' if dry else ''}\n")
    signals = []  # SIGINT / SIGTERM: the running stage is stopped, no other starts
    handlers = {s: signal.signal(s, lambda signum, frame: signals.append(signum))
                for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for entry in summary["stages"]:
            stage, left = entry["stage"], t_end - time.monotonic() - STOP_GRACE
            if signals or left < 5:
                entry["status"] = "not run: " + ("interrupted" if signals else "budget spent")
                continue
            limit = min(caps[stage], left)
            path = os.path.join(out, stage_file(stage))
            if os.path.exists(path):
                os.remove(path)  # an earlier run's
            entry.update(status="running", started=now(), limit_s=round(limit))
            write_json(summary_path, summary)
            print(f"=== {stage} (at most {limit:.0f} s)", flush=True)
            env = dict(os.environ, PYTHONUNBUFFERED="1", TORCH_LOGS=logs)
            if dry:  # the CPU kernels are not what a GPU runs; Triton on CPU is its interpreter
                env.update(DSPARK_CPU_KERNELS="0", TRITON_INTERPRET="1" if stage == "triton" else "0")
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
                else:
                    status = {0: "ok", SKIPPED: "skipped"}.get(p.returncode, f"exit {p.returncode}")
                reader.join(timeout=5)
            entry.update(status=status, seconds=round(time.monotonic() - t0, 1))
            with contextlib.suppress(OSError, ValueError):  # what the stage's file says (absent: nothing)
                with open(path) as f:
                    doc = json.load(f)
                entry.update(failed_checks=[c["name"] for c in doc.get("checks", []) if not c["ok"]],
                             warnings=len(doc.get("warnings", [])), rows=len(doc.get("rows", [])))
            print(f"=== {stage}: {status} in {entry['seconds']:.0f} s", flush=True)
            write_json(summary_path, summary)
        summary["seconds"] = round(time.monotonic() - t_start, 1)
        write_json(summary_path, summary)
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    if signals:
        print(f"interrupted by {signal.Signals(signals[0]).name}: stopped; {summary_path} lists what finished",
              file=sys.stderr)
        return 128 + signals[0]
    return 0 if all(e["status"] in ("ok", "skipped") for e in summary["stages"]) else 1


class Flags(argparse.ArgumentParser):
    def error(self, message):  # one line, as every program here says a bad flag
        raise UserError(message)


def parse(argv) -> argparse.Namespace:
    ap = Flags(prog="scripts/device_run.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "device_out"),
                    help="the folder the results go to (default: $OUT, else device_out)")
    ap.add_argument("--dry-run", action="store_true", help="run the stages on CPU with small shapes (no CUDA needed)")
    ap.add_argument("--budget", type=float, default=BUDGET, help=f"seconds for all stages together (default {BUDGET})")
    ap.add_argument("--stages", default=",".join(DEFAULT_STAGES),
                    help=f"comma-separated stages, run in the order given (default: {','.join(DEFAULT_STAGES)}; "
                         f"also: {', '.join(s for s in STAGES if s not in DEFAULT_STAGES)})")
    ap.add_argument("--stage", choices=STAGES, help=argparse.SUPPRESS)  # a child: run one stage in this process
    a = ap.parse_args(argv)
    a.stages = [s.strip() for s in a.stages.split(",") if s.strip()]
    unknown = [s for s in a.stages if s not in STAGES]
    if unknown:
        raise UserError(f"--stages: unknown stage {unknown[0]!r} (known: {', '.join(STAGES)})")
    if not a.stages:
        raise UserError("--stages: none given")
    if len(set(a.stages)) < len(a.stages):
        raise UserError(f"--stages {','.join(a.stages)}: a stage given twice")
    if not 10 <= a.budget <= 3600:  # NaN fails too
        raise UserError(f"--budget {a.budget:g}: must be a number of seconds from 10 to 3600")
    if not a.out.strip():
        raise UserError("--out: empty path")
    if os.path.exists(a.out) and not os.path.isdir(a.out):
        raise UserError(f"--out {a.out}: is a file, not a directory")
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
    return run_stages(a.stages, a.out, a.dry_run, a.budget,
                      {s: c * DRY_CAPS for s, c in STAGES.items()} if a.dry_run else STAGES)


if __name__ == "__main__":
    sys.exit(main())
