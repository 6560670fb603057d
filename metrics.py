"""What a run's rounds mean in numbers: one definition of each metric, used by speculate.py (its
summary line and trace), eval.py (per dataset, summed over ranks) and the benchmarks.

Everything starts from raw counts (`count`), which add across requests, datasets and processes;
the metrics are ratios of those sums, never averages of averages. A round record is one line of
the trace: `verified` drafts went to the target, `accepted` of them survived, then one token more
(the correction or bonus) was committed. A round is counted as the authors' evaluation counts it
(DeepSpec's eval): when a stop token is among the accepted drafts, the round ends at that token —
it has verified and accepted the drafts up to and including it, and commits those alone (no bonus).
Tokens a last round produces past the token budget are counted, as theirs are.

Under the authors' names and definitions (docs/algorithm.md, "Evaluation"):
- `acceptance_length` τ: tokens committed per round = Σ committed / rounds;
- `draft_tokens_per_proposal`: drafts sent to the target per round = Σ verified / rounds (the
  verify budget; speculate.py's summary calls it `verified_per_round`);
- `verify_rate`: Σ committed / (Σ verified + rounds), committed tokens per token the target verified;
- `accept_rates_by_position[j]`: rounds that accepted more than j drafts ÷ rounds that verified more
  than j (j = 0 .. K-1).
And the paper's per-position acceptance (its Figure 2), conditional on the earlier drafts:
- `accept_rate_by_position[k-1]`: rounds that accepted draft k ÷ rounds that accepted drafts 1..k-1
  and verified draft k.
A ratio with nothing behind it is None — also a conditional rate no round tried (undefined, not a
position that always rejects: 0.0 would read as one).
"""

from __future__ import annotations

from typing import Iterable, Optional

COUNT_KEYS = ("num_samples", "num_rounds", "accepted", "verified", "committed", "drafted", "tokens")
LIST_KEYS = ("verified_at", "accepted_at", "tried", "ok")


def round_counts(rd: dict, stop_ids: Iterable[int] = ()) -> tuple[int, int, int]:
    """(accepted, verified, committed) of one round record; a stop token among the accepted drafts
    ends the round at it."""
    n = rd["accepted"]
    for j, t in enumerate(rd["draft"][:n]):
        if t in stop_ids:
            return j + 1, j + 1, j + 1
    return n, rd["verified"], n + 1


def count(requests, K: int, stop_ids: Iterable[int] = ()) -> dict:
    """Raw counts of finished requests (objects with `.rounds`, trace records, and `.output_ids`).
    COUNT_KEYS are sums; per draft position j = 0..K-1: `verified_at` / `accepted_at` (rounds that
    verified / accepted more than j drafts), `tried` (drafts 1..j accepted, draft j+1 verified) and
    `ok` (drafts 1..j+1 accepted)."""
    stop = set(stop_ids)
    rounds = [(round_counts(rd, stop), len(rd["draft"])) for r in requests for rd in r.rounds]
    c = {"num_samples": len(requests), "num_rounds": len(rounds),
         "accepted": sum(a for (a, _, _), _ in rounds), "verified": sum(v for (_, v, _), _ in rounds),
         "committed": sum(t for (_, _, t), _ in rounds), "drafted": sum(d for _, d in rounds),
         "tokens": sum(len(r.output_ids) for r in requests)}
    c["verified_at"] = [sum(1 for (_, v, _), _ in rounds if v > j) for j in range(K)]
    c["accepted_at"] = [sum(1 for (a, _, _), _ in rounds if a > j) for j in range(K)]
    c["tried"] = [sum(1 for (a, v, _), _ in rounds if a >= j and v > j) for j in range(K)]
    c["ok"] = c["accepted_at"]
    return c


def flatten(c: dict) -> list[int]:
    """The counts as one list of integers (to sum across processes); `unflatten` inverts it."""
    return [c[k] for k in COUNT_KEYS] + [x for k in LIST_KEYS for x in c[k]]


def unflatten(values: list[int], K: int) -> dict:
    c = dict(zip(COUNT_KEYS, values))
    rest = values[len(COUNT_KEYS):]
    c.update({k: rest[i * K:(i + 1) * K] for i, k in enumerate(LIST_KEYS)})
    return c


def acceptance_length(c: dict) -> Optional[float]:
    """τ = Σ committed / rounds."""
    return c["committed"] / c["num_rounds"] if c["num_rounds"] else None


def verified_per_round(c: dict) -> Optional[float]:
    """Σ verified / rounds (the authors' draft_tokens_per_proposal)."""
    return c["verified"] / c["num_rounds"] if c["num_rounds"] else None


def verify_rate(c: dict) -> Optional[float]:
    """Σ committed / (Σ verified + rounds)."""
    return c["committed"] / (c["verified"] + c["num_rounds"]) if c["num_rounds"] else None


def accept_rates_by_position(c: dict) -> list[Optional[float]]:
    """The authors': rounds that accepted more than j drafts ÷ rounds that verified more than j."""
    return [a / v if v else None for a, v in zip(c["accepted_at"], c["verified_at"])]


def accept_rate_by_position(c: dict) -> list[Optional[float]]:
    """The paper's conditional rate of draft k: ok_k / tried_k (None where no round tried position k)."""
    return [ok / tried if tried else None for ok, tried in zip(c["ok"], c["tried"])]
