"""Speculative decoding with a DSpark / DFlash drafter — or, without one, plain autoregressive decoding
by the same engine (the baseline).

    python speculate.py --target DIR --drafter DIR --prompt "..." --max-new-tokens 128

Read top to bottom: `generate` (the Python API) -> `Engine.generate` (continuous batching) ->
`Engine.round` -> `draft` (block forward, Markov chain, confidence, schedule) and `verify` (one
target pass, acceptance, commit). The command line (cli.py) calls the API."""

from __future__ import annotations

import functools
import numbers
import os
import sys
import time
from dataclasses import dataclass, field, fields
from types import FunctionType
from typing import Literal, NamedTuple, Optional

import torch

import kernels
import scheduler as sched
from kernels import NO_FILTERS, Filters
from model import Ragged, Transformer
from support import metrics
from support.checkpoint import Models, load_models
from support.cli import MAX_TEMPERATURE, MAX_TOP_K, MIN_TEMPERATURE, UserError, check_ranges, free_memory, sync
from support.text import StopStrings, auto_chat, check_prompts, encode

# One round, in static shapes (what torch.compile captures)

class Proposal(NamedTuple):
    drafts: torch.Tensor                # [B, K] x_1 .. x_K
    q: Optional[torch.Tensor]           # [B, K, V] the distributions they were drawn from (None at T=0)
    confidence: Optional[torch.Tensor]  # [B, K] c_1 .. c_K (None without a confidence head)
    verify_len: torch.Tensor            # [B] ℓ: how many drafts go to the target, 0 .. K


def draft(target, drafter, anchor, anchor_pos, active, *, noise, temperature, filters, schedule, ops,
          capacity=None) -> Proposal:
    """Steps 1-2: the block at anchor [B] (the last committed token, at anchor_pos [B]), the Markov chain,
    the confidences, the schedule. noise: the chain's Exp(1) [B, K, V]; capacity: async's C."""
    B = anchor.shape[0]
    if drafter is None:
        return Proposal(anchor.new_zeros((B, 0)), None, None, anchor.new_zeros((B,)))
    hidden, base_logits = drafter(anchor, anchor_pos)                      # [B, K, H], [B, K, V]
    drafts, q = ops.markov_chain(base_logits, hidden, anchor, drafter.markov_head, temperature, None, noise,
                                 filters=filters)
    confidence = drafter.confidence(hidden, torch.cat([anchor[:, None], drafts[:, :-1]], dim=1))
    return Proposal(drafts, q, confidence, schedule(confidence, active, capacity))


def verify(target, drafter, anchor, anchor_pos, active, proposal: Proposal, *, temperature, filters, u,
           bonus_noise, ops, num_tokens: Optional[int] = None):
    """Steps 3-5: one target pass over [x_0 .. x_ℓ] with capture, acceptance, commit. num_tokens None:
    each row sends its K+1 slots; N: the rows' 1 + ℓ tokens flattened, padded to N (`model.Ragged`).
    Returns the record and the next anchor at anchor_pos + accepted + 1: that move is the KV rollback."""
    drafts, q, confidence, verify_len = proposal
    K = drafts.shape[1]
    capture = drafter.cfg.target_layer_ids if drafter is not None else ()
    tokens = torch.cat([anchor[:, None], drafts], dim=1)                   # [B, K+1]
    positions = anchor_pos[:, None] + torch.arange(K + 1, device=anchor.device)
    if num_tokens is None:
        logits, features = target(tokens, positions, capture=capture, attention=ops.attention)
    else:
        ragged = Ragged.build(torch.where(active, verify_len + 1, 0), positions, num_tokens)
        logits, features = target(ragged.flatten(tokens), positions, capture=capture, ragged=ragged,
                                  attention=ops.attention)
        logits = ragged.pad(logits)                                        # [B, K+1, V]
        features = ragged.pad(features) if features is not None else None
    if temperature == 0:
        accepted, next_token = ops.verify_greedy(drafts, logits, verify_len)
    else:
        accepted, next_token = ops.verify_sampled(drafts, q, logits, verify_len, temperature, None, u, bonus_noise,
                                                  filters=filters)
    if drafter is not None:  # context rows a .. a+K; those past a+n are masked next round, then overwritten
        drafter.commit_context(features, positions)
    finite = torch.isfinite(logits.gather(1, accepted[:, None, None].expand(-1, 1, logits.shape[-1]))
                            .gather(2, next_token[:, None, None])).flatten()  # the committed token's logit
    record = torch.cat([drafts, verify_len[:, None], accepted[:, None], next_token[:, None], finite[:, None],
                        confidence if confidence is not None else torch.zeros(drafts.shape, device=drafts.device)],
                       1).double()  # the round's one device->host transfer
    return record, torch.where(active, next_token, anchor), torch.where(active, anchor_pos + accepted + 1, anchor_pos)


