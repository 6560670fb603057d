"""How many drafts a round verifies (docs/algorithm.md, "Scheduling"; the paper's §3.2.2).

`Scheduler` is what the engine holds: called inside the round's draft graph, it turns the drafts'
confidences into verify lengths ℓ [B], one of
- "none": the whole block, every round;
- "threshold": the drafts before the first confidence below θ;
- "hardware": the paper's Algorithm 1 over the whole batch (`hardware_schedule`), which weighs the
  expected accepted tokens against SPS(B), the engine's measured rounds per second when a round
  verifies B tokens;
- "async": the paper's production variant (§5.2): the batch's capacity C, how many drafts it verifies,
  is searched host side over SPS(B) without an early stop from the confidences of two rounds earlier
  (`capacity_search`, `Scheduler.plan`), so the verify size is known before the draft graph runs;
  inside it the C drafts with the highest current prefix survival are verified (`top_capacity`).
Host side it also owns the verify sizes: compiled, a ragged verification is padded to one of a few
`verify_buckets` (one graph each), and with an SPS table a count goes to the fastest bucket that
holds it. SPS(B) is profiled by timing the engine's own rounds (`profile`), fitted into a curve
(`sps_curve`), and kept in a JSON table that is reused only for the exact configuration it was
measured on (`load_or_profile`). The flags' checks live here too (`resolve_scheduler`,
`check_schedulable`, `parse_buckets`), for speculate.py and eval.py alike.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Callable, NamedTuple, Optional, Union

import torch

from common import UserError, check_writable, parse_ints, read_json, write_json

KINDS = ("none", "threshold", "hardware", "async")
SPS_KINDS = ("hardware", "async")  # the schedules that read SPS(B)


def threshold_schedule(confidence: torch.Tensor, threshold: float) -> torch.Tensor:
    """ℓ [B]: the drafts before the first confidence below the threshold (0 if c_1 < θ)."""
    return torch.cumprod((confidence >= threshold).long(), dim=1).sum(1)


def hardware_schedule(confidence: torch.Tensor, active: torch.Tensor, sps: torch.Tensor) -> torch.Tensor:
    """The paper's Algorithm 1, on the device, for the whole batch at once.

    confidence [B, K] (c_{r,j}, calibrated if the drafter was); active [B]; sps [B*(K+1) + 1]:
    measured steps/second of a round that verifies B tokens. Candidates (r, j) with prefix survival
    a_{r,j} = Π_{i<=j} c_{r,i} > 0 are sorted by a, descending (a stable sort, so j-1 comes before j
    in a tie); admitting the i-th gives B = R + i tokens and τ = R + the sum of the admitted a;
    admission stops at the first one whose τ·SPS(B) does not beat the best so far, which is always
    the one before it — so nothing past the stop, and no token's own realisation, decides whether
    it is verified (the lossless condition).
    Returns ℓ [B]: the admitted candidates of each row (a prefix, as a is non-increasing in j).
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


def top_capacity(confidence: torch.Tensor, active: torch.Tensor, capacity: torch.Tensor) -> torch.Tensor:
    """The async scheduler's selection, on the device: of the candidates (r, j) of active rows with
    prefix survival a_{r,j} = Π_{i<=j} c_{r,i} > 0, the `capacity` ones with the highest a (capacity: a
    0-d long tensor, fixed before these drafts were drawn). The sort is stable and a never rises with j,
    so j-1 ranks before j and every row gets a prefix; whether (r, j) is taken depends on a_{r,j} and
    the candidates ranked before it — never on x_{r,j} or on anything drawn after it.
    Returns ℓ [B]."""
    B, K = confidence.shape
    a = torch.cumprod(confidence.double(), dim=1) * active[:, None]  # inactive rows offer nothing
    a_sorted, order = torch.sort(a.reshape(-1), descending=True, stable=True)
    take = (torch.arange(B * K, device=a.device) < capacity) & (a_sorted > 0)
    return torch.zeros(B * K, dtype=torch.long, device=a.device).scatter(0, order, take.long()).view(B, K).sum(1)


