"""Speed: autoregressive and speculative decoding side by side, in one run, on one machine.

    python scripts/bench.py                                   # CPU: the constructed ~35M pair (τ ≈ 5-6)
    python scripts/bench.py --model qwen3-8b --device cuda --batch-sizes 1,8,32
    python scripts/bench.py --target DIR --drafter DIR         # real checkpoints

For each batch size it runs the project's engine without a drafter (autoregressive) and with
one (speculative), after a warm-up that compiles the round, and reports: tokens/s (every row's
tokens, as gpt-fast reports at batch 1), τ, time per round split into draft / verify (the target
pass, the acceptance and the drafter's context commit) / the rest, the bytes a round reads, achieved
GB/s against a measured copy bandwidth (the memory-bandwidth floor), compile seconds and the
process's peak memory. With `--reference` (the default on CPU at batch 1) it also runs the
same algorithm the way the reference implementations do — transformers' Qwen3 with a dynamic
cache as the target and the drafter eager in plain modules (its weights unfused and unpacked) — on
the same prompt. The modes' --repeats timed runs
are interleaved (order rotated each repeat); a row's figures are its median run's (by tokens/s, the
upper of an even count), and each speed-up is the median of the ratios within a repeat, with its
range. Decoding is greedy (a checkpoint's
generation_config.json is not read), and every run must emit the autoregressive tokens (in float32 a
difference raises; in bfloat16 or float16, where near-ties may round either way, it is counted); with
`--temperature T` every mode samples at T instead (seeded, no filters; the reference loop, greedy, is
left out), and the tokens are not compared: they follow the same law but differ run
to run (tests/test_lossless.py tests the law).

The schedulers under load (tokens/s against concurrency) are scripts/bench_concurrency.py.

The constructed pair (`--model bigram-35m`): a random Qwen3 of ~35M parameters whose attention
output is scaled to almost nothing, so its next token is (nearly) a function of the current
token, and whose final norm keeps only `r` features, so that function has rank r. The drafter's
Markov head is given exactly that table (W1 = the target's final features per token, W2 = the
target's lm_head columns): the drafter is right whenever the target is a bigram model. It is a
stand-in for a trained pair with τ ≈ 5-6, not a language model.
"""

from __future__ import annotations

import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field, fields, replace
from types import SimpleNamespace
from typing import Literal, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sampling
from drafter import Drafter, DrafterConfig
from model import ModelArgs, Transformer
from speculate import Engine, Request, cache_length, drafts_per_round
from support import cpu_kernels, flags, metrics, plots
from support.checkpoint import (
    PRESETS,
    attach,
    check_target_memory,
    init_random_,
    load_drafter,
    load_target,
    random_pair,
    resolve_checkpoint,
)
from support.cli import (
    Interrupted,
    UserError,
    check_ranges,
    cli_main,
    device_name,
    dtype_name,
    fits,
    flag,
    flat,
    free_memory,
    one_process,
    parse_ints,
    resolve_device,
    resolve_dtype,
    set_threads,
    sync,
    use_compile_cache,
)
from support.files import check_outputs, optional_file, write_json
from support.flags import Machine, Settings


@dataclass
class BenchArgs:
    """Autoregressive vs speculative decoding speed, side by side."""

    model: str = "bigram-35m"
    """bigram-35m (constructed CPU pair, τ ≈ 5.8) or a random-weight preset: qwen3-4b, qwen3-8b,
    qwen3-14b (or qwen3-tiny: Qwen3's vocabulary with toy layers, a smoke test).
    Ignored when --target is given."""
    target: Optional[str] = None
    """A Hugging Face Qwen3 directory (or hub id ORG/NAME[@REVISION]) instead of a preset."""
    drafter: Optional[str] = None
    """A drafter directory or hub id (with --target)."""
    decode: flat(Settings) = field(default_factory=lambda: Settings(compile=True))
    machine: flat(Machine) = field(default_factory=Machine)
    drafter_kind: Literal["dspark", "eagle3"] = "dspark"
    """The random preset's drafter: DSpark (block 7, 5 layers, vanilla Markov r=256, confidence head) or
    Eagle3 (one layer, a chain of 7). A --target's --drafter is what its checkpoint is."""
    skip_guards: bool = True
    """Compiled: time the runs with torch.compile's guard evaluation cut to the guards that tell its
    graphs apart (torch.compiler.set_stance(skip_guard_eval_unsafe=True)). Safe here: every graph is
    compiled in the warm-up and nothing that a guard checks changes after it; and in float32 the
    tokens are checked against autoregressive decoding's. --no-skip-guards: evaluate every guard."""
    batch_sizes: str = "1"
    """Comma-separated batch sizes, e.g. 1,8,32."""
    prompt_len: int = 64
    """Tokens per random prompt (not with --prompts-file)."""
    prompts_file: Optional[str] = None
    """Time these prompts instead of random ones (JSON lines, as speculate.py's --prompts-file, taken as
    they are: no chat template), each a request through the batch's rows: e.g. demo/heldout.jsonl."""
    tree_plot: Optional[str] = None
    """With --tree-budgets: draw τ and the speed-up over autoregressive decoding against the budget,
    the chain beside them, at the first batch size (.png or .svg)."""
    tree_budgets: Optional[str] = None
    """Comma-separated tree budgets timed beside the chain, a mode each ("tree N"), interleaved with the
    others (e.g. 4,8,16,32,64). Not with --tree-budget, which makes the speculative mode itself a tree."""
    reference: Optional[bool] = None
    """Also time the transformers-target reference loop at batch 1 (default: on for cpu when transformers,
    a test-only dependency, is installed; without it the loop is skipped with a note)."""
    out: Optional[str] = None
    """Write the results as JSON here (rewritten after every batch size)."""
    repeats: int = 3
    """Timed runs per mode and batch size, interleaved in rotating order; the median is reported, and
    each speed-up is the median of the repeats' own ratios."""


# ----------------------------------------------------------------------------------------
# The constructed CPU pair

BIGRAM_35M = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=10,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=64, tie_word_embeddings=True)