class RoundRecord(NamedTuple):
    drafts: list[int]
    verified: int
    accepted: int
    bonus: int                  # the token committed after the accepted drafts
    finite: bool                # the committed token's logit was finite
    confidence: Optional[list[float]]


def unpack(record: torch.Tensor, has_confidence: bool) -> list[RoundRecord]:
    K = (record.shape[1] - 4) // 2
    return [RoundRecord([int(x) for x in r[:K]], int(r[K]), int(r[K + 1]), int(r[K + 2]), bool(r[K + 3]),
                        r[K + 4:] if has_confidence else None) for r in record.tolist()]


def prefill(target, drafter, prompts: list[list[int]], temperature, noise, device, rows=None, filters=NO_FILTERS):
    """Prompts (right-padded) into cache rows 0..len-1 or `rows`, with the drafter's context -> each
    one's first token (-1: logits not finite) and position."""
    lens = torch.tensor([len(p) for p in prompts], device=device)
    P = int(lens.max())
    tokens = torch.tensor([p + [p[-1]] * (P - len(p)) for p in prompts], device=device)
    positions = torch.arange(P, device=device).expand(len(prompts), P)
    capture = drafter.cfg.target_layer_ids if drafter is not None else ()
    logits, features = target(tokens, positions, capture=capture, logits_index=lens - 1, rows=rows)
    if drafter is not None:
        drafter.commit_context(features, positions, rows)
    first = kernels.sample(logits, temperature, None, noise, filters=filters)
    return torch.where(torch.isfinite(logits).all(-1), first, -1), lens


# Compiling: one graph per half, static shapes; on CPU frozen weights and a C++ wrapper, on CUDA
# reduce-overhead (CUDA graphs).

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CompileMode = Literal[COMPILE_MODES]


def compiled(fn, device, mode: Optional[str] = None, verbose: bool = False):
    import torch._inductor.select_algorithm as select

    cpu_recipe = not str(device).startswith("cuda") and mode is None
    options = {"max_autotune": True} if cpu_recipe else torch._inductor.list_mode_options(mode or "reduce-overhead")
    if hasattr(torch._inductor.config, "max_autotune_report_choices_stats"):
        options["max_autotune_report_choices_stats"] = False  # no JSON blob per autotuned op
    select.PRINT_AUTOTUNE = verbose  # the autotuning tables, on stderr
    graph = torch.compile(fn, fullgraph=True, dynamic=False, options=options)
    if not cpu_recipe:
        return graph

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with torch.no_grad(), torch._inductor.config.patch(freezing=True, cpp_wrapper=True):
            return graph(*args, **kwargs)
    return call


def own_code(fn):
    """`fn` with a code object of its own: graphs are kept per code object, so the cut-down guards
    (`Engine.generate`) never mistake another engine's graph for this one's."""
    copy = FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


# The engine

class NonFinite(UserError):
    def __init__(self, request: int, where: str):
        super().__init__(f"request {request}, {where}: the logits are not finite (NaN or Inf): check the checkpoints' "
                         f"weights and config (rope_theta, rms_norm_eps) and --temperature")


@dataclass
class Request:
    index: int
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    rounds: list[dict] = field(default_factory=list)  # trace records
    finish_reason: Optional[str] = None
    started: Optional[float] = None   # perf_counter at admission ...
    finished: Optional[float] = None  # ... and at the last token
    prompt: int = 0
    sample: int = 0