def capacity_search(confidence: list[list[float]], R: int, sps: list[float], limit: int) -> int:
    """The async scheduler's capacity, host side: the C in 0 .. limit that maximises
    Θ(C) = (R + the sum of the C largest prefix survivals) · SPS(R + C) — Algorithm 1's objective along
    its greedy path, searched to the end (no early stop), so the search steps over cliffs of a jagged
    SPS curve. confidence: one list of K per row of the round the forecast comes from; R: the active
    rows of the round it is for; sps[B]: SPS(B) by verify tokens. Ties go to the smallest C. Plain
    Python: a few hundred numbers, which torch's per-operation overhead would make slower."""
    a = []
    for row in confidence:
        prod = 1.0
        for c in row:
            prod *= c
            if prod > 0:
                a.append(prod)
    a.sort(reverse=True)
    best, C, tau = R * sps[R], 0, float(R)
    for i, x in enumerate(a[:limit], start=1):
        tau += x
        if tau * sps[R + i] > best:
            best, C = tau * sps[R + i], i
    return C


class Plan(NamedTuple):
    """An async round's schedule, fixed before its drafts exist (`Scheduler.plan`)."""
    capacity: int          # C: how many drafts the whole batch verifies at most
    source: Union[int, str]  # the batch round whose confidences chose C, or "warmup"
    round: int             # this round's number among the decode's batch rounds (all rows step together)
    num_tokens: int        # the verify size: the active rows' anchors + C, padded to a bucket when compiled
    tensor: torch.Tensor   # C as a 0-d tensor on the device: the draft graph's input

    def trace(self) -> dict:
        """The keys it adds to a round record (docs/trace-format.md)."""
        return {"batch_round": self.round, "capacity": self.capacity, "capacity_from_round": self.source}


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


