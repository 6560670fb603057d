"""How many drafts a round verifies (the paper's §3.2.2 and §5.2; docs/algorithm.md): inside the draft graph,
verify lengths ℓ [B] from the drafts' confidences ("none", "threshold", "hardware": Algorithm 1 over SPS(B),
the measured rounds/s at B verify tokens; "async": a capacity searched on the host from two rounds earlier).
Host side: the verify sizes (a few buckets: --verify-buckets, by default when compiled) and the SPS table,
profiled from the engine's rounds."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import NamedTuple, Optional, Union

import torch

from sampling import prefix_length
from support import cpu_kernels
from support.cli import UserError, device_name, dtype_name, parse_ints, sync
from support.files import check_writable, read_json, write_json

KINDS = ("none", "threshold", "hardware", "async")
SPS_KINDS = ("hardware", "async")  # the schedules that read SPS(B)
SCHEDULED = ", ".join(k for k in KINDS if k != "none")  # the kinds that read confidences, for messages


def threshold_schedule(confidence: torch.Tensor, threshold: float) -> torch.Tensor:
    """ℓ [B]: the drafts before the first confidence below the threshold (0 if c_1 < θ)."""
    confident = confidence >= threshold  # [B, K]
    return prefix_length(confident)


def ranked(confidence, active):
    """The candidates (r, j) by prefix survival a_{r,j} = Π_{i<=j} c_{r,i}, descending (stable: j-1 before j
    at a tie, so every row's admitted drafts are a prefix); inactive rows offer nothing. Returns the sorted
    survivals [B*K] and each one's flat index r*K + j."""
    survival = torch.cumprod(confidence.double(), dim=1)  # [B, K] a_{r,j}
    offered = torch.where(active[:, None], survival, 0.0)  # a free row's, whatever it holds: 0
    flat = offered.reshape(-1)
    return torch.sort(flat, descending=True, stable=True)


def hardware_schedule(confidence, active, sps) -> torch.Tensor:
    """Algorithm 1 for the batch, on the device: admit candidates while τ·SPS(R + i) beats the best so far
    (τ = R + Σ admitted a); the stop never depends on a token's own realisation, so lossless. Returns ℓ [B]."""
    B, K = confidence.shape
    a_sorted, order = ranked(confidence, active)
    R = active.long().sum()
    tau = R + torch.cumsum(a_sorted, 0)  # τ with candidates 1 .. i admitted
    verify_tokens = R + torch.arange(1, B * K + 1, device=a_sorted.device)
    throughput = tau * sps[verify_tokens]  # τ·SPS: tokens a second
    anchors_only = R * sps[R[None]]
    before = torch.cat([anchors_only, throughput[:-1]])  # the best when candidate i is tried
    improves = (throughput > before) & (a_sorted > 0)
    take = torch.cumprod(improves.long(), dim=0)  # admitted up to the first that does not improve
    return admitted_per_row(take, order, B, K)


def admitted_per_row(take, order, B: int, K: int) -> torch.Tensor:
    """ℓ [B] from `take` [B*K] (1: admitted), in the ranked order `order`."""
    flat = torch.zeros_like(order)
    flat = flat.scatter(0, order, take)
    return flat.view(B, K).sum(1)


def top_capacity(confidence, active, capacity) -> torch.Tensor:
    """The async selection: the `capacity` (0-d, fixed before these drafts) best prefix survivals. Returns ℓ [B]."""
    B, K = confidence.shape
    a_sorted, order = ranked(confidence, active)
    within = torch.arange(B * K, device=a_sorted.device) < capacity
    take = within & (a_sorted > 0)
    return admitted_per_row(take.long(), order, B, K)


def capacity_search(confidence: list[list[float]], R: int, sps: list[float], limit: int) -> int:
    """The async capacity: the smallest C in 0 .. limit maximising (R + the C largest prefix survivals) ·
    SPS(R + C), searched to the end so it steps over a jagged curve's cliffs (confidence: K per row)."""
    a = []
    for row in confidence:
        prod = 1.0
        for c in row:
            prod *= c
            if prod > 0:
                a.append(prod)
    a.sort(reverse=True)
    best = R * sps[R]
    C = 0
    tau = float(R)
    for i, x in enumerate(a[:limit], start=1):
        tau += x
        throughput = tau * sps[R + i]
        if throughput > best:
            best = throughput
            C = i
    return C


class Plan(NamedTuple):
    """An async round's schedule, fixed before its drafts exist (`Scheduler.plan`)."""
    # C: how many drafts the whole batch verifies at most
    capacity: int
    # the batch round whose confidences chose C, "warmup", or "fixed" (`Scheduler.fixed`)
    source: Union[int, str]
    # this round's number among the decode's batch rounds (all rows step together)
    round: int
    # the verify size: the active rows' anchors + C, padded to a bucket where the scheduler has buckets
    num_tokens: int
    # C as a 0-d tensor on the device: the draft graph's input
    tensor: torch.Tensor

    def trace(self) -> dict:
        """The keys it adds to a round record (docs/trace-format.md)."""
        return {"batch_round": self.round, "capacity": self.capacity,
                "capacity_from_round": self.source}


def verify_buckets(max_tokens: int) -> list[int]:
    """Padded verify sizes 1, 2, 3, 4, 6, 8, 12, ... (at most a third padding) and max_tokens itself."""
    out = []
    b = 1
    while b < max_tokens:
        out.append(b)
        between = b * 3 // 2
        if b >= 2 and between < max_tokens:
            out.append(between)
        b *= 2
    out.append(max_tokens)
    return out


def isotonic(y: list[float]) -> list[float]:
    """The non-decreasing sequence closest to y in squared error (pool adjacent violators)."""
    blocks = []  # [mean, count]
    for v in y:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m1, n1 = blocks.pop()
            m2, n2 = blocks[-1]
            n = n1 + n2
            blocks[-1] = [(m2 * n2 + m1 * n1) / n, n]  # the two pooled into their mean
    out = []
    for mean, count in blocks:
        out.extend([mean] * count)
    return out


def sps_curve(points: list[int], rates: list[float], buckets: Optional[list[int]], top: int):
    """(SPS(B) for B = 0 .. top, route) from steps/s at `points`: bucketed, B goes to the fastest bucket that
    holds it (route[B]); without buckets, the step time made non-decreasing (a dip is noise) and interpolated."""
    if buckets is not None:
        per = dict(zip(points, rates))
        route = [0]
        for n in range(1, top + 1):
            holding = [b for b in buckets if b >= n]
            fastest = max(holding, key=lambda b: (per[b], -b))  # the smaller bucket at a tie
            route.append(fastest)
        sps = [per[b] for b in route[1:]]
        sps.insert(0, sps[0])  # SPS(0): a placeholder, only ever multiplied by R = 0
        return sps, route
    step_seconds = isotonic([1 / r for r in rates])
    seconds = torch.tensor(step_seconds, dtype=torch.float64)
    x = torch.tensor(points, dtype=torch.float64)
    at = torch.arange(top + 1, dtype=torch.float64).clamp(min=points[0])
    hi = torch.searchsorted(x, at).clamp(1, len(points) - 1)
    lo = hi - 1
    span = x[hi] - x[lo]
    w = ((at - x[lo]) / span).clamp(0, 1)  # the weight of the point above
    interpolated = seconds[lo] * (1 - w) + seconds[hi] * w
    return (1 / interpolated).tolist(), None


class Scheduler:
    """The schedule of `batch` rows of K drafts: ℓ [B] in the draft graph (`__call__`), padded verify sizes
    (`bucket`), async plans on the host (`plan`); `sps` is filled in place, so every phase runs one graph."""

    def __init__(self, kind: str, K: int, batch: int, *, threshold: float = 0.0,
                 buckets: Optional[list[int]] = None, compiled: bool = False, device="cpu"):
        self.kind = kind
        self.K = K
        self.threshold = threshold
        top = batch * (K + 1)  # tokens of a round that verifies every draft of every row
        # Buckets (--verify-buckets, else by default when compiled): a few padded token counts, one graph each
        # when compiled; SPS is profiled there (without buckets: at the default's points).
        self.buckets = None
        if buckets:
            self.buckets = sorted(buckets)
        elif compiled:
            self.buckets = verify_buckets(top)
        self.profile_points = self.buckets or verify_buckets(top)
        # SPS(B) by verify tokens: on the device for Algorithm 1, on the host for the async search.
        self.sps = None
        self.measured = False  # whether `set_sps` gave SPS a table: until then it is flat
        self.capacity = None  # async's C, the draft graph's input (`fixed`)
        if kind in SPS_KINDS:
            sps_device = device
            if kind == "async":
                sps_device = "cpu"  # read by the search on the host
            self.sps = torch.ones(top + 1, dtype=torch.float64, device=sps_device)
        if kind == "async":
            self.capacity = torch.zeros((), dtype=torch.long, device=device)
        self.route: Optional[list[int]] = None
        self.reset()

    def __call__(self, confidence: Optional[torch.Tensor], active: torch.Tensor,
                 capacity: Optional[torch.Tensor] = None) -> torch.Tensor:
        """ℓ [B], inside the draft graph. confidence [B, K] (None only for "none"); capacity: async's
        0-d C (`Plan.tensor`), passed in so that a compiled graph reads it as an input."""
        if self.kind == "async":
            return top_capacity(confidence, active, capacity)
        if self.kind == "hardware":
            return hardware_schedule(confidence, active, self.sps)
        if self.kind == "threshold":
            return threshold_schedule(confidence, self.threshold)
        if self.kind == "none":
            return torch.full(active.shape, self.K, dtype=torch.long, device=active.device)
        raise NotImplementedError(f"scheduler {self.kind!r}: Scheduler.__call__ has no branch for it")

    def bucket(self, n: int) -> int:
        """n itself without buckets, else the smallest bucket holding n, or with an SPS table the fastest."""
        if self.buckets is None:
            return n
        if self.route is not None:
            return self.route[n]
        # the largest holds a full round (parse_buckets)
        return next(b for b in self.buckets if b >= n)

    def reset(self):
        """Forget the history: a new decode starts with two warm-up rounds."""
        # the last two rounds' confidences, K per active row
        self.history: list[list[list[float]]] = []
        self.rounds = 0  # rounds observed in this decode

    def observe(self, confidence: list[list[float]]):
        """A finished round's confidences, one list per row that was active in it (its RoundRecords)."""
        self.history = (self.history + [confidence])[-2:]
        self.rounds += 1

    def plan(self, R: int) -> Plan:
        """The next round's capacity C and verify size for R rows, from the round two before (a pipelined
        engine could not have read the last one yet, so the plan leaves it out), grown to fill its bucket;
        the first two rounds verify every draft."""
        r = self.rounds
        limit = R * self.K
        if r < 2:
            C = limit
            source = "warmup"
        else:
            two_before = self.history[0]  # round r - 2's confidences (r - 1's, history[-1], is left out)
            C = capacity_search(two_before, R, self.sps.tolist(), limit)
            source = r - 2
        num_tokens = self.bucket(R + C)
        capacity = min(num_tokens - R, limit)  # grown to fill the bucket
        return self.fixed(num_tokens, capacity, source, r)

    def fixed(self, num_tokens: int, capacity: Optional[int] = None,
              source: Union[int, str] = "fixed", round: int = -1) -> Plan:
        """A plan of exactly num_tokens verify tokens (capacity too by default: warm-up and profiling)."""
        if capacity is None:
            capacity = num_tokens  # no fewer than the drafts on offer: every one is taken
        self.capacity.fill_(capacity)  # in place: no host-to-device copy to wait for
        return Plan(capacity, source, round, num_tokens, self.capacity)

    def set_sps(self, table: dict, source: str = "set_sps"):
        """Use a profiled SPS table (`profile_sps`, or read by `load_or_profile`), checked: a dict
        of one rate per profile point, its own profile_points (where it has them) this
        scheduler's (`source` names the table in the refusal)."""
        if self.sps is None:
            raise UserError(f"{source}: scheduler {self.kind!r} reads no SPS table "
                            f"(only {' and '.join(SPS_KINDS)} do)")
        if not isinstance(table, dict):
            raise UserError(f"{source}: an SPS table is a dict with 'steps_per_second' "
                            f"(profile_sps, load_or_profile), got {type(table).__name__}")
        points = table.get("profile_points", self.profile_points)
        if points != self.profile_points:  # another batch or buckets: rates at other sizes
            raise UserError(f"{source}: the table's profile_points {points} are not this "
                            f"scheduler's {self.profile_points}")
        top = len(self.sps) - 1
        steps_per_second = table.get("steps_per_second")
        check_rates(steps_per_second, len(self.profile_points), source)
        sps, self.route = sps_curve(self.profile_points, steps_per_second, self.buckets, top)
        # in place: a compiled graph may hold it
        self.sps.copy_(torch.tensor(sps, dtype=torch.float64))
        self.measured = True


def resolve(kind: Optional[str], threshold: float, sps_table: Optional[str], buckets: Optional[str]) -> str:
    """--scheduler's value (default: threshold if --confidence-threshold > 0, else none), checked with the flags."""
    resolved = kind
    if resolved is None:
        resolved = "none"
        if threshold > 0:
            resolved = "threshold"
    if resolved == "threshold" and threshold <= 0:
        raise UserError("--scheduler threshold: needs --confidence-threshold above 0")
    if kind not in (None, "threshold") and threshold > 0:
        raise UserError(f"--confidence-threshold {threshold}: only --scheduler threshold uses it, "
                        f"not --scheduler {kind}")
    if sps_table is not None and resolved not in SPS_KINDS:
        raise UserError(f"--sps-table {sps_table}: only --scheduler {' or '.join(SPS_KINDS)} uses it")
    if buckets is not None:
        if resolved == "none":
            raise UserError(f"--verify-buckets: only a scheduled round (--scheduler {SCHEDULED}) "
                            f"uses it")
        parse_ints(buckets, "--verify-buckets", distinct_positive=True)
    return resolved


def parse_buckets(text: Optional[str], batch: int, drafter) -> Optional[list[int]]:
    """--verify-buckets as a sorted list (None: the engine's default) for an engine of `batch` rows: the
    buckets below its full round, then the full round. A largest bucket below it cannot hold a round."""
    if text is None:
        return None
    buckets = sorted(parse_ints(text, "--verify-buckets"))  # checked in `resolve`
    width = drafter.cfg.num_drafts + 1
    check_full_round(buckets, batch, width)
    full = batch * width
    smaller = [b for b in buckets if b < full]
    return smaller + [full]


def check_full_round(buckets: list[int], batch: int, width: int):
    """The largest bucket holds a full round: `batch` rows of `width` tokens."""
    full = batch * width
    largest = max(buckets)
    if largest < full:
        raise UserError(f"--verify-buckets: the largest bucket {largest} is below {full}, the "
                        f"tokens of a full round ({batch} row(s) x {width})")


SPS_RANGE = (1e-6, 1e9)  # rounds per second a table may hold: a round of 11.6 days to one of a nanosecond


def check_rates(sps, points: int, source: str):
    """An SPS table's steps_per_second: `points` numbers inside SPS_RANGE."""
    well_formed = isinstance(sps, list) and len(sps) == points
    if well_formed:
        for x in sps:
            is_number = isinstance(x, (int, float)) and not isinstance(x, bool)
            # compared exactly: a 400-digit integer is no float, and the schedule's products overflow past these
            well_formed = well_formed and is_number and SPS_RANGE[0] <= x <= SPS_RANGE[1]
    if not well_formed:
        raise UserError(f"{source}: 'steps_per_second' must be {points} numbers from {SPS_RANGE[0]:g} to "
                        f"{SPS_RANGE[1]:g}, one per profile point")


def sps_identity(engine) -> dict:
    """What an engine's SPS table was measured for; a table is reused only where all of it matches."""
    a = engine.target.args
    unique = {p.data_ptr(): p for p in engine.target.parameters()}  # tied weights once
    n = sum(p.numel() for p in unique.values())
    target = (f"Qwen3 {n} parameters, {a.num_hidden_layers} layers, hidden {a.hidden_size}, "
              f"vocab {a.vocab_size}")
    drafter = None
    if engine.drafter is not None:
        drafter = engine.drafter.cfg.describe(engine.K)
    dtype = dtype_name(engine.target.embed_tokens.weight.dtype)
    sampled = engine.temperature > 0
    f = engine.filters
    filters = {"top_k": f.top_k > 0, "top_p": f.top_p < 1.0, "min_p": f.min_p > 0.0}  # each on or off
    return {"device": device_name(engine.device), "torch": torch.__version__, "target": target,
            "drafter": drafter, "dtype": dtype, "batch_capacity": engine.max_batch,
            "verify_width": engine.K + 1, "sampling": sampled, "filters": filters,
            "compiled": engine.is_compiled, "compile_mode": engine.compile_mode, "kernels": engine.backend,
            "cpu_kernels": cpu_kernels.gemm_path(engine.target),
            "buckets": engine.scheduler.buckets, "profile_points": engine.scheduler.profile_points}


def profile_sps(engine) -> dict:
    """SPS(B): the engine's rounds per second at every profile point (a dummy round of b verify tokens): the
    fastest of 7 timed sweeps (after an untimed one), so a slow spell on a shared machine lands on no point in
    particular."""
    points = engine.scheduler.profile_points
    best = [float("inf")] * len(points)
    with engine.stance():  # the graphs found as a decode finds them
        for sweep in range(1 + 7):  # an untimed sweep, then 7 timed
            for i, b in enumerate(points):
                sync(engine.device)
                t = time.perf_counter()
                engine.dummy_round(b)
                sync(engine.device)
                if sweep:
                    best[i] = min(best[i], time.perf_counter() - t)
    rates = [1 / s for s in best]
    return dict(sps_identity(engine), seconds_per_step=best, steps_per_second=rates)


def read_table(engine, path: Optional[str], verbose: bool = True) -> Optional[dict]:
    """The SPS table at `path`, checked against `sps_identity(engine)`; None where there is no file.
    The engine need not be warmed up: a table that does not fit is refused before any compile."""
    if path is None or not os.path.isfile(path):
        return None
    want = sps_identity(engine)
    table = read_json(path)
    for key, value in want.items():
        if key not in table:
            raise UserError(f"{path}: no {key!r} (not an SPS table of this version of speculate.py); "
                            f"delete it if it is an older table, to profile again, or give "
                            f"--sps-table another path")
        # compared as JSON: true is not 1
        if json.dumps(table[key], sort_keys=True) != json.dumps(value, sort_keys=True):
            what = key
            if key == "batch_capacity":  # the engine's rows: --batch-size, at most the requests
                what = "batch_capacity (--batch-size, or the requests where fewer)"
            raise UserError(f"{path}: {what} is {table[key]!r} in the table but {value!r} in this run; "
                            f"delete the file to profile again")
    check_rates(table.get("steps_per_second"), len(engine.scheduler.profile_points), path)
    if verbose:
        print(f"SPS table read from {path}", file=sys.stderr)
    return table


def load_or_profile(engine, path: Optional[str], verbose: bool = True) -> dict:
    """The SPS table: read from `path` (`read_table`), else profiled (and written there)."""
    points = engine.scheduler.profile_points

    def say(text):
        if verbose:
            print(text, file=sys.stderr)

    table = read_table(engine, path, verbose)
    if table is not None:
        return table
    if path is not None:
        # a directory or a missing folder fails before the profiling
        check_writable(path, "--sps-table")
    t0 = time.perf_counter()
    table = profile_sps(engine)
    measured = table["steps_per_second"]
    rates = [f"{b}: {r:.1f}" for b, r in zip(points, measured)]
    pts = ", ".join(rates)
    say(f"profiled SPS(B) in {time.perf_counter() - t0:.1f} s (verify tokens: steps/s): {pts}")
    if path is None:
        # the verify lengths, so a request's random numbers, follow the table
        if engine.temperature > 0:
            say("note: this SPS table is not saved, and another run profiles its own; sampled runs repeat "
                "token for token only with the same table: --sps-table FILE saves it, and reads it back "
                "next time")
        return table
    try:
        write_json(path, table, indent=1)
    except OSError as e:
        raise UserError(f"--sps-table {path}: cannot write the table ({e.strerror})") from None
    say(f"SPS table written to {path}")
    return table
