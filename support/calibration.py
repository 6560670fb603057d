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
STS_GRID = np.unique(np.concatenate([np.geomspace(0.05, 20.0, 241), [1.0]]))


def ece(p, y, bins: int = ECE_BINS) -> Optional[float]:
    """Σ_b (n_b / N) |mean(y_b) - mean(p_b)| over bins [b/bins, (b+1)/bins), the last one closed."""
    p, y = np.asarray(p, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if p.size == 0:
        return None
    idx = np.minimum((p * bins).astype(np.int64), bins - 1)
    gap = np.abs(np.bincount(idx, weights=y, minlength=bins) - np.bincount(idx, weights=p, minlength=bins))
    return float(gap.sum() / p.size)


def auroc(p, y) -> Optional[float]:
    """Mann-Whitney U, ties sharing their mean rank; None with one class."""
    p, y = np.asarray(p, dtype=np.float64), np.asarray(y).astype(bool)
    n1 = int(y.sum())
    n0 = y.size - n1
    if n1 == 0 or n0 == 0:
        return None
    _, inverse, counts = np.unique(p, return_inverse=True, return_counts=True)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    ranks = (first + (counts + 1) / 2.0)[inverse]
    return float((ranks[y].sum() - n1 * (n1 + 1) / 2.0) / (n1 * n0))


def brier(p, y) -> Optional[float]:
    p, y = np.asarray(p, dtype=np.float64), np.asarray(y, dtype=np.float64)
    return float(np.mean((p - y) ** 2)) if p.size else None


def _logit(c):
    c = np.clip(np.asarray(c, dtype=np.float64), 1e-12, 1 - 1e-12)  # float32 sigmoids reach 0 and 1 exactly
    return np.log(c) - np.log1p(-c)


def _sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # no overflow warnings


def apply_temperatures(confidence, temperatures):
    """c_k -> σ(logit(c_k) / T_k)."""
    return _sigmoid(_logit(confidence) / np.asarray(temperatures, dtype=np.float64))


def uncalibrate(confidence: np.ndarray, temperatures: list[float]) -> np.ndarray:
    """The raw head's c_k from recorded σ(logit_k / T_k)."""
    return _sigmoid(_logit(confidence) * np.asarray(temperatures, dtype=np.float64)).astype(np.float32)


def saturated(confidence: np.ndarray) -> int:
    """Recorded float32 confidences at exactly 0 or 1: `uncalibrate` cannot recover those."""
    c = np.asarray(confidence, dtype=np.float32)
    return int(np.count_nonzero((c <= 0) | (c >= 1)))


def survival_events(confidence, verified, accepted, k: int):
    """Prefix survival a_k = Π_{i≤k} c_i and the event "drafts 1..k accepted", over the rounds that
    verified draft k (1-based)."""
    mask = np.asarray(verified) >= k
    a = np.prod(np.asarray(confidence, dtype=np.float64)[mask, :k], axis=1)
    return a, (np.asarray(accepted)[mask] >= k)


def position_metrics(confidence, verified, accepted, bins: int = ECE_BINS) -> list[dict]:
    out = []
    for k in range(1, np.shape(confidence)[1] + 1):
        a, y = survival_events(confidence, verified, accepted, k)
        out.append({"position": k, "rounds": int(a.size), "survived": int(y.sum()),
                    "mean_survival": float(a.mean()) if a.size else None,
                    "observed_survival": float(y.mean()) if a.size else None,
                    "ece": ece(a, y, bins), "auroc": auroc(a, y), "brier": brier(a, y)})
    return out


def fit_sts(confidence, verified, accepted, grid=STS_GRID, bins: int = ECE_BINS) -> list[float]:
    """Sequential Temperature Scaling: for k = 1..K in order, the T_k minimising the ECE of a_k with
    the earlier positions calibrated. Ties go to the T nearest 1; a position never verified keeps 1."""
    C = np.asarray(confidence, dtype=np.float64)
    N, K = C.shape
    logits = _logit(C)
    verified, accepted = np.asarray(verified), np.asarray(accepted)
    temps, prefix = np.ones(K), np.ones(N)
    order = np.argsort(np.abs(np.log(grid)), kind="stable")
    for k in range(K):
        mask = verified >= k + 1
        if mask.any():
            y = accepted[mask] >= k + 1
            errs = [ece(prefix[mask] * _sigmoid(logits[mask, k] / t), y, bins) for t in grid[order]]
            temps[k] = grid[order][int(np.argmin(errs))]
        prefix = prefix * _sigmoid(logits[:, k] / temps[k])
    return [float(t) for t in temps]


def round_arrays(requests: list, dataset: int, K: int, stop_ids=()) -> dict:
    """Finished requests' rounds as arrays (confidence: the engine's float32 values); a round that
    accepted a stop token ends there (`metrics.round_counts`)."""
    rounds = [(r.index, rd, mt.round_counts(rd, stop_ids)) for r in requests for rd in r.rounds]
    n = len(rounds)
    return {"dataset": np.full(n, dataset, dtype=np.int32),
            "request": np.array([i for i, _, _ in rounds], dtype=np.int64).reshape(n),
            "round": np.array([rd["round"] for _, rd, _ in rounds], dtype=np.int64).reshape(n),
            "confidence": np.array([rd["confidence"] for _, rd, _ in rounds], dtype=np.float32).reshape(n, K),
            "verified": np.array([c[1] for _, _, c in rounds], dtype=np.int64).reshape(n),
            "accepted": np.array([c[0] for _, _, c in rounds], dtype=np.int64).reshape(n)}


def concat_rounds(parts: list[dict]) -> dict:
    rec = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    order = np.lexsort((rec["round"], rec["request"], rec["dataset"]))
    return {k: v[order] for k, v in rec.items()}


def calibration_report(rec: dict, split: float, bins: int = ECE_BINS,
                       names: Optional[list[str]] = None) -> Optional[dict]:
    """`raw` pooled over every round, `raw_by_dataset` per dataset (as the authors report it); with
    0 < split < 1, STS fitted on the first `split` of every dataset's requests, scored on the rest."""
    C = rec["confidence"].astype(np.float64)
    if C.shape[0] == 0 or C.shape[1] == 0:
        return None
    ver, acc, ds = rec["verified"], rec["accepted"], rec["dataset"]
    report = {"positions": C.shape[1], "bins": bins, "rounds": int(C.shape[0]),
              "raw": position_metrics(C, ver, acc, bins), "split": split,
              "raw_by_dataset": {(names[d] if names else str(d)): position_metrics(
                  C[ds == d], ver[ds == d], acc[ds == d], bins) for d in np.unique(ds)},
              "_all": (C, ver, acc)}  # "_" entries are for the plot, not the JSON
    if not 0 < split < 1:
        return report
    fit = np.zeros(C.shape[0], dtype=bool)
    for d in np.unique(ds):
        reqs = np.unique(rec["request"][ds == d])
        fit |= (ds == d) & np.isin(rec["request"], reqs[:int(math.floor(split * len(reqs)))])
    if not fit.any() or fit.all():
        report["sts_note"] = "too few requests to split into fit and held-out parts; no STS"
        return report
    temps = fit_sts(C[fit], ver[fit], acc[fit], bins=bins)
    Ch, vh, ah = C[~fit], ver[~fit], acc[~fit]
    report.update(temperatures=temps, fit_rounds=int(fit.sum()), heldout_rounds=int((~fit).sum()),
                  raw_heldout=position_metrics(Ch, vh, ah, bins),
                  sts_heldout=position_metrics(apply_temperatures(Ch, temps), vh, ah, bins), _heldout=(Ch, vh, ah))
    return report


def reliability_panels(calibration: dict, bins: int) -> list[dict]:
    """Before / after STS on the held-out requests, or the raw head on every round without STS."""
    C, ver, acc = calibration["_heldout"] if "_heldout" in calibration else calibration["_all"]
    Cs = apply_temperatures(C, calibration["temperatures"]) if "_heldout" in calibration else None
    panels = []
    for k in range(1, C.shape[1] + 1):
        before = survival_events(C, ver, acc, k)
        after = survival_events(Cs, ver, acc, k) if Cs is not None else None
        panels.append({"position": k, "before": before, "after": after, "ece_before": ece(*before, bins),
                       "ece_after": ece(*after, bins) if after else None, "auroc": auroc(*before)})
    return panels
