"""Speculative decoding with a DSpark / DFlash drafter — or, without `--drafter`, plain
autoregressive decoding by the same engine (the baseline).

    python speculate.py --target DIR [--drafter DIR] --prompt "..." --max-new-tokens 128
    python speculate.py ... --batch-size 16 --scheduler hardware --sps-table sps.json

This file reads top to bottom (docs/algorithm.md, "One round"):
1. the round — `draft` (drafter block forward -> Markov chain -> confidence -> schedule), then
   `verify` (one target pass over [anchor, drafts] with capture -> acceptance -> commit); the
   host reads one small tensor per round, `RoundRecord`s;
2. the engine — `Engine.generate` keeps `batch_size` rows busy (continuous batching) and calls
   `Engine.round`, which runs the two halves (compiled or not) with, for a shortened schedule, one
   host read between them: how many tokens the target verifies (a ragged batch, `model.Ragged`) —
   none under the async schedule, whose size is planned before the round (`scheduler.Plan`);
3. the command line — flags, loading, prompts, the trace file, the printed figures.
Without a drafter a round is the same with zero drafts: the target runs on the anchor and the
"bonus" is the next token, so baseline and speculative numbers come from one code path.
"""

from __future__ import annotations

import json
import numbers
import os
import sys
import time
from dataclasses import dataclass, field, replace
from types import FunctionType, SimpleNamespace
from typing import Annotated, Literal, NamedTuple, Optional, Sequence, Union

import torch

try:  # the command line's parser; the Python API and the engine run without it (e.g. on the GPU machine)
    import tyro
except ImportError:
    tyro = None

import kernels
import metrics
import runlog
import scheduler as sched
from compiling import CompileMode, auto_compile, check_compile_flags, compiled, use_compile_cache
from common import (AutoBool, Interrupted, StreamFile, UserError, check_outputs, check_ranges, check_threads, cli_main,
                    device_name, free_memory, set_threads, signals_deferred, sync)
from kernels import NO_FILTERS
from inputs import (Models, Sampling, auto_chat, calibration_note, check_chat_flags, check_prompts, check_sampling,
                    encode_prompt, load_models, load_prompts, resolve_checkpoint, resolve_sampling)
from cpu_kernels import gemm_note
from model import Ragged, Transformer
from outputs import Completion, OutputFile, Printer, completion
from runlog import DecodeWatch, WandbFlags
from scheduler import check_schedulable, parse_buckets, resolve_scheduler
from text import StopStrings


# ----------------------------------------------------------------------------------------
# One round (static shapes throughout: it is what torch.compile captures)

class Proposal(NamedTuple):
    """What the drafter offers this round (steps 1-2)."""
    drafts: torch.Tensor                # [B, K] x_1 .. x_K
    q: Optional[torch.Tensor]           # [B, K, V] the distributions they were drawn from (None at T=0)
    confidence: Optional[torch.Tensor]  # [B, K] c_1 .. c_K (None without a confidence head)
    verify_len: torch.Tensor            # [B] ℓ: how many of the drafts go to the target, 0 .. K
    finite: torch.Tensor                # [B] bool: the drafter's logits and confidences are finite


def rows_finite(x: torch.Tensor) -> torch.Tensor:
    """x [B, ...] -> [B] bool: every value of the row finite — its largest and smallest values are (a NaN
    propagates into both, +inf is the largest, -inf the smallest). Two reductions that allocate nothing
    the size of x: isfinite().all() made three passes and two reductions, and a float64 sum cast all of x
    first (about 0.3 ms of a demo round either way, against 0.04 ms; torch profiler)."""
    rows = x.reshape(x.shape[0], -1)
    return torch.isfinite(rows.amax(-1)) & torch.isfinite(rows.amin(-1))


def draft(target: Transformer, drafter, anchor, anchor_pos, active, *, noise, temperature: float,
          filters: kernels.Filters, schedule: sched.Scheduler, kernels: kernels.KernelSet, capacity=None) -> Proposal:
    """Steps 1-2 for every row: the drafter's block forward at the anchor, the sequential Markov
    chain, the confidence head, then the schedule. anchor [B] is the last committed token, at
    anchor_pos [B]; the drafter's context holds rows < anchor_pos. active [B]: rows still decoding.
    noise: the chain's Exp(1) noise [B, K, V] (None at T=0); filters: top-k/top-p/min-p, applied to
    every slot's distribution as verification applies them to the target's. capacity: the async schedule's C, a 0-d
    tensor fixed before this round (`scheduler.Plan`)."""
    B = anchor.shape[0]
    if drafter is None:
        return Proposal(anchor.new_zeros((B, 0)), None, None, anchor.new_zeros((B,)), active.new_ones((B,)))
    hidden, base_logits = drafter(anchor, anchor_pos)                 # [B, K, H], [B, K, V]
    drafts, q = kernels.markov_chain(base_logits, hidden, anchor, drafter.markov_head, temperature, None, noise,
                                     filters=filters)
    confidence = drafter.confidence(hidden, torch.cat([anchor[:, None], drafts[:, :-1]], dim=1))
    finite = rows_finite(base_logits)
    if confidence is not None:
        finite = finite & rows_finite(confidence)
    return Proposal(drafts, q, confidence, schedule(confidence, active, capacity), finite)


def verify(target: Transformer, drafter, anchor, anchor_pos, active, proposal: Proposal, *, temperature: float,
           filters: kernels.Filters, u, bonus_noise, kernels: kernels.KernelSet, num_tokens: Optional[int] = None):
    """Steps 3-5: one target pass over [x_0, x_1 .. x_ℓ] with capture, acceptance, commit.

    num_tokens None: every row sends all K+1 slots (unscheduled drafts are masked out of
    acceptance; their cache rows are never read). num_tokens N: the rows' 1 + ℓ tokens (0 for
    inactive rows) go flattened into one ragged batch padded to N tokens (`model.Ragged`), so the
    target's matrix multiplies cost the scheduled tokens, not the block. u [B, K], bonus_noise
    [B, V]: the acceptance uniforms and the correction/bonus race's Exp(1) noise (None at T=0).
    Returns (record, anchor', anchor_pos'): `pack`ed for the host, and the rows' next anchor at
    anchor_pos + accepted + 1 — moving it is the whole KV rollback.
    """
    drafts, q, confidence, verify_len, finite = proposal
    B, K = drafts.shape
    capture = drafter.cfg.target_layer_ids if drafter is not None else ()
    tokens = torch.cat([anchor[:, None], drafts], dim=1)                  # [B, K+1]
    positions = anchor_pos[:, None] + torch.arange(K + 1, device=anchor.device)
    # 3. Verify.
    if num_tokens is None:
        logits, features = target(tokens, positions, capture=capture, attention=kernels.attention)
    else:
        ragged = Ragged.build(torch.where(active, verify_len + 1, 0), positions, num_tokens)
        logits, features = target(ragged.flatten(tokens), positions, capture=capture, ragged=ragged,
                                  attention=kernels.attention)
        logits = ragged.pad(logits)                                        # [B, K+1, V], zeros unverified
        features = ragged.pad(features) if features is not None else None
    # 4. Accept.
    if temperature == 0:
        accepted, next_token = kernels.verify_greedy(drafts, logits, verify_len)
    else:
        accepted, next_token = kernels.verify_sampled(drafts, q, logits, verify_len, temperature, None, u,
                                                      bonus_noise, filters=filters)
    # 5. Commit: the drafter's context gains rows a .. a+K; rows past a+n are masked out next
    #    round (context is < the new anchor position) and overwritten later.
    if drafter is not None:
        drafter.commit_context(features, positions)
    finite = finite & rows_finite(logits)  # read with the record: no extra sync
    return (pack(drafts, verify_len, accepted, next_token, confidence, finite),
            torch.where(active, next_token, anchor), torch.where(active, anchor_pos + accepted + 1, anchor_pos))


