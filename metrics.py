"""What a run's rounds mean in numbers: one definition of each metric, used by speculate.py (its
summary line and trace), eval.py (per dataset, summed over ranks) and the benchmarks.

Everything starts from raw counts (`count`), which add across requests, datasets and processes;
the metrics are ratios of those sums, never averages of averages. A round record is one line of
the trace: `verified` drafts went to the target, `accepted` of them survived, then one token more
(the correction or bonus) was committed.

- τ, `acceptance_length`: tokens committed per round, bonus included = Σ(accepted + 1) / rounds.
- `accept_rate_by_position[k-1]`: the rate of accepting draft k among the rounds that accepted
  drafts 1..k-1 and sent draft k to the target (the paper's per-position acceptance, conditional).
- `verified_per_round`: drafts sent to the target per round (the verify budget).
A metric with no rounds behind it is None.
"""

from __future__ import annotations

from typing import Optional

COUNT_KEYS = ("num_samples", "num_rounds", "accepted", "verified", "drafted", "tokens")


def count(requests, K: int) -> dict:
    """Raw counts of finished requests (objects with `.rounds`, trace records, and `.output_ids`):
    COUNT_KEYS plus per position k = 1..K `tried` (drafts 1..k-1 accepted, draft k verified) and `ok`
    (drafts 1..k accepted)."""
    rounds = [rd for r in requests for rd in r.rounds]
    return {"num_samples": len(requests), "num_rounds": len(rounds),
            "accepted": sum(rd["accepted"] for rd in rounds), "verified": sum(rd["verified"] for rd in rounds),
            "drafted": sum(len(rd["draft"]) for rd in rounds), "tokens": sum(len(r.output_ids) for r in requests),
            "tried": [sum(1 for rd in rounds if rd["accepted"] >= k - 1 and rd["verified"] >= k) for k in range(1, K + 1)],
            "ok": [sum(1 for rd in rounds if rd["accepted"] >= k) for k in range(1, K + 1)]}


def acceptance_length(c: dict) -> Optional[float]:
    """τ = Σ(accepted + 1) / rounds."""
    return (c["accepted"] + c["num_rounds"]) / c["num_rounds"] if c["num_rounds"] else None


def accept_rate_by_position(c: dict) -> list[float]:
    """ok_k / tried_k for k = 1..K (0.0 where no round tried position k)."""
    return [ok / tried if tried else 0.0 for ok, tried in zip(c["ok"], c["tried"])]


def verified_per_round(c: dict) -> Optional[float]:
    """Σ verified / rounds."""
    return c["verified"] / c["num_rounds"] if c["num_rounds"] else None