def cache_length(longest_prompt: int, max_new_tokens: int, drafter) -> int:
    """Cache rows: prompt + budget + a round's window past a finished row's last anchor."""
    width = max(drafter.cfg.num_slots, drafter.cfg.num_drafts + 1) if drafter is not None else 1
    return longest_prompt + max_new_tokens + 2 * width


def caches(model) -> list:
    return [model.rope] + [layer.self_attn.kv_cache for layer in model.layers]


class Engine:
    """Requests through prefill and rounds in `batch_size` rows (continuous batching). A round is `draft`
    then `verify`, one graph each when compiled; scheduled, the host reads the verify size between them
    (a bucket when compiled), except "async", planned before. Its arguments were checked above it."""

    def __init__(self, target: Transformer, drafter=None, *, batch_size: int, max_seq: int, temperature: float = 0.0,
                 filters: Filters = NO_FILTERS, seed: int = 0, stop_ids=(), stop_strings=None, scheduler: str = "none",
                 threshold: float = 0.0, buckets=None, ragged: Optional[bool] = None, compile: bool = False,
                 compile_mode: Optional[str] = None, compile_verbose: bool = False, kernels: str = "torch"):
        self.target, self.drafter, self.stop_ids, self.stop_strings = target, drafter, set(stop_ids), stop_strings
        self.max_batch, self.max_seq, self.temperature, self.compiled = batch_size, max_seq, temperature, compile
        self.device = target.embed_tokens.weight.device
        self.filters = filters if temperature > 0 else NO_FILTERS  # greedy: argmax survives every filter
        self.seed = seed  # request i samples from its own generator, seeded seed + i
        for m in (target, drafter):
            if m is not None:
                m.setup_caches(batch_size, max_seq)
        self.caches = [caches(m) if m is not None else None for m in (target, drafter)]
        self.K = drafter.cfg.num_drafts if drafter is not None else 0
        self.scheduler = sched.Scheduler(scheduler, self.K, batch_size, threshold=threshold, buckets=buckets,
                                         compiled=compile, device=self.device)
        self.ragged = scheduler != "none" if ragged is None else ragged
        wrap = (lambda f: compiled(own_code(f), self.device, compile_mode, compile_verbose)) if compile else (lambda f: f)
        self.draft_fn, self.verify_fn = wrap(draft), wrap(verify)
        self.bound = dict(temperature=temperature, filters=self.filters, ops=kernels_for(kernels, self.device))
        self.cuda_graphs = compile and self.device.type == "cuda"
        if compile and self.ragged:  # one verify graph per bucket, all expected
            torch._dynamo.config.recompile_limit += len(self.scheduler.profile_points) + 1
        self.prefill_seconds = self.decode_seconds = self.compile_seconds = 0.0
        self.warmed, self.skip_guards = False, True  # skip_guards False: evaluate every guard (bench.py)

    def round(self, anchor, anchor_pos, active, noise: Optional[kernels.Noise], verify_len=None, plan=None):
        """One round for every row. verify_len [B] (profiling): exactly these drafts; plan: async's."""
        rows = (self.target, self.drafter, anchor, anchor_pos, active)
        if self.cuda_graphs:  # one CUDA-graph generation per round: verify reads draft's outputs
            torch.compiler.cudagraph_mark_step_begin()
        proposal = self.draft_fn(*rows, noise=noise.chain if noise else None, schedule=self.scheduler,
                                 capacity=plan.tensor if plan else None, **self.bound)
        if verify_len is not None:
            proposal = proposal._replace(verify_len=verify_len)
        num_tokens = plan.num_tokens if plan else None
        if self.ragged and plan is None:  # the host read between the halves
            n = int(torch.where(active, proposal.verify_len + 1, 0).sum())
            num_tokens = n if verify_len is not None else self.scheduler.bucket(n)
        return self.verify_fn(*rows, proposal, u=noise.u if noise else None, bonus_noise=noise.bonus if noise else None,
                              num_tokens=num_tokens, **self.bound)

    def own_caches(self):
        """Put this engine's caches back (another engine may have replaced them; graphs hold these)."""
        for m, mine in zip((self.target, self.drafter), self.caches):
            if m is not None and any(a is not b for a, b in zip(caches(m), mine)):
                m.register_buffer("rope", mine[0], persistent=False)
                for layer, kv in zip(m.layers, mine[1:]):
                    layer.self_attn.kv_cache = kv
                if isinstance(m, Transformer):
                    m.max_batch, m.max_seq = mine[1].k.shape[:2]

    def generate(self, requests: list[Request], max_new_tokens: int, on_round=None, on_finish=None, on_step=None):
        """Decode `requests`, a finished one's row taking the next at once. Every round runs every row
        (free rows inactive): static shapes. Warmed up, guards are cut to what tells the graphs apart.
        on_round(request, record), on_finish(request), on_step() after each batch round."""
        self.own_caches()
        skip = self.compiled and self.warmed and self.skip_guards
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=skip):
            B, K, V, dev = self.max_batch, self.K, self.target.args.vocab_size, self.device
            has_confidence = self.drafter is not None and self.drafter.confidence_head is not None
            waiting, rows, gens = list(reversed(requests)), [None] * B, [None] * B
            anchor = torch.zeros(B, dtype=torch.long, device=dev)
            anchor_pos = torch.zeros(B, dtype=torch.long, device=dev)
            self.scheduler.reset()

            def finish(req):
                req.finished = time.perf_counter()
                if on_finish is not None:
                    on_finish(req)

            def admit():  # prefill waiting requests into free rows (again, if one ends at its first token)
                nonlocal anchor, anchor_pos
                while waiting and None in rows:
                    free = [i for i, r in enumerate(rows) if r is None][:len(waiting)]
                    new, t0 = [waiting.pop() for _ in free], time.perf_counter()
                    noise = None
                    if self.temperature > 0:  # a request's samples depend only on the seed and its index
                        for i, req in zip(free, new):
                            gens[i] = torch.Generator(device=dev).manual_seed(self.seed + req.index)
                        noise = torch.stack([torch.empty(V, device=dev).exponential_(1, generator=gens[i])
                                             for i in free])
                    index = torch.tensor(free, device=dev)
                    first, lens = prefill(self.target, self.drafter, [r.prompt_ids for r in new], self.temperature,
                                          noise, dev, rows=None if free == list(range(len(free))) else index,
                                          filters=self.filters)
                    anchor, anchor_pos = anchor.index_copy(0, index, first), anchor_pos.index_copy(0, index, lens)
                    for i, req, t in zip(free, new, first.tolist()):
                        req.started = t0
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
                if self.cuda_graphs:  # outlive the next graph replay
                    anchor, anchor_pos = anchor.clone(), anchor_pos.clone()
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
        """Append up to the budget and the first stop token; a stop string cuts after its last token."""
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

    def dummy_round(self, num_tokens: Optional[int] = None):
        """A round at position 0 filling `num_tokens` verify tokens (None: the engine's schedule), for
        compiling and profiling: throwaway noise, cache rows rewritten before they are read."""
        self.own_caches()
        B, dev, W = self.max_batch, self.device, self.K + 1
        zeros = lambda dtype=torch.long: torch.zeros(B, dtype=dtype, device=dev)  # noqa: E731 (distinct tensors)
        noise = (kernels.round_noise(torch.Generator(device=dev).manual_seed(0), B, self.K,
                                     self.target.args.vocab_size, dev) if self.temperature > 0 else None)
        if num_tokens is None:
            return self.round(zeros(), zeros(), zeros(torch.bool), noise)[0].tolist()
        counts = (num_tokens - W * torch.arange(B, device=dev)).clamp(0, W)  # fill rows in order
        plan = self.scheduler.fixed(num_tokens) if self.scheduler.kind == "async" else None
        return self.round(zeros(), zeros(), counts > 0, noise, verify_len=(counts - 1).clamp(min=0), plan=plan)[0].tolist()

    def warmup(self):
        """Compile every graph a round can call before anything is timed."""
        t0, s = time.perf_counter(), self.scheduler
        for n in [None] if not self.ragged else (s.buckets or [s.profile_points[-1]]):
            self.dummy_round(n)
        self.compile_seconds += time.perf_counter() - t0
        self.warmed = True

    def profile_sps(self, reps: int = 7) -> dict:
        """SPS(B): this engine's rounds per second at every profile point."""
        best = sched.profile(self.dummy_round, self.scheduler.profile_points, lambda: sync(self.device), reps)
        return dict(self.sps_identity(), seconds_per_step=best, steps_per_second=[1 / s for s in best])

    def sps_identity(self) -> dict:
        """What an SPS table was measured for; a table is reused only where all of it matches."""
        from support.cli import device_name
        a, d = self.target.args, self.drafter
        n = sum(p.numel() for p in {p.data_ptr(): p for p in self.target.parameters()}.values())
        return {"device": device_name(self.device), "torch": torch.__version__,
                "target": f"Qwen3 {n} parameters, {a.num_hidden_layers} layers, hidden {a.hidden_size}, "
                          f"vocab {a.vocab_size}",
                "drafter": d.cfg.describe() if d is not None else None,
                "dtype": str(self.target.embed_tokens.weight.dtype).replace("torch.", ""),
                "batch_capacity": self.max_batch, "verify_width": self.K + 1, "sampling": self.temperature > 0,
                "compiled": self.compiled, "buckets": self.scheduler.buckets,
                "profile_points": self.scheduler.profile_points}