def bigram_pair(device, dtype, seed: int = 0, rank: int = 64, block_size: int = 5, attn_scale: float = 2e-5):
    """A near-bigram ~35M target and a 1-layer DSpark drafter whose Markov head carries its table."""
    args = ModelArgs(**BIGRAM_35M)
    with torch.device("meta"):
        target = Transformer(args)
    target = target.to(dtype).to_empty(device=device)
    target.lm_head.weight = target.embed_tokens.weight
    init_random_(target, seed, std=0.5)  # large enough that the logits are far from flat
    with torch.no_grad():
        for layer in target.layers:
            layer.self_attn.o_proj.weight.mul_(attn_scale)
        target.norm.weight[rank:] = 0  # the next-token table has rank `rank`
    target.eval().requires_grad_(False)
    # The target's final features for every single token (what W1 must hold): a cache-free forward each.
    V = args.vocab_size
    with torch.no_grad():
        feats = [target.hidden(torch.arange(s, min(s + 1024, V), device=device)[:, None])[0][:, 0, :rank]
                 for s in range(0, V, 1024)]
    w1 = torch.cat(feats)  # [V, r]
    cfg = DrafterConfig(layers=ModelArgs(**{**BIGRAM_35M, "num_hidden_layers": 1}), block_size=block_size,
                        target_layer_ids=(1, 5), mask_token_id=V - 1, layout="dspark", markov_head_type="vanilla",
                        markov_rank=rank, confidence_head=False, confidence_with_markov=False)
    with torch.device("meta"):
        drafter = Drafter(cfg)
    drafter = init_random_(drafter.to(dtype).to_empty(device=device), seed + 1)
    with torch.no_grad():
        drafter.norm.weight.fill_(1e-3)  # the block's own logits U are small next to the Markov term
        drafter.markov_head.markov_w1.weight.copy_(w1)
        drafter.markov_head.markov_w2.weight.copy_(target.lm_head.weight[:, :rank])
    attach(drafter, target)
    return target, drafter.eval().requires_grad_(False)


# ----------------------------------------------------------------------------------------
# Measurements

def copy_bandwidth(device, nbytes: int) -> float:
    """Bytes per second of a large device-to-device copy (read + write counted)."""
    x = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1)
    y = torch.empty_like(x)
    y.copy_(x)
    sync(device)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        y.copy_(x)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def round_bytes(target: Transformer, drafter: Optional[Drafter], cached: float,
                num_drafts: int = 0, tree_budget: int = 0) -> int:
    """Bytes one round reads: target weights, its KV cache at `cached` positions (all rows'), and the
    drafter's weights, with the lm_head read again for the block's logits, W2 once per Markov step
    (K a round; a tree of `tree_budget` nodes, once a depth for all its nodes: min(K, tree_budget))
    and each layer's kv_proj again for the
    committed features; an Eagle3 drafter's layer, its cache and the lm_head once per draft, its fc
    (the committed features' projection) once. A lookup table (the
    input embedding unless it is the tied lm_head, the Markov head's W1) is gathered a few rows a
    round, not read: not counted."""
    a = target.args
    elt = target.lm_head.weight.element_size()
    read = {target.lm_head.weight.data_ptr()}  # a tied embedding is read whole, as the lm_head

    def weights(module):  # each tensor once, lookup tables left out
        gathered = set()
        for m in module.modules():
            if isinstance(m, torch.nn.Embedding) and m.weight.data_ptr() not in read:
                gathered.add(m.weight.data_ptr())
        once = {}
        for p in module.parameters():
            if p.data_ptr() not in gathered:
                once[p.data_ptr()] = p
        return once.values()

    def kv_bytes(layers):  # K and V of every layer at the cached positions
        per_position = 2 * layers.num_hidden_layers * layers.num_key_value_heads * layers.head_dim * elt
        return int(per_position * cached)

    total = nbytes(weights(target))
    total += kv_bytes(a)
    if drafter is not None:
        K = drafts_per_round(drafter, num_drafts)
        steps = 1  # drafter passes a round
        if drafter.cfg.layout == "eagle3":
            steps = K  # K - 1 drafting steps and the rebuild of what was committed
        projection = nbytes([drafter.fc.weight])  # the committed features' fc: once a round
        per_pass = nbytes(weights(drafter)) - projection + nbytes([target.lm_head.weight])
        total += projection + steps * per_pass
        if drafter.markov_head is not None:
            markov_steps = K  # a chain's K drafts; a tree's depths, as many as it has nodes at most
            if tree_budget:
                markov_steps = min(K, tree_budget)
            extra_reads = markov_steps - 1  # W2 is in the drafter's weights once
            total += extra_reads * nbytes([drafter.markov_head.markov_w2.weight])
        if drafter.cfg.layout != "eagle3":  # the commit projects the features to every layer's K/V
            total += nbytes([layer.self_attn.kv_proj.weight for layer in drafter.layers])
        total += steps * kv_bytes(drafter.cfg.layers)
    return total


def proc_kib(path: str, names: tuple) -> dict:
    """The kB figures `names` of a /proc file ("Name:   123 kB" lines); {} where it is not there."""
    kib = {}
    if not os.path.exists(path):
        return kib
    with open(path) as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in names:
                kib[name] = int(value.split()[0])
    return kib


def peak_memory(device) -> float:
    """GiB: the CUDA allocator's peak, or on cpu the process's peak resident set, since the last
    `reset_peak_memory`. Linux's counters behind the peak (VmHWM) and the resident set (VmRSS) can
    trail the pages just touched, so the resident set counted from the page tables now
    (smaps_rollup's Rss) counts too."""
    if str(device).startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**30
    kib = proc_kib("/proc/self/status", ("VmHWM", "VmRSS"))
    kib.update(proc_kib("/proc/self/smaps_rollup", ("Rss",)))
    if kib:
        return max(kib.values()) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def reset_peak_memory(device):
    """Count `peak_memory` from here: the bandwidth probe's buffers are not the run's. On a CPU this
    takes Linux's /proc/self/clear_refs; elsewhere the peak keeps the probe."""
    if str(device).startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak resident set starts again from the current one
    except OSError:
        pass


def side_engine(target, drafter, batch: int, max_seq: int, s: Settings, tree_budget: int = 0) -> Engine:
    """An engine for the side-by-side runs, compiled (warm-up) and settled by one short untimed run.
    Every engine of one batch size gets the same max_seq, so they share the target's cache buffers
    (setup_caches keeps them) and alternating between them recompiles nothing."""
    engine = Engine(target, drafter, batch_size=batch, max_seq=max_seq, temperature=s.temperature,
                    seed=s.seed, compile=s.compile, compile_mode=s.compile_mode,
                    compile_verbose=s.verbose, backend=s.kernels,
                    tree_budget=tree_budget, tree_temperature=s.tree_temperature,
                    num_drafts=s.draft_length)
    if s.compile:
        engine.warmup()
    room = max_seq - cache_length(0, 0, drafter, engine.K, tree_budget)  # the prompt and budget it holds
    prompt = [1, 2, 3][:room - 1]
    budget = min(8, room - len(prompt))
    engine.generate([Request(i, prompt) for i in range(batch)], budget)
    return engine


