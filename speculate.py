"""Speculative decoding with a DSpark / DFlash drafter — or, without `--drafter`, plain
autoregressive decoding by the same engine (the baseline).

One round (DSPARK.md §5), all in `speculative_round` below:
  draft (drafter block forward -> Markov chain -> confidence) -> schedule (how many drafts to
  verify: all, up to a confidence threshold, or Algorithm 1 over the batch) -> verify (target
  forward on [anchor, drafts] with capture) -> accept (rejection sampling) -> commit (the
  drafter's context gains the verified rows; rollback is the anchor position).

Without a drafter a round is the same with zero drafts: the target runs on the anchor and
the "bonus" is the next token, so baseline and speculative numbers come from one code path.
With a scheduler (`--scheduler threshold|hardware`) the engine runs the round's two halves,
`draft` and `verify`, apart: between them the host reads how many tokens were scheduled, and
the target verifies exactly those, flattened into one ragged batch (`model.Ragged`).

    python speculate.py --target DIR [--drafter DIR] --prompt "..." --max-new-tokens 128
    python speculate.py ... --batch-size 16 --scheduler hardware --sps-table sps.json
"""

from __future__ import annotations

import functools
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from typing import Literal, Optional

import torch

import kernels
from common import UserError, check_writable, read_json, read_jsonl
from model import Ragged, Tokenizer, Transformer, load_target, random_target, stop_token_ids


@dataclass
class Args:
    """Speculative decoding with DSpark / DFlash drafters (baseline decoding without --drafter)."""

    target: Optional[str] = None
    """Hugging Face Qwen3 directory (config.json, safetensors, tokenizer.json)."""
    drafter: Optional[str] = None
    """Drafter directory (any DSpark / DFlash spelling); omitted: plain autoregressive decoding."""
    prompt: Optional[str] = None
    """One prompt as text (rendered with the chat template unless --no-chat)."""
    prompt_ids: Optional[str] = None
    """One prompt as comma-separated token ids, e.g. 1,2,3 (no tokenizer needed)."""
    prompts_file: Optional[str] = None
    """JSON lines, each {"prompt": str}, {"prompt_ids": [int]} or {"turns": [str]} (first turn used)."""
    chat: bool = True
    """Render text prompts with the target's chat template, thinking off (default: on when the
    tokenizer has a template; --chat without one uses Qwen3's non-thinking format)."""
    num_samples: int = 1
    """Run every prompt this many times (independent samples)."""
    batch_size: int = 1
    """Requests decoded together (rows); with more requests than rows, a finished request's row
    takes the next waiting one at once (continuous batching)."""
    max_new_tokens: int = 128
    """Token budget per request (exact)."""
    temperature: float = 0.0
    """0 = greedy; otherwise lossless rejection sampling at this temperature."""
    seed: int = 0
    """Seed of the sampling generator: a sampled run repeats exactly with the same seed."""
    confidence_threshold: float = 0.0
    """Verify drafts only up to the first confidence below this; 0 = the whole block."""
    scheduler: Optional[Literal["none", "threshold", "hardware"]] = None
    """How many drafts each round verifies. none: the whole block; threshold: up to the first
    confidence below --confidence-threshold; hardware: the paper's Algorithm 1 over the batch,
    maximising expected tokens x SPS(B) from a profiled table (default: threshold when
    --confidence-threshold > 0, else none)."""
    sps_table: Optional[str] = None
    """JSON table of SPS(B) (steps/s by verify tokens) for --scheduler hardware: read if the file
    exists (it must match this run's device, models, dtype, batch size and buckets), else
    profiled and written there. Without it the table is profiled at start and not kept."""
    verify_buckets: Optional[str] = None
    """Comma-separated token counts a scheduled round's ragged verification is padded to (one
    compiled graph each). Default: with --compile 1,2,3,4,6,8,12,... up to batch size x (drafts + 1);
    eager, the exact count (no padding)."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where to run."""
    dtype: Optional[Literal["float32", "bfloat16", "float16"]] = None
    """Weights and activations (default: bfloat16 on cuda, float32 on cpu)."""
    compile: bool = False
    """torch.compile the round (default: on for cuda, off for cpu)."""
    kernels: Literal["torch", "triton"] = "torch"
    """The Markov chain and the acceptance: plain torch (the references), or kernels.py's Triton
    kernels (cuda; on cpu only in Triton's interpreter, TRITON_INTERPRET=1, for testing)."""
    trace_file: Optional[str] = None
    """Write a JSON-lines record of every round, request and a summary here."""
    wandb: bool = False
    """Log the run to Weights & Biases (WANDB_MODE=offline works without network)."""
    calibration: Optional[str] = None
    """Confidence temperatures from `eval.py --calibration-out` (Sequential Temperature Scaling):
    c_k = σ(logit_k / T_k), applied before the threshold."""
    random_init: Optional[Literal["qwen3-4b", "qwen3-8b", "qwen3-14b"]] = None
    """Instead of --target/--drafter: a real-shaped target and a block-7, 5-layer DSpark drafter with
    random weights, to measure speed without downloads (prompts as ids; use bench.py for tables)."""


# ----------------------------------------------------------------------------------------
# One round

