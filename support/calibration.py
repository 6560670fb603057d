"""How well the confidence head predicts acceptance, as the paper measures it (docs/evaluation.md): per draft
position, the prefix survival a_k = Π_{i<=k} c_i against the event "drafts 1..k accepted" over the rounds that
verified draft k, scored by ECE, AUROC and Brier (numpy, float64); Sequential Temperature Scaling (STS) fitted
on a split of the requests and scored on the rest."""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from support import metrics as mt

ECE_BINS = 20
# STS's 1-D search space: temperatures for c_k's logit, geometric from 1/20 to 20 (1.0 included).
_GEOMETRIC = np.geomspace(0.05, 20.0, 241)
STS_GRID = np.unique(np.concatenate([_GEOMETRIC, [1.0]]))


def bin_index(p: np.ndarray, bins: int) -> np.ndarray:
    """Each probability's bin among [b/bins, (b+1)/bins), the last one closed."""
    return np.clip((p * bins).astype(np.int64), 0, bins - 1)


def ece(p, y, bins: int = ECE_BINS) -> Optional[float]:
    """Σ_b (n_b / N) |mean(y_b) - mean(p_b)| over bins [b/bins, (b+1)/bins), the last one closed."""
    p = np.asarray(p, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if p.size == 0:
        return None
    idx = bin_index(p, bins)
    observed = np.bincount(idx, weights=y, minlength=bins)
    predicted = np.bincount(idx, weights=p, minlength=bins)
    gap = np.abs(observed - predicted)
    return float(gap.sum() / p.size)


def auroc(p, y) -> Optional[float]:
    """Mann-Whitney U, ties sharing their mean rank; None with one class."""
    p = np.asarray(p, dtype=np.float64)
    y = np.asarray(y).astype(bool)
    n1 = int(y.sum())
    n0 = y.size - n1
    if n1 == 0 or n0 == 0:
        return None
    _, inverse, counts = np.unique(p, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    first = np.concatenate([[0], ends[:-1]])  # each distinct value's first 0-based rank
    mean_rank = first + (counts + 1) / 2.0
    ranks = mean_rank[inverse]
    lowest = n1 * (n1 + 1) / 2.0  # the positives' rank sum when all rank lowest
    u = ranks[y].sum() - lowest
    return float(u / (n1 * n0))


def brier(p, y) -> Optional[float]:
    p = np.asarray(p, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if p.size == 0:
        return None
    return float(np.mean((p - y) ** 2))


def _logit(c):
    c = np.asarray(c, dtype=np.float64)
    c = np.clip(c, 1e-12, 1 - 1e-12)  # float32 sigmoids reach 0 and 1 exactly
    return np.log(c) - np.log1p(-c)


def _sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # no overflow warnings


def apply_temperatures(confidence, temperatures):
    """c_k -> σ(logit(c_k) / T_k)."""
    t = np.asarray(temperatures, dtype=np.float64)
    return _sigmoid(_logit(confidence) / t)


def uncalibrate(confidence: np.ndarray, temperatures: list[float]) -> np.ndarray:
    """The raw head's c_k from recorded σ(logit_k / T_k)."""
    t = np.asarray(temperatures, dtype=np.float64)
    raw = _sigmoid(_logit(confidence) * t)
    return raw.astype(np.float32)


def saturated(confidence: np.ndarray) -> int:
    """Recorded float32 confidences at exactly 0 or 1: `uncalibrate` cannot recover those."""
    c = np.asarray(confidence, dtype=np.float32)
    return int(np.count_nonzero((c <= 0) | (c >= 1)))


def survival_events(confidence, verified, accepted, k: int):
    """Prefix survival a_k = Π_{i≤k} c_i and the event "drafts 1..k accepted", over the rounds that
    verified draft k (1-based)."""
    mask = np.asarray(verified) >= k
    c = np.asarray(confidence, dtype=np.float64)
    a = np.prod(c[mask, :k], axis=1)
    survived = np.asarray(accepted)[mask] >= k
    return a, survived


def position_metrics(confidence, verified, accepted, bins: int) -> list[dict]:
    out = []
    for k in range(1, np.shape(confidence)[1] + 1):
        a, y = survival_events(confidence, verified, accepted, k)
        mean_survival = None
        observed_survival = None
        if a.size:
            mean_survival = float(a.mean())
            observed_survival = float(y.mean())
        out.append({
            "position": k,
            "rounds": int(a.size),
            "survived": int(y.sum()),
            "mean_survival": mean_survival,
            "observed_survival": observed_survival,
            "ece": ece(a, y, bins),
            "auroc": auroc(a, y),
            "brier": brier(a, y),
        })
    return out


def fit_sts(confidence, verified, accepted, bins: int = ECE_BINS) -> list[float]:
    """Sequential Temperature Scaling: for k = 1..K in order, the T_k minimising the ECE of a_k with
    the earlier positions calibrated. Ties go to the T nearest 1; a position never verified keeps 1."""
    C = np.asarray(confidence, dtype=np.float64)
    N, K = C.shape
    logits = _logit(C)
    verified = np.asarray(verified)
    accepted = np.asarray(accepted)
    temps = np.ones(K)
    prefix = np.ones(N)  # a_{k-1} with positions 1..k-1 calibrated
    order = np.argsort(np.abs(np.log(STS_GRID)), kind="stable")
    candidates = STS_GRID[order]  # nearest 1 first, so argmin's first minimum is the tie-break
    for k in range(K):
        mask = verified >= k + 1
        if mask.any():
            y = accepted[mask] >= k + 1
            errs = []
            for t in candidates:
                a = prefix[mask] * _sigmoid(logits[mask, k] / t)
                errs.append(ece(a, y, bins))
            temps[k] = candidates[int(np.argmin(errs))]
        prefix = prefix * _sigmoid(logits[:, k] / temps[k])
    return [float(t) for t in temps]


def round_arrays(requests: list, dataset: int, K: int, stop_ids) -> dict:
    """Finished requests' rounds as arrays (confidence: the engine's float32 values); a round that
    accepted a stop token ends there (`metrics.round_counts`)."""
    request = []
    number = []
    confidence = []
    verified = []
    accepted = []
    for r in requests:
        for rd in r.rounds:
            round_accepted, round_verified, _ = mt.round_counts(rd, stop_ids)
            request.append(r.index)
            number.append(rd["round"])
            confidence.append(rd["confidence"])
            verified.append(round_verified)
            accepted.append(round_accepted)
    n = len(request)
    return {"dataset": np.full(n, dataset, dtype=np.int32),
            "request": np.array(request, dtype=np.int64),
            "round": np.array(number, dtype=np.int64),
            "confidence": np.array(confidence, dtype=np.float32).reshape(n, K),  # (0, K) with no rounds
            "verified": np.array(verified, dtype=np.int64),
            "accepted": np.array(accepted, dtype=np.int64)}


def concat_rounds(parts: list[dict]) -> dict:
    rec = {}
    for k in parts[0]:
        rec[k] = np.concatenate([p[k] for p in parts])
    order = np.lexsort((rec["round"], rec["request"], rec["dataset"]))  # by dataset, request, round
    return {k: v[order] for k, v in rec.items()}


def calibration_report(rec: dict, split: float, requests: list[int], bins: int = ECE_BINS,
                       names: Optional[list[str]] = None) -> Optional[dict]:
    """`raw` pooled over every round, `raw_by_dataset` per dataset (as the authors report it); unless
    split is 0, STS fitted on the first `split` (< 1) of every dataset's requests (`requests`: how many
    each dataset has, numbered from 0; one that ended at its first token adds no round), scored on the
    rest."""
    C = rec["confidence"].astype(np.float64)
    rounds, positions = C.shape
    if rounds == 0 or positions == 0:
        return None
    ver = rec["verified"]
    acc = rec["accepted"]
    ds = rec["dataset"]
    by_dataset = {}
    for d in np.unique(ds):
        name = str(d)
        if names:
            name = names[d]
        rows = ds == d
        by_dataset[name] = position_metrics(C[rows], ver[rows], acc[rows], bins)
    report = {
        "positions": positions,
        "bins": bins,
        "rounds": int(rounds),
        "raw": position_metrics(C, ver, acc, bins),
        "split": split,
        "raw_by_dataset": by_dataset,
        "_all": (C, ver, acc),  # "_" entries are for the plot, not the JSON
    }
    if split == 0:  # no STS (--calibration-split is checked to be in [0, 1))
        return report
    # The fit part: the first `split` of every dataset's requests.
    fit = np.zeros(rounds, dtype=bool)
    for d in np.unique(ds):
        boundary = fit_requests(split, requests[d])
        fit |= (ds == d) & (rec["request"] < boundary)
    if not fit.any() or fit.all():
        report["sts_note"] = "too few requests to split into fit and held-out parts; no STS"
        return report
    temps = fit_sts(C[fit], ver[fit], acc[fit], bins=bins)
    held = ~fit
    Ch = C[held]
    vh = ver[held]
    ah = acc[held]
    Cs = apply_temperatures(Ch, temps)
    report["temperatures"] = temps
    report["fit_rounds"] = int(fit.sum())
    # the rounds each T_k was fitted on (0: never verified, kept 1)
    report["fit_rounds_by_position"] = [int((ver[fit] >= k + 1).sum()) for k in range(C.shape[1])]
    report["heldout_rounds"] = int(held.sum())
    report["raw_heldout"] = position_metrics(Ch, vh, ah, bins)
    report["sts_heldout"] = position_metrics(Cs, vh, ah, bins)
    report["_heldout"] = (Ch, vh, ah)
    return report


def fit_requests(split: float, requests: int) -> int:
    """How many of a dataset's first requests fit STS: floor(split x requests), the product rounded to
    9 decimals first (0.29 x 100 is 28.999999999999996 in floating point)."""
    return math.floor(round(split * requests, 9))


def reliability_title(calibration: dict) -> str:
    """Which rounds the reliability diagram shows, in its report's bins, and whether a schedule chose them."""
    if "_heldout" in calibration:
        title = (f"held-out requests: {calibration['heldout_rounds']} rounds (the other "
                 f"{calibration['fit_rounds']} fitted STS)")
    else:
        title = f"every round: {calibration['rounds']} (no STS)"
    title += f"; ECE over {calibration['bins']} bins"
    if calibration.get("scheduled"):
        title += f"; chosen under --scheduler {calibration['scheduled']}: biased"
    return title


def reliability_panels(calibration: dict) -> list[dict]:
    """Before / after STS on the held-out requests, or the raw head on every round without STS, in the
    report's ECE bins."""
    bins = calibration["bins"]
    Cs = None
    if "_heldout" in calibration:
        C, ver, acc = calibration["_heldout"]
        Cs = apply_temperatures(C, calibration["temperatures"])
    else:
        C, ver, acc = calibration["_all"]
    panels = []
    for k in range(1, C.shape[1] + 1):
        before = survival_events(C, ver, acc, k)
        after = None
        ece_after = None
        if Cs is not None:
            after = survival_events(Cs, ver, acc, k)
            ece_after = ece(*after, bins)
        panels.append({
            "position": k,
            "before": before,
            "after": after,
            "ece_before": ece(*before, bins),
            "ece_after": ece_after,
            "auroc": auroc(*before),
        })
    return panels