def kernels_for(name: str, device) -> kernels.KernelSet:
    try:
        return kernels.kernel_set(name, device)
    except RuntimeError as e:  # Triton cannot run there
        raise UserError(f"--kernels {name}: {e}") from None


# The Python API: load once, generate many times. Its arguments are the flags, checked once here.

MAX_REQUESTS = 10_000_000
DEMO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo")  # the committed demo pair


@dataclass
class Settings:
    """How to decode (the flags of the same names)."""
    max_new_tokens: int = 128
    temperature: Optional[float] = None  # None: the target's generation_config.json, else greedy
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    min_p: Optional[float] = None
    stop: tuple = ()
    ignore_eos: bool = False
    seed: int = 0
    num_samples: int = 1
    batch_size: Optional[int] = None  # None: min(requests, 16)
    scheduler: Optional[str] = None  # None: threshold when confidence_threshold > 0, else none
    confidence_threshold: float = 0.0
    verify_buckets: Optional[list] = None
    sps_table: Optional[str] = None
    compile: bool = False
    compile_mode: Optional[str] = None
    compile_verbose: bool = False
    kernels: str = "torch"

    RANGES = {"max_new_tokens": (int, "[1, 10485760]"), "seed": (int, f"[0, {2**62}]"),
              "num_samples": (int, f"[1, {MAX_REQUESTS}]"), "batch_size": (int, "[1, 65536]"),
              "top_k": (int, f"[0, {MAX_TOP_K}]"), "temperature": (float, f"[0, {MAX_TEMPERATURE:g}]"),
              "top_p": (float, "(0, 1]"), "min_p": (float, "[0, 1]"), "confidence_threshold": (float, "[0, 1]")}
    CHOICES = {"scheduler": sched.KINDS, "compile_mode": COMPILE_MODES, "kernels": ("torch", "triton")}

    def check(self) -> "Settings":
        """Types, ranges, spellings, then combinations (numpy numbers taken as Python's)."""
        for name, (kind, interval) in self.RANGES.items():
            v = getattr(self, name)
            want = numbers.Integral if kind is int else numbers.Real
            if v is None and name in ("max_new_tokens", "seed", "num_samples", "confidence_threshold"):
                raise UserError(f"--{name.replace('_', '-')}: invalid value None")
            if v is not None and (isinstance(v, bool) or not isinstance(v, want)):
                raise UserError(f"--{name.replace('_', '-')}: invalid value {v!r} "
                                f"(expected {'an integer' if kind is int else 'a number'})")
            setattr(self, name, None if v is None else kind(v))
        check_ranges(self, **{name: interval for name, (_, interval) in self.RANGES.items()})
        for name, choices in self.CHOICES.items():
            if getattr(self, name) is not None and getattr(self, name) not in choices:
                raise UserError(f"--{name.replace('_', '-')} {getattr(self, name)!r}: one of {', '.join(choices)}")
        if self.temperature is not None and 0 < self.temperature < MIN_TEMPERATURE:
            raise UserError(f"--temperature: invalid value {self.temperature!r} (valid: 0 for greedy, or "
                            f"{MIN_TEMPERATURE:g} to {MAX_TEMPERATURE:g})")
        self.stop = (self.stop,) if isinstance(self.stop, str) else () if self.stop is None else self.stop
        if not isinstance(self.stop, (list, tuple)):
            raise UserError(f"--stop {self.stop!r}: a stop string or a list of them")
        self.stop = tuple(self.stop)
        StopStrings.check(self.stop)
        self.scheduler = sched.resolve(self.scheduler, self.confidence_threshold, self.sps_table, self.verify_buckets)
        for flag, given in ((f"--compile-mode {self.compile_mode}", self.compile_mode is not None),
                            ("--verbose", self.compile_verbose)):
            if given and not self.compile:
                raise UserError(f"{flag}: only used with --compile (the run is eager)")
        return self