def speculative_round(target: Transformer, drafter, anchor: torch.Tensor, anchor_pos: torch.Tensor,
                      active: torch.Tensor, temperature: float, threshold: float, noise, sps=None,
                      triton: bool = False):
    """Draft, schedule, verify, accept and commit once for every row; static shapes throughout.

    anchor [B]: the last committed token, at positions anchor_pos [B]; the target's cache and
    the drafter's context hold rows < anchor_pos. active [B] (bool): rows still decoding; the
    others keep their anchor. noise: `kernels.round_noise(...)` when sampling, None at T=0.
    sps: the hardware scheduler's steps-per-second table (None: threshold or whole block).
    triton: the Markov chain and the acceptance through kernels.py's Triton versions (same
    signatures and results as the plain-torch references, which are the default).
    Returns (record, anchor', anchor_pos'): record [B, 2K+3] (float64, the one tensor the host
    reads) holds drafts [K], verified ℓ, accepted n, next token, confidence [K] (0 without a
    head). Moving the anchor to anchor_pos + n + 1 is the whole KV rollback.

    This is the whole round as one graph, verifying a fixed K+1 slots per row. The engine runs
    the same two halves separately (`draft`, then `verify` on a ragged batch of exactly the
    scheduled tokens) when a scheduler shortens verification.
    """
    chain_noise, u, bonus_noise = noise if noise is not None else (None, None, None)
    drafts, q, confidence, verify_len = draft(target, drafter, anchor, anchor_pos, active, temperature, threshold,
                                              chain_noise, sps, triton)
    return verify(target, drafter, anchor, anchor_pos, active, drafts, q, confidence, verify_len, temperature,
                  u, bonus_noise, None, triton)


def draft(target: Transformer, drafter, anchor, anchor_pos, active, temperature: float, threshold: float,
          chain_noise, sps=None, triton: bool = False):
    """Steps 1-2: the block forward, the sequential Markov chain, confidence, then the schedule.

    Returns drafts [B, K], their distributions q [B, K, V] (None at T=0), confidence [B, K]
    (None without a head) and verify_len [B] (ℓ: drafts to verify, 0 .. K).
    """
    B = anchor.shape[0]
    if drafter is None:
        return anchor.new_zeros((B, 0)), None, None, anchor.new_zeros((B,))
    hidden, base_logits = drafter(anchor, anchor_pos)
    chain = kernels.markov_chain_triton if triton else kernels.markov_chain
    drafts, q = chain(base_logits, hidden, anchor, drafter.markov_head, temperature, None, chain_noise)
    confidence = drafter.confidence(hidden, torch.cat([anchor[:, None], drafts[:, :-1]], dim=1))
    K = drafts.shape[1]
    if confidence is not None and sps is not None:
        verify_len = hardware_schedule(confidence, active, sps)
    elif confidence is not None and threshold > 0:
        # Verify the drafts before the first confidence below the threshold.
        verify_len = torch.cumprod((confidence >= threshold).long(), dim=1).sum(1)
    else:
        verify_len = torch.full((B,), K, dtype=torch.long, device=anchor.device)
    return drafts, q, confidence, verify_len


def hardware_schedule(confidence: torch.Tensor, active: torch.Tensor, sps: torch.Tensor) -> torch.Tensor:
    """DSPARK.md §4 / the paper's Algorithm 1, on the device, for the whole batch at once.

    confidence [B, K] (c_{r,j}, calibrated if the drafter was); active [B]; sps [B*(K+1) + 1]:
    measured steps/second of a round that verifies B tokens (`profile_sps`). Candidates (r, j)
    with prefix survival a_{r,j} = Π_{i<=j} c_{r,i} > 0 are sorted by a, descending (a stable
    sort, so j-1 comes before j in a tie); admitting the i-th gives B = R + i tokens and
    τ = R + the sum of the admitted a; admission stops at the first one whose τ·SPS(B) does not
    beat the best so far, which is always the one before it — so nothing past the stop, and no
    token's own realisation, decides whether it is verified (the lossless condition).
    Returns verify_len [B]: ℓ_r, the admitted candidates of each row (a prefix, as a is
    non-increasing in j).
    """
    B, K = confidence.shape
    a = torch.cumprod(confidence.double(), dim=1) * active[:, None]  # inactive rows offer nothing
    a_sorted, order = torch.sort(a.reshape(-1), descending=True, stable=True)
    R = active.long().sum()
    admitted = torch.arange(1, B * K + 1, device=a.device)           # i = 1 .. B*K
    theta = (R + torch.cumsum(a_sorted, 0)) * sps[R + admitted]      # Θ after admitting i
    before = torch.cat([R * sps[R[None]], theta[:-1]])               # Θ_best when i is tried
    take = torch.cumprod(((theta > before) & (a_sorted > 0)).long(), dim=0)
    return torch.zeros(B * K, dtype=torch.long, device=a.device).scatter(0, order, take).view(B, K).sum(1)


def verify(target: Transformer, drafter, anchor, anchor_pos, active, drafts, q, confidence, verify_len,
           temperature: float, u=None, bonus_noise=None, num_tokens: Optional[int] = None, triton: bool = False):
    """Steps 3-5: one target pass over [x_0, x_1 .. x_ℓ] with capture, acceptance, commit.

    num_tokens None: every row sends all K+1 slots (unscheduled drafts are masked out of
    acceptance; their cache rows are never read). num_tokens N: the rows' 1 + ℓ tokens (0 for
    inactive rows) go flattened into one ragged batch padded to N tokens (`model.Ragged`), so
    the target's matrix multiplies cost the scheduled tokens, not the block.
    Returns (record, anchor', anchor_pos') as `speculative_round`.
    """
    B, K = drafts.shape
    capture = drafter.cfg.target_layer_ids if drafter is not None else ()
    tokens = torch.cat([anchor[:, None], drafts], dim=1)                  # [B, K+1]
    positions = anchor_pos[:, None] + torch.arange(K + 1, device=anchor.device)
    if num_tokens is None:
        logits, features = target(tokens, positions, capture=capture)
    else:
        ragged = Ragged.build(torch.where(active, verify_len + 1, 0), positions, num_tokens)
        logits, features = target(ragged.flatten(tokens), positions, capture=capture, ragged=ragged)
        logits = ragged.pad(logits)                                        # [B, K+1, V], zeros unverified
        features = ragged.pad(features) if features is not None else None
    # 4. Accept.
    if temperature == 0:
        accepted, next_token = (kernels.verify_greedy_triton if triton else kernels.verify_greedy)(
            drafts, logits, verify_len)
    else:
        accepted, next_token = (kernels.verify_sampled_triton if triton else kernels.verify_sampled)(
            drafts, q, logits, verify_len, temperature, None, u, bonus_noise)
    # 5. Commit: the drafter's context gains rows a .. a+K; rows past a+n are masked out next
    #    round (context is < the new anchor position) and overwritten later.
    if drafter is not None:
        drafter.commit_context(features, positions)
    if confidence is None:
        confidence = torch.zeros((B, K), device=anchor.device)
    record = torch.cat([drafts, verify_len[:, None], accepted[:, None], next_token[:, None]], dim=1).double()
    record = torch.cat([record, confidence.double()], dim=1)
    return (record, torch.where(active, next_token, anchor),
            torch.where(active, anchor_pos + accepted + 1, anchor_pos))