def round_split(engine: Engine, prompts: list[list[int]], max_new_tokens: int,
                skip_guards: bool = True) -> dict:
    """The round split into draft (block forward, Markov chain, confidence, schedule), verify (target
    forward with capture, acceptance, context commit) and the rest (the host's work), timed where the
    engine makes its draft and verify calls in one more run, synchronised around each, so the parts add
    up to that run's rounds; the syncs cost a little on a GPU, so that run's `split_round_ms` is kept
    beside the timed runs' `round_ms`. Also the bytes a round of that run reads (`round_bytes` at its
    rows' mean cached length: `bytes_per_round`)."""
    dev = engine.device
    spent = {"draft": 0.0, "verify": 0.0}
    calls = {"draft": engine.draft_fn, "verify": engine.verify_fn}

    def timed(part):
        def call(*a, **kw):
            sync(dev)
            t0 = time.perf_counter()
            out = calls[part](*a, **kw)
            sync(dev)
            spent[part] += time.perf_counter() - t0
            return out
        return call

    engine.draft_fn = timed("draft")
    engine.verify_fn = timed("verify")
    try:
        r = timed_generate(engine, prompts, max_new_tokens, skip_guards)
    finally:
        engine.draft_fn = calls["draft"]
        engine.verify_fn = calls["verify"]
    rounds = r["rounds"]
    # Without a drafter the draft call only returns an empty block: host work, counted in the rest.
    draft = 0.0
    if engine.drafter is not None:
        draft = 1e3 * spent["draft"] / rounds
    verify = 1e3 * spent["verify"] / rounds
    round_ms = 1e3 * r["decode_seconds"] / rounds
    cached = cached_per_round(r["requests"], rounds)
    nbytes_read = round_bytes(engine.target, engine.drafter, cached, engine.K, engine.tree_budget)
    # nested intervals of one clock: only float rounding could take the rest below zero
    rest = max(0.0, round_ms - draft - verify)
    return {"split_round_ms": round_ms, "draft_ms": draft, "verify_ms": verify, "rest_ms": rest,
            "bytes_per_round": nbytes_read}


def cached_per_round(requests: list[Request], rounds: int) -> float:
    """The cache positions a round's rows hold, all rows together, on average over the `rounds` the
    engine ran: each request's length at each of its rounds (rows without a request hold none)."""
    positions = 0
    for q in requests:
        length = len(q.prompt_ids) + 1  # the prompt and the prefill's token
        for rd in q.rounds:
            positions += length
            length += rd["accepted"] + 1
    return positions / rounds


def timed_generate(engine: Engine, prompts: list[list[int]], max_new_tokens: int,
                   skip_guards: bool = True) -> dict:
    """One measured run: every prompt a request, streamed through the engine's rows (continuous
    batching). Total tokens/s counts prefill and decode wall time (the engine's own clocks). A
    request's own tokens/s divides its tokens by the time from its admission to its last token.
    `skip_guards` (a compiled engine, after its warm-up): BenchArgs.skip_guards."""
    reqs = [Request(i, p) for i, p in enumerate(prompts)]
    engine.prefill_seconds = 0.0
    engine.decode_seconds = 0.0
    engine.skip_guards = skip_guards  # Engine.generate applies it once warmed up
    rounds = 0

    def count_round():
        nonlocal rounds
        rounds += 1

    engine.generate(reqs, max_new_tokens, on_step=count_round)
    seconds = engine.prefill_seconds + engine.decode_seconds
    c = metrics.count(reqs, engine.K, engine.stop_ids)
    speeds = [len(r.output_ids) / (r.finished - r.started) for r in reqs]
    return {
        "tokens": c["tokens"], "seconds": seconds, "total_tokens_per_second": c["tokens"] / seconds,
        "per_request_tokens_per_second": sum(speeds) / len(reqs),
        "acceptance_length": metrics.acceptance_length(c),
        "verified_per_round": metrics.verified_per_round(c),  # the verify budget per live request per round
        "prefill_seconds": engine.prefill_seconds, "decode_seconds": engine.decode_seconds,
        "rounds": rounds,  # rounds the batch ran, more prompts than rows streamed through them
        "outputs": [r.output_ids for r in reqs], "requests": reqs,
    }


def compare_outputs(runs: dict, prompts: list[list[int]], target: Transformer, exact: bool, what: str) -> dict:
    """Every mode's tokens against autoregressive decoding's. In float32 they must be equal (a
    difference raises). In bf16/fp16 a K+1-token verify and a 1-token step round differently, and
    at a near-tie the argmax flips; then the differences are counted and reported, with the target's
    gap between its two best logits where they start (small gaps: rounding; large: a bug).
    Returns {mode: [{"request", "repeat", "first_token", "logit_gap"}, ...]} (empty: all equal)."""
    want = runs["autoregressive"][0]["outputs"]
    differ = {}
    for m, reps in runs.items():
        for rep, r in enumerate(reps):
            for i, (got, ref) in enumerate(zip(r["outputs"], want)):
                if got == ref:
                    continue
                if exact:
                    raise AssertionError(f"{what}: {m} (repeat {rep}) emitted different tokens than "
                                         f"autoregressive decoding (request {i})")
                t = min(len(got), len(ref))  # the first token that differs
                for j, (a, b) in enumerate(zip(got, ref)):
                    if a != b:
                        t = j
                        break
                device = target.embed_tokens.weight.device
                with torch.no_grad():  # the target alone, cache-free, on the prompt and the common prefix
                    tokens = torch.tensor([prompts[i] + ref[:t]], device=device)
                    logits = target(tokens)[0]
                    top2 = logits[0, -1].float().topk(2).values
                gap = float(top2[0] - top2[1])
                differ.setdefault(m, []).append({"request": i, "repeat": rep, "first_token": t, "logit_gap": gap})
    for m, d in differ.items():
        gaps = ", ".join(f"{x['logit_gap']:.3g}" for x in d[:8])
        print(f"{what}: {m} differs from autoregressive in {len(d)} request runs (not float32: rounding at "
              f"near-ties; first differing token's top-2 logit gap: {gaps})", flush=True)
    return differ