def kernel_set(name: str, device) -> kernels.KernelSet:
    """`kernels.kernel_set`, its refusal (Triton cannot run on `device`) as the one-line UserError of
    `--kernels NAME` — what an Engine binds, and what the command lines check before loading models."""
    try:
        return kernels.kernel_set(name, device)
    except (RuntimeError, ValueError) as e:  # Triton cannot run there; a name that is no kernel set
        raise UserError(f"--kernels {name}: {e}") from None


def own_code(fn):
    """`fn` with a code object of its own. torch.compile keeps its graphs per code object, so each
    engine's `draft` and `verify` hold only that engine's graphs — with guard evaluation cut to the
    guards that tell a code object's graphs apart (`Engine.generate`), a speculative engine's call
    was otherwise answered by an autoregressive engine's draft graph compiled beside it (both engines
    of `python speculate.py --compile`: τ 1.00, measured; BENCHMARKS.md, session 9)."""
    copy = FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__, copy.__doc__, copy.__qualname__ = fn.__kwdefaults__, fn.__doc__, fn.__qualname__
    return copy


class RoundRecord(NamedTuple):
    """One row's round as the host sees it (a trace line's fields)."""
    drafts: list[int]
    verified: int
    accepted: int
    bonus: int                          # the token committed after the accepted drafts
    confidence: Optional[list[float]]
    finite: bool                        # every logit and confidence of the round was finite


def pack(drafts, verify_len, accepted, next_token, confidence, finite) -> torch.Tensor:
    """The round's one device->host transfer: [B, 2K+4] float64 = drafts [K], verified, accepted,
    next token, finite, confidence [K] (zeros without a head). `unpack` reads it back."""
    if confidence is None:
        confidence = torch.zeros(drafts.shape, device=drafts.device)
    return torch.cat([drafts, verify_len[:, None], accepted[:, None], next_token[:, None], finite[:, None],
                      confidence], 1).double()


def unpack(packed: torch.Tensor, has_confidence: bool) -> list[RoundRecord]:
    K = (packed.shape[1] - 4) // 2
    return [RoundRecord([int(x) for x in r[:K]], int(r[K]), int(r[K + 1]), int(r[K + 2]),
                        r[K + 4:] if has_confidence else None, bool(r[K + 3])) for r in packed.tolist()]


def prefill(target: Transformer, drafter, prompts: list[list[int]], temperature: float,
            noise: Optional[torch.Tensor], device, rows: Optional[torch.Tensor] = None,
            filters: kernels.Filters = kernels.NO_FILTERS):
    """Run the prompts (right-padded) through the target, capturing features for the drafter,
    into cache rows 0..len-1 or `rows` (the rows that continuous batching just freed). noise
    [len, V]: the first token's Exp(1) race noise when sampling (None at T=0).

    Returns the first token of every prompt (its first anchor; -1 where the logits were not finite)
    and its position (the prompt length).
    Pad positions are written past each prompt's end, where they are masked and later overwritten.
    """
    lens = torch.tensor([len(p) for p in prompts], device=device)
    P = int(lens.max())
    tokens = torch.tensor([p + [p[-1]] * (P - len(p)) for p in prompts], device=device)
    positions = torch.arange(P, device=device).expand(len(prompts), P)
    capture = drafter.cfg.target_layer_ids if drafter is not None else ()
    logits, features = target(tokens, positions, capture=capture, logits_index=lens - 1, rows=rows)
    if drafter is not None:
        drafter.commit_context(features, positions, rows)
    first = kernels.sample(logits, temperature, None, noise, filters=filters)
    return torch.where(torch.isfinite(logits).all(-1), first, -1), lens  # -1: non-finite logits


# ----------------------------------------------------------------------------------------
# The engine

class NonFinite(UserError):
    """The target's (or the drafter's) logits were NaN or infinite: the weights or the config are broken."""

    def __init__(self, request: int, where: str):
        super().__init__(f"request {request}, {where}: the logits or confidences are not finite (NaN or Inf): check "
                         f"the checkpoints' weights and config (rope_theta, rms_norm_eps) and --temperature")


@dataclass
class Request:
    index: int
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    rounds: list[dict] = field(default_factory=list)  # trace records, one per round
    finish_reason: Optional[str] = None
    started: Optional[float] = None   # time.perf_counter() when the engine took it (before its prefill)
    finished: Optional[float] = None  # ... and when its last token was committed
    prompt: int = 0   # which prompt of the run, and which sample of it (--num-samples)
    sample: int = 0


def check_cache_memory(target: Transformer, drafter, batch: int, max_seq: int, device):
    """Refuse, before allocating, KV caches that cannot fit in the device's free memory."""
    def kv(a, elt):  # K and V of every layer, [batch, max_seq, kv_heads, head_dim]
        return 2 * a.num_hidden_layers * batch * max_seq * a.num_key_value_heads * a.head_dim * elt
    elt = target.embed_tokens.weight.element_size()
    need = kv(target.args, elt) + (kv(drafter.cfg.layers, elt) if drafter is not None else 0)
    free = free_memory(device)
    if free and need > 0.9 * free:
        raise UserError(f"the KV caches for --batch-size {batch} x {max_seq} positions need {need / 2**30:.1f} GiB; "
                        f"{free / 2**30:.1f} GiB are free on {device}: lower --batch-size or --max-new-tokens")


def cache_length(longest_prompt: int, max_new_tokens: int, drafter) -> int:
    """Cache rows for a batch: prompt + budget, plus room for a round's block / verify window from a
    finished row's last anchor (which may sit up to K+1 past its budget while other rows go on)."""
    width = max(drafter.cfg.num_slots, drafter.cfg.num_drafts + 1) if drafter is not None else 1
    return longest_prompt + max_new_tokens + 2 * width


def rope_and_caches(model) -> list:
    """What `setup_caches` (re-)allocates in a target or drafter: its RoPE table, then every layer's KV cache."""
    return [model.rope] + [layer.self_attn.kv_cache for layer in model.layers]