def prefill(target: Transformer, drafter, prompts: list[list[int]], temperature: float,
            generator: Optional[torch.Generator], device, rows: Optional[torch.Tensor] = None):
    """Run the prompts (right-padded) through the target, capturing features for the drafter,
    into cache rows 0..len-1 or `rows` (the rows that continuous batching just freed).

    Returns the first token of every prompt (its first anchor) and its position (the prompt length).
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
    return kernels.sample(logits, temperature, generator), lens


# ----------------------------------------------------------------------------------------
# Requests

@dataclass
class Request:
    index: int
    prompt_ids: list[int]
    output_ids: list[int]
    rounds: list[dict]
    finish_reason: Optional[str] = None
    started: Optional[float] = None   # time.perf_counter() when the engine took it (before its prefill)
    finished: Optional[float] = None  # ... and when its last token was committed

    @property
    def acceptance_length(self) -> Optional[float]:
        """τ: tokens per round the drafter and the target produced, bonus included (None: no round)."""
        return sum(r["accepted"] + 1 for r in self.rounds) / len(self.rounds) if self.rounds else None


def compiled(fn, device, mode: Optional[str] = None):
    """`fn` under torch.compile with the project's recipe: one graph, static shapes, max-autotune
    (with CUDA graphs on GPU), or `mode` when given.

    On CPU the default also freezes the weights into the graph (Inductor's `freezing`): they become
    constants, packed once, and max-autotune can then pick Inductor's C++ GEMM micro-kernels, which
    beat MKL 1.4-3.5x at the few-row matmuls of a round on this project's CPU (BENCHMARKS.md). The
    weights must not change in place afterwards (a new model recompiles; an edited one would not be
    seen), and the packed copies cost a second copy of the weights' memory. The graph's wrapper is
    generated as C++ rather than Python (`cpp_wrapper`): a round calls a few hundred kernels, and
    the profiler put ~2.6 ms of a ~26 ms round in the Python graph call itself, outside them. Both settings
    are read when a graph compiles, which is the first call of each shape, so every call runs with
    them switched on (and without autograd, which freezing needs)."""
    if str(device).startswith("cuda") or mode is not None:
        return torch.compile(fn, fullgraph=True, dynamic=False, mode=mode or "max-autotune")
    # max-autotune's options without its CUDA graphs (which the C++ wrapper would warn it skips).
    graph = torch.compile(fn, fullgraph=True, dynamic=False, options={"max_autotune": True})

    @functools.wraps(fn)
    def frozen(*args):
        with torch.no_grad(), torch._inductor.config.patch(freezing=True, cpp_wrapper=True):
            return graph(*args)
    return frozen


def verify_buckets(max_tokens: int) -> list[int]:
    """The token counts a ragged verification is padded to: 1, 2, 3, 4, 6, 8, 12, 16, 24, ...
    (powers of two and 1.5x them, so at most a third is padding) and max_tokens itself."""
    out, b = [], 1
    while b < max_tokens:
        out += [b] + ([b * 3 // 2] if b >= 2 and b * 3 // 2 < max_tokens else [])
        b *= 2
    return out + [max_tokens]


def isotonic(y: list[float]) -> list[float]:
    """The non-decreasing sequence closest to y in squared error (pool adjacent violators)."""
    blocks = []  # [mean, count]
    for v in y:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, n2), (m1, n1) = blocks[-2], blocks.pop()
            blocks[-1] = [(m2 * n2 + m1 * n1) / (n2 + n1), n2 + n1]
    return [m for m, n in blocks for _ in range(n)]


def sps_curve(points: list[int], rates: list[float], buckets: Optional[list[int]], top: int):
    """SPS(B) for B = 0 .. top from steps/s measured at `points`; returns (sps, route).

    Bucketed (compiled): B tokens go to the fastest bucket that holds them (route[B]), so SPS(B) is
    the best measured rate over buckets >= B — a step function, as the hardware is. Eager (buckets
    None, route None): the step time is made non-decreasing in B by isotonic regression (more
    tokens never cost less — a dip or bump at one point is measurement noise, averaged into its
    neighbours rather than carried forward) and interpolated linearly between the points."""
    if buckets is not None:
        per = dict(zip(points, rates))
        route = [0] + [max((b for b in buckets if b >= n), key=lambda b: (per[b], -b)) for n in range(1, top + 1)]
        return [per[route[1]]] + [per[b] for b in route[1:]], route
    seconds = torch.tensor(isotonic([1 / r for r in rates]), dtype=torch.float64)
    x = torch.tensor(points, dtype=torch.float64)
    at = torch.arange(top + 1, dtype=torch.float64).clamp(min=points[0])
    hi = torch.searchsorted(x, at).clamp(1, len(points) - 1)
    w = ((at - x[hi - 1]) / (x[hi] - x[hi - 1])).clamp(0, 1)
    return (1 / (seconds[hi - 1] * (1 - w) + seconds[hi] * w)).tolist(), None


def device_name(device) -> str:
    """The hardware, in words: the GPU's name, or the CPU's model, cores and torch threads."""
    if str(device).startswith("cuda"):
        return torch.cuda.get_device_name(device)
    name = f"{platform.machine()} CPU"
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return f"{name} ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"


class Engine:
    """Requests through prefill and rounds in `max_batch` rows (continuous batching), with stop
    and budget handling.

    scheduler "none": every round is one `speculative_round` verifying the whole block (one
    graph). "threshold" / "hardware": the round runs as its two halves — `draft` (which
    schedules), one host read of the scheduled token count, then `verify` on a ragged batch of
    exactly those tokens (eager) or padded to a bucket (compiled: one verify graph per bucket)
    — so a shorter schedule costs fewer target FLOPs. "hardware" wants `set_sps(...)`.
    """

    def __init__(self, target: Transformer, drafter, stop_ids, batch_size: int, max_seq: int, temperature: float,
                 threshold: float, seed: int, device, compile: bool = False, compile_mode: Optional[str] = None,
                 scheduler: Optional[str] = None, buckets: Optional[list[int]] = None, ragged: Optional[bool] = None,
                 triton: bool = False):
        self.target, self.drafter, self.stop_ids = target, drafter, set(stop_ids)
        self.temperature, self.threshold, self.device, self.triton = temperature, threshold, device, triton
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.max_batch = batch_size
        target.setup_caches(batch_size, max_seq)
        if drafter is not None:
            drafter.setup_caches(batch_size, max_seq)
        self.K = drafter.cfg.num_drafts if drafter is not None else 0
        if scheduler is None:
            scheduler = "threshold" if threshold > 0 and drafter is not None else "none"
        if scheduler != "none" and (drafter is None or drafter.confidence_head is None):
            raise UserError(f"--scheduler {scheduler}: needs a --drafter with a confidence head")
        self.scheduler, self.sps_table, self.compiled = scheduler, None, compile
        # The two-half round with ragged verification: always for a scheduler; for "none" on request
        # (it then also skips free rows), to compare schedules on one executor.
        self.ragged = scheduler != "none" if ragged is None else ragged
        if not self.ragged and scheduler != "none":
            raise ValueError(f"scheduler {scheduler!r} runs the ragged round")
        # hardware: a flat placeholder until `set_sps` (so warm-up and profiling run, and compile,
        # the very graph the real table then feeds).
        self.sps = (torch.ones(batch_size * (self.K + 1) + 1, dtype=torch.float64, device=device)
                    if scheduler == "hardware" else None)
        # Compiled, verification is padded to a few token counts (one graph each); eager runs the
        # exact count. SPS is profiled at the buckets, or at the same geometric points when eager.
        self.buckets = sorted(buckets) if buckets else (verify_buckets(batch_size * (self.K + 1)) if compile else None)
        self.profile_points = self.buckets or verify_buckets(batch_size * (self.K + 1))
        wrap = (lambda f: compiled(f, device, compile_mode)) if compile else (lambda f: f)
        if not self.ragged:
            self.round_fn = wrap(speculative_round)
        else:
            if compile:  # one more verify graph per bucket, all expected: raise dynamo's limit to match
                for name in ("recompile_limit", "cache_size_limit"):
                    if hasattr(torch._dynamo.config, name):
                        setattr(torch._dynamo.config, name, getattr(torch._dynamo.config, name) + len(self.buckets) + 1)
            self.draft_fn, self.verify_fn = wrap(draft), wrap(verify)
        self.prefill_seconds = self.decode_seconds = self.compile_seconds = 0.0

    def bucket(self, n: int) -> int:
        """The token count n verify tokens are padded to: n itself without buckets, else the smallest
        bucket that holds them, or with an SPS table the fastest (a bigger bucket may be quicker)."""
        if self.buckets is None:
            return n
        if self.sps_table is not None:
            return self.route[n]
        for b in self.buckets:
            if b >= n:
                return b
        raise UserError(f"--verify-buckets: the largest bucket {self.buckets[-1]} is below the {n} tokens "
                              f"a round verifies")

    def round(self, anchor, anchor_pos, active, noise, verify_len: Optional[torch.Tensor] = None):
        """One round for every row -> (record, anchor', anchor_pos'), as `speculative_round`.
        verify_len [B] (ragged rounds, for profiling): verify exactly these many drafts per active
        row, at exactly that many tokens, instead of the schedule's."""
        args = (self.target, self.drafter, anchor, anchor_pos, active)
        if not self.ragged:
            return self.round_fn(*args, self.temperature, self.threshold, noise, self.sps, self.triton)
        chain_noise, u, bonus_noise = noise if noise is not None else (None, None, None)
        drafts, q, confidence, scheduled = self.draft_fn(*args, self.temperature, self.threshold, chain_noise,
                                                         self.sps, self.triton)
        forced = verify_len is not None
        verify_len = verify_len if forced else scheduled
        n = int(torch.where(active, verify_len + 1, 0).sum())  # host read: the ragged batch's size
        return self.verify_fn(*args, drafts, q, confidence, verify_len, self.temperature, u, bonus_noise,
                              n if forced else self.bucket(n), self.triton)

    def _dummy_round(self, num_tokens: Optional[int] = None):
        """A round on rows at position 0 whose schedule fills `num_tokens` verify tokens (None: the
        engine's own schedule). Noise comes from a throwaway generator, so the run's random stream
        (and every sampled token) is the same as without it; the cache rows it writes are rewritten
        by the next prefill before they are read."""
        B, dev, W = self.max_batch, self.device, self.K + 1
        zeros = lambda dtype=torch.long: torch.zeros(B, dtype=dtype, device=dev)  # distinct tensors: no aliasing guard
        noise = (kernels.round_noise(torch.Generator(device=dev).manual_seed(0), B, self.K,
                                     self.target.args.vocab_size, dev) if self.temperature > 0 else None)
        if num_tokens is None:
            record, _, _ = self.round(zeros(), zeros(), zeros(torch.bool), noise)
        else:
            counts = (num_tokens - W * torch.arange(B, device=dev)).clamp(0, W)  # fill rows in order
            record, _, _ = self.round(zeros(), zeros(), counts > 0, noise, verify_len=(counts - 1).clamp(min=0))
        return record.tolist()

    def warmup(self):
        """Compile before anything is timed: the round, or the draft and every verify bucket."""
        t0 = time.perf_counter()
        for n in [None] if not self.ragged else (self.buckets or [self.profile_points[-1]]):
            self._dummy_round(n)
        self.compile_seconds += time.perf_counter() - t0

    def profile_sps(self, reps: int = 7, verbose: bool = True) -> dict:
        """SPS(B), measured: rounds per second when a round verifies B tokens, at every profile point
        (the buckets, or the same geometric points when eager). A round here is what the engine
        runs per step — draft, host read, ragged verify of B tokens — so SPS is the engine's step
        rate, as the paper's Algorithm 1 wants it. The points are swept `reps` times in turn
        (after one untimed sweep) and each keeps its fastest round: on a shared machine a slow
        spell then lands on no point in particular, and the fastest is the least disturbed.
        Returns the table (see `set_sps`)."""
        t0 = time.perf_counter()
        best = [float("inf")] * len(self.profile_points)
        for sweep in range(reps + 1):
            for i, b in enumerate(self.profile_points):
                self._sync()
                t = time.perf_counter()
                self._dummy_round(b)
                self._sync()
                if sweep:
                    best[i] = min(best[i], time.perf_counter() - t)
        table = dict(self.sps_identity(), seconds_per_step=best, steps_per_second=[1 / s for s in best])
        if verbose:
            pts = ", ".join(f"{b}: {1 / s:.1f}" for b, s in zip(self.profile_points, best))
            print(f"profiled SPS(B) in {time.perf_counter() - t0:.1f} s (verify tokens: steps/s): {pts}",
                  file=sys.stderr)
        return table

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
                "buckets": self.buckets, "profile_points": self.profile_points}

    def set_sps(self, table: dict):
        """Use a profiled table (`profile_sps`, or read by `sps_for`) for the hardware scheduler."""
        sps, self.route = sps_curve(self.profile_points, table["steps_per_second"], self.buckets,
                                    self.max_batch * (self.K + 1))
        self.sps_table = table
        self.sps.copy_(torch.tensor(sps, dtype=torch.float64))  # in place: a compiled graph may hold it

    def _sync(self):
        if str(self.device).startswith("cuda"):
            torch.cuda.synchronize()

    def _commit(self, req: Request, tokens: list[int], budget: int) -> int:
        """Append tokens up to the budget and the first stop token; returns how many went in."""
        n = 0
        for t in tokens:
            if req.finish_reason is not None:
                break
            req.output_ids.append(t)
            n += 1
            if t in self.stop_ids:
                req.finish_reason = "stop"
            elif len(req.output_ids) >= budget:
                req.finish_reason = "length"
        return n

    def generate(self, requests: list[Request], max_new_tokens: int, on_round=None, on_finish=None):
        """Decode requests to completion, `max_batch` at a time, continuously: when a request
        finishes, the next waiting one is prefilled into its row while the other rows keep going.
        `on_round(request, record)` sees every round of every request, `on_finish(request)` its end.

        A round always runs all `max_batch` rows (free rows are inactive), so its shapes never
        change and a compiled round never recompiles.
        """
        B, K, V, dev = self.max_batch, self.K, self.target.args.vocab_size, self.device
        waiting = list(reversed(requests))  # popped from the end: first come, first served
        rows: list[Optional[Request]] = [None] * B
        anchor = torch.zeros(B, dtype=torch.long, device=dev)
        anchor_pos = torch.zeros(B, dtype=torch.long, device=dev)

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
                first, lens = prefill(self.target, self.drafter, [r.prompt_ids for r in new], self.temperature,
                                      self.generator, dev, rows=None if leading else index)
                anchor, anchor_pos = anchor.index_copy(0, index, first), anchor_pos.index_copy(0, index, lens)
                for i, req, t in zip(free, new, first.tolist()):
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
            noise = kernels.round_noise(self.generator, B, K, V, dev) if self.temperature > 0 else None
            record, anchor, anchor_pos = self.round(anchor, anchor_pos, active, noise)
            anchor, anchor_pos = anchor.clone(), anchor_pos.clone()  # outlive the next graph replay
            record = record.tolist()  # the one host read of the round
            for i, req in enumerate(rows):
                if req is None:
                    continue
                rec = record[i]
                n = int(rec[K + 1])
                entry = {"request": req.index, "round": len(req.rounds), "anchor": req.output_ids[-1],
                         "draft": [int(x) for x in rec[:K]],
                         "confidence": rec[K + 3:] if self.drafter is not None and self.drafter.confidence_head is not None else None,
                         "verified": int(rec[K]), "accepted": n, "bonus": int(rec[K + 2])}
                req.rounds.append(entry)
                self._commit(req, entry["draft"][:n] + [entry["bonus"]], max_new_tokens)
                if on_round is not None:
                    on_round(req, entry)
                if req.finish_reason is not None:
                    rows[i] = None
                    finish(req)
            self.decode_seconds += time.perf_counter() - t0
            admit()
        return requests