class Scheduler:
    """The engine's verification schedule (`kind` in KINDS) for `batch` rows of K drafts.

    Device side, `__call__(confidence, active)` gives ℓ [B] inside the draft graph. Host side,
    `bucket(n)` is the size a ragged verification of n tokens is padded to (n itself when eager).
    "hardware" reads SPS(B) from `self.sps`, a flat placeholder until `set_sps` fills it in place —
    so warm-up, profiling and decoding all run (and compile) the very same graph.
    "async" is planned on the host before each round: `plan(R)` gives the capacity (from the history
    that `observe` keeps) and the verify size, and `__call__(confidence, active, capacity)` selects
    inside the draft graph.
    """

    def __init__(self, kind: str, K: int, batch: int, *, threshold: float = 0.0,
                 buckets: Optional[list[int]] = None, compiled: bool = False, device="cpu"):
        if kind not in KINDS:
            raise ValueError(f"unknown scheduler {kind!r}")
        self.kind, self.K, self.threshold = kind, K, threshold
        top = batch * (K + 1)  # tokens of a round that verifies every draft of every row
        # Compiled, verification is padded to a few token counts (one graph each); eager runs the
        # exact count. SPS is profiled at the buckets, or at the same geometric points when eager.
        self.buckets = sorted(buckets) if buckets else (verify_buckets(top) if compiled else None)
        self.profile_points = self.buckets or verify_buckets(top)
        # SPS(B) by verify tokens: on the device for Algorithm 1, on the host for the async search.
        self.sps = (torch.ones(top + 1, dtype=torch.float64, device=device if kind == "hardware" else "cpu")
                    if kind in SPS_KINDS else None)
        self.table: Optional[dict] = None  # the SPS table in use (set_sps)
        self.route: Optional[list[int]] = None
        self.capacity = torch.zeros((), dtype=torch.long, device=device) if kind == "async" else None
        self.reset()

    def __call__(self, confidence: Optional[torch.Tensor], active: torch.Tensor,
                 capacity: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.kind == "async":
            return top_capacity(confidence, active, capacity)
        if self.kind == "hardware":
            return hardware_schedule(confidence, active, self.sps)
        if self.kind == "threshold":
            return threshold_schedule(confidence, self.threshold)
        if self.kind == "none":
            return torch.full(active.shape, self.K, dtype=torch.long, device=active.device)
        # A kind added to KINDS without its branch here must not run as "none" under its own name.
        raise NotImplementedError(f"scheduler {self.kind!r}: Scheduler.__call__ has no branch for it")

    def bucket(self, n: int) -> int:
        """The token count n verify tokens are padded to: n itself without buckets, else the smallest
        bucket that holds them, or with an SPS table the fastest (a bigger bucket may be quicker)."""
        if self.buckets is None:
            return n
        if self.route is not None:
            return self.route[n]
        for b in self.buckets:
            if b >= n:
                return b
        raise UserError(f"--verify-buckets: the largest bucket {self.buckets[-1]} is below the {n} tokens "
                        f"a round verifies")

    # The async schedule's host side: the batch's confidences, round by round, and the plan.

    def reset(self):
        """Forget the history: a new decode starts with two warm-up rounds."""
        self.history: list[list[list[float]]] = []  # the last two rounds' confidences, K per active row
        self.rounds = 0                         # rounds observed in this decode

    def observe(self, confidence: list[list[float]]):
        """A finished round's confidences, one list per row that was active in it (its RoundRecords)."""
        self.history = (self.history + [confidence])[-2:]
        self.rounds += 1

    def plan(self, R: int) -> Plan:
        """The capacity and verify size of the next round, for R active rows, before its drafts exist.

        C comes from the round two before it (`capacity_search` on that round's confidences: a
        pipelined engine has not read the previous round yet when it must size this one), at most the
        R·K drafts there are; compiled, the verify size R + C is padded to a bucket and C grows to fill
        it (those tokens cost nothing more). The first two rounds of a decode have no such round: they
        verify every draft, the `none` schedule — lossless without any confidence, no SPS read, and
        two rounds of a whole decode."""
        r, limit = self.rounds, R * self.K
        if r < 2:
            C, source = limit, "warmup"
        else:
            C, source = capacity_search(self.history[0], R, self.sps.tolist(), limit), r - 2
        num_tokens = self.bucket(R + C)
        return self.fixed(num_tokens, min(num_tokens - R, limit), source, r)

    def fixed(self, num_tokens: int, capacity: Optional[int] = None, source: Union[int, str] = "fixed",
              round: int = -1) -> Plan:
        """A plan of exactly num_tokens verify tokens (by default capacity num_tokens: the dummy rounds
        of warm-up and profiling set their own verify lengths)."""
        capacity = num_tokens if capacity is None else capacity
        self.capacity.fill_(capacity)  # in place: no host-to-device copy to wait for
        return Plan(capacity, source, round, num_tokens, self.capacity)

    def set_sps(self, table: dict):
        """Use a profiled SPS table (`profile`, or read by `load_or_profile`)."""
        sps, self.route = sps_curve(self.profile_points, table["steps_per_second"], self.buckets, len(self.sps) - 1)
        self.table = table
        self.sps.copy_(torch.tensor(sps, dtype=torch.float64))  # in place: a compiled graph may hold it

    def set_curve(self, sps: list[float]):
        """Use SPS(B) as given for every B = 0 .. top — no fit, no routing to a faster bucket (a synthetic
        curve: scripts/bench_concurrency.py --sps-synthetic)."""
        if len(sps) != len(self.sps):
            raise ValueError(f"an SPS curve needs {len(self.sps)} values (B = 0 .. {len(self.sps) - 1}), "
                             f"got {len(sps)}")
        self.sps.copy_(torch.tensor(sps, dtype=torch.float64))
        self.table, self.route = {"steps_per_second_by_tokens": list(sps)}, None


def resolve_scheduler(args) -> str:
    """--scheduler's value (default: threshold when --confidence-threshold > 0, else none), checked
    against --confidence-threshold, --sps-table and --verify-buckets before anything is loaded.
    `args` has those fields (speculate's Args or eval's)."""
    kind = args.scheduler or ("threshold" if args.confidence_threshold > 0 else "none")
    if kind == "threshold" and args.confidence_threshold <= 0:
        raise UserError("--scheduler threshold: needs --confidence-threshold above 0")
    if args.scheduler in ("none", "hardware", "async") and args.confidence_threshold > 0:
        raise UserError(f"--confidence-threshold {args.confidence_threshold}: only --scheduler threshold "
                        f"uses it, not --scheduler {args.scheduler}")
    if args.sps_table is not None and kind not in SPS_KINDS:
        raise UserError(f"--sps-table {args.sps_table}: only --scheduler hardware or async uses it")
    if getattr(args, "verify_buckets", None) is not None:
        if kind == "none":
            raise UserError("--verify-buckets: only a scheduled round (--scheduler threshold, hardware or async) "
                            "uses it")
        parse_ints(args.verify_buckets, "--verify-buckets", positive=True, distinct=True)
    return kind


def check_schedulable(kind: str, drafter, threshold: float):
    """A schedule other than none reads the drafts' confidences."""
    if kind != "none" and (drafter is None or drafter.confidence_head is None):
        flag = "--confidence-threshold" if threshold > 0 else f"--scheduler {kind}:"
        raise UserError(f"{flag} needs a --drafter with a confidence head")


def parse_buckets(text: Optional[str], batch: int, drafter) -> Optional[list[int]]:
    """--verify-buckets as a sorted list (None: the engine's default), the largest holding a full round."""
    if text is None:
        return None
    buckets = sorted(parse_ints(text, "--verify-buckets", positive=True, distinct=True))
    need = batch * (drafter.cfg.num_drafts + 1)
    if buckets[-1] < need:
        raise UserError(f"--verify-buckets: the largest bucket {buckets[-1]} is below {need}, the tokens of a full "
                        f"round (batch {batch} x {drafter.cfg.num_drafts + 1})")
    return buckets


def profile(step: Callable[[int], object], points: list[int], sync: Callable[[], None], reps: int = 7) -> list[float]:
    """Seconds per round at every verify size in `points`, measured by running `step(b)` (one engine
    round verifying b tokens). The points are swept `reps` times in turn (after one untimed sweep) and
    each keeps its fastest round: on a shared machine a slow spell then lands on no point in
    particular, and the fastest is the least disturbed."""
    best = [float("inf")] * len(points)
    for sweep in range(reps + 1):
        for i, b in enumerate(points):
            sync()
            t = time.perf_counter()
            step(b)
            sync()
            if sweep:
                best[i] = min(best[i], time.perf_counter() - t)
    return best


def load_or_profile(engine, path: Optional[str], verbose: bool = True) -> dict:
    """The hardware scheduler's SPS table: read from `path` if it exists (every identity key must
    match `engine.sps_identity()`), else profiled now with `engine.profile_sps()` (and written to
    `path` when given)."""
    want = engine.sps_identity()
    points = engine.scheduler.profile_points
    if path is not None and not os.path.isfile(path):
        check_writable(path, "--sps-table")  # to be written: a directory or a missing folder fails now
    if path is not None and os.path.isfile(path):
        table = read_json(path)
        for key, value in want.items():
            if key not in table:
                raise UserError(f"{path}: no {key!r} (not an SPS table written by speculate.py)")
            if json.dumps(table[key], sort_keys=True) != json.dumps(value, sort_keys=True):  # true is not 1
                raise UserError(f"{path}: {key} is {table[key]!r} in the table but {value!r} in this run; "
                                f"delete the file to profile again")
        sps = table.get("steps_per_second")
        if not isinstance(sps, list) or len(sps) != len(points) or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < float("inf") for x in sps):
            raise UserError(f"{path}: 'steps_per_second' must be {len(points)} positive numbers, one per profile point")
        if verbose:
            print(f"SPS table read from {path}", file=sys.stderr)
        return table
    t0 = time.perf_counter()
    table = engine.profile_sps()
    if verbose:
        pts = ", ".join(f"{b}: {r:.1f}" for b, r in zip(points, table["steps_per_second"]))
        print(f"profiled SPS(B) in {time.perf_counter() - t0:.1f} s (verify tokens: steps/s): {pts}", file=sys.stderr)
        if path is None and want.get("sampling"):  # the verify lengths, so a request's random numbers, follow it
            print("note: this SPS table is not saved, and another run profiles its own; sampled runs repeat "
                  "token for token only with the same table: --sps-table FILE saves it, and reads it back next "
                  "time", file=sys.stderr)
    if path is not None:
        try:
            write_json(path, table, indent=1)
        except OSError as e:
            raise UserError(f"--sps-table {path}: cannot write the table ({e.strerror})") from None
        if verbose:
            print(f"SPS table written to {path}", file=sys.stderr)
    return table
