"""What a run's rounds mean in numbers, as the authors define them (docs/algorithm.md, "Evaluation"): ratios of
raw counts (`count`) that add across requests, datasets and processes, never averages of averages. A round
verifies drafts, accepts some, commits one token more; an accepted stop token ends it there (as DeepSpec counts).
A ratio with nothing behind it is None (a position no round tried is undefined, not 0)."""

from __future__ import annotations

from typing import Iterable, Optional

COUNT_KEYS = (
    "num_samples", "num_rounds", "accepted", "verified", "committed", "drafted", "tokens",
)
LIST_KEYS = ("verified_at", "accepted_at", "tried")


def accepted_tokens(rd: dict) -> list[int]:
    """The drafts a round accepted: a chain's first `accepted`, or a tree's nodes along its path."""
    if "path" in rd:
        return [rd["draft"][node - 1] for node in rd["path"]]
    return rd["draft"][:rd["accepted"]]


def round_counts(rd: dict, stop_ids: Iterable[int] = ()) -> tuple[int, int, int]:
    """(accepted, verified, committed) of one round record; an accepted stop token ends it there: the last
    token accepted and committed, and a chain's last verified (as DeepSpec counts). A tree's verified stays
    its count of nodes reached, every one of which the target scored (with the unreached placeholders,
    which are not drafts)."""
    n = rd["accepted"]
    for j, t in enumerate(accepted_tokens(rd)):
        if t in stop_ids:
            ended = j + 1
            verified = ended
            if "path" in rd:
                verified = rd["verified"]
            return ended, verified, ended
    return n, rd["verified"], n + 1


def drafted(rd: dict) -> int:
    """The drafts a round proposed: a chain's K, or the tree nodes its search reached (parent -1: a
    placeholder in `draft`)."""
    if "parents" in rd:
        return sum(parent >= 0 for parent in rd["parents"])
    return len(rd["draft"])


def path_reach(rd: dict, accepted: int) -> int:
    """How deep a tree round's drafts reach along its first `accepted` path nodes: one deeper than they
    when the last of them (the root when none) has a child, a draft sent after them."""
    last = 0  # the root
    if accepted:
        last = rd["path"][accepted - 1]
    has_child = last in rd["parents"]
    return accepted + has_child


def count(requests, K: int, stop_ids: Iterable[int] = ()) -> dict:
    """Raw counts of finished requests (`.rounds` of trace records, `.output_ids`): COUNT_KEYS summed, and per
    position j < K rounds that verified / accepted more than j (`verified_at` / `accepted_at`) and that
    accepted drafts 1..j and sent draft j+1 (`tried`; those that accepted it are `accepted_at[j]`). A
    tree's positions are its depths: it verified position j when it reached depth j + 1, and tried it
    after accepting j drafts when the path's last node had a child."""
    stop = set(stop_ids)
    c = dict.fromkeys(COUNT_KEYS, 0)
    c["num_samples"] = len(requests)
    for key in ("verified_at", "accepted_at", "tried"):
        c[key] = [0] * K
    for r in requests:
        c["tokens"] += len(r.output_ids)
        for rd in r.rounds:
            a, v, t = round_counts(rd, stop)
            reach = min(v, rd.get("depth", v))  # a tree verified as deep as it reached
            sent = reach  # ... and as deep as its drafts after the accepted ones reach
            if "path" in rd:
                sent = min(v, path_reach(rd, a))
            if t == a:  # an accepted stop token ended the round: no position after it counts
                reach = min(reach, a)
                sent = min(sent, a)
            c["num_rounds"] += 1
            c["accepted"] += a
            c["verified"] += v
            c["committed"] += t
            c["drafted"] += drafted(rd)
            for j in range(K):
                c["verified_at"][j] += reach > j
                c["accepted_at"][j] += a > j
                tried = a >= j and sent > j  # drafts 1..j accepted, draft j + 1 sent
                c["tried"][j] += tried
    return c


def _ratio(part: int, whole: int) -> Optional[float]:
    """part / whole, or None when whole is 0 (nothing behind the ratio)."""
    if not whole:
        return None
    return part / whole


def acceptance_length(c: dict) -> Optional[float]:
    """τ = Σ committed / rounds."""
    return _ratio(c["committed"], c["num_rounds"])


def verified_per_round(c: dict) -> Optional[float]:
    """Σ verified / rounds (the authors' draft_tokens_per_proposal)."""
    return _ratio(c["verified"], c["num_rounds"])


def verify_rate(c: dict) -> Optional[float]:
    """Σ committed / (Σ verified + rounds)."""
    return _ratio(c["committed"], c["verified"] + c["num_rounds"])


def accept_rates_by_position(c: dict) -> list[Optional[float]]:
    """The authors': rounds that accepted more than j drafts ÷ rounds that verified more than j."""
    return [_ratio(a, v) for a, v in zip(c["accepted_at"], c["verified_at"])]


def accept_rate_by_position(c: dict) -> list[Optional[float]]:
    """The paper's conditional rate of draft k: rounds that accepted drafts 1..k ÷ rounds that accepted
    1..k-1 and sent draft k (None where no round tried position k)."""
    return [_ratio(a, tried) for a, tried in zip(c["accepted_at"], c["tried"])]