@dataclass
class Sampling:
    """How tokens are drawn, and where that came from (printed at start)."""
    temperature: float
    filters: Filters
    source: str

    def describe(self) -> str:
        if self.temperature == 0:
            return f"sampling: greedy ({self.source})"
        f = self.filters
        parts = [f"temperature {self.temperature:g}"] + ([f"top-k {f.top_k}"] if f.top_k else []) + (
            [f"top-p {f.top_p:g}"] if f.top_p < 1 else []) + ([f"min-p {f.min_p:g}"] if f.min_p > 0 else [])
        return f"sampling: {', '.join(parts)} ({self.source})"


def sampling_for(m: Models, s: Settings) -> Sampling:
    """The arguments if any is given (a filter alone: T = 1), else generation_config.json, else greedy."""
    given = {k: getattr(s, k) for k in ("temperature", "top_k", "top_p", "min_p") if getattr(s, k) is not None}
    if given:
        source = "from " + ", ".join(f"--{k.replace('_', '-')}" for k in given)
    elif m.generation is not None:
        given, source = m.generation, f"from {m.generation_source}"
    else:
        source = ("no sampling flag, and no generation_config.json" if m.generation_source is None else
                  f"no sampling flag, and {m.generation_source} has do_sample false")
        given = {"temperature": 0.0}
    T = float(given.get("temperature", 1.0))
    f = Filters(int(given.get("top_k") or 0), float(given.get("top_p", 1.0)), float(given.get("min_p", 0.0)))
    return Sampling(T, f if T > 0 else Filters(), source)