def median_run(runs: list[dict]) -> dict:
    """The run with the median total tokens/s (the upper one of an even count)."""
    by_speed = sorted(runs, key=lambda r: r["total_tokens_per_second"])
    return by_speed[len(runs) // 2]


def transformers_available() -> bool:
    """Whether transformers imports (it is test-only: the runtime requirements do not include it)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def transformers_copy(target: Transformer):
    """transformers' Qwen3ForCausalLM holding `target`'s weights (the reference implementations' target)."""
    import transformers

    a = target.args
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=a.vocab_size, hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
        num_hidden_layers=a.num_hidden_layers, num_attention_heads=a.num_attention_heads,
        num_key_value_heads=a.num_key_value_heads, head_dim=a.head_dim, rms_norm_eps=a.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": a.rope_theta}, attention_bias=a.attention_bias,
        tie_word_embeddings=a.tie_word_embeddings, max_position_embeddings=a.max_position_embeddings))
    from support.checkpoint import published
    sd = {}
    for k, v in published(target.state_dict()).items():
        name = "model." + k  # transformers keeps the body under .model, the lm_head beside it
        if k == "lm_head.weight":
            name = k
        sd[name] = v
    hf.load_state_dict(sd, strict=True)
    w = target.lm_head.weight
    return hf.to(device=w.device, dtype=w.dtype).eval()


def reference_fits(args: BenchArgs, target: Transformer, drafter, dev: str) -> tuple[bool, str]:
    """Whether the reference loop's copies of the models fit beside them: built in float32 on the host,
    then cast and moved to `dev` (`transformers_copy`, `reference_drafter`). Asked for, an error where
    they do not; by default, skipped with a note."""
    params = 0
    for m in (target, drafter):
        if m is not None:
            params += sum(p.numel() for p in m.parameters())
    itemsize = target.lm_head.weight.dtype.itemsize
    needs = {"cpu": params * 4}  # in float32 while they are built ...
    if dev != "cpu" or itemsize != 4:  # ... beside their cast, where it is a copy
        needs[dev] = needs.get(dev, 0) + params * itemsize
    for where, need in needs.items():
        free = free_memory(where)
        if not fits(need, free):
            what = (f"its copies of the models need {need / 2**30:.1f} GiB on {where} while built; "
                    f"{free / 2**30:.1f} GiB are free")
            if args.reference:
                raise UserError(f"--reference: {what}: drop the flag, or a smaller model")
            return False, f"note: the reference loop is skipped: {what}"
    return True, ""


def reference_drafter(drafter: Optional[Drafter], hf) -> Optional[Drafter]:
    """The drafter as the reference implementations run it: the same weights in plain modules (nn.Linear,
    no CPU kernels: those are this project's engine's), reading the embedding and lm_head of the
    reference target `hf` (transformers_copy)."""
    if drafter is None:
        return None
    plain = Drafter(drafter.cfg)
    plain.load_state_dict(drafter.state_dict(), strict=True)
    w = drafter.fc.weight
    plain = plain.to(device=w.device, dtype=w.dtype).eval().requires_grad_(False)
    # the two things its forward reads from the target
    plain._target[0] = SimpleNamespace(embed_tokens=hf.model.embed_tokens, lm_head=hf.lm_head)
    return plain


def kv_cache(hf) -> dict:
    """A new DynamicCache for `hf`, as the keyword its forward takes: `cache` (newer transformers, which
    deprecate `past_key_values` with a warning) or `past_key_values` (4.x). Updated in place by each
    forward, so the caller keeps it and never reads it back from the output (also deprecated)."""
    import inspect

    from transformers import DynamicCache

    try:
        cache = DynamicCache(config=hf.config)
    except TypeError:  # transformers before the config argument
        cache = DynamicCache()
    keyword = "past_key_values"
    if "cache" in inspect.signature(hf.forward).parameters:
        keyword = "cache"
    return {keyword: cache}


def reference_generate(hf, drafter: Optional[Drafter], prompt: list[int], max_new_tokens: int,
                       device, max_seq: int) -> tuple[list[int], float]:
    """The reference implementations' way, batch 1, greedy: transformers' Qwen3 with a
    DynamicCache as the target (cropped after every round), the drafter run eagerly (`reference_drafter`;
    its context cache sized max_seq)."""
    ids = ()
    K = 0
    if drafter is not None:
        ids = drafter.cfg.target_layer_ids
        K = drafter.cfg.num_drafts
        drafter.setup_caches(1, max(max_seq, len(prompt) + max_new_tokens + 2 * (K + 1)))

    def features(out):  # the captured layers' outputs, side by side
        return torch.cat([out.hidden_states[i + 1] for i in ids], -1)

    sync(device)
    t0 = time.perf_counter()
    cache = kv_cache(hf)
    x = torch.tensor([prompt], device=device)
    out = hf(x, use_cache=True, output_hidden_states=drafter is not None, **cache)
    pos = len(prompt)
    if drafter is not None:
        drafter.commit_context(features(out), torch.arange(pos, device=device)[None])
    anchor = out.logits[:, -1].argmax(-1)
    generated = [int(anchor)]
    while len(generated) < max_new_tokens:
        if drafter is not None:
            hidden, base = drafter(anchor, torch.tensor([pos], device=device))
            drafts, _ = sampling.markov_chain(base, hidden, anchor, drafter.markov_head, 0.0, None)
        else:
            drafts = anchor.new_zeros((1, 0))
        tokens = torch.cat([anchor[:, None], drafts], 1)
        out = hf(tokens, use_cache=True, output_hidden_states=drafter is not None, **cache)
        verify_len = torch.full((1,), K, device=device)
        n, next_token = sampling.accept_greedy(drafts, out.logits, verify_len)
        n = int(n)
        if K - n > 0:
            # drop the rejected drafts' rows (negative: transformers 4 and 5)
            next(iter(cache.values())).crop(n - K)
        if drafter is not None:
            drafter.commit_context(features(out), pos + torch.arange(K + 1, device=device)[None])
        generated += drafts[0, :n].tolist() + [int(next_token)]
        pos += n + 1
        anchor = next_token
    sync(device)
    return generated[:max_new_tokens], time.perf_counter() - t0


