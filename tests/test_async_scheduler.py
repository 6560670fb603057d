"""The asynchronous scheduler (`--scheduler async`, the paper's §5.2 variant): the capacity C — how
many drafts the whole batch verifies — is searched over SPS(B) from the confidences of two rounds
earlier, with no early stop; which drafts is a stable top-C of the current prefix survivals.

- The pieces: `top_capacity` equals a literal top-C over the paper's sorted candidate list and gives
  every row a prefix; `capacity_search` reaches the best allocation of a brute-force search for any
  SPS curve, jagged ones included, where Algorithm 1's early stop does not.
- The capacity never reads the current round: the plan is made before the draft runs, from the
  round two back (recomputed from the trace's confidences), and perturbing one round's confidences
  changes that round's selection and the capacity two rounds later, never its own capacity or the
  next one's.
- No host read between draft and verify (a probe on every Python-level read of a tensor's value,
  armed from draft's return to verify's call); threshold and hardware, which do read, trip it. The
  compiled round is checked the same way in test_compile.py.
- Lossless: greedy output equals the target's at batch 1 and 3; sampled output passes the
  chi-square test of test_lossless.py, with rounds verifying 0, 1 or 2 drafts under capacities from
  history, also with a confidence head whose c_2 swings with x_1 (the situation of the paper's
  Appendix A); and the Appendix A numbers themselves, through the real acceptance kernel: the same
  search fed the current round's confidences outputs (0.85, 0.15), fed an earlier round's it
  outputs the target's (0.7, 0.3).
- Flags: bad combinations with `--scheduler async` are refused with one line.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import sys

import pytest
import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (_HERE, os.path.dirname(_HERE), os.path.join(os.path.dirname(_HERE), "scripts")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from bench_concurrency import use_curve  # noqa: E402
from conftest import chi2_pvalue, run_captured  # noqa: E402
from drafters import make_drafter, make_target  # noqa: E402
from test_lossless import (  # noqa: E402
    N_SAMPLES,
    P_MIN,
    SAMPLE_PROMPT,
    SV,
    M,
    check_trace,
    exact_joint,
    run_traced,
    seq_index,
    target_logits_after,
)
from test_scheduler import (  # noqa: E402
    PROMPTS,
    K,
    is_one_error_line,
    run_env_traced,
    scheduler_env,
    theta_of,
    write_sps_table,
)

import sampling  # noqa: E402
import scheduler as sched  # noqa: E402
import speculate  # noqa: E402
from support.checkpoint import load_target  # noqa: E402

torch.set_num_threads(1)


# ----------------------------------------------------------------------------------------
# The selection and the capacity search

def top_capacity_literal(c, active, C):
    """The C candidates (r, j) with the highest a_{r,j} = Π_{i<=j} c_{r,i} > 0, ties broken by (r, j)
    (the paper's sorted list); returns each row's count and asserts the taken ones form a prefix."""
    cands = []
    for r, row in enumerate(c):
        prod = 1.0
        for j, cj in enumerate(row, start=1):
            prod *= cj
            if active[r] and prod > 0:
                cands.append((-prod, r, j))
    taken = sorted(cands)[:C]
    lengths = [0] * len(c)
    for _, r, j in sorted(taken, key=lambda t: (t[1], t[2])):
        assert j == lengths[r] + 1, "a row's taken drafts must be a prefix"
        lengths[r] = j
    return lengths


def random_case(rng, zeros=True):
    B, K_ = rng.randint(1, 4), rng.randint(1, 4)
    pool = [0.0, 1.0, 0.5, 0.25] if zeros else [1.0, 0.5, 0.25]  # exact ties (and zeros)
    c = [[rng.choice(pool) if rng.random() < 0.3 else rng.uniform(0.01, 1) for _ in range(K_)] for _ in range(B)]
    active = [rng.random() < 0.8 for _ in range(B)]
    if not any(active):
        active[0] = True
    return c, active


def test_top_capacity_is_a_stable_top_c_of_prefix_survival():
    rng = random.Random(0)
    for _ in range(400):
        c, active = random_case(rng)
        C = rng.randint(0, len(c) * len(c[0]) + 1)
        got = sched.top_capacity(torch.tensor(c), torch.tensor(active), torch.tensor(C)).tolist()
        assert got == top_capacity_literal(c, active, C), (c, active, C)
        positive = sum(1 for r, row in enumerate(c) if active[r]
                       for a in torch.tensor(row, dtype=torch.float64).cumprod(0).tolist() if a > 0)
        assert sum(got) == min(C, positive)
        assert all(l == 0 for l, on in zip(got, active) if not on)


def jagged_sps(rng, top):
    vals = [rng.uniform(0.1, 2) for _ in range(top + 1)]
    return vals, (lambda b: vals[b])


def test_capacity_search_finds_the_best_allocation_for_any_sps_curve():
    """Along the greedy path, C = argmax Θ(C) over every C is the best of all allocations (for a fixed
    B the largest survivals are best) — for jagged curves too, which Algorithm 1's stop may miss."""
    rng = random.Random(1)
    missed = 0
    for _ in range(300):
        c, active = random_case(rng, zeros=False)
        B, K_ = len(c), len(c[0])
        R = sum(active)
        vals, sps = jagged_sps(rng, B * (K_ + 1))
        best = max(theta_of(c, active, ls, sps)
                   for ls in itertools.product(*[range(K_ + 1) if on else [0] for on in active]))
        C = sched.capacity_search([row for row, on in zip(c, active) if on], R, vals, R * K_)
        got = sched.top_capacity(torch.tensor(c), torch.tensor(active), torch.tensor(C)).tolist()
        assert sum(got) == C
        assert theta_of(c, active, got, sps) == pytest.approx(best, rel=1e-12), (c, active, vals)
        table = torch.tensor(vals, dtype=torch.float64)
        hw = sched.hardware_schedule(torch.tensor(c, dtype=torch.float64), torch.tensor(active), table).tolist()
        missed += theta_of(c, active, hw, sps) < best * (1 - 1e-9)
    assert missed > 20, "jagged curves should often trap Algorithm 1's early stop"


def test_capacity_search_steps_over_a_cliff_that_stops_algorithm_1():
    # test_scheduler's dip at B = 3: Algorithm 1 verifies nothing; the full search verifies all 8.
    vals = [1.0, 1.0, 0.9, 0.3] + [0.9] * 7
    c = [[0.99] * 4, [0.95] * 4]
    table = torch.tensor(vals, dtype=torch.float64)
    assert sched.hardware_schedule(torch.tensor(c, dtype=torch.float64), torch.tensor([True, True]), table).tolist() \
        == [0, 0]
    assert sched.capacity_search(c, 2, vals, 8) == 8


def test_the_capacity_never_reads_the_current_round():
    s = sched.Scheduler("async", 3, 2)
    use_curve(s, [1.0, 1.0, 1.0, 0.8, 0.8, 0.5, 0.5, 0.45, 0.45])
    two_back = [[0.9, 0.8, 0.7], [0.6, 0.5, 0.4]]
    plans = []
    for last in ([[0.1, 0.1, 0.1], [0.2, 0.2, 0.2]], [[0.99, 0.99, 0.99], [0.99, 0.99, 0.99]]):
        s.reset()
        assert s.plan(2).source == "warmup" and s.plan(2).capacity == 6  # no history: the whole block
        s.observe(two_back)
        assert s.plan(2).source == "warmup"
        s.observe(last)  # the round just before: a pipelined engine has not read it yet
        plans.append(s.plan(2))
    assert plans[0].capacity == plans[1].capacity == sched.capacity_search(two_back, 2, s.sps.tolist(), 6)
    assert plans[0].source == 0 and plans[0].round == 2
    # The current confidences choose which drafts, never how many may be verified.
    cap, active, seen = plans[1].tensor, torch.tensor([True, True]), set()
    for current in torch.rand(50, 2, 3, generator=torch.Generator().manual_seed(0)):
        lengths = s(current, active, cap)
        assert int(lengths.sum()) == plans[1].capacity and int(cap) == plans[1].capacity
        seen.add(tuple(lengths.tolist()))
    assert len(seen) > 1


# ----------------------------------------------------------------------------------------
# The engine: plan before draft, capacity from the trace's round r - 2, no host read in between

@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """test_scheduler's checkpoints: K = 4 drafts, confidences straddling 0.5-0.7 (schedules of every length)."""
    return scheduler_env(tmp_path_factory.mktemp("async"))


def test_buckets_for_the_batch_size_serve_fewer_requests(env, tmp_path):
    """--verify-buckets written for --batch-size rows serve an engine of fewer (fewer requests, or eval.py's
    largest shard): the buckets past its full round are cut to it (they were refused as above it, naming a
    batch never given). A largest bucket below the engine's full round is refused."""
    import eval as ev
    from support.checkpoint import load_models

    flags = ["--target", env["target"], "--drafter", env["drafter"], "--prompt-ids", "1,2,3", "--max-new-tokens", 6,
             "--scheduler", "threshold", "--confidence-threshold", "0.5", "--batch-size", 4]
    rc, out, err = run_captured(flags + ["--verify-buckets", "3,8,20"])  # K = 4: a full round of 4 rows is 20
    assert rc == 0, err
    rc, _, err = run_captured(flags + ["--verify-buckets", "2,4"])
    assert rc == 2 and "the largest bucket 4 is below 5, the tokens of a full round (1 row(s) x 5)" in err, err
    m = load_models(env["target"], env["drafter"])
    assert sched.parse_buckets("3,8,20", 1, m.drafter) == [3, 5]
    assert sched.parse_buckets("3,5,20", 1, m.drafter) == [3, 5]
    assert sched.parse_buckets("3,8,20", 4, m.drafter) == [3, 8, 20]
    data = tmp_path / "data"
    data.mkdir()
    (data / "two.jsonl").write_text("".join(json.dumps({"prompt_ids": [1, 2, 3 + i]}) + "\n" for i in range(2)))
    rc = ev.main(["--target", str(env["target"]), "--drafter", str(env["drafter"]), "--data-dir", str(data),
                  "--datasets", "two", "--max-new-tokens", "6", "--batch-size", "4", "--confidence-threshold", "0.5",
                  "--verify-buckets", "3,8,20", "--no-progress", "--out", str(tmp_path / "r.json")])
    assert rc == 0  # eval.py cuts the batch to its largest shard, 2 rows


@pytest.mark.parametrize("flags,needle", [
    (["--scheduler", "async", "--confidence-threshold", "0.5"], "--scheduler threshold"),
    (["--scheduler", "async", "--verify-buckets", "2,4"], "largest bucket 4"),
    (["--scheduler", "threshold", "--confidence-threshold", "0.5", "--sps-table", "x.json"], "hardware or async"),
    (["--scheduler", "async", "--drafter-plain"], "--scheduler async: the --drafter has no confidence head"),
    (["--confidence-threshold", "0.5", "--drafter-plain"],
     "--confidence-threshold 0.5: the --drafter has no confidence head"),
])
def test_bad_async_flags_are_refused(env, flags, needle):
    drafter = env["plain"] if "--drafter-plain" in flags else env["drafter"]
    rc, _, err = run_captured(["--target", env["target"], "--drafter", drafter, "--prompt-ids", "1,2,3", "--max-new-tokens", 4]
                              + [f for f in flags if f != "--drafter-plain"])
    assert rc == 2 and needle in err and is_one_error_line(err), err


def capacity_checks(rounds, table_or_scheduler, K_):
    """The trace's async keys: per batch round, the capacity bounds the verified drafts, and for round
    r >= 2 it is `capacity_search` on round r-2's recorded confidences (its active rows, in row order)."""
    s = table_or_scheduler
    by_round = {}
    for r in rounds:
        by_round.setdefault(r["batch_round"], []).append(r)
    assert sorted(by_round) == list(range(len(by_round)))
    caps = []
    for b, rs in sorted(by_round.items()):
        R, cap = len(rs), rs[0]["capacity"]
        assert all(r["capacity"] == cap and r["capacity_from_round"] == rs[0]["capacity_from_round"] for r in rs)
        assert sum(r["verified"] for r in rs) <= cap <= R * K_
        if b < 2:
            assert rs[0]["capacity_from_round"] == "warmup" and cap == R * K_
        else:
            assert rs[0]["capacity_from_round"] == b - 2
            history = [r["confidence"] for r in by_round[b - 2]]
            assert cap == sched.capacity_search(history, R, s.sps.tolist(), R * K_), b
        caps.append(cap)
    return caps


def sps_scheduler(table_path, batch):
    s = sched.Scheduler("async", K, batch)
    s.set_sps(json.load(open(table_path)))
    return s


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_output_equals_the_target(env, batch):
    ref = run_env_traced(env, drafter=False).outputs()
    table = write_sps_table(os.path.join(env["dir"], f"sps_async{batch}.json"), env["target"], env["drafter"], batch,
                            0.0, lambda b: 1 + 0.3 * b)
    tr = run_env_traced(env, "--scheduler", "async", "--sps-table", table, batch=batch)
    check_trace(tr, n_requests=len(PROMPTS), K=K, V=48, confidence=True, max_new=32)
    assert tr.outputs() == ref
    assert tr.summary["scheduler"] == "async"
    caps = capacity_checks(tr.rounds, sps_scheduler(table, batch), K)
    verified = [r["verified"] for r in tr.rounds]
    assert len(set(verified)) >= 2 and min(caps[2:]) < batch * K, "the capacity should bind and vary"


class HostReads:
    """Counts Python-level reads of a tensor's value (item, tolist, int(), float(), bool(), index,
    numpy, formatting) made between an engine's draft returning and its verify being called."""
    METHODS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__", "numpy", "__format__")

    def __init__(self, monkeypatch):
        self.armed, self.reads, self.rounds = False, [], 0
        for name in self.METHODS:
            orig = getattr(torch.Tensor, name)

            def probe(t, *args, _orig=orig, _name=name, **kwargs):
                if self.armed:
                    self.reads.append(_name)
                return _orig(t, *args, **kwargs)
            monkeypatch.setattr(torch.Tensor, name, probe)

    def watch(self, engine):
        draft, verify = engine.draft_fn, engine.verify_fn

        def drafted(*args, **kwargs):
            out = draft(*args, **kwargs)
            self.armed, self.rounds = True, self.rounds + 1
            return out

        def verified(*args, **kwargs):
            self.armed = False
            return verify(*args, **kwargs)
        engine.draft_fn, engine.verify_fn = drafted, verified
        return self


def engine_for(env, kind, batch=2, **kw):
    from support.checkpoint import load_drafter

    target = load_target(env["target"])
    engine = speculate.Engine(target, load_drafter(env["drafter"], target), batch_size=batch, max_seq=64,
                              scheduler=kind, threshold=0.6 if kind == "threshold" else 0.0, **kw)
    if kind in sched.SPS_KINDS:
        points = engine.scheduler.profile_points
        engine.scheduler.set_sps(dict(sched.sps_identity(engine), steps_per_second=[1 / (1 + 0.3 * b) for b in points]))
    return engine


@pytest.mark.parametrize("kind", ["async", "threshold", "hardware"])
def test_no_host_read_between_draft_and_verify(env, monkeypatch, kind):
    engine = engine_for(env, kind)
    probe = HostReads(monkeypatch).watch(engine)
    with torch.inference_mode():
        engine.generate([speculate.Request(i, p) for i, p in enumerate(PROMPTS)], 16)
    assert probe.rounds > 5
    if kind == "async":
        assert probe.reads == []
    else:  # the probe sees the token count these schedules read between the halves
        assert probe.reads.count("__int__") == probe.rounds, probe.reads


def test_plan_comes_before_draft_and_perturbing_a_round_moves_only_later_capacities(env, monkeypatch):
    """Each round: plan, draft, verify. Lowering row 0's confidences in round 3 changes round 3's
    selection and round 5's capacity (fed by round 3); the capacities of rounds 0-4 stay as they were."""
    def run(perturb_round=None):
        engine = engine_for(env, "async")
        s, events, rounds = engine.scheduler, [], []
        plan, draft, verify, conf = s.plan, engine.draft_fn, engine.verify_fn, engine.drafter.confidence
        monkeypatch.setattr(s, "plan", lambda R: events.append("plan") or plan(R))
        engine.draft_fn = lambda *a, **k: events.append("draft") or draft(*a, **k)
        engine.verify_fn = lambda *a, **k: events.append("verify") or verify(*a, **k)
        scale = torch.tensor([[0.3], [1.0]])  # row 0 only: the ranking between the rows changes
        engine.drafter.confidence = lambda *a: conf(*a) * (scale if s.rounds == perturb_round else 1.0)
        with torch.inference_mode():
            engine.generate([speculate.Request(i, p) for i, p in enumerate(PROMPTS)], 24,
                            on_round=lambda req, rec: rounds.append(rec))
        assert events == ["plan", "draft", "verify"] * (len(events) // 3)
        caps = capacity_checks(rounds, s, K)
        sel = {}
        for r in rounds:
            sel.setdefault(r["batch_round"], []).append(r["verified"])
        return caps, sel, [r for r in rounds if r["batch_round"] == 3]

    caps, sel, r3 = run()
    caps_p, sel_p, r3_p = run(perturb_round=3)
    assert caps_p[:5] == caps[:5]
    assert sel_p[3] != sel[3], "the perturbed round selects differently"
    assert caps_p[5] != caps[5], "and it feeds the capacity two rounds later"
    assert [r["confidence"] for r in r3_p] != [r["confidence"] for r in r3]


# ----------------------------------------------------------------------------------------
# Sampled output follows the target's distribution

BATCH_S = N_SAMPLES // 4  # four waves of rows: all but the first decode under capacities from history


def parity_confidence(drafter_dir: str, scale: float = 4.0):
    """A confidence head that reads only the previous token: c_k = σ(±scale) as x_{k-1} is even or odd
    (the oracle drafter's W1 is the identity, so the head's Markov weights index the token). c_2 then
    swings with the drawn x_1 — the dependence that Appendix A's counterexample exploits."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(drafter_dir, "model.safetensors")
    w = load_file(path)
    weight = torch.zeros_like(w["confidence_head.proj.weight"])
    V = w["markov_head.markov_w1.weight"].shape[0]
    weight[0, -V:] = torch.tensor([scale if v % 2 == 0 else -scale for v in range(V)])
    w["confidence_head.proj.weight"], w["confidence_head.proj.bias"] = weight, torch.zeros(1)
    save_file(w, path)


@pytest.fixture(scope="module")
def senv(tmp_path_factory):
    d = tmp_path_factory.mktemp("async_sampled")
    target = make_target(d / "target", vocab_size=SV, attn_scale=0.05)
    opts = dict(markov="vanilla", oracle=True, oracle_scale=1.0, norm_scale=0.05, block_size=2)
    drafters = {"oracle": make_drafter(d / "oracle", target, **opts),
                "parity": make_drafter(d / "parity", target, **opts)}
    parity_confidence(drafters["parity"])
    # oracle: step time 0.6 R + B (a token pays while its survival beats τ/(0.6 R + B), about 0.6-0.7:
    # inside the spread of a_1 and a_2, so rows verify 0, 1 or 2 drafts); parity: flat to B = R, then
    # a cliff per R tokens — Algorithm 1 would stop at its first draft.
    steps = {"oracle": lambda b: 0.6 * BATCH_S + b, "parity": lambda b: 1.0 if b <= BATCH_S else 1.3 if b <= 2 * BATCH_S
             else 1.6}
    tables = {name: write_sps_table(d / f"sps_{name}.json", target, drafters[name], BATCH_S, 1.0, steps[name])
              for name in drafters}
    return dict(dir=str(d), target=target, drafters=drafters, tables=tables,
                joint=exact_joint(*target_logits_after(target, SAMPLE_PROMPT, M, SV), 1.0))


@pytest.mark.parametrize("drafter", ["oracle", "parity"])
def test_sampled_output_follows_the_target(senv, drafter):
    tr = run_traced(senv["dir"], ["--target", senv["target"], "--drafter", senv["drafters"][drafter],
                                  "--prompt-ids", ",".join(map(str, SAMPLE_PROMPT)), "--num-samples", N_SAMPLES,
                                  "--batch-size", BATCH_S, "--max-new-tokens", M, "--temperature", 1.0,
                                  "--scheduler", "async", "--sps-table", senv["tables"][drafter]])
    check_trace(tr, n_requests=N_SAMPLES, K=2, V=SV, confidence=True, max_new=M)
    s = sched.Scheduler("async", 2, BATCH_S)
    s.set_sps(json.load(open(senv["tables"][drafter])))
    caps = capacity_checks(tr.rounds, s, 2)
    history = [r for r in tr.rounds if r["batch_round"] >= 2]
    assert len(history) > 0.6 * len(tr.rounds) and len(set(caps)) > 2, caps
    lengths = [r["verified"] for r in history]
    assert all(lengths.count(v) > 200 for v in (0, 1, 2)), {v: lengths.count(v) for v in (0, 1, 2)}
    p = chi2_pvalue(seq_index(tr.outputs(), SV), senv["joint"])
    assert p > P_MIN, f"chi-square p = {p:.2e}"


# ----------------------------------------------------------------------------------------
# The paper's Appendix A counterexample, through the real acceptance function

A, B_ = 0, 1
PAPER_SPS = torch.tensor([1.0, 1.0, 0.5, 0.45], dtype=torch.float64)  # SPS(B) for B = 0 .. 3 (SPS(0) unused)


def appendix_a_first_tokens(lengths_for, n=40000, seed=0):
    """One request (R = 1), two drafts; vocabulary {A, B}; target p = (0.7, 0.3), draft q = (0.5, 0.5);
    c_1 = 0.8, and c_2 = 0.9 after x_1 = A, 0 after B. lengths_for(c [1, 2]) -> ℓ. Returns the first
    committed token of n independent rounds, accepted by `sampling.accept_sampled`."""
    g = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(torch.tensor([0.5, 0.5]), 2 * n, replacement=True, generator=g).view(n, 2)
    ell = {x1: lengths_for(torch.tensor([[0.8, 0.9 if x1 == A else 0.0]])) for x1 in (A, B_)}
    verify_len = torch.where(drafts[:, 0] == A, ell[A], ell[B_])
    q = torch.full((n, 2, 2), 0.5)
    logits = torch.tensor([0.7, 0.3]).log().expand(n, 3, 2)
    # the acceptance's uniforms, then its race's noise, in a round's order
    u = torch.rand((n, 2), generator=g)
    noise = sampling.exponential((n, 2), g, "cpu")
    accepted, token = sampling.accept_sampled(drafts, q, logits, verify_len, 1.0, u, noise)
    return torch.where(accepted >= 1, drafts[:, 0], token), ell


def test_appendix_a_counterexample_is_biased_when_the_capacity_reads_the_current_round():
    """The same search and selection as the async scheduler, but fed the round's own confidences:
    ℓ = 2 after A, 0 after B, and the output is the paper's (0.85, 0.15), not the target's (0.7, 0.3)."""
    active = torch.tensor([True])

    def retrospective(c):
        C = sched.capacity_search(c.tolist(), 1, PAPER_SPS.tolist(), 2)
        return int(sched.top_capacity(c, active, torch.tensor(C)))

    y, ell = appendix_a_first_tokens(retrospective)
    assert ell == {A: 2, B_: 0}
    assert float((y == A).double().mean()) == pytest.approx(0.85, abs=0.01)
    assert chi2_pvalue(y, torch.tensor([0.7, 0.3])) < 1e-10


@pytest.mark.parametrize("two_back,sps,C", [([0.8, 0.9], PAPER_SPS.tolist(), 2), ([0.8, 0.0], PAPER_SPS.tolist(), 0),
                                             ([0.9, 0.1], [1.0, 1.0, 0.6, 0.3], 1)], ids=["C=2", "C=0", "C=1"])
def test_appendix_a_counterexample_stays_exact_with_the_capacity_from_history(two_back, sps, C):
    """The capacity comes from an earlier round (whatever it was), the selection from this one: x_1 is
    verified after A and after B alike, and the output is the target's (0.7, 0.3)."""
    s = sched.Scheduler("async", 2, 1)
    use_curve(s, sps)
    for conf in (two_back, [0.5, 0.5]):
        s.observe([conf])
    plan = s.plan(1)
    assert plan.source == 0 and plan.capacity == C
    y, ell = appendix_a_first_tokens(lambda c: int(s(c, torch.tensor([True]), plan.tensor)))
    assert ell[A] == plan.capacity and ell[B_] == min(plan.capacity, 1)  # a_2 = 0 after B: not a candidate
    assert chi2_pvalue(y, torch.tensor([0.7, 0.3])) > P_MIN
    # Algorithm 1 with its early stop, on the current round, is exact too: Θ_1 < Θ_0, ℓ = 0.
    algorithm_1 = lambda c: int(sched.hardware_schedule(c.double(), torch.tensor([True]), PAPER_SPS))  # noqa: E731
    y, ell = appendix_a_first_tokens(algorithm_1)
    assert ell == {A: 0, B_: 0} and chi2_pvalue(y, torch.tensor([0.7, 0.3])) > P_MIN


def test_each_decode_starts_with_two_warm_up_rounds(env):
    """A second decode on the same engine plans from its own rounds: its first two verify every draft
    again, not from the history the first decode left."""
    engine = engine_for(env, "async")
    requests = [speculate.Request(i, p) for i, p in enumerate(PROMPTS[:2])]
    again = [speculate.Request(i, p) for i, p in enumerate(PROMPTS[:2])]
    with torch.inference_mode():
        engine.generate(requests, 16)
        assert engine.scheduler.rounds > 2
        engine.generate(again, 16)
    rounds = sorted(again[0].rounds, key=lambda r: r["batch_round"])
    assert [r["capacity_from_round"] for r in rounds[:3]] == ["warmup", "warmup", 0]


def test_a_plan_grows_its_capacity_to_fill_the_bucket(monkeypatch):
    """The verify size is the smallest bucket holding R + C tokens; the padding is not wasted: the capacity
    grows to fill it (at most every draft)."""
    s = sched.Scheduler("async", 4, 2, buckets=[4, 10])
    plan = s.plan(2)  # warm-up: every draft of both rows
    assert (plan.num_tokens, plan.capacity, plan.source) == (10, 8, "warmup")
    s.observe([[0.9] * 4, [0.9] * 4])
    s.observe([[0.9] * 4, [0.9] * 4])
    monkeypatch.setattr(sched, "capacity_search", lambda *args: 1)
    plan = s.plan(2)
    assert (plan.num_tokens, plan.capacity, plan.source) == (4, 2, 0)
    assert int(s.capacity) == 2  # the graph's input, filled in place