def accept_rate_by_position(requests: list[Request], K: int) -> list[float]:
    """Rate of accepting draft k given drafts 1..k-1 were accepted and draft k was verified."""
    rates = []
    for k in range(1, K + 1):
        tried = sum(1 for r in requests for rd in r.rounds if rd["accepted"] >= k - 1 and rd["verified"] >= k)
        ok = sum(1 for r in requests for rd in r.rounds if rd["accepted"] >= k)
        rates.append(ok / tried if tried else 0.0)
    return rates


# ----------------------------------------------------------------------------------------
# Prompts

def parse_ids(text: str, what: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{what}: {text!r} is not a comma-separated list of token ids") from None
    return ids


def load_prompts(args: Args, tokenizer: Optional[Tokenizer], chat: bool) -> list[list[int]]:
    """Token ids of every prompt given by --prompt, --prompt-ids or --prompts-file."""
    given = [f for f in ("prompt", "prompt_ids", "prompts_file") if getattr(args, f) is not None]
    if len(given) != 1:
        raise UserError("give exactly one of --prompt, --prompt-ids, --prompts-file"
                              + (f" (got {', '.join('--' + g.replace('_', '-') for g in given)})" if given else ""))

    def encode(text: str, where: str) -> list[int]:
        if tokenizer is None:
            raise UserError(f"{where}: a text prompt needs the target's tokenizer.json")
        return tokenizer.encode(tokenizer.render_chat(text) if chat else text)

    if args.prompt is not None:
        return [encode(args.prompt, "--prompt")]
    if args.prompt_ids is not None:
        return [parse_ids(args.prompt_ids, "--prompt-ids")]
    path = args.prompts_file
    if not os.path.isfile(path):
        raise UserError(f"{path}: prompts file not found")
    prompts = []
    for where, row in read_jsonl(path):
        if isinstance(row, dict) and isinstance(row.get("prompt"), str):
            prompts.append(encode(row["prompt"], where))
        elif isinstance(row, dict) and isinstance(row.get("prompt_ids"), list):
            ids = row["prompt_ids"]
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise UserError(f"{where}: 'prompt_ids' must be a list of integers")
            prompts.append(ids)
        elif isinstance(row, dict) and isinstance(row.get("turns"), list) and row["turns"] \
                and isinstance(row["turns"][0], str):
            prompts.append(encode(row["turns"][0], where))
        else:
            raise UserError(f"{where}: expected {{\"prompt\": str}}, {{\"prompt_ids\": [int]}} "
                                  "or {\"turns\": [str]}")
    if not prompts:
        raise UserError(f"{path}: no prompts")
    return prompts


# ----------------------------------------------------------------------------------------
# CLI

def _explicit(argv: list[str], flag: str) -> bool:
    return any(a in (f"--{flag}", f"--no-{flag}") for a in argv)


@dataclass
class Models:
    """What `load_models` resolves from the flags shared by speculate.py and eval.py."""
    target: Transformer
    drafter: object  # drafter.Drafter or None
    tokenizer: Optional[Tokenizer]
    stop_ids: tuple
    chat: bool  # render text prompts with the chat template
    compile: bool
    dtype: torch.dtype


def load_models(args, argv: list[str], device: Optional[str] = None, verbose: bool = True) -> Models:
    """Load the target (and drafter) named by `args` — speculate's `Args` or anything with the same
    fields — and check the flags that depend on them. `device` overrides args.device (a rank's GPU)."""
    device = device or args.device
    if getattr(args, "random_init", None) is None and args.target is None:
        raise UserError("--target: no target directory given")
    if getattr(args, "random_init", None) is not None and (args.target is not None or args.drafter is not None):
        raise UserError("--random-init builds its own target and drafter: drop --target/--drafter")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is available")
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    compile = args.compile if _explicit(argv, "compile") else args.device == "cuda"
    drafter = tokenizer = None
    if getattr(args, "random_init", None) is not None:
        from drafter import random_drafter
        target = random_target(args.random_init, device, dtype, args.seed)
        drafter = random_drafter(target)
        stop_ids = ()
    else:
        target = load_target(args.target, device, dtype)
        stop_ids = stop_token_ids(args.target, target.args)
        if os.path.isfile(os.path.join(args.target, "tokenizer.json")):
            tokenizer = Tokenizer(args.target)
        if args.drafter is not None:
            from drafter import load_drafter
            drafter = load_drafter(args.drafter, target, device, dtype)
    has_confidence = drafter is not None and drafter.cfg.confidence_head
    if args.confidence_threshold > 0 and not has_confidence:
        raise UserError("--confidence-threshold needs a --drafter with a confidence head")
    if getattr(args, "scheduler", None) in ("threshold", "hardware") and not has_confidence:
        raise UserError(f"--scheduler {args.scheduler}: needs a --drafter with a confidence head")
    if getattr(args, "calibration", None) is not None:
        if not has_confidence:
            raise UserError(f"--calibration {args.calibration}: needs a --drafter with a confidence head")
        temps = read_json(args.calibration).get("temperatures")
        K = drafter.cfg.num_drafts
        if not isinstance(temps, list) or len(temps) != K or not all(
                isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t < float("inf") for t in temps):
            raise UserError(f"{args.calibration}: 'temperatures' must be a list of {K} positive numbers "
                                  f"(one per draft position), got {temps!r}")
        drafter.calibrate(temps)
    if drafter is not None and verbose:  # once every check has passed
        print(drafter.cfg.describe() + (" (random weights)" if args.drafter is None else ""), file=sys.stderr)
    chat = args.chat if _explicit(argv, "chat") else (tokenizer is not None and tokenizer.chat_template is not None)
    return Models(target, drafter, tokenizer, stop_ids, chat, compile, dtype)


def check_prompts(prompts: list[list[int]], target: Transformer, max_new_tokens: int, where: str = ""):
    """Every prompt non-empty, inside the vocabulary, and fitting the context with its budget."""
    V, context = target.args.vocab_size, target.args.max_position_embeddings
    for i, p in enumerate(prompts):
        if not p:
            raise UserError(f"{where}prompt {i}: empty prompt")
        bad = [t for t in p if not 0 <= t < V]
        if bad:
            raise UserError(f"{where}prompt {i}: token id {bad[0]} is outside the vocabulary (0..{V - 1})")
        if len(p) + max_new_tokens > context:
            raise UserError(f"{where}prompt {i}: {len(p)} tokens + --max-new-tokens {max_new_tokens} exceed "
                                  f"the target's context of {context} (max_position_embeddings)")


def cache_length(longest_prompt: int, max_new_tokens: int, drafter) -> int:
    """Cache rows for a batch: prompt + budget, plus room for a round's block / verify window from a
    finished row's last anchor (which may sit up to K+1 past its budget while other rows go on)."""
    width = max(drafter.cfg.num_slots, drafter.cfg.num_drafts + 1) if drafter is not None else 1
    return longest_prompt + max_new_tokens + 2 * width


DEMO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo")
# From shutil.py, one of the standard-library files held out of the demo pair's training (demo/heldout.txt).
DEMO_PROMPT = 'def copyfileobj(fsrc, fdst, length=0):\n    """copy data from file-like object fsrc to file-like object fdst"""\n'


def demo_defaults(args: Args) -> bool:
    """With no --target, --drafter or --random-init: the committed demo pair (demo/target, demo/drafter; made by
    scripts/train_demo.sh) and, without a prompt flag, a raw code prompt. Returns whether demo mode is on."""
    if args.target is not None or args.drafter is not None or args.random_init is not None:
        return False
    args.target, args.drafter = os.path.join(DEMO_DIR, "target"), os.path.join(DEMO_DIR, "drafter")
    if args.prompt is None and args.prompt_ids is None and args.prompts_file is None:
        args.prompt = DEMO_PROMPT  # the demo tokenizer has no chat template: sent raw
    return True


def check_scheduler_flags(args):
    """--scheduler, --confidence-threshold, --sps-table and --verify-buckets must agree."""
    sched = args.scheduler
    if sched == "threshold" and args.confidence_threshold <= 0:
        raise UserError("--scheduler threshold: needs --confidence-threshold above 0")
    if sched in ("none", "hardware") and args.confidence_threshold > 0:
        raise UserError(f"--confidence-threshold {args.confidence_threshold}: only --scheduler threshold "
                              f"uses it, not --scheduler {sched}")
    if args.sps_table is not None and sched != "hardware":
        raise UserError(f"--sps-table {args.sps_table}: only --scheduler hardware uses it")
    if getattr(args, "verify_buckets", None) is not None:
        if (sched or ("threshold" if args.confidence_threshold > 0 else "none")) == "none":
            raise UserError("--verify-buckets: only a scheduled round (--scheduler threshold or hardware) uses it")
        buckets = parse_ids(args.verify_buckets, "--verify-buckets")
        if not buckets or any(b < 1 for b in buckets) or len(set(buckets)) != len(buckets):
            raise UserError(f"--verify-buckets: {args.verify_buckets!r} must be distinct positive integers")


def parse_buckets(args, batch: int, drafter) -> Optional[list[int]]:
    """--verify-buckets as a sorted list (None: the engine's default), the largest holding a full round."""
    if getattr(args, "verify_buckets", None) is None:
        return None
    buckets = sorted(parse_ids(args.verify_buckets, "--verify-buckets"))
    need = batch * (drafter.cfg.num_drafts + 1)
    if buckets[-1] < need:
        raise UserError(f"--verify-buckets: the largest bucket {buckets[-1]} is below {need}, the tokens of a full "
                              f"round (batch {batch} x {drafter.cfg.num_drafts + 1})")
    return buckets


def sps_for(engine: Engine, path: Optional[str], verbose: bool = True) -> dict:
    """The hardware scheduler's SPS table: read from `path` if it exists (every identity key must
    match this engine), else profiled now (and written to `path` when given)."""
    want = engine.sps_identity()
    if path is not None and not os.path.isfile(path):
        check_writable(path, "--sps-table")  # to be written: a directory or a missing folder fails now
    if path is not None and os.path.isfile(path):
        table = read_json(path)
        for key, value in want.items():
            if key not in table:
                raise UserError(f"{path}: no {key!r} (not an SPS table written by speculate.py)")
            if table[key] != value:
                raise UserError(f"{path}: {key} is {table[key]!r} in the table but {value!r} in this run; "
                                      f"delete the file to profile again")
        sps = table.get("steps_per_second")
        if not isinstance(sps, list) or len(sps) != len(engine.profile_points) or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < float("inf") for x in sps):
            raise UserError(f"{path}: 'steps_per_second' must be {len(engine.profile_points)} positive numbers, "
                                  f"one per profile point")
        if verbose:
            print(f"SPS table read from {path}", file=sys.stderr)
        return table
    table = engine.profile_sps(verbose=verbose)
    if path is not None:
        try:
            with open(path, "w") as f:
                json.dump(table, f, indent=1)
        except OSError as e:
            raise UserError(f"--sps-table {path}: cannot write the table ({e.strerror})") from None
        if verbose:
            print(f"SPS table written to {path}", file=sys.stderr)
    return table