# The decode settings bench.py times with (greedy or at --temperature without filters, one batch size at a
# time from --batch-sizes, every draft verified); any other given is refused, naming what to use instead.
TIMED = ("max_new_tokens", "seed", "compile", "compile_mode", "verbose", "kernels", "tree_budget", "tree_temperature",
         "draft_length", "temperature")
BenchArgs.__doc__ = flags.reads_only(BenchArgs.__doc__, "bench.py", TIMED)
# What to use instead of a setting bench.py does not time with (the others: speculate.py).
INSTEAD = {
    "ignore_eos": "its requests never stop at an EOS token anyway (each decodes --max-new-tokens)",
    "batch_size": "it times each batch size of --batch-sizes (e.g. --batch-sizes 1,8)",
    "scheduler": "scripts/bench_concurrency.py times the schedulers (--schedulers)",
    "confidence_threshold": "scripts/bench_concurrency.py times the threshold scheduler at it",
}


def file_prompts(path: str, target_dir: Optional[str], target: Transformer, drafter,
                 max_new_tokens: int) -> list[list[int]]:
    """--prompts-file's prompts as ids, as they are (text through the target's tokenizer, no template),
    checked as speculate.py checks its own (each named file:line)."""
    from support.text import Tokenizer, check_prompts, load_prompts

    tokenizer = None
    if target_dir is not None and optional_file(os.path.join(target_dir, "tokenizer.json")):
        tokenizer = Tokenizer(target_dir)
    sources = []
    prompts = load_prompts(tokenizer=tokenizer, chat=False, prompts_file=path, sources=sources,
                           no_chat_why="bench.py takes prompts as they are: prompt, prompt_ids or turns records")
    check_prompts(prompts, target, max_new_tokens, drafter=drafter, sources=sources)
    return prompts


def check_args(args: BenchArgs) -> tuple[list[int], Settings]:
    """The flags alone, before any device or model (tests/test_device_run.py checks device_run.py's bench
    stages with it too); returns the batch sizes and the checked decode settings."""
    batch_sizes = parse_ints(args.batch_sizes, "--batch-sizes", distinct_positive=True)
    default = Settings()
    for f in fields(Settings):
        value = getattr(args.decode, f.name)
        if f.name in TIMED or value == getattr(default, f.name):
            continue
        shown = f"{flag(f.name)} {value}"
        if isinstance(value, bool):  # --ignore-eos
            shown = flag(f.name)
        if isinstance(value, tuple):  # --stop, repeatable: the first
            shown = f"{flag(f.name)} {value[0]!r}"
        instead = INSTEAD.get(f.name, "speculate.py decodes with it and reports tokens/s")
        raise UserError(f"{shown}: bench.py does not time decoding with it; {instead}")
    trees = args.decode.tree_budget > 0 or args.tree_budgets is not None
    s = flags.check_settings(args.decode, args.machine.device, trees=trees)
    if s.temperature is None:  # no checkpoint's generation_config decides here
        s = flags.derived(s, temperature=0.0)
    flags.check_machine(args.machine, s.compile)
    if not args.skip_guards and not s.compile:
        raise UserError("--no-skip-guards: only used with --compile (the run is eager)")
    check_ranges(args, repeats="[1, 1000]", prompt_len="[1, 1000000]")
    if args.prompts_file is not None and args.prompt_len != BenchArgs.prompt_len:
        raise UserError(f"--prompt-len {args.prompt_len}: the random prompts' length, and --prompts-file "
                        f"{args.prompts_file} gives the prompts; it would change nothing")
    if args.tree_budgets is not None:
        budgets = parse_ints(args.tree_budgets, "--tree-budgets", distinct_positive=True)
        if max(budgets) > flags.MAX_TREE_BUDGET:
            raise UserError(f"--tree-budgets {args.tree_budgets}: at most {flags.MAX_TREE_BUDGET} nodes a "
                            f"tree, as --tree-budget")
        if args.drafter_kind == "eagle3":
            raise UserError("--tree-budgets: an Eagle3 drafter drafts a chain (trees grow from a block drafter)")
        if s.tree_budget:  # the trees are timed beside the chain, which --tree-budget would replace
            raise UserError(f"--tree-budget {s.tree_budget}: makes the speculative mode a tree, and "
                            f"--tree-budgets {args.tree_budgets} times trees beside the chain: give one of them")
    check_ranges(s, max_new_tokens="[2, 10485760]")  # (one new token is the prefill's: no round to time)
    if args.drafter is not None and args.target is None:
        raise UserError(f"--drafter {args.drafter}: needs the --target it was trained for (without --target, "
                        f"bench.py builds its own pair: --model)")
    if args.target is not None and args.model != BenchArgs.__dataclass_fields__["model"].default:
        raise UserError(f"--model {args.model}: --target gives the models (--model builds a pair only without it)")
    if args.target is None and args.model not in ("bigram-35m", *PRESETS):
        raise UserError(f"--model {args.model!r}: unknown (bigram-35m, {', '.join(PRESETS)})")
    if args.drafter_kind != "dspark" and (args.target is not None or args.model == "bigram-35m"):
        raise UserError(f"--drafter-kind {args.drafter_kind}: chooses a random preset's drafter (qwen3-*), not "
                        f"{'a --target pair' if args.target else 'bigram-35m, whose drafter is constructed'}")
    if args.tree_plot is not None and args.tree_budgets is None:
        raise UserError("--tree-plot: draws --tree-budgets' modes against the chain; give --tree-budgets")
    plots.check_plot_path(args.tree_plot, "--tree-plot")
    outputs = {"--out": args.out, "--tree-plot": args.tree_plot}
    inputs = [args.target, args.drafter, args.prompts_file, args.machine.compile_cache]
    check_outputs(outputs, inputs=inputs)
    return batch_sizes, s