def requests_for(prompts: list[list[int]], num_samples: int) -> list[Request]:
    """Request i = prompt i // num_samples, sample i % num_samples."""
    return [Request(i, prompts[i // num_samples], prompt=i // num_samples, sample=i % num_samples)
            for i in range(len(prompts) * num_samples)]


def make_engine(m: Models, drafter, prompts: list[list[int]], s: Settings, *, max_seq: Optional[int] = None,
                verbose: bool = True) -> Engine:
    """The engine for `drafter` (None: autoregressive) sized for the prompts (at least `max_seq` rows),
    compiled and warmed up when asked, its SPS table read or profiled."""
    kind = s.scheduler if drafter is not None else "none"
    if kind != "none" and (drafter is None or drafter.confidence_head is None):
        flag = "--confidence-threshold" if s.confidence_threshold > 0 else f"--scheduler {kind}:"
        raise UserError(f"{flag} needs a --drafter with a confidence head")
    batch = min(s.batch_size or 16, len(prompts) * s.num_samples)
    need = cache_length(max(map(len, prompts)), s.max_new_tokens, drafter)
    max_seq = max(need, max_seq or 0)
    sampling, dev = sampling_for(m, s), m.target.embed_tokens.weight.device
    kv = sum(2 * a.num_hidden_layers * batch * max_seq * a.num_key_value_heads * a.head_dim
             for a in [m.target.args] + ([drafter.cfg.layers] if drafter else [])) * m.dtype.itemsize
    if free_memory(dev) and kv > 0.9 * free_memory(dev):
        raise UserError(f"the KV caches for --batch-size {batch} x {max_seq} positions need {kv / 2**30:.1f} GiB; "
                        f"{free_memory(dev) / 2**30:.1f} GiB are free on {dev}: lower --batch-size or --max-new-tokens")
    buckets = sched.parse_buckets(s.verify_buckets, batch, drafter) if kind != "none" else None
    engine = Engine(m.target, drafter, batch_size=batch, max_seq=max_seq, temperature=sampling.temperature,
                    filters=sampling.filters, seed=s.seed, stop_ids=() if s.ignore_eos else m.stop_ids,
                    stop_strings=StopStrings.build(m.tokenizer, s.stop), scheduler=kind,
                    threshold=s.confidence_threshold, buckets=buckets, compile=s.compile, compile_mode=s.compile_mode,
                    compile_verbose=s.compile_verbose, kernels=s.kernels)
    if s.compile:
        engine.warmup()
        if verbose:
            print(f"compiled the round in {engine.compile_seconds:.1f} s", file=sys.stderr)
    if kind in sched.SPS_KINDS:
        engine.scheduler.set_sps(sched.load_or_profile(engine, s.sps_table, verbose=verbose))
    return engine


def load(target: Optional[str] = None, drafter: Optional[str] = None, *, device: str = "cpu",
         dtype: Optional[str] = None, calibration: Optional[str] = None) -> Models:
    """The models for `generate`: checkpoint directories or hub ids; with neither, the demo pair."""
    if target is None and drafter is None:
        target, drafter = os.path.join(DEMO_DIR, "target"), os.path.join(DEMO_DIR, "drafter")
    return load_models(target, drafter, device=device, dtype=dtype, calibration=calibration)


@dataclass
class Completion:
    """One request's result, as the API returns it and the output file records it."""
    request: int                 # prompts in order, each num_samples times
    prompt: int
    sample: int
    text: Optional[str]          # special tokens skipped, cut before a stop string
    output_ids: list[int]        # up to the stop token, or the one completing the stop string
    finish_reason: str           # "stop" or "length"
    num_rounds: int
    acceptance_length: Optional[float]  # τ
    prompt_ids: list[int]
    rounds: list[dict] = field(default_factory=list, repr=False)  # trace records (not in the output file)

    def record(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "rounds"}


def completion(req: Request, m: Models, engine: Engine) -> Completion:
    text = None
    if m.tokenizer is not None:
        text = m.tokenizer.decode(req.output_ids, skip_special_tokens=True)
        text = engine.stop_strings.cut(text) if engine.stop_strings else text
    tau = metrics.acceptance_length(metrics.count([req], 0, engine.stop_ids))
    return Completion(req.index, req.prompt, req.sample, text, list(req.output_ids), req.finish_reason,
                      len(req.rounds), tau, list(req.prompt_ids), list(req.rounds))


def generate(m: Models, prompts, *, chat: Optional[bool] = None, system_prompt: Optional[str] = None,
             thinking: bool = False, **settings) -> list[Completion]:
    """One Completion per prompt and sample, in order. `prompts`: one or a list of texts, token-id
    lists or conversations ([{"role", "content"}, ...]). Other arguments: `Settings` (the flags)."""
    unknown = set(settings) - {f.name for f in fields(Settings)} - {"compile_verbose"}
    if unknown:
        raise TypeError(f"generate() got unexpected keyword argument {sorted(unknown)[0]!r}")
    s = Settings(**settings).check()
    if not isinstance(prompts, (str, list, tuple)):
        raise UserError(f"prompts: expected a text, a list of token ids, a conversation (a list of messages) or a "
                        f"list of these, got {type(prompts).__name__}")
    one = isinstance(prompts, str) or (prompts and all(isinstance(x, (int, dict)) for x in prompts))
    chat = auto_chat(chat, m.tokenizer)
    ids = [encode(m.tokenizer, p, f"prompt {i}", chat=chat, system_prompt=system_prompt, thinking=thinking)
           for i, p in enumerate([prompts] if one else prompts)]
    if not ids:
        raise UserError("generate: no prompts")
    check_prompts(ids, m.target, s.max_new_tokens, drafter=m.drafter)
    engine = make_engine(m, m.drafter, ids, s, verbose=False)
    requests = requests_for(ids, s.num_samples)
    engine.generate(requests, s.max_new_tokens)
    return [completion(r, m, engine) for r in requests]


def main(argv: Optional[list[str]] = None) -> int:
    import cli
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