class Engine:
    """Requests through prefill and rounds in `batch_size` rows (continuous batching), with stop
    and budget handling.

    A round is `draft` then `verify`, each one graph when compiled. With `ragged` (always for the
    schedulers, which shorten verification) the host reads the scheduled token count between them
    and the target verifies exactly those tokens (eager) or that count padded to a bucket (compiled:
    one verify graph per bucket) — except under "async", whose count is planned before the draft, so
    that nothing is read between the halves, as without `ragged`, where every row verifies its whole
    block. The scheduler, the kernel set ("torch" references or "triton") and the sampling settings
    (temperature, filters) are bound here, once.
    """

    def __init__(self, target: Transformer, drafter=None, *, batch_size: int, max_seq: int, temperature: float = 0.0,
                 filters: kernels.Filters = kernels.NO_FILTERS, seed: int = 0, device="cpu", stop_ids=(), stop_strings=None,
                 scheduler: str = "none", threshold: float = 0.0,
                 buckets: Optional[list[int]] = None, ragged: Optional[bool] = None, compile: bool = False,
                 compile_mode: Optional[str] = None, compile_verbose: bool = False, kernels: str = "torch"):
        if scheduler != "none" and (drafter is None or drafter.confidence_head is None):
            raise UserError(f"--scheduler {scheduler}: needs a --drafter with a confidence head")
        check_sampling(temperature)  # (a negative one sampled from softmax(-logits), unseeded)
        self.target, self.drafter, self.stop_ids, self.stop_strings = target, drafter, set(stop_ids), stop_strings
        self.max_seq = max_seq
        self.max_batch, self.temperature, self.device, self.compiled = batch_size, temperature, device, compile
        self.filters = filters if temperature > 0 else NO_FILTERS  # greedy: argmax survives every filter
        self.seed = seed  # request i samples from its own generator, seeded seed + i
        check_cache_memory(target, drafter, batch_size, max_seq, device)
        target.setup_caches(batch_size, max_seq)
        if drafter is not None:
            drafter.setup_caches(batch_size, max_seq)
        # This engine's caches (`own_caches` puts them back when another engine replaced them).
        self.caches = [rope_and_caches(m) if m is not None else None for m in (target, drafter)]
        self.K = drafter.cfg.num_drafts if drafter is not None else 0
        self.scheduler = sched.Scheduler(scheduler, self.K, batch_size, threshold=threshold, buckets=buckets,
                                         compiled=compile, device=device)
        # The two-half round with ragged verification: always for a scheduler; for "none" on request
        # (it then also skips free rows), to compare schedules on one executor.
        self.ragged = scheduler != "none" if ragged is None else ragged
        if not self.ragged and scheduler != "none":
            raise ValueError(f"scheduler {scheduler!r} runs the ragged round")
        # The round's halves, compiled or not, and what every call passes them, fixed here.
        wrap = (lambda f: compiled(own_code(f), device, compile_mode, compile_verbose)) if compile else (lambda f: f)
        self.draft_fn, self.verify_fn = wrap(draft), wrap(verify)
        self.bound = dict(temperature=temperature, filters=self.filters, kernels=kernel_set(kernels, device))
        self.cuda_graphs = compile and str(device).startswith("cuda")
        if compile and self.ragged:  # one verify graph per bucket, all expected: raise dynamo's limit to match
            for name in ("recompile_limit", "cache_size_limit"):
                if hasattr(torch._dynamo.config, name):
                    limit = getattr(torch._dynamo.config, name) + len(self.scheduler.profile_points) + 1
                    setattr(torch._dynamo.config, name, limit)
        self.prefill_seconds = self.decode_seconds = self.compile_seconds = 0.0
        # Compiled and warmed up (`warmup` compiles every graph a round can call: the draft, and the
        # verify at every bucket), `generate` evaluates only the guards that tell those graphs apart
        # (torch.compiler.set_stance(skip_guard_eval_unsafe=True)): nothing a guard checks changes after
        # the warm-up, and full evaluation cost 0.5-1.2 ms a round on CPU (BENCHMARKS.md). Safe because
        # the engine's halves are code of its own (`own_code`): no other engine's graphs sit beside
        # them for the cut-down guards to confuse them with. False: every guard.
        self.warmed, self.skip_guards = False, True

    def round(self, anchor, anchor_pos, active, noise: Optional[kernels.Noise], verify_len=None,
              plan: Optional[sched.Plan] = None):
        """One round for every row -> (record, anchor', anchor_pos'), as `verify` returns them.
        verify_len [B] (profiling a ragged round): verify exactly these many drafts per active row,
        at exactly that many tokens, instead of the schedule's. plan (the async schedule): the
        capacity and verify size, fixed before the drafts exist — nothing is read between the halves."""
        rows = (self.target, self.drafter, anchor, anchor_pos, active)
        if self.cuda_graphs:  # one CUDA-graph generation per round: verify may read draft's outputs
            torch.compiler.cudagraph_mark_step_begin()
        # 1-2. Draft and schedule.
        proposal = self.draft_fn(*rows, noise=noise.chain if noise is not None else None, schedule=self.scheduler,
                                 capacity=plan.tensor if plan is not None else None, **self.bound)
        if verify_len is not None:
            proposal = proposal._replace(verify_len=verify_len)
        num_tokens = plan.num_tokens if plan is not None else None
        if self.ragged and plan is None:  # the host read between the halves: the ragged batch's size
            n = int(torch.where(active, proposal.verify_len + 1, 0).sum())
            num_tokens = n if verify_len is not None else self.scheduler.bucket(n)
        # 3-5. Verify, accept, commit.
        return self.verify_fn(*rows, proposal, u=noise.u if noise is not None else None,
                              bonus_noise=noise.bonus if noise is not None else None, num_tokens=num_tokens,
                              **self.bound)

    def generate(self, requests: list[Request], max_new_tokens: int, on_round=None, on_finish=None, on_step=None):
        """Decode requests to completion, `batch_size` at a time, continuously: when a request
        finishes, the next waiting one is prefilled into its row while the other rows keep going.
        `on_round(request, record)` sees every round of every request, `on_finish(request)` its end,
        `on_step()` the end of every round of the batch (runlog.DecodeWatch's figures as it goes).

        A round always runs all rows (free rows are inactive), so its shapes never change and a
        compiled round never recompiles. Compiled and warmed up, guard evaluation is cut to what tells
        the graphs apart (`skip_guards`, __init__).
        """
        self.own_caches()
        skip = self.compiled and self.warmed and self.skip_guards
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=skip):
            return self._generate(requests, max_new_tokens, on_round, on_finish, on_step)

    def own_caches(self):
        """Put this engine's caches back in the models. Engines on the same models share them, and
        building one of another size re-allocates them (`setup_caches`): eager rounds would read any
        caches, but a compiled round holds the very tensors it was compiled with (the CPU recipe's
        frozen graphs keep the ones they only read as constants) and, with guard evaluation cut down
        (`skip_guards`), nothing checks the new ones' shapes: it decoded other tokens, silently."""
        for m, mine in zip((self.target, self.drafter), self.caches):
            if m is None or all(a is b for a, b in zip(rope_and_caches(m), mine)):
                continue
            rope, *kvs = mine
            for layer, kv in zip(m.layers, kvs):
                layer.self_attn.kv_cache = kv
            m.register_buffer("rope", rope, persistent=False)
            if isinstance(m, Transformer):
                m.max_batch, m.max_seq = kv.k.shape[:2]

    def _generate(self, requests: list[Request], max_new_tokens: int, on_round, on_finish, on_step):
        B, K, V, dev = self.max_batch, self.K, self.target.args.vocab_size, self.device
        check_ranges(SimpleNamespace(max_new_tokens=max_new_tokens), max_new_tokens="[1, 10485760]")
        if not isinstance(max_new_tokens, numbers.Integral):
            raise UserError(f"--max-new-tokens: invalid value {max_new_tokens!r} (expected an integer)")
        check_prompts([r.prompt_ids for r in requests], self.target, max_new_tokens, where="Engine.generate: ",
                      drafter=self.drafter)
        for req in requests:  # a row's cache must hold the prompt, the budget and a round's overshoot
            need = cache_length(len(req.prompt_ids), max_new_tokens, self.drafter)
            if need > self.max_seq:
                raise UserError(f"request {req.index}: {len(req.prompt_ids)} prompt tokens + {max_new_tokens} new tokens "
                                f"need {need} cache positions, and this engine was built with max_seq={self.max_seq}")
        has_confidence = self.drafter is not None and self.drafter.confidence_head is not None
        waiting = list(reversed(requests))  # popped from the end: first come, first served
        rows: list[Optional[Request]] = [None] * B
        gens: list[Optional[torch.Generator]] = [None] * B  # the rows' requests' random streams
        anchor = torch.zeros(B, dtype=torch.long, device=dev)
        anchor_pos = torch.zeros(B, dtype=torch.long, device=dev)
        self.scheduler.reset()  # async: a new decode's history, so its output does not depend on earlier ones

        def finish(req: Request):
            req.finished = time.perf_counter()
            if on_finish is not None:
                on_finish(req)

        def admit():
            """Prefill waiting requests into the free rows (again, if one ends with its first token)."""
            nonlocal anchor, anchor_pos
            while waiting and None in rows:
                free = [i for i, r in enumerate(rows) if r is None][:len(waiting)]
                new = [waiting.pop() for _ in free]
                t0 = time.perf_counter()
                for req in new:
                    req.started = t0
                index = torch.tensor(free, device=dev)
                leading = free == list(range(len(free)))  # e.g. the first admission: cache rows as a view
                noise = None
                if self.temperature > 0:  # a request's samples depend only on the seed and its index
                    for i, req in zip(free, new):
                        gens[i] = torch.Generator(device=dev).manual_seed(self.seed + req.index)
                    noise = torch.stack([torch.empty(V, device=dev).exponential_(1, generator=gens[i]) for i in free])
                first, lens = prefill(self.target, self.drafter, [r.prompt_ids for r in new], self.temperature,
                                      noise, dev, rows=None if leading else index, filters=self.filters)
                anchor, anchor_pos = anchor.index_copy(0, index, first), anchor_pos.index_copy(0, index, lens)
                for i, req, t in zip(free, new, first.tolist()):
                    if t < 0:
                        raise NonFinite(req.index, "the prefill")
                    self._commit(req, [t], max_new_tokens)
                    if req.finish_reason is None:
                        rows[i] = req
                    else:
                        finish(req)
                self.prefill_seconds += time.perf_counter() - t0

        admit()
        live = None
        while any(r is not None for r in rows):
            t0 = time.perf_counter()
            if live != [r is not None for r in rows]:
                live = [r is not None for r in rows]
                active = torch.tensor(live, device=dev)
            noise = kernels.rows_noise([g if r is not None else None for g, r in zip(gens, rows)], K, V, dev) \
                if self.temperature > 0 else None
            plan = self.scheduler.plan(sum(live)) if self.scheduler.kind == "async" else None
            record, anchor, anchor_pos = self.round(anchor, anchor_pos, active, noise, plan=plan)
            anchor, anchor_pos = anchor.clone(), anchor_pos.clone()  # outlive the next graph replay
            records = unpack(record, has_confidence)  # the one host read
            if plan is not None:  # the history that sizes the round after next
                self.scheduler.observe([rec.confidence for rec, on in zip(records, live) if on])
            for i, (req, rec) in enumerate(zip(rows, records)):
                if req is None:
                    continue
                if not rec.finite:
                    raise NonFinite(req.index, f"round {len(req.rounds)}")
                entry = {"request": req.index, "round": len(req.rounds), "anchor": req.output_ids[-1],
                         "draft": rec.drafts, "confidence": rec.confidence, "verified": rec.verified,
                         "accepted": rec.accepted, "bonus": rec.bonus, **(plan.trace() if plan else {})}
                req.rounds.append(entry)
                self._commit(req, rec.drafts[:rec.accepted] + [rec.bonus], max_new_tokens)
                if on_round is not None:
                    on_round(req, entry)
                if req.finish_reason is not None:
                    rows[i] = None
                    finish(req)
            self.decode_seconds += time.perf_counter() - t0
            if on_step is not None:
                on_step()
            admit()
        return requests

    def _commit(self, req: Request, tokens: list[int], budget: int):
        """Append tokens up to the budget and the first stop token; with stop strings, cut the output
        after the token that completes the first of them."""
        before = len(req.output_ids)
        for t in tokens:
            if req.finish_reason is not None:
                break
            req.output_ids.append(t)
            if t in self.stop_ids:
                req.finish_reason = "stop"
            elif len(req.output_ids) >= budget:
                req.finish_reason = "length"
        if self.stop_strings is not None and len(req.output_ids) > before:
            keep = self.stop_strings.keep(req.output_ids, before)
            if keep is not None:
                del req.output_ids[keep:]
                req.finish_reason = "stop"

    # Compiling and profiling: rounds on dummy rows.

    def _dummy_round(self, num_tokens: Optional[int] = None):
        """A round on rows at position 0 whose schedule fills `num_tokens` verify tokens (None: the
        engine's own schedule). Noise comes from a throwaway generator, so the run's random stream
        (and every sampled token) is the same as without it; the cache rows it writes are rewritten
        by the next prefill before they are read."""
        self.own_caches()
        B, dev, W = self.max_batch, self.device, self.K + 1
        zeros = lambda dtype=torch.long: torch.zeros(B, dtype=dtype, device=dev)  # distinct tensors: no aliasing guard
        noise = (kernels.round_noise(torch.Generator(device=dev).manual_seed(0), B, self.K,
                                     self.target.args.vocab_size, dev) if self.temperature > 0 else None)
        if num_tokens is None:
            record, _, _ = self.round(zeros(), zeros(), zeros(torch.bool), noise)
        else:
            counts = (num_tokens - W * torch.arange(B, device=dev)).clamp(0, W)  # fill rows in order
            plan = self.scheduler.fixed(num_tokens) if self.scheduler.kind == "async" else None
            record, _, _ = self.round(zeros(), zeros(), counts > 0, noise, verify_len=(counts - 1).clamp(min=0),
                                      plan=plan)
        return record.tolist()

    def warmup(self):
        """Compile before anything is timed: the draft and the verify graph (one per bucket when ragged)."""
        t0 = time.perf_counter()
        s = self.scheduler
        for n in [None] if not self.ragged else (s.buckets or [s.profile_points[-1]]):
            self._dummy_round(n)
        self.compile_seconds += time.perf_counter() - t0
        self.warmed = True

    def profile_sps(self, reps: int = 7) -> dict:
        """The hardware scheduler's SPS table, measured: rounds per second when a round verifies B
        tokens, at every profile point — the engine's real step (draft, host read, ragged verify)."""
        best = sched.profile(self._dummy_round, self.scheduler.profile_points, lambda: sync(self.device), reps)
        return dict(self.sps_identity(), seconds_per_step=best, steps_per_second=[1 / s for s in best])

    def sps_identity(self) -> dict:
        """What an SPS table was measured for; a table is reused only where all of it matches."""
        a, d = self.target.args, self.drafter
        n = sum(p.numel() for p in {p.data_ptr(): p for p in self.target.parameters()}.values())
        return {"device": device_name(self.device), "torch": torch.__version__,
                "target": f"Qwen3 {n} parameters, {a.num_hidden_layers} layers, hidden {a.hidden_size}, "
                          f"vocab {a.vocab_size}",
                "drafter": d.cfg.describe() if d is not None else None,
                "dtype": str(self.target.embed_tokens.weight.dtype).replace("torch.", ""),
                "batch_capacity": self.max_batch, "verify_width": self.K + 1, "sampling": self.temperature > 0,
                "compiled": self.compiled,
                "buckets": self.scheduler.buckets, "profile_points": self.scheduler.profile_points}