def reference_wanted(args: BenchArgs, s: Settings, batch_sizes: list[int], dev: str) -> tuple[bool, str]:
    """Whether the transformers-target reference loop runs: asked for, or by default on a CPU; only at
    batch 1, for a DSpark chain, with transformers installed (asked for without it: an error). With it, a
    note to print once the flags are checked: why the default loop is skipped ("" when it is not)."""
    if args.reference and 1 not in batch_sizes:
        raise UserError(f"--reference: the reference loop runs at batch 1, and --batch-sizes {args.batch_sizes} "
                        f"has no 1")
    chain_only = s.tree_budget == 0 and args.drafter_kind == "dspark"
    if args.reference and not chain_only:
        raise UserError("--reference: the reference loop is a DSpark drafter's chain (no --tree-budget, no Eagle3)")
    if args.reference and s.temperature > 0:
        raise UserError(f"--reference: the reference loop decodes greedily, and --temperature "
                        f"{s.temperature:g} samples")
    wanted = args.reference
    if wanted is None:
        wanted = dev == "cpu"
    if not wanted:
        return False, ""
    if not (1 in batch_sizes and chain_only and s.temperature == 0):  # the default, where it cannot run
        timed = "a DSpark drafter's chain"
        if args.target is not None and args.drafter is None:
            timed = "the target alone"
        return False, f"note: the reference loop is skipped: it times {timed}, greedy, at batch 1"
    if transformers_available():
        return True, ""
    if args.reference:
        raise UserError("--reference: the reference loop runs transformers' Qwen3, and transformers is not "
                        "installed (a test-only dependency: pip install -r requirements-dev.txt)")
    return False, ("note: the reference loop (transformers' Qwen3) is skipped: transformers is not installed "
                   "(test-only: pip install -r requirements-dev.txt to time it too)")


def build_pair(args: BenchArgs, s: Settings, target_dir, drafter_dir, dev: str, dtype):
    """(target, drafter or None, the name the results give the pair): the checkpoints, the constructed
    bigram pair or a random preset."""
    if args.target is not None:
        check_target_memory(target_dir, dev, dtype, drafter_dir)  # (None without a --drafter)
        target = load_target(target_dir, dev, dtype)
        drafter = None
        if args.drafter:
            drafter = load_drafter(drafter_dir, target, dev, dtype)
        return target, drafter, args.target
    if args.model == "bigram-35m":
        target, drafter = bigram_pair(dev, dtype, s.seed)
        return target, drafter, args.model
    eagle3 = args.drafter_kind == "eagle3"
    target, drafter = random_pair(args.model, dev, dtype, s.seed, eagle3=eagle3, flag="--model")
    return target, drafter, f"{args.model} (random weights)"


def check_pair(args: BenchArgs, s: Settings, target: Transformer, drafter):
    """What only the built pair can tell: a loaded drafter's kind (and whether there is one), and the
    context random prompts need (a --prompts-file's own: `file_prompts`)."""
    if drafter is None and args.tree_budgets is not None:
        raise UserError(f"--tree-budgets {args.tree_budgets}: a tree is drafted by a --drafter (without "
                        f"one bench.py times autoregressive decoding alone)")
    if drafter is None:
        flags.check_no_drafter(s)
    flags.check_drafter_settings(s, drafter)  # --draft-length, --tree-budget: as speculate.py
    flags.check_tree_temperature(s, [drafter], s.temperature)
    if drafter is not None and drafter.cfg.layout == "eagle3":
        if args.reference:
            raise UserError(f"--reference: the reference loop is a DSpark drafter's chain, and --drafter "
                            f"{args.drafter} is an Eagle3 drafter")
        if args.tree_budgets is not None:
            raise UserError(f"--tree-budgets: --drafter {args.drafter} is an Eagle3 drafter, which drafts a "
                            f"chain (trees grow from a block drafter)")
    contexts = [target.args.max_position_embeddings]
    if drafter is not None:
        contexts.append(drafter.cfg.layers.max_position_embeddings)
    context = min(contexts)
    # positions past it were never trained: not a benchmark (a --prompts-file's prompts: `file_prompts`)
    if args.prompts_file is None and args.prompt_len + s.max_new_tokens > context:
        raise UserError(f"--prompt-len {args.prompt_len} + --max-new-tokens {s.max_new_tokens} exceed the "
                        f"models' context of {context} positions (max_position_embeddings)")


def header(name: str, target, drafter, dtype, hw: str, s: Settings, args: BenchArgs, threads: str,
           cache_dir, built_seconds: float, bw: float) -> str:
    """The first line printed: what is timed, on what."""
    unique = {p.data_ptr(): p for p in target.parameters()}  # tied weights once
    n_target = sum(p.numel() for p in unique.values())
    models = f"target {n_target / 1e6:.1f}M params, no drafter"
    if drafter is not None:
        n_drafter = sum(p.numel() for p in drafter.parameters())
        models = f"target {n_target / 1e6:.1f}M params, drafter {n_drafter / 1e6:.1f}M params"
    line = (f"# {name}: {models}, {dtype_name(dtype)}, "
            f"{hw}, torch {torch.__version__}, compile={s.compile}, {threads}")
    if s.compile and args.skip_guards:
        line += " (guards skipped after warm-up)"
    if s.kernels != "torch":
        line += f", kernels={s.kernels}"
    if s.temperature > 0:
        line += f", sampled at temperature {s.temperature:g}"
    if s.tree_budget:
        line += f", speculative: a tree of {s.tree_budget} nodes"
    if cache_dir:
        line += f" (cache {cache_dir})"
    gemms = cpu_kernels.describe(target, s.compile)
    if gemms:
        line += f"; {gemms}"
    return line + f"; models built in {built_seconds:.1f} s; copy bandwidth {bw / 1e9:.1f} GB/s"


def bench_engines(target, drafter, B: int, max_seq: int, s: Settings, tree_budgets: list[int]) -> dict:
    """The modes' engines at batch B, by name: autoregressive, speculative, and a tree per budget."""
    engines = {"autoregressive": side_engine(target, None, B, max_seq, s)}
    if drafter is None:
        return engines
    engines["speculative"] = side_engine(target, drafter, B, max_seq, s, s.tree_budget)
    for budget in tree_budgets:
        engines[f"tree {budget}"] = side_engine(target, drafter, B, max_seq, s, budget)
    return engines


def interleaved_runs(modes: list[str], engines: dict, reference, prompts, s: Settings, dev: str,
                     max_seq: int, repeats: int, skip_guards: bool) -> dict:
    """Each mode's timed runs, `repeats` each, interleaved with the order rotated every repeat, so a slow
    spell lands on every mode. `reference`: (transformers' target, its drafter) for the "reference" mode."""
    runs = {m: [] for m in modes}
    for rep in range(repeats):
        k = rep % len(modes)
        for m in modes[k:] + modes[:k]:
            if m == "reference":  # batch 1: the prompts one after another, as the engine's one row takes them
                hf, ref_drafter = reference
                outputs = []
                seconds = 0.0
                for prompt in prompts:
                    ids, spent = reference_generate(hf, ref_drafter, prompt, s.max_new_tokens, dev, max_seq)
                    outputs.append(ids)
                    seconds += spent
                tokens = sum(len(ids) for ids in outputs)
                runs[m].append({"outputs": outputs, "total_tokens_per_second": tokens / seconds})
            else:
                runs[m].append(timed_generate(engines[m], prompts, s.max_new_tokens, skip_guards))
    return runs