def run(args: Args, argv: list[str]) -> dict:
    """Everything `python speculate.py` does; returns the summary. Raises UserError on bad input."""
    demo = demo_defaults(args)
    for name, ok in (("num_samples", args.num_samples >= 1), ("batch_size", args.batch_size >= 1),
                     ("max_new_tokens", args.max_new_tokens >= 1), ("temperature", args.temperature >= 0),
                     ("confidence_threshold", 0 <= args.confidence_threshold <= 1)):
        if not ok:
            raise UserError(f"--{name.replace('_', '-')}: invalid value {getattr(args, name)!r}")
    check_scheduler_flags(args)
    check_writable(args.trace_file, "--trace-file")
    if args.sps_table is not None and not os.path.isfile(args.sps_table):
        check_writable(args.sps_table, "--sps-table")
    on = "cuda" if args.device == "cuda" and torch.cuda.is_available() else "cpu"
    if args.kernels == "triton" and not kernels._triton_ok(torch.zeros(1, device=on)):
        raise UserError("--kernels triton: needs the triton package and --device cuda (on cpu, Triton's "
                              "interpreter: TRITON_INTERPRET=1)")
    m = load_models(args, argv)
    target, drafter, tokenizer = m.target, m.drafter, m.tokenizer
    prompts = load_prompts(args, tokenizer, m.chat)
    check_prompts(prompts, target, args.max_new_tokens)
    if demo:  # the baseline first, by the same engine without the drafter, for the side-by-side figures
        baseline = decode(args, m, None, prompts, None)
    summary = decode(args, m, drafter, prompts, args.trace_file)
    if demo and baseline["tokens_per_second"] > 0:
        print(f"speed-up: {summary['tokens_per_second'] / baseline['tokens_per_second']:.2f}x "
              f"(speculative vs autoregressive tokens/s, same prompts, greedy outputs identical: "
              f"{baseline['outputs'] == summary['outputs']})")
    if args.wandb:
        import wandb
        wandb.init(project="dspark-fast", config=asdict(args))
        wandb.log({k: v for k, v in summary.items() if k != "summary" and not isinstance(v, list)})
        wandb.finish()
    return summary