# ----------------------------------------------------------------------------------------
# The Python API: load once, generate many times

def load(target: Optional[str] = None, drafter: Optional[str] = None, *, device: str = "cpu",
         dtype: Optional[str] = None, calibration: Optional[str] = None) -> Models:
    """The target (and drafter) for `generate`, loaded once: checkpoint directories, as on the command
    line; with neither, the committed demo pair. `dtype`: "float32", "bfloat16" or "float16" (default
    bfloat16 on cuda, float32 on cpu)."""
    if target is None and drafter is None:
        target, drafter = os.path.join(DEMO_DIR, "target"), os.path.join(DEMO_DIR, "drafter")
    return load_models(target, drafter, device=device, dtype=dtype, calibration=calibration)


def _api_numbers(integers: dict, reals: dict) -> dict:
    """The Python API's numeric arguments as the flags' types: integers (numpy's too) as int, reals as
    float; None stays None; anything else (a bool, a str, 2.5 for a count) is one UserError naming it."""
    out = {}
    for kind, values in ((numbers.Integral, integers), (numbers.Real, reals)):
        for name, v in values.items():
            if v is not None and (isinstance(v, bool) or not isinstance(v, kind)):
                raise UserError(f"--{name.replace('_', '-')}: invalid value {v!r} "
                                f"(expected {'an integer' if kind is numbers.Integral else 'a number'})")
            out[name] = None if v is None else int(v) if kind is numbers.Integral else float(v)
    return out