def mode_row(m: str, B: int, runs: list[dict], engine, prompts, s: Settings, skip_guards: bool,
             differ: dict) -> dict:
    """An engine mode's results at batch B: the median run's figures and the round split (`differ`:
    `compare_outputs`' differing request runs by mode, recorded on every row when any mode differed)."""
    tps = [r["total_tokens_per_second"] for r in runs]
    r = median_run(runs)  # every figure of the row is this run's
    round_s = r["decode_seconds"] / r["rounds"]
    parts = round_split(engine, prompts, s.max_new_tokens, skip_guards)
    row = {"mode": m, "batch": B, "tokens_per_second": r["total_tokens_per_second"], "tokens_per_second_runs": tps,
           "decode_tokens_per_second": (r["tokens"] - len(prompts)) / r["decode_seconds"],
           "acceptance_length": r["acceptance_length"], "round_ms": 1e3 * round_s}
    row.update(parts)
    row["achieved_gbps"] = parts["bytes_per_round"] / round_s / 1e9
    row["compile_seconds"] = engine.compile_seconds
    if differ:
        row["differing_requests"] = differ.get(m)
    return row


def reference_row(runs: list[dict], with_drafter: bool, differ: dict) -> dict:
    """The reference loop's results (batch 1): the median run's tokens/s, and, as on the engines' rows,
    `compare_outputs`' differing request runs when any mode differed."""
    mode = "reference (transformers target)"
    if with_drafter:
        mode = "reference (transformers target, eager drafter)"
    tps = [r["total_tokens_per_second"] for r in runs]
    median = median_run(runs)
    row = {"mode": mode, "batch": 1, "tokens_per_second": median["total_tokens_per_second"],
           "tokens_per_second_runs": tps}
    if differ:
        row["differing_requests"] = differ.get("reference")
    return row


def speed_ups(runs: dict, rows: list[dict], B: int, tree_budgets: list[int], dev: str, s: Settings) -> list[dict]:
    """The ratios within each repeat (adjacent runs), their median and range, printed; a row's own
    speed-up over autoregressive decoding is set on it."""
    engine = "speculative"
    if engine not in runs:  # no drafter: the reference loop is transformers' target alone
        engine = "autoregressive"
    pairs = [("speculative", "autoregressive", f"speculative / autoregressive at batch {B}"),
             (engine, "reference", "this engine / the reference loop at batch 1")]
    for budget in tree_budgets:
        pairs.append((f"tree {budget}", "autoregressive", f"tree {budget} / autoregressive at batch {B}"))
    ratios = []
    for num, den, what in pairs:
        if num not in runs or den not in runs:
            continue
        rs = []
        for a, b in zip(runs[num], runs[den]):
            rs.append(a["total_tokens_per_second"] / b["total_tokens_per_second"])
        median = statistics.median(rs)
        ratios.append({"ratio": what, "median": median, "runs": rs})
        if den == "autoregressive":
            for row in rows:
                if row["mode"] == num and row["batch"] == B:
                    row["speed_up"] = median
        note = ""
        if min(r["seconds"] for r in runs[num]) < 1:  # the numerator is always an engine mode's
            note += "; runs under a second: noise, give more --max-new-tokens or --repeats"
        eager_cpu_batch = B > 1 and dev == "cpu" and not s.compile
        if num == "speculative" and den == "autoregressive" and eager_cpu_batch:
            note += "; at batch > 1 eager speculation on a CPU verifies B x (K+1) tokens per round and may lose"
        print(f"{what}: {median:.2f}x (median of {len(rs)} interleaved repeats; "
              f"{min(rs):.2f}-{max(rs):.2f}{note})", flush=True)
    return ratios