def decode(args: Args, m: Models, drafter, prompts: list[list[int]], trace_file: Optional[str]) -> dict:
    """Decode every prompt with `drafter` (None: autoregressive), print the texts and one figures line."""
    target, tokenizer = m.target, m.tokenizer
    requests = [Request(i, p, [], []) for i, p in enumerate(pp for pp in prompts for _ in range(args.num_samples))]
    max_seq = cache_length(max(len(r.prompt_ids) for r in requests), args.max_new_tokens, drafter)
    batch = min(args.batch_size, len(requests))
    engine = Engine(target, drafter, m.stop_ids, batch, max_seq, args.temperature, args.confidence_threshold,
                    args.seed, args.device, m.compile, scheduler=args.scheduler if drafter is not None else None,
                    buckets=parse_buckets(args, batch, drafter) if drafter is not None else None,
                    triton=args.kernels == "triton")
    if m.compile:
        engine.warmup()
    if engine.scheduler == "hardware":
        engine.set_sps(sps_for(engine, args.sps_table))

    trace = open(trace_file, "w") if trace_file else None
    on_round = (lambda req, rec: trace.write(json.dumps(rec) + "\n")) if trace else None
    on_finish = (lambda req: trace.write(json.dumps({
        "request": req.index, "output_ids": req.output_ids, "num_rounds": len(req.rounds),
        "acceptance_length": req.acceptance_length, "finish_reason": req.finish_reason}) + "\n")) if trace else None
    engine.generate(requests, args.max_new_tokens, on_round, on_finish)
    for req in requests:  # in prompt order, whatever order they finished in
        print(tokenizer.decode(req.output_ids) if tokenizer is not None else ",".join(map(str, req.output_ids)))

    n_tokens = sum(len(r.output_ids) for r in requests)
    n_rounds = sum(len(r.rounds) for r in requests)
    seconds = engine.prefill_seconds + engine.decode_seconds
    summary = {
        "summary": True,
        "tokens_per_second": n_tokens / seconds if seconds > 0 else 0.0,
        "acceptance_length": sum(rd["accepted"] + 1 for r in requests for rd in r.rounds) / max(n_rounds, 1),
        "accept_rate_by_position": accept_rate_by_position(requests, drafter.cfg.num_drafts if drafter else 0),
        "verified_per_round": sum(rd["verified"] for r in requests for rd in r.rounds) / max(n_rounds, 1),
        "scheduler": engine.scheduler,
        "prefill_seconds": engine.prefill_seconds,
        "decode_seconds": engine.decode_seconds,
        "compile_seconds": engine.compile_seconds,
    }
    if trace:
        trace.write(json.dumps(summary) + "\n")
        trace.close()
    rates = " ".join(f"{x:.2f}" for x in summary["accept_rate_by_position"])
    print(f"{'speculative' if drafter else 'autoregressive'}: {n_tokens} tokens in {seconds:.2f} s, "
          f"{summary['tokens_per_second']:.1f} tokens/s, τ={summary['acceptance_length']:.2f}"
          + (f", accept by position [{rates}], verified {summary['verified_per_round']:.2f}/round "
             f"({engine.scheduler})" if drafter else "")
          + f" (prefill {engine.prefill_seconds:.2f} s, decode {engine.decode_seconds:.2f} s)")
    return dict(summary, outputs=[r.output_ids for r in requests])


def main(argv: Optional[list[str]] = None) -> int:
    import tyro

    argv = sys.argv[1:] if argv is None else argv
    args = tyro.cli(Args, args=argv)
    try:
        with torch.inference_mode():
            run(args, argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