def generate(m: Models, prompts, *, max_new_tokens: int = 128, temperature: Optional[float] = None,
             top_k: Optional[int] = None, top_p: Optional[float] = None, min_p: Optional[float] = None,
             stop: Union[str, Sequence[str], None] = (), ignore_eos: bool = False, seed: int = 0, num_samples: int = 1,
             batch_size: Optional[int] = None, chat: Optional[bool] = None, system_prompt: Optional[str] = None,
             thinking: bool = False,
             scheduler: Optional[str] = None, confidence_threshold: float = 0.0, compile: bool = False,
             compile_mode: Optional[str] = None, kernels: str = "torch",
             sps_table: Optional[str] = None) -> list[Completion]:
    """Decode prompts with the models from `load` and return one `Completion` per prompt and sample
    (text, ids, finish reason, rounds, τ), in order. `prompts`: one prompt or a list of them — a text,
    a list of token ids or a conversation. `stop`: a stop string or a list of them. Sampling as on the
    command line: with no sampling argument the target's generation_config.json, else the arguments
    (temperature 0: greedy). `scheduler` and `confidence_threshold` as --scheduler and
    --confidence-threshold (default: threshold when the threshold is above 0, else none). The KV caches
    are sized for the longest prompt and the budget; a request that cannot fit the context is refused.
    Under the hardware and async schedulers the SPS table is read from `sps_table` (written there when
    missing) or profiled first, as `--sps-table` does. Every argument is checked as its flag is; the
    errors (`UserError`) name the flag (--max-new-tokens for max_new_tokens)."""
    if not isinstance(prompts, (str, list, tuple)):
        raise UserError(f"prompts: expected a text, a list of token ids, a conversation (a list of messages) or a "
                        f"list of these, got {type(prompts).__name__}")
    one = isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and all(
        isinstance(x, (int, dict)) for x in prompts))
    ids = [encode_prompt(m.tokenizer, p, chat=chat, system_prompt=system_prompt, thinking=thinking, where=f"prompt {i}")
           for i, p in enumerate([prompts] if one else prompts)]
    if not ids:
        raise UserError("generate: no prompts")
    n = _api_numbers(dict(max_new_tokens=max_new_tokens, num_samples=num_samples, batch_size=batch_size, seed=seed,
                          top_k=top_k),
                     dict(temperature=temperature, top_p=top_p, min_p=min_p, confidence_threshold=confidence_threshold))
    check_ranges(SimpleNamespace(**n), max_new_tokens="[1, 10485760]", num_samples=f"[1, {MAX_REQUESTS}]",
                 batch_size="[1, 65536]", seed=f"[0, {2**62}]", confidence_threshold="[0, 1]")
    for name in ("max_new_tokens", "seed", "num_samples", "confidence_threshold"):  # (no None for these)
        if n[name] is None:
            raise UserError(f"--{name.replace('_', '-')}: invalid value None")
    max_new_tokens, seed, confidence_threshold = n["max_new_tokens"], n["seed"], n["confidence_threshold"]
    if scheduler is not None and scheduler not in sched.KINDS:
        raise UserError(f"--scheduler {scheduler!r}: one of {', '.join(sched.KINDS)}")
    kind = resolve_scheduler(SimpleNamespace(scheduler=scheduler, confidence_threshold=confidence_threshold,
                                             sps_table=sps_table))
    check_compile_flags(compile, None, False, compile_mode)
    if stop is None or isinstance(stop, str):
        stop = [] if stop is None else [stop]
    elif isinstance(stop, (list, tuple)):
        stop = list(stop)
    else:
        raise UserError(f"--stop {stop!r}: a stop string or a list of them")
    check_prompts(ids, m.target, max_new_tokens, drafter=m.drafter)
    sampling = resolve_sampling(m, n["temperature"], n["top_k"], n["top_p"], n["min_p"])
    requests = requests_for(ids, n["num_samples"])
    check_schedulable(kind, m.drafter, confidence_threshold)
    stops = StopStrings.build(m.tokenizer, stop)
    engine = build_engine(m, m.drafter, requests, max_new_tokens, sampling=sampling, seed=seed,
                          batch_size=n["batch_size"] or min(len(requests), 16), scheduler=kind,
                          threshold=confidence_threshold, compile=compile, kernels=kernels, stops=stops,
                          ignore_eos=ignore_eos, compile_mode=compile_mode)
    if kind in sched.SPS_KINDS:  # its steps per second by verify size: without them it verifies every draft
        if compile:
            engine.warmup()
        engine.scheduler.set_sps(sched.load_or_profile(engine, sps_table, verbose=False))
    engine.generate(requests, max_new_tokens)
    return [completion(r, m.tokenizer, stops, engine.stop_ids) for r in requests]