def run(args: BenchArgs) -> list[dict]:
    one_process("bench.py", "it measures one process's decoding")
    batch_sizes, s = check_args(args)
    # what the --out config says ran: greedy when no temperature is given
    args = replace(args, decode=replace(args.decode, temperature=s.temperature))
    target_dir = resolve_checkpoint(args.target, "--target")
    drafter_dir = resolve_checkpoint(args.drafter, "--drafter")
    check_outputs({"--out": args.out}, inputs=[target_dir, drafter_dir])  # hub ids: their snapshot directories
    cache_dir = None
    if s.compile:
        cache_dir = use_compile_cache(args.machine.compile_cache)
    threads = set_threads(args.machine.threads)
    dev = resolve_device(args.machine.device)
    dtype = resolve_dtype(args.machine.dtype, dev)
    want_reference, reference_note = reference_wanted(args, s, batch_sizes, dev)
    t0 = time.perf_counter()
    target, drafter, name = build_pair(args, s, target_dir, drafter_dir, dev, dtype)
    check_pair(args, s, target, drafter)
    given = None
    longest = args.prompt_len
    if args.prompts_file is not None:
        given = file_prompts(args.prompts_file, target_dir, target, drafter, s.max_new_tokens)
        longest = max(map(len, given))
        if max(batch_sizes) > len(given):  # rows without a request would run idle every round
            raise UserError(f"--batch-sizes {args.batch_sizes}: more rows than the {len(given)} prompts of "
                            f"--prompts-file {args.prompts_file}")
    if want_reference and drafter is not None and drafter.cfg.layout == "eagle3":  # a checkpoint's kind, known now
        if args.reference:
            raise UserError(f"--reference: the reference loop is a DSpark drafter's chain, and --drafter "
                            f"{args.drafter} is an Eagle3 drafter")
        reference_note = ("note: the reference loop is skipped: it times a DSpark drafter's chain, "
                          "and --drafter is Eagle3")
        want_reference = False
    for m in (target, drafter):
        if m is not None:
            cpu_kernels.install(m)
    if want_reference:  # counted once the kernels have made their copy
        want_reference, reference_note = reference_fits(args, target, drafter, dev)
    if reference_note:  # once the pair and the prompts are checked
        print(reference_note, file=sys.stderr, flush=True)
    built_seconds = time.perf_counter() - t0
    copy_bytes = 1 << 28
    if dev == "cuda":
        copy_bytes = 1 << 30
    bw = copy_bandwidth(dev, copy_bytes)
    reset_peak_memory(dev)
    hw = device_name(dev)
    print(header(name, target, drafter, dtype, hw, s, args, threads, cache_dir, built_seconds, bw), flush=True)
    hf = None
    ref_drafter = None
    if want_reference:
        hf = transformers_copy(target)
        ref_drafter = reference_drafter(drafter, hf)
    tree_budgets = []
    if args.tree_budgets is not None:
        tree_budgets = parse_ints(args.tree_budgets, "--tree-budgets")
    widest = max([s.tree_budget] + tree_budgets)
    max_seq = cache_length(longest, s.max_new_tokens, drafter, s.draft_length, widest)
    tree_bytes = 0
    if widest:
        tree_bytes = flags.tree_round_bytes(target, drafter, widest, s.temperature > 0)
    flags.check_cache_memory(target, drafter, max(batch_sizes), max_seq, dev, tree_bytes, rows="--batch-sizes")
    random_prompts = None  # a batch's are the first B of these, whatever --batch-sizes lists before it
    if given is None:
        g = torch.Generator().manual_seed(s.seed)
        shape = (max(batch_sizes), args.prompt_len)
        random_prompts = torch.randint(0, target.args.vocab_size - 1, shape, generator=g).tolist()
    # what ran, beside the flags as given: the dtype, and the drafter's layout and drafts a round
    resolved = {"dtype_resolved": dtype_name(dtype), "drafter_layout": None, "num_drafts": None}
    if drafter is not None:
        resolved["drafter_layout"] = drafter.cfg.layout
        resolved["num_drafts"] = drafts_per_round(drafter, s.draft_length)
    rows = []
    ratios = []
    written = []  # what an interruption's last line names as kept: --out once a row is in it, the plot
    try:
        for B in batch_sizes:
            prompts = given
            if prompts is None:
                prompts = random_prompts[:B]
            engines = bench_engines(target, drafter, B, max_seq, s, tree_budgets)
            modes = list(engines)
            if hf is not None and B == 1:
                modes.append("reference")
                # its warm-up, as the engines had theirs
                reference_generate(hf, ref_drafter, prompts[0], min(s.max_new_tokens, 8), dev, max_seq)
            runs = interleaved_runs(modes, engines, (hf, ref_drafter), prompts, s, dev, max_seq, args.repeats,
                                    args.skip_guards)
            differ = {}
            if s.temperature == 0:  # sampled, the modes' tokens differ run to run (their law is the same)
                differ = compare_outputs(runs, prompts, target, exact=dtype == torch.float32, what=f"batch {B}")
            for m in modes:
                if m == "reference":
                    row = reference_row(runs[m], drafter is not None, differ)
                    line = f"{row['mode']:<48} b=1  {row['tokens_per_second']:9.1f} tok/s"
                else:
                    row = mode_row(m, B, runs[m], engines[m], prompts, s, args.skip_guards, differ)
                    line = _row(row, bw)
                rows.append(row)
                # each row kept as soon as it is measured, before it is printed (a reader gone loses none)
                save(args, hw, bw, dev, rows, ratios, complete=False, resolved=resolved)
                if args.out and args.out not in written:
                    written.insert(0, args.out)
                print(line, flush=True)
            ratios += speed_ups(runs, rows, B, tree_budgets, dev, s)
            save(args, hw, bw, dev, rows, ratios, complete=B == batch_sizes[-1], resolved=resolved)
            if args.tree_plot is not None and B == batch_sizes[0]:
                at_b = [r for r in rows if r.get("batch") == B]
                plots.tree_plot(args.tree_plot, at_b, f"{name}, batch {B}, {hw}")
                written.append(args.tree_plot)
    except Interrupted as e:
        e.written = written
        raise
    allocator = "process RSS"
    if dev == "cuda":
        allocator = "CUDA allocator"
    print(f"peak memory: {peak_memory(dev):.2f} GiB ({allocator})")
    return rows


def save(args: BenchArgs, hw: str, bw: float, dev, rows: list[dict], ratios: list[dict], complete: bool,
         resolved: dict):
    """--out, rewritten after every batch size: a run cut short (a time limit on a borrowed GPU)
    still leaves what it measured, marked incomplete."""
    if not args.out:
        return
    timing = (f"tokens/s = generated tokens / (prefill + decode seconds), median of {args.repeats} "
              f"interleaved repeats; the round split (draft, verify, rest) from one more run with its "
              f"halves timed in place and synchronised (split_round_ms)")
    config = flags.recorded_flags(args, TIMED)
    if args.target is not None:  # the checkpoints are the pair; --model and its drafter kind build one
        config["model"] = None
        config["drafter_kind"] = None
    if config["tree_budget"] == 0 and config["tree_budgets"] is None:  # no tree for it to rank
        config["tree_temperature"] = None
    config.update(resolved)
    write_json(args.out, {"config": config, "hardware": hw, "torch": torch.__version__,
                          "copy_bandwidth_gbps": bw / 1e9, "peak_memory_gib": peak_memory(dev),
                          "timing": timing, "complete": complete, "rows": rows, "ratios": ratios}, indent=1)


def _row(r: dict, bw: float) -> str:
    floor_ms = r["bytes_per_round"] / bw * 1e3
    over_floor = r["round_ms"] / floor_ms
    return (f"{r['mode']:<48} b={r['batch']:<3}{r['tokens_per_second']:9.1f} tok/s  "
            f"τ={r['acceptance_length']:.2f}  round {r['round_ms']:.2f} ms (split of a synced "
            f"{r['split_round_ms']:.2f}: draft {r['draft_ms']:.2f}, verify {r['verify_ms']:.2f}, "
            f"rest {r['rest_ms']:.2f})  {r['achieved_gbps']:.1f} GB/s (round {over_floor:.2f}x the floor)  "
            f"compile {r['compile_seconds']:.1f} s")


def run_and_say(args: BenchArgs) -> list[dict]:
    """`run`; an interruption before any file was written says so, and how to keep rows."""
    try:
        return run(args)
    except Interrupted as e:
        if e.written is None:
            e.written = []
        if not e.written and not args.out:
            e.hint = "--out FILE keeps each measured row"
        raise


def main(argv: Optional[list[str]] = None) -> int:
    one_drafter = {"--drafter": "bench.py times one (eval.py compares several)"}
    return cli_main(BenchArgs, run_and_say, argv, once=one_drafter)


if __name__ == "__main__":
    sys.exit(main())