def requests_for(prompts: list[list[int]], num_samples: int) -> list[Request]:
    """Every prompt num_samples times: request i = prompt i // num_samples, sample i % num_samples."""
    return [Request(i, prompts[i // num_samples], prompt=i // num_samples, sample=i % num_samples)
            for i in range(len(prompts) * num_samples)]


def build_engine(m: Models, drafter, requests: list[Request], max_new_tokens: int, *, sampling: Sampling, seed: int,
                 batch_size: int, scheduler: str, threshold: float, compile: bool, kernels: str = "torch",
                 stops: Optional[StopStrings] = None, ignore_eos: bool = False, buckets=None,
                 max_seq: Optional[int] = None, compile_mode: Optional[str] = None,
                 compile_verbose: bool = False) -> Engine:
    """An engine sized for these requests: caches for the longest prompt + budget (or `max_seq`, at least
    that), at most batch_size rows."""
    batch = min(batch_size, len(requests))
    need = cache_length(max(len(r.prompt_ids) for r in requests), max_new_tokens, drafter)
    return Engine(m.target, drafter, batch_size=batch, temperature=sampling.temperature, filters=sampling.filters,
                  seed=seed, max_seq=max(need, max_seq or 0),
                  device=str(m.target.embed_tokens.weight.device), stop_ids=() if ignore_eos else m.stop_ids,
                  stop_strings=stops, scheduler=scheduler, threshold=threshold,
                  buckets=buckets if scheduler != "none" else None, compile=compile, compile_mode=compile_mode,
                  compile_verbose=compile_verbose, kernels=kernels)


# ----------------------------------------------------------------------------------------
# The command line

DEMO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo")
# The demo's prompts without a prompt flag: this one, from shutil.py (one of the standard-library files held
# out of the demo pair's training, demo/heldout.txt), whose completion is printed, then the 20 prompts of
# demo/heldout.jsonl (64-token windows of the held-out files), so that the figures are those of 21 prompts,
# not of one 128-token run (a fraction of a second, as noisy as that).
DEMO_PROMPT = 'def copyfileobj(fsrc, fdst, length=0):\n    """copy data from file-like object fsrc to file-like object fdst"""\n'
DEMO_PROMPTS_FILE = os.path.join(DEMO_DIR, "heldout.jsonl")


@dataclass
class Args(WandbFlags):
    """Speculative decoding with DSpark / DFlash drafters (baseline decoding without --drafter)."""

    target: Optional[str] = None
    """Hugging Face Qwen3 directory (config.json, safetensors, tokenizer.json), or a hub id ORG/NAME[@REVISION]
    taken from the Hugging Face cache or downloaded into it (HF_HUB_OFFLINE=1: the cache only). Default,
    with no --drafter and no --random-init either: the demo pair in demo/."""
    drafter: Optional[str] = None
    """Drafter directory or hub id (any DSpark / DFlash spelling); omitted: plain autoregressive decoding."""
    prompt: Optional[str] = None
    """One prompt as text (rendered with the chat template unless --no-chat)."""
    prompt_ids: Optional[str] = None
    """One prompt as comma-separated token ids, e.g. 1,2,3 (no tokenizer needed)."""
    prompts_file: Optional[str] = None
    """JSON lines, each {"prompt": str}, {"prompt_ids": [int]}, {"turns": [str]} (first turn used) or
    {"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]} (a conversation that ends
    with the user's turn). The demo (no --target) without a prompt flag decodes 21 prompts: a code prompt
    from the held-out shutil.py, then demo/heldout.jsonl's 20, printing the first one's completion."""
    chat: AutoBool = None
    """Render text prompts with the target's chat template, thinking off. Default: on when the
    tokenizer has a template; --chat without one uses Qwen3's format."""
    system_prompt: Optional[str] = None
    """A system turn before every text prompt's user turn (chat rendering only; not with token ids)."""
    enable_thinking: bool = False
    """Render the chat with the template's thinking on (Qwen3: the model writes its reasoning first);
    off by default, as the published drafters were trained."""
    num_samples: int = 1
    """Run every prompt this many times (independent samples)."""
    batch_size: int = 1
    """Requests decoded together (rows); with more requests than rows, a finished request's row
    takes the next waiting one at once (continuous batching)."""
    max_new_tokens: int = 128
    """Token budget per request (exact)."""
    temperature: Optional[float] = None
    """0 = greedy; otherwise lossless rejection sampling at this temperature. Default: with no sampling
    flag (--temperature, --top-k, --top-p, --min-p) the target's generation_config.json (greedy without
    one, or when it says do_sample false); 1.0 when only filter flags are given."""
    top_k: Optional[int] = None
    """Sample from the K most likely tokens only (0: off), in the target's and the drafter's
    distributions alike, so the output stays exactly the target's filtered sampling."""
    top_p: Optional[float] = None
    """Then from the most likely tokens that make up probability P (1: off); applied like --top-k."""
    min_p: Optional[float] = None
    """Then only tokens at least M times as likely as the most likely one (0: off); applied like --top-k."""
    stop: Annotated[tuple[str, ...], tyro.conf.UseAppendAction] = ()
    """End a request at this text (repeatable: --stop A --stop B); the printed text is cut before it."""
    ignore_eos: bool = False
    """Do not stop at the target's EOS tokens: every request runs to --max-new-tokens (or a --stop)."""
    seed: int = 0
    """Seed of sampling: request i draws from its own generator seeded seed + i, so its output depends
    only on the seed and its index (not on the batch size or the requests beside it)."""
    confidence_threshold: float = 0.0
    """Verify drafts only up to the first confidence below this; 0 = the whole block."""
    scheduler: Optional[Literal["none", "threshold", "hardware", "async"]] = None
    """How many drafts each round verifies. none: the whole block; threshold: up to the first
    confidence below --confidence-threshold; hardware: the paper's Algorithm 1 over the batch,
    maximising expected tokens x SPS(B) from a profiled table; async: the paper's production variant,
    the batch's draft count searched over SPS(B) from the confidences of two rounds earlier (no host
    read inside a round), filled with the most confident drafts. Default: threshold when
    --confidence-threshold > 0, else none."""
    sps_table: Optional[str] = None
    """JSON table of SPS(B) (steps/s by verify tokens) for --scheduler hardware or async: read if the file
    exists (it must match this run's device, models, dtype, batch size and buckets), else
    profiled and written there. Without it the table is profiled at start and not kept."""
    verify_buckets: Optional[str] = None
    """Comma-separated token counts a scheduled round's ragged verification is padded to (one
    compiled graph each). Default: with --compile 1,2,3,4,6,8,12,... up to batch size x (drafts + 1);
    eager, the exact count (no padding)."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where to run."""
    dtype: Optional[Literal["float32", "bfloat16", "float16"]] = None
    """Weights and activations. Default: bfloat16 on cuda, float32 on cpu."""
    threads: Optional[int] = None
    """CPU threads for torch (torch.set_num_threads). Default: OMP_NUM_THREADS when set, else half the
    CPUs this process may use (printed at start); see the README on sharing a machine. The project's
    CPU kernels (float32 products, a round's attention; README, Speed) split their work over them."""
    compile: AutoBool = None
    """torch.compile the round. Default: on for cuda, off for cpu (where a first compile takes
    minutes, which a short run never earns back)."""
    compile_mode: Optional[CompileMode] = None
    """With --compile: this torch.compile mode instead of the project's recipe (on cpu max-autotune with
    the weights frozen into the graph and a C++ wrapper; on cuda reduce-overhead, CUDA graphs without
    autotuning; max-autotune: also autotune every GEMM shape). default: Inductor's default mode, whose
    graphs its caches keep, so a second run starts in seconds, but whose round is slower on cpu
    (README, "Compiling")."""
    compile_cache: Optional[str] = None
    """With --compile: the directory of torch.compile's on-disk caches, which later runs of the same
    shapes reuse. Default: $TORCHINDUCTOR_CACHE_DIR when set, else ~/.cache/dspark-fast/inductor."""
    verbose: bool = False
    """With --compile: show what compiling prints (Inductor's autotuning tables, on stderr); without
    it compiling prints one line, its time and the cache directory."""
    kernels: Literal["torch", "triton"] = "torch"
    """The Markov chain, the acceptance and the verification's attention over the KV cache: plain torch
    (the references; the model's own attention), or kernels.py's Triton kernels (cuda; on cpu only in
    Triton's interpreter, TRITON_INTERPRET=1, for testing)."""
    trace_file: Optional[str] = None
    """Write a JSON-lines record of every round, request and a summary here (docs/trace-format.md)."""
    output_file: Optional[str] = None
    """Write one JSON record per request here as it finishes: request, prompt and sample indices, text,
    output ids, finish reason, rounds, τ and the prompt's ids."""
    progress: bool = True
    """A progress bar on stderr while several requests decode (requests done, tokens/s, τ); only when
    stderr is a terminal."""
    log_every: int = 10
    """With --wandb: log the figures so far (tokens/s, τ, verified per round, accepted lengths) every
    this many rounds."""
    calibration: Optional[str] = None
    """Confidence temperatures from `eval.py --calibration-out` (Sequential Temperature Scaling):
    c_k = σ(logit_k / T_k), applied before the threshold."""
    random_init: Optional[Literal["qwen3-4b", "qwen3-8b", "qwen3-14b"]] = None
    """Instead of --target/--drafter: a real-shaped target and a block-7, 5-layer DSpark drafter with
    random weights, to measure speed without downloads (prompts as ids; use bench.py for tables)."""


MAX_REQUESTS = 10_000_000


def check_args(args: Args):
    """The flags alone, before anything is loaded."""
    check_ranges(args, num_samples=f"[1, {MAX_REQUESTS}]", batch_size="[1, 65536]", max_new_tokens="[1, 10485760]",
                 confidence_threshold="[0, 1]", seed=f"[0, {2**62}]", log_every="[1, inf)")
    runlog.check(args)
    check_sampling(args.temperature, args.top_k, args.top_p, args.min_p)
    check_threads(args.threads)
    if any(not s for s in args.stop):
        raise UserError("--stop: an empty stop string would end every request at once")
    if args.random_init is not None:  # no tokenizer: say so before building (and allocating) the model
        for flag, given in (("--prompt", args.prompt is not None), ("--stop", bool(args.stop)),
                            ("--system-prompt", args.system_prompt is not None)):
            if given:
                raise UserError(f"{flag}: text needs a tokenizer, and --random-init {args.random_init} has none "
                                f"(use --prompt-ids)")
    if args.chat and args.prompt_ids is not None:  # (--no-chat agrees with token ids: they are never rendered)
        raise UserError("--chat: --prompt-ids are token ids, never rendered; it would change nothing")
    StopStrings.check(args.stop)
    if args.calibration is not None and resolve_scheduler(args) == "none":
        raise UserError(f"--calibration {args.calibration}: only a scheduled round reads the confidences "
                        f"(--scheduler threshold, hardware or async); without one it changes nothing")
    sps_exists = args.sps_table is not None and os.path.isfile(args.sps_table)  # read if it exists, else written
    check_outputs({"--trace-file": args.trace_file, "--output-file": args.output_file,
                   "--sps-table": None if sps_exists else args.sps_table},
                  inputs=[args.target, args.drafter, args.prompts_file, args.calibration,
                          args.sps_table if sps_exists else None])
    kernel_set(args.kernels, args.device)  # refused here, before any model is loaded
    check_compile_flags(auto_compile(args.compile, args.device), args.compile_cache, args.verbose, args.compile_mode)


def run(args: Args) -> dict:
    """Everything `python speculate.py` does; returns the summary. Raises UserError on bad input."""
    demo = args.target is None and args.drafter is None and args.random_init is None
    no_prompt = args.prompt is None and args.prompt_ids is None and args.prompts_file is None
    if demo:  # the committed demo pair (scripts/train_demo.sh) and, without a prompt flag, its prompts (DEMO_PROMPT)
        args = replace(args, target=os.path.join(DEMO_DIR, "target"), drafter=os.path.join(DEMO_DIR, "drafter"),
                       prompts_file=DEMO_PROMPTS_FILE if no_prompt else args.prompts_file)
    check_args(args)  # before any download
    check_chat_flags(chat=args.chat, prompt_ids=args.prompt_ids, system_prompt=args.system_prompt,
                     thinking=args.enable_thinking)
    if args.random_init is None:
        args = replace(args, target=resolve_checkpoint(args.target, "--target"),
                       drafter=resolve_checkpoint(args.drafter, "--drafter"))
        check_args(args)  # outputs again: not inside the snapshot directories hub ids resolved to
    with runlog.session(args, "speculate", "speculate.py") as log:  # --wandb: a run around the work
        return load_and_decode(args, demo, log, lead=DEMO_PROMPT if demo and no_prompt else None)


def load_and_decode(args: Args, demo: bool, log: Optional[runlog.Log], lead: Optional[str] = None) -> dict:
    """Load the models, read the prompts and decode them (in demo mode twice: without, then with the drafter).
    `lead`: a text prompt put before the prompts read, the only one whose completion is printed (the demo's
    default run: DEMO_PROMPT, then the held-out prompts)."""
    threads = set_threads(args.threads)
    if auto_compile(args.compile, args.device):
        args = replace(args, compile_cache=use_compile_cache(args.compile_cache))
    kind = resolve_scheduler(args)
    m = load_models(args.target, args.drafter, device=args.device, dtype=args.dtype, random_init=args.random_init,
                    calibration=args.calibration, seed=args.seed)
    check_schedulable(kind, m.drafter, args.confidence_threshold)
    sampling = resolve_sampling(m, args.temperature, args.top_k, args.top_p, args.min_p)
    if note := calibration_note(args.calibration, m.directories[1], sampling.temperature):
        print(note, file=sys.stderr)
    stops = StopStrings.build(m.tokenizer, args.stop)
    context = m.target.args.max_position_embeddings
    chat = auto_chat(args.chat, m.tokenizer)
    sources = []  # where each prompt came from, for check_prompts' messages
    prompts = load_prompts(tokenizer=m.tokenizer, chat=chat, prompt=args.prompt,
                           prompt_ids=args.prompt_ids, prompts_file=args.prompts_file,
                           max_len=max(context - args.max_new_tokens, 1), system_prompt=args.system_prompt,
                           thinking=args.enable_thinking, sources=sources)
    if lead is not None:  # the demo tokenizer has no chat template: raw text
        prompts = [encode_prompt(m.tokenizer, lead, chat=chat, system_prompt=args.system_prompt,
                                 thinking=args.enable_thinking, where="the demo prompt")] + prompts
        sources = ["the demo prompt"] + sources
    check_prompts(prompts, m.target, args.max_new_tokens, drafter=m.drafter, sources=sources)
    if len(prompts) * args.num_samples > MAX_REQUESTS:
        raise UserError(f"--num-samples {args.num_samples}: {len(prompts)} prompts x {args.num_samples} samples is more "
                        f"than {MAX_REQUESTS:,} requests")
    if log is not None:  # what the flags resolved to, and what was loaded
        f = sampling.filters
        log.config(demo=demo, hardware=device_name(args.device), dtype_resolved=str(m.dtype).removeprefix("torch."),
                   threads_resolved=torch.get_num_threads(), scheduler_resolved=kind, chat_resolved=chat,
                   compile_resolved=auto_compile(args.compile, args.device),
                   sampling={"temperature": sampling.temperature, "top_k": f.top_k, "top_p": f.top_p,
                             "min_p": f.min_p, "source": sampling.source},
                   num_prompts=len(prompts), num_requests=len(prompts) * args.num_samples,
                   target_config=runlog.checkpoint_config(m.directories[0]),
                   drafter_config=runlog.checkpoint_config(m.directories[1]),
                   drafter_resolved=m.drafter.cfg.describe() if m.drafter is not None else None)
    gemms = gemm_note(m.target, compiled=auto_compile(args.compile, args.device))
    announce = f"{threads}; " + (f"{gemms}; " if gemms else "") + sampling.describe()  # printed once every input is checked
    if demo:  # the prompt, then the baseline by the same engine without the drafter, for the side-by-side figures
        # The speculative engine first: its SPS table (--sps-table) is read and checked before any decoding.
        # The baseline's engine gets as many cache rows, so the two share the target's caches (kept, not
        # reallocated under the speculative engine).
        engine = ready_engine(args, m, m.drafter, prompts, kind, sampling, stops)
        text = m.tokenizer.decode(prompts[0]) if args.prompt is not None or lead is not None else prompts[0]
        more = (f" 1 of {len(prompts)} (the figures cover all {len(prompts)}: this one, then the "
                f"{len(prompts) - 1} of demo/heldout.jsonl)" if lead is not None else "")
        print(f"--- prompt{more} ---\n{text}")
        baseline = decode(args, m, None, prompts, None, None, "none", sampling, stops, heading="autoregressive",
                          announce=announce, log=log, show=1 if lead is not None else None,
                          engine=ready_engine(args, m, None, prompts, "none", sampling, stops, max_seq=engine.max_seq))
    summary = decode(args, m, m.drafter, prompts, args.trace_file, args.output_file, kind, sampling, stops,
                     heading="speculative" if demo else None, announce=None if demo else announce, log=log,
                     engine=engine if demo else None, show=1 if lead is not None else None)
    if demo and baseline["tokens_per_second"] > 0:
        greedy = sampling.temperature == 0
        speed_up = summary["tokens_per_second"] / baseline["tokens_per_second"]
        print(f"speed-up: {speed_up:.2f}x (speculative vs autoregressive tokens/s, same prompts, "
              + (f"greedy outputs identical: {baseline['outputs'] == summary['outputs']})" if greedy else
                 "sampled: the two follow the same distribution, not the same tokens)"))
        if log is not None:
            log.summary({"speed_up": speed_up, **({"greedy_outputs_identical": baseline["outputs"] == summary["outputs"]}
                                                  if greedy else {})})
    return summary


def ready_engine(args: Args, m: Models, drafter, prompts: list[list[int]], kind: str, sampling: Sampling,
                 stops: Optional[StopStrings], max_seq: Optional[int] = None) -> Engine:
    """The engine for `drafter` (None: autoregressive) and these prompts, compiled when asked, with its SPS
    table read (and checked against the engine) or profiled under the hardware and async schedulers.
    `max_seq`: at least this many cache rows (an engine of the same size shares the target's caches)."""
    requests = requests_for(prompts, args.num_samples)
    engine = build_engine(m, drafter, requests, args.max_new_tokens, sampling=sampling, seed=args.seed,
                          batch_size=args.batch_size, scheduler=kind, threshold=args.confidence_threshold,
                          compile=auto_compile(args.compile, args.device), kernels=args.kernels, stops=stops,
                          ignore_eos=args.ignore_eos,
                          buckets=parse_buckets(args.verify_buckets, min(args.batch_size, len(requests)), drafter)
                          if kind != "none" else None, max_seq=max_seq, compile_mode=args.compile_mode,
                          compile_verbose=args.verbose)
    if engine.compiled:
        engine.warmup()
        print(f"compiled the round in {engine.compile_seconds:.1f} s (compile cache: {args.compile_cache})",
              file=sys.stderr)
    if kind in sched.SPS_KINDS:
        engine.scheduler.set_sps(sched.load_or_profile(engine, args.sps_table))
    return engine


def decode(args: Args, m: Models, drafter, prompts: list[list[int]], trace_file: Optional[str],
           output_file: Optional[str], kind: str, sampling: Sampling, stops: Optional[StopStrings],
           heading: Optional[str] = None, announce: Optional[str] = None, log: Optional[runlog.Log] = None,
           engine: Optional[Engine] = None, show: Optional[int] = None) -> dict:
    """Decode every prompt with `drafter` (None: autoregressive) on `engine` (default: `ready_engine`'s),
    print the texts (with `show`, the first `show` requests') and one figures line. Interrupted (Ctrl-C,
    SIGTERM), it still prints the finished requests and ends the trace with a summary marked "interrupted"; on an error the trace and output
    files are left as they were. With `log` (--wandb) the figures go to the run as it decodes and at the
    end (runlog.py)."""
    requests = requests_for(prompts, args.num_samples)
    if engine is None:
        engine = ready_engine(args, m, drafter, prompts, kind, sampling, stops)
    if announce:  # every input checked, the caches allocated: say how it runs
        print(announce, file=sys.stderr)
    if drafter is not None or m.hub_snapshots:
        print(m.describe() + (" (random weights)" if args.random_init else ""), file=sys.stderr)

    trace = out = None  # made inside the try below: a signal at any moment leaves no temporary file
    printer = Printer(m.tokenizer, stops, len(requests), args.num_samples, show=show)
    name = "speculative" if drafter is not None else "autoregressive"
    watch = DecodeWatch(log, name, engine.K, engine.stop_ids, len(requests), args.log_every,
                        lambda: engine.prefill_seconds + engine.decode_seconds,
                        bar=args.progress and len(requests) > 1 and sys.stderr.isatty())
    if heading:
        print(f"--- {heading} ---")

    def on_round(req: Request, rec: dict):
        if trace:
            trace.write(json.dumps(rec, allow_nan=False) + "\n")
        printer.on_round(req)
        watch.on_round(req, rec)

    def on_finish(req: Request):
        if trace:
            trace.write(json.dumps({
                "request": req.index, "output_ids": req.output_ids, "num_rounds": len(req.rounds),
                "acceptance_length": metrics.acceptance_length(metrics.count([req], 0, engine.stop_ids)),
                "finish_reason": req.finish_reason}, allow_nan=False) + "\n")
            trace.sync()  # a finished request is on disk
        if out:
            out.write(completion(req, m.tokenizer, stops, engine.stop_ids))
        watch.on_finish(req)

    interrupted = None
    try:
        trace = StreamFile(trace_file) if trace_file else None
        out = OutputFile(output_file) if output_file else None
        engine.generate(requests, args.max_new_tokens, on_round, on_finish, watch.on_step)
    except Interrupted as e:
        interrupted = e
    except BaseException:
        for f in (trace, out):
            if f:
                f.abort()
        raise
    finally:
        watch.close()
    with signals_deferred():  # what is done, printed and published whole; a signal now acts after it
        done = [r for r in requests if r.finish_reason is not None]
        completions = [completion(r, m.tokenizer, stops, engine.stop_ids) for r in done]  # in request order
        printer.finish(completions)

        c = metrics.count(done, engine.K, engine.stop_ids)
        seconds = engine.prefill_seconds + engine.decode_seconds
        summary = {
            "summary": True,
            "tokens_per_second": c["tokens"] / seconds if seconds > 0 else 0.0,
            "acceptance_length": metrics.acceptance_length(c),
            "accept_rate_by_position": metrics.accept_rate_by_position(c),
            "verified_per_round": metrics.verified_per_round(c),
            "scheduler": kind,
            "prefill_seconds": engine.prefill_seconds,
            "decode_seconds": engine.decode_seconds,
            "compile_seconds": engine.compile_seconds,
        }
        if interrupted is not None:
            summary.update(interrupted=True, finished_requests=len(done), requests=len(requests))
        if trace:
            trace.write(json.dumps(summary) + "\n")
            trace.close()
        if out:
            out.close()
    if log is not None:  # also when interrupted: what was finished, and the files as they were published
        runlog.log_decode(log, name, dict(summary, tokens=c["tokens"]), completions, prompts, m.tokenizer,
                          {"trace": trace_file, "outputs": output_file})
    if interrupted is not None:
        raise interrupted
    tau, rates = summary["acceptance_length"], " ".join("-" if x is None else f"{x:.2f}"
                                                        for x in summary["accept_rate_by_position"])
    print(f"{'speculative' if drafter else 'autoregressive'}: {c['tokens']} tokens in {seconds:.2f} s, "
          f"{summary['tokens_per_second']:.1f} tokens/s, τ={'-' if tau is None else f'{tau:.2f}'}"
          + (f", accept by position [{rates}], verified {summary['verified_per_round']:.2f}/round ({kind})"
             if drafter and c["num_rounds"] else "")
          + f" (prefill {engine.prefill_seconds:.2f} s, decode {engine.decode_seconds:.2f} s)")
    return dict(summary, outputs=[r.output_ids for r in requests])


def main(argv: Optional[list[str]] = None) -> int:
    return cli_main(Args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
