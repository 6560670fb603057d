"""The hardware-aware prefix scheduler (paper Algorithm 1), ragged verification through the engine (the
ragged forward itself: test_model.py), and the `--scheduler` / `--sps-table` / `--verify-buckets` flags.

- Algorithm 1: the vectorised `scheduler.hardware_schedule` equals a literal, line-by-line
  transcription of the paper's pseudocode on random cases (ties, zeros, inactive rows); on
  cases where the objective along the greedy path is unimodal it equals a brute-force search
  over every allocation; it never admits anything after its early stop (the paper's Appendix A
  counterexample, and a jagged SPS curve where going on would pay).
- Lossless: greedy output under every scheduler equals the target's; sampled output under the
  hardware scheduler passes the chi-square test of test_lossless.py. The hardware runs use SPS
  tables written by hand in the documented format, so that the schedule is known to vary.
- The SPS table: profiled and written, then read back; a table of another configuration or a
  malformed one is refused with one line; bad flag combinations are refused.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import pathlib
import random
import re
import sys

import pytest
import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (_HERE, os.path.dirname(_HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

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
    set_confidence_bias,
    target_logits_after,
)

import sampling  # noqa: E402
import scheduler as sched
import speculate  # noqa: E402
from support.checkpoint import load_target  # noqa: E402

torch.set_num_threads(1)


# ----------------------------------------------------------------------------------------
# Algorithm 1 against the paper's pseudocode and against brute force

def algorithm1_literal(c, active, sps):
    """The paper's Algorithm 1, line by line, in plain Python (c: R x γ lists of the active rows'
    confidences; sps: a function of B). Returns the selected lengths of every row (0 if inactive)."""
    rows = [r for r in range(len(c)) if active[r]]
    R = len(rows)
    a = {}
    for r in rows:  # 1-3: prefix survival
        prod = 1.0
        for j, cj in enumerate(c[r], start=1):
            prod *= cj
            a[(r, j)] = prod
    # 4: candidates with a > 0, sorted descending (j before j+1 within a row on ties)
    E = sorted((rj for rj in a if a[rj] > 0), key=lambda rj: (-a[rj], rows.index(rj[0]), rj[1]))
    length = {r: 0 for r in rows}
    B, tau = R, float(R)                      # 5
    best, chosen = R * sps(R), dict(length)   # 6
    for r, j in E:                            # 7
        length[r] = j                         # 8
        B += 1
        tau += a[(r, j)]
        theta = tau * sps(B)                  # 9
        if theta > best:                      # 10-11
            best, chosen = theta, dict(length)
        else:                                 # 12-13
            break
    return [chosen.get(r, 0) for r in range(len(c))]


def vectorised(c, active, sps_fn):
    c = torch.tensor(c, dtype=torch.float64)
    B, K = c.shape
    table = torch.tensor([sps_fn(max(b, 1)) for b in range(B * (K + 1) + 1)], dtype=torch.float64)
    return sched.hardware_schedule(c, torch.tensor(active), table).tolist()


def theta_of(c, active, lengths, sps):
    R = sum(active)
    tau = R + sum(float(torch.tensor(c[r][:lengths[r]], dtype=torch.float64).cumprod(0).sum())
                  for r in range(len(c)) if active[r])
    return tau * sps(R + sum(lengths))


def random_case(rng):
    B, K = rng.randint(1, 4), rng.randint(1, 4)
    pool = [0.0, 1.0, 0.5, 0.25]  # exact ties and zeros
    c = [[rng.choice(pool) if rng.random() < 0.3 else rng.random() for _ in range(K)] for _ in range(B)]
    active = [rng.random() < 0.8 for _ in range(B)]
    if not any(active):
        active[0] = True
    return c, active


def test_vectorised_equals_the_pseudocode_on_random_cases():
    rng = random.Random(0)
    seen = set()
    for case in range(600):
        c, active = random_case(rng)
        kind = case % 3
        if kind == 0:    # smooth: a fixed cost per step plus a cost per token
            t0, per = rng.uniform(0.5, 5), rng.uniform(0.05, 1)
            sps = lambda b, t0=t0, per=per: 1 / (t0 + per * b)
        elif kind == 1:  # jagged: random positive rates
            vals = [rng.uniform(0.1, 2) for _ in range(64)]
            sps = lambda b, vals=vals: vals[b]
        else:            # flat with a cliff
            cliff = rng.randint(1, 8)
            sps = lambda b, cliff=cliff: 1.0 if b <= cliff else 0.6
        want = algorithm1_literal(c, active, sps)
        got = vectorised(c, active, sps)
        assert got == want, (c, active, kind)
        assert all(l == 0 for l, on in zip(got, active) if not on)
        seen.add(tuple(got))
    assert len(seen) > 30, "the random cases should produce many different schedules"


def greedy_path_is_unimodal(c, active, sps):
    """Θ along the full greedy admission path rises, then only falls (no later rise)."""
    R = sum(active)
    a = sorted((v for r in range(len(c)) if active[r]
                for v in torch.tensor(c[r], dtype=torch.float64).cumprod(0).tolist() if v > 0), reverse=True)
    thetas, tau = [R * sps(R)], float(R)
    for i, v in enumerate(a, start=1):
        tau += v
        thetas.append(tau * sps(R + i))
    falling = False
    for x, y in zip(thetas, thetas[1:]):
        if y <= x:
            falling = True
        elif falling:
            return False
    return True


def test_a_free_rows_confidences_never_reach_the_schedule():
    """A free row offers nothing whatever its confidences hold: NaN there (garbage in a free row's
    cache) leaves the active rows' verify lengths as they are."""
    active = torch.tensor([True, False])
    sps = torch.ones(2 * 4 + 1, dtype=torch.float64)
    for spoiled in (0.9, float("nan")):
        confidence = torch.full((2, 3), 0.9)
        confidence[1] = spoiled
        assert sched.hardware_schedule(confidence, active, sps).tolist() == [3, 0]
        assert sched.top_capacity(confidence, active, torch.tensor(2)).tolist() == [2, 0]


def test_equals_brute_force_where_the_objective_is_unimodal():
    rng = random.Random(1)
    checked = 0
    for _ in range(400):
        c, active = random_case(rng)
        t0, per = rng.uniform(0.2, 4), rng.uniform(0.05, 1)
        sps = lambda b: 1 / (t0 + per * b)
        if not greedy_path_is_unimodal(c, active, sps):
            continue
        K = len(c[0])
        best = max(theta_of(c, active, ls, sps)
                   for ls in itertools.product(*[range(K + 1) if on else [0] for on in active]))
        got = vectorised(c, active, sps)
        assert theta_of(c, active, got, sps) == pytest.approx(best, rel=1e-12), (c, active, got)
        checked += 1
    assert checked > 200


def test_appendix_a_counterexample_stops_before_looking_further():
    # R = 1, γ = 2, a_1 = 0.8; SPS(1) = 1, SPS(2) = 0.5, SPS(3) = 0.45. Θ_1 = 0.9 < Θ_0 = 1: stop,
    # whatever c_2 is, although with c_2 = 0.9 verifying both would give Θ_2 = 1.134.
    sps = lambda b: {1: 1.0, 2: 0.5, 3: 0.45}[b]
    for c2 in (0.9, 0.0, 0.5):
        assert vectorised([[0.8, c2]], [True], sps) == [0]
    assert theta_of([[0.8, 0.9]], [True], [2], sps) == pytest.approx(1.134)


def test_never_admits_after_the_first_non_improvement():
    # SPS dips at B = 3 then recovers: admitting on past the dip would pay, Algorithm 1 must not.
    vals = {1: 1.0, 2: 0.9, 3: 0.3, **{b: 0.9 for b in range(4, 11)}}
    sps = lambda b: vals[b]
    c = [[0.99, 0.99, 0.99, 0.99], [0.95, 0.95, 0.95, 0.95]]
    got = vectorised(c, [True, True], sps)
    assert got == algorithm1_literal(c, [True, True], sps) == [0, 0]  # Θ(3) < Θ(2): stop at once
    assert theta_of(c, [True, True], [4, 4], sps) > theta_of(c, [True, True], [0, 0], sps)


def test_admission_follows_prefix_survival_across_rows():
    # A row with high confidence gets its drafts verified before a row with low confidence.
    sps = lambda b: 1 / (1 + 0.3 * b)
    got = vectorised([[0.95, 0.9, 0.9], [0.3, 0.9, 0.9]], [True, True], sps)
    assert got[0] > got[1]


# ----------------------------------------------------------------------------------------
# Lossless under every scheduler

K = 4
PROMPTS = [[1, 2, 3, 4, 5], [7, 30, 2], [9], [40, 41, 42, 43, 44, 45, 46, 3]]


def write_sps_table(path, target_dir, drafter_dir, batch, temperature, step_time, buckets=None, compile=False,
                    filters=sampling.NO_FILTERS):
    """An SPS table in speculate.py's format, for this configuration, with hand-chosen step times (the
    models loaded as speculate.py loads them: with the CPU kernels where they run)."""
    from support.checkpoint import load_models

    models = load_models(target_dir, drafter_dir)
    engine = speculate.Engine(models.target, models.drafter, batch_size=batch, max_seq=64, temperature=temperature,
                              filters=filters, scheduler="hardware", buckets=buckets,
                              compile=compile)  # nothing compiles until called
    points = engine.scheduler.profile_points
    table = dict(sched.sps_identity(engine), steps_per_second=[1 / step_time(b) for b in points])
    table["seconds_per_step"] = [step_time(b) for b in points]
    with open(path, "w") as f:
        json.dump(table, f)
    return str(path)


def scheduler_env(d):
    """A target, a drafter with K = 4 drafts and a plain DFlash drafter in d, and PROMPTS as a prompts file."""
    target = make_target(d / "target", attn_scale=0.01)
    drafter = make_drafter(d / "drafter", target, block_size=K, markov="vanilla", oracle=True, oracle_scale=4.0,
                           norm_scale=0.05)
    set_confidence_bias(drafter, 0.5)  # confidences straddle 0.5-0.7: schedules of every length
    plain = make_drafter(d / "dflash", target, block_size=K, markov=None, confidence=False)
    pf = d / "prompts.jsonl"
    pf.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in PROMPTS))
    return dict(dir=str(d), target=target, drafter=drafter, plain=plain, prompts=str(pf))


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return scheduler_env(tmp_path_factory.mktemp("scheduler"))


def run_env_traced(env, *extra, batch=1, drafter=True, max_new=32):
    """speculate.main on env's target and prompts file (env's drafter too unless drafter=False): its Trace."""
    args = ["--target", env["target"], "--prompts-file", env["prompts"], "--max-new-tokens", max_new,
            "--batch-size", batch] + (["--drafter", env["drafter"]] if drafter else []) + list(extra)
    return run_traced(env["dir"], args)


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_output_equals_the_target_under_every_scheduler(env, batch):
    ref = run_env_traced(env, drafter=False).outputs()
    # A fixed cost per round plus 0.3 of it per verified token: with these confidences (c ~ 0.5-0.8)
    # the hardware schedule verifies 1 to 3 drafts of 4.
    table = write_sps_table(os.path.join(env["dir"], f"sps{batch}.json"), env["target"], env["drafter"], batch, 0.0,
                            lambda b: 1 + 0.3 * b)
    runs = {"none": run_env_traced(env, "--scheduler", "none", batch=batch),
            "threshold": run_env_traced(env, "--scheduler", "threshold", "--confidence-threshold", 0.6, batch=batch),
            "hardware": run_env_traced(env, "--scheduler", "hardware", "--sps-table", table, batch=batch)}
    for name, tr in runs.items():
        check_trace(tr, n_requests=len(PROMPTS), K=K, V=48, confidence=True, max_new=32)
        assert tr.outputs() == ref, name
        assert tr.summary["scheduler"] == name
        verified = [r["verified"] for r in tr.rounds]
        assert tr.summary["verified_per_round"] == pytest.approx(sum(verified) / len(verified))
    hw = [r["verified"] for r in runs["hardware"].rounds]
    assert all(v == K for v in (r["verified"] for r in runs["none"].rounds))
    assert len(set(hw)) >= 2 and max(hw) < K, f"the hardware schedule should vary: {sorted(set(hw))}"
    assert sum(hw) < sum(r["verified"] for r in runs["none"].rounds)


@pytest.mark.parametrize("calibrated", [False, True])
def test_hardware_schedule_follows_the_table_at_batch_one(env, calibrated):
    # Batch 1, SPS(B) = 1 / (1 + 0.6 B): exactly Algorithm 1 on the confidences the trace reports —
    # with --calibration, the STS-calibrated ones.
    table = write_sps_table(os.path.join(env["dir"], "sps_b1.json"), env["target"], env["drafter"], 1, 0.0,
                            lambda b: 1 + 0.6 * b)
    extra = []
    if calibrated:
        cal = os.path.join(env["dir"], "cal.json")
        with open(cal, "w") as f:
            json.dump({"temperatures": [0.5, 2.0, 1.0, 3.0]}, f)
        extra = ["--calibration", cal]
    tr = run_env_traced(env, "--scheduler", "hardware", "--sps-table", table, *extra)
    sps = lambda b: 1 / (1 + 0.6 * b)
    for r in tr.rounds:
        assert r["verified"] == algorithm1_literal([r["confidence"]], [True], sps)[0], r
    if calibrated:
        plain = run_env_traced(env, "--scheduler", "hardware", "--sps-table", table)
        first, first_plain = tr.rounds[0]["confidence"], plain.rounds[0]["confidence"]
        logit = lambda c: math.log(c / (1 - c))
        assert logit(first[0]) == pytest.approx(logit(first_plain[0]) / 0.5, rel=1e-4)


def test_sampled_output_follows_the_target_under_the_hardware_scheduler(tmp_path_factory):
    d = tmp_path_factory.mktemp("scheduler_sampled")
    target = make_target(d / "target", vocab_size=SV, attn_scale=0.05)
    drafter = make_drafter(d / "drafter", target, markov="vanilla", oracle=True, oracle_scale=1.0, norm_scale=0.05,
                           block_size=2)
    # Step time R + B (R = the batch): verifying one more token pays while its survival beats
    # τ/(R+B), which ends near 0.58 here — inside the spread of a_1 (0.55-0.82) and a_2
    # (0.33-0.63) — so rounds verify 0, 1 or 2 drafts depending on the row's confidences.
    table = write_sps_table(d / "sps.json", target, drafter, N_SAMPLES, 1.0, lambda b: N_SAMPLES + b)
    tr = run_traced(str(d), ["--target", target, "--drafter", drafter, "--prompt-ids",
                             ",".join(map(str, SAMPLE_PROMPT)), "--num-samples", N_SAMPLES, "--batch-size", N_SAMPLES,
                             "--max-new-tokens", M, "--temperature", 1.0, "--scheduler", "hardware", "--sps-table",
                             table])
    check_trace(tr, n_requests=N_SAMPLES, K=2, V=SV, confidence=True, max_new=M)
    first = [r["verified"] for r in tr.rounds if r["round"] == 0]
    assert all(first.count(v) > 50 for v in (0, 1, 2)), {v: first.count(v) for v in (0, 1, 2)}
    prefixes, logits = target_logits_after(target, SAMPLE_PROMPT, M, SV)
    p = chi2_pvalue(seq_index(tr.outputs(), SV), exact_joint(prefixes, logits, 1.0))
    assert p > P_MIN, f"chi-square p = {p:.2e}"


# ----------------------------------------------------------------------------------------
# The SPS table and the flags

def is_one_error_line(err: str) -> bool:
    """The failure is one `error: ...` line, the last thing on stderr (after the drafter's description)."""
    lines = err.strip().splitlines()
    return sum(l.startswith("error:") for l in lines) == 1 and lines[-1].startswith("error:")


def test_the_python_api_schedules_with_the_sps_table(env, tmp_path):
    """speculate.generate(scheduler="hardware") reads its SPS table (or profiles one) as the command line
    does (its path a str or a pathlib.Path): the same rounds as the CLI with the same table. Before, it
    kept the placeholder table and verified every draft — the whole-block schedule under another name."""
    table = write_sps_table(tmp_path / "sps.json", env["target"], env["drafter"], 3, 0.0, lambda b: 1 + 0.3 * b)
    tr = run_env_traced(env, "--scheduler", "hardware", "--sps-table", table, "--temperature", 0, batch=3)
    m = speculate.load(env["target"], env["drafter"])
    done = speculate.generate(m, [json.loads(line)["prompt_ids"] for line in open(env["prompts"])], max_new_tokens=32,
                              temperature=0.0, batch_size=3, scheduler="hardware", sps_table=pathlib.Path(table))
    assert [c.output_ids for c in done] == tr.outputs()
    assert [c.num_rounds for c in done] == [tr.requests[i]["num_rounds"] for i in sorted(tr.requests)]
    assert sum(r["verified"] for r in tr.rounds) < K * len(tr.rounds)  # the table shortened verification
    with pytest.raises(speculate.UserError, match="only --scheduler hardware or async uses it"):
        speculate.generate(m, [1, 2, 3], max_new_tokens=4, sps_table=table)


def test_a_sampled_hardware_run_repeats_with_the_same_table(env, tmp_path):
    """--seed's promise under the hardware schedule: the same table, the same tokens. Without a table
    every run profiles its own, and the note says how to keep one."""
    table = write_sps_table(tmp_path / "sps.json", env["target"], env["drafter"], 3, 1.0, lambda b: 1 + 0.3 * b)
    runs = [run_env_traced(env, "--scheduler", "hardware", "--sps-table", table, "--temperature", 1, "--seed", 5,
                           batch=3)
            for _ in range(2)]
    assert runs[0].outputs() == runs[1].outputs()
    assert [r["verified"] for r in runs[0].rounds] == [r["verified"] for r in runs[1].rounds]
    flags = ["--target", env["target"], "--drafter", env["drafter"], "--prompt-ids", "1,2,3", "--max-new-tokens", 4,
             "--batch-size", 2, "--num-samples", 2, "--scheduler", "hardware"]
    rc, _, err = run_captured(flags + ["--temperature", 1])
    assert rc == 0 and "not saved" in err and "--sps-table FILE" in err, err
    rc, _, err = run_captured(flags)  # greedy: the same tokens whatever the table
    assert rc == 0 and "profiled SPS" in err and "not saved" not in err, err


def test_sps_table_is_profiled_written_and_read_back(env, tmp_path):
    path = tmp_path / "sps.json"
    rc, _, err = run_captured(["--target", env["target"], "--drafter", env["drafter"], "--prompt-ids", "1,2,3",
                               "--max-new-tokens", 8, "--batch-size", 2, "--num-samples", 2, "--scheduler", "hardware", "--sps-table", path])
    assert rc == 0, err
    assert "profiled SPS(B)" in err and "written to" in err
    table = json.load(open(path))
    assert table["batch_capacity"] == 2 and table["verify_width"] == K + 1 and table["buckets"] is None
    assert table["profile_points"] == sched.verify_buckets(2 * (K + 1))
    assert len(table["steps_per_second"]) == len(table["profile_points"])
    assert all(s > 0 for s in table["steps_per_second"])
    rc, _, err = run_captured(["--target", env["target"], "--drafter", env["drafter"], "--prompt-ids", "1,2,3",
                               "--max-new-tokens", 8, "--batch-size", 2, "--num-samples", 2, "--scheduler", "hardware", "--sps-table", path])
    assert rc == 0 and "read from" in err and "profiled SPS" not in err, err
    # Another batch capacity: refused, naming the key.
    rc, _, err = run_captured(["--target", env["target"], "--drafter", env["drafter"], "--prompt-ids", "1,2,3",
                               "--max-new-tokens", 8, "--batch-size", 3, "--num-samples", 3, "--scheduler", "hardware",
                               "--sps-table", path])
    assert rc == 2 and "batch_capacity (--batch-size, or the requests where fewer) is 2 in the table but 3" in err
    assert is_one_error_line(err), err


def _bad_table(path, edit):
    table = json.load(open(path))
    edit(table)
    path.write_text(json.dumps(table))


def test_sps_table_paths_that_cannot_work_are_refused(env, tmp_path):
    for path, needle in ((tmp_path, "is a directory"), (tmp_path / "no" / "x.json", "does not exist")):
        rc, _, err = run_captured(["--target", env["target"], "--drafter", env["drafter"], "--prompt-ids", "1,2,3",
                                   "--max-new-tokens", 4, "--scheduler", "hardware", "--sps-table", path])
        assert rc == 2 and needle in err and is_one_error_line(err), err


@pytest.mark.parametrize("edit,needle", [
    (lambda t: t.update(steps_per_second=[1.0]), "steps_per_second"),
    (lambda t: t.update(steps_per_second=[-1.0] * len(t["profile_points"])), "steps_per_second"),
    (lambda t: t.pop("dtype"), "dtype"),
    (lambda t: t.update(drafter="something else"), "drafter"),
    # rates whose schedule overflows: a traceback (bucketed), or inf everywhere and nothing verified
    (lambda t: t.update(steps_per_second=[10**400] * len(t["profile_points"])), "steps_per_second"),
    (lambda t: t.update(steps_per_second=[1e-320] * len(t["profile_points"])), "steps_per_second"),
    # measured with another backend or compile mode: another round's speed
    (lambda t: t.update(kernels="triton"), "kernels is 'triton' in the table but 'torch' in this run"),
    (lambda t: t.update(compile_mode="reduce-overhead"), "compile_mode is 'reduce-overhead' in the table"),
    # measured with a sampling filter on: each runs over the vocabulary in every round, a flatter curve
    (lambda t: t.update(filters=dict(t["filters"], top_p=True)), "filters is {'top_k': False, 'top_p': True, "
                                                                  "'min_p': False} in the table but"),
    # measured with the CPU kernels on, off or on another path (DSPARK_CPU_KERNELS): another speed curve
    (lambda t: t.update(cpu_kernels={"mkl": "avx2"}.get(t["cpu_kernels"], "mkl")), "cpu_kernels is '"),
    (lambda t: t.pop("cpu_kernels"), "no 'cpu_kernels' (not an SPS table of this version"),
])
def test_a_malformed_or_foreign_sps_table_is_refused(env, tmp_path, edit, needle):
    path = tmp_path / "sps.json"
    write_sps_table(path, env["target"], env["drafter"], 1, 0.0, lambda b: 1.0 + b)
    _bad_table(path, edit)
    rc, _, err = run_captured(["--target", env["target"], "--drafter", env["drafter"], "--prompt-ids", "1,2,3",
                               "--max-new-tokens", 4, "--scheduler", "hardware", "--sps-table", path])
    assert rc == 2 and needle in err and str(path) in err and is_one_error_line(err), err


def test_a_table_that_does_not_fit_is_refused_before_the_compile(env, tmp_path, monkeypatch):
    """Everything that decides whether an SPS table fits the run is known before the engine compiles: a
    table of another run is refused before warmup (a cold compile takes minutes), a fitting one is read
    once, and the engine warms up and uses it."""
    from support import flags

    path = tmp_path / "sps.json"
    write_sps_table(path, env["target"], env["drafter"], 1, 0.0, lambda b: 1.0 + b)  # an eager run's
    m = speculate.load(env["target"], env["drafter"])
    warmed = []
    monkeypatch.setattr(speculate.Engine, "warmup", lambda self: warmed.append(self))
    s = flags.check_settings(flags.Settings(max_new_tokens=4, scheduler="hardware", sps_table=str(path),
                                            compile=True), "cpu")
    with pytest.raises(speculate.UserError, match="compiled is False in the table but True in this run"):
        speculate.make_engine(m, m.drafter, [[1, 2, 3]], s, verbose=False)
    assert warmed == []
    write_sps_table(path, env["target"], env["drafter"], 1, 0.0, lambda b: 1.0 + b, compile=True)
    engine = speculate.make_engine(m, m.drafter, [[1, 2, 3]], s, verbose=False)
    assert warmed == [engine] and engine.scheduler.measured


@pytest.mark.parametrize("flags,needle", [
    (["--scheduler", "threshold"], "--confidence-threshold"),
    (["--scheduler", "none", "--confidence-threshold", "0.5"], "--scheduler threshold"),
    (["--scheduler", "hardware", "--confidence-threshold", "0.5"], "--scheduler threshold"),
    (["--sps-table", "x.json"], "--sps-table"),
    (["--scheduler", "threshold", "--confidence-threshold", "0.5", "--verify-buckets", "a,b"], "--verify-buckets"),
    (["--scheduler", "hardware", "--verify-buckets", "0,10"], "--verify-buckets"),
    (["--scheduler", "hardware", "--verify-buckets", "2,2,10"], "--verify-buckets"),
    (["--scheduler", "hardware", "--verify-buckets", "2,4"], "largest bucket 4"),
    (["--verify-buckets", "5"], "--verify-buckets"),
    (["--scheduler", "hardware", "--drafter-plain"], "confidence head"),
])
def test_bad_scheduler_flags_are_refused(env, flags, needle):
    drafter = env["drafter"]
    if "--drafter-plain" in flags:
        flags = [f for f in flags if f != "--drafter-plain"]
        drafter = env["plain"]
    rc, _, err = run_captured(["--target", env["target"], "--drafter", drafter, "--prompt-ids", "1,2,3",
                               "--max-new-tokens", 4] + flags)
    assert rc == 2 and needle in err and is_one_error_line(err), err


def test_a_verify_is_padded_to_the_smallest_bucket_that_holds_it():
    """With buckets (and no SPS table to route by) n tokens verify as the smallest bucket holding them;
    without, as themselves."""
    s = sched.Scheduler("threshold", 4, 2, threshold=0.5, buckets=[9, 4, 10])
    assert [s.bucket(n) for n in (1, 4, 5, 9, 10)] == [4, 4, 9, 9, 10]
    assert sched.Scheduler("threshold", 4, 2, threshold=0.5).bucket(5) == 5


def test_explicit_buckets_pad_the_ragged_batch_and_keep_the_output(env):
    ref = run_env_traced(env, drafter=False, batch=3).outputs()
    tr = run_env_traced(env, "--scheduler", "threshold", "--confidence-threshold", 0.6, "--verify-buckets", "4,9,15",
                        batch=3)
    assert tr.outputs() == ref


# ----------------------------------------------------------------------------------------
# Continuous batching: a finished request's row takes the next waiting one

@pytest.mark.parametrize("scheduler,ragged", [("none", False), ("none", True), ("threshold", True),
                                              ("autoregressive", True)])
def test_continuous_batching_refills_rows_and_keeps_outputs(env, scheduler, ragged):
    from support.checkpoint import load_drafter

    target = load_target(env["target"])
    drafter = load_drafter(env["drafter"], target)
    # A long prompt first, so a later, shorter one lands in a row with stale cache past its end.
    prompts = [[40, 41, 42, 43, 44, 45, 46, 3, 5, 6, 7], [9], [1, 2, 3], [7, 30, 2], [11, 12], [5]]
    budgets = 12
    threshold = 0.6 if scheduler == "threshold" else 0.0

    def run(batch, reqs):
        engine = speculate.Engine(target, None if scheduler == "autoregressive" else drafter, batch_size=batch,
                                  max_seq=64, threshold=threshold,
                                  scheduler="none" if scheduler == "autoregressive" else scheduler, ragged=ragged)
        with torch.inference_mode():
            return engine.generate(reqs, budgets)

    alone = [run(1, [speculate.Request(0, p, [], [])])[0].output_ids for p in prompts]
    reqs = [speculate.Request(i, p, [], []) for i, p in enumerate(prompts)]
    run(2, reqs)
    assert [r.output_ids for r in reqs] == alone
    assert all(r.finish_reason == "length" and len(r.output_ids) == budgets for r in reqs)
    # Rows were refilled while others decoded: request 2 started after some request finished and
    # before the last one did.
    first_end = min(r.finished for r in reqs)
    assert first_end <= reqs[2].started < max(r.finished for r in reqs)
    assert all(r.started <= r.finished for r in reqs)


def test_continuous_batching_with_requests_that_end_at_their_first_token(env):
    from support.checkpoint import load_drafter

    target = load_target(env["target"])
    drafter = load_drafter(env["drafter"], target)
    engine = speculate.Engine(target, drafter, batch_size=2, max_seq=64)
    reqs = [speculate.Request(i, [i + 1, i + 2], [], []) for i in range(5)]
    ended = []
    with torch.inference_mode():
        engine.generate(reqs, 1, on_finish=lambda r: ended.append(r.index))
    assert sorted(ended) == list(range(5)) and all(len(r.output_ids) == 1 and not r.rounds for r in reqs)


# ----------------------------------------------------------------------------------------
# The SPS curve the scheduler uses

def test_isotonic_equals_the_min_max_formula():
    rng = random.Random(3)
    for _ in range(200):
        y = [rng.uniform(0, 10) for _ in range(rng.randint(1, 9))]
        n = len(y)
        mean = lambda j, k: sum(y[j:k + 1]) / (k - j + 1)
        want = [max(min(mean(j, k) for k in range(i, n)) for j in range(i + 1)) for i in range(n)]
        assert sched.isotonic(y) == pytest.approx(want)


@pytest.mark.parametrize("kind", ["hardware", "async"])
def test_an_engine_built_by_hand_schedules_only_with_an_sps_table(env, kind):
    """Engine(scheduler="hardware" or "async") without set_sps is refused in one line: its SPS was flat, so
    it verified every draft while its trace said it scheduled. make_engine sets the table itself."""
    from support.checkpoint import load_drafter

    target = load_target(env["target"])
    engine = speculate.Engine(target, load_drafter(env["drafter"], target), batch_size=2, max_seq=64,
                              scheduler=kind)
    reqs = [speculate.Request(0, [1, 2, 3])]
    with pytest.raises(speculate.UserError, match=re.escape(f"Engine(scheduler={kind!r}): no SPS table")):
        engine.generate(reqs, 4)
    points = engine.scheduler.profile_points
    engine.scheduler.set_sps(dict(sched.sps_identity(engine), steps_per_second=[1 / (1 + b) for b in points]))
    with torch.inference_mode():
        engine.generate(reqs, 4)
    assert reqs[0].output_ids


def test_sps_is_profiled_as_a_decode_finds_its_graphs(env, monkeypatch):
    """A warmed compiled engine decodes with guard evaluation cut (`Engine.stance`); SPS(B) is the rate of
    those rounds, so its dummy rounds run in that same stance."""
    import contextlib

    from support.checkpoint import load_drafter

    target = load_target(env["target"])
    engine = speculate.Engine(target, load_drafter(env["drafter"], target), batch_size=2, max_seq=64,
                              scheduler="hardware")
    inside = []
    rounds = []

    @contextlib.contextmanager
    def stance():
        inside.append(True)
        yield
        inside.pop()
    monkeypatch.setattr(engine, "stance", stance)
    monkeypatch.setattr(engine, "dummy_round", lambda b: rounds.append(bool(inside)))
    sched.profile_sps(engine)
    assert len(rounds) == 8 * len(engine.scheduler.profile_points) and all(rounds)


def test_eager_sps_is_the_isotonic_step_time_interpolated(env):
    from support.checkpoint import load_drafter

    target = load_target(env["target"])
    engine = speculate.Engine(target, load_drafter(env["drafter"], target), batch_size=2, max_seq=64,
                              scheduler="hardware")
    points = engine.scheduler.profile_points  # 1, 2, 3, 4, 6, 8, 10
    seconds = [1.0, 1.2, 1.1, 1.4, 1.6, 2.0, 2.2]  # a noisy dip at 3 tokens
    engine.scheduler.set_sps(dict(sched.sps_identity(engine), steps_per_second=[1 / s for s in seconds]))
    fit = sched.isotonic(seconds)
    assert fit[1] == fit[2] == pytest.approx(1.15)
    sps = engine.scheduler.sps.tolist()
    for b, s in zip(points, fit):
        assert sps[b] == pytest.approx(1 / s)
    assert sps[5] == pytest.approx(1 / ((fit[3] + fit[4]) / 2))  # halfway between 4 and 6 tokens
    assert all(x >= y for x, y in zip(sps[1:], sps[2:]))  # more tokens never faster


def test_bucketed_sps_routes_to_the_fastest_bucket_that_fits(env):
    from support.checkpoint import load_drafter

    target = load_target(env["target"])
    engine = speculate.Engine(target, load_drafter(env["drafter"], target), batch_size=2, max_seq=64,
                              scheduler="hardware", buckets=[2, 4, 10])
    s = engine.scheduler
    s.set_sps(dict(sched.sps_identity(engine), steps_per_second=[5.0, 3.0, 4.0]))  # 10 measured faster than 4
    assert [s.bucket(n) for n in range(1, 11)] == [2, 2] + [10] * 8
    assert s.sps.tolist()[1:] == [5.0, 5.0] + [4.0] * 8


def test_triton_kernels_on_cpu_without_the_interpreter_are_refused(env, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    rc, _, err = run_captured(["--target", env["target"], "--drafter", env["drafter"], "--prompt-ids", "1,2,3",
                               "--max-new-tokens", 4, "--kernels", "triton"])
    assert rc == 2 and "--kernels triton" in err and is_one_error_line(err), err


def test_a_new_kind_without_its_branch_is_not_run_as_none(monkeypatch):
    """A researcher's new schedule added to KINDS (so that flags and the engine accept it) but not given its
    branch in Scheduler.__call__ must fail, not verify the whole block under its own name."""
    monkeypatch.setattr(sched, "KINDS", sched.KINDS + ("mine",))
    s = sched.Scheduler("mine", 4, 2)
    with pytest.raises(NotImplementedError):
        s(torch.full((2, 4), 0.9), torch.ones(2, dtype=torch.bool))


def test_a_new_kind_that_reads_sps_gets_its_curve(monkeypatch):
    """docs/hacking.md: a new schedule that reads SPS(B) is added to SPS_KINDS; the scheduler keeps its curve
    by that membership, so make_engine's set_sps fills it rather than failing on a missing one."""
    monkeypatch.setattr(sched, "KINDS", sched.KINDS + ("mine",))
    monkeypatch.setattr(sched, "SPS_KINDS", sched.SPS_KINDS + ("mine",))
    s = sched.Scheduler("mine", 4, 2)
    points = s.profile_points
    s.set_sps({"steps_per_second": [1 / (1 + b) for b in points]})
    assert s.measured and s.sps.tolist()[points[0]] == pytest.approx(1 / (1 + points[0]))


# ----------------------------------------------------------------------------------------
# Ties: a confidence equal to θ, an admission that leaves Θ unchanged, two capacities of equal worth

@pytest.mark.parametrize("theta", [0.5, 0.75, 1.0])
def test_a_confidence_equal_to_the_threshold_keeps_its_draft(theta):
    """docs/trace-format.md: drafts are verified up to the first confidence below θ, so c = θ keeps a draft
    (θ = 1.0 too: a float32 sigmoid saturates to exactly 1.0) and the next float32 below θ cuts there."""
    at = torch.tensor(theta, dtype=torch.float32)
    if theta == 1.0:
        at = torch.sigmoid(torch.tensor(40.0))  # a confident head's logit
        assert at.item() == 1.0
    below = torch.nextafter(at, torch.tensor(0.0))
    c = torch.stack([at, at, below, at]).repeat(3, 1)
    c[1, 0] = below
    c[2] = at
    assert sched.threshold_schedule(c, theta).tolist() == [2, 0, 4]


def test_algorithm_1_does_not_admit_a_candidate_that_leaves_the_objective_unchanged():
    """The paper's rule admits while Θ improves: an admission giving exactly the same Θ stops it (sums and
    products exact in binary, so the ties are true ties)."""
    # R = 1, c = [0.5, 1.0] (a = 0.5, 0.5); SPS(1, 2, 3) = 1, 1, 0.75: Θ = 1, then 1.5 (admitted), then
    # 2 x 0.75 = 1.5, no better: not admitted.
    c = [[0.5, 1.0]]
    sps = {1: 1.0, 2: 1.0, 3: 0.75}.get
    assert theta_of(c, [True], [2], sps) == theta_of(c, [True], [1], sps) == 1.5
    assert vectorised(c, [True], sps) == algorithm1_literal(c, [True], sps) == [1]
    # SPS(1, 2, 3) = 1.5, 1, 4: the first admission ties Θ_0 (1.5 x 1 = 1 x 1.5): nothing is admitted, and
    # the search stops there although admitting both would pay (2 x 4 = 8).
    sps = {1: 1.5, 2: 1.0, 3: 4.0}.get
    assert theta_of(c, [True], [1], sps) == theta_of(c, [True], [0], sps) == 1.5
    assert vectorised(c, [True], sps) == algorithm1_literal(c, [True], sps) == [0]
    # Two rows, c = [1, 0] and [0.5, 0]: the tie at the second row's first draft (3 x 0.875 = 3.5 x 0.75),
    # so row 0 keeps its draft and row 1 gets none.
    c = [[1.0, 0.0], [0.5, 0.0]]
    sps = {1: 1.0, 2: 1.0, 3: 0.875, 4: 0.75, 5: 0.1, 6: 0.1}.get
    assert theta_of(c, [True, True], [1, 1], sps) == theta_of(c, [True, True], [1, 0], sps) == 2.625
    assert vectorised(c, [True, True], sps) == algorithm1_literal(c, [True, True], sps) == [1, 0]


def test_capacity_search_returns_the_smallest_capacity_at_a_tie():
    """Its docstring's promise: of the capacities that maximise (R + the C best survivals) x SPS(R + C), the
    smallest, whether the tie is with the next capacity or one further on (exact binary sums)."""
    c = [[0.5, 1.0]]  # R = 1, survivals 0.5, 0.5
    for sps, want in (([1.0, 1.0, 1.0, 0.75], 1),  # C = 1: 1.5 x 1; C = 2: 2 x 0.75
                      ([1.0, 1.5, 0.5, 0.75], 0),  # C = 0: 1 x 1.5 ties C = 2, C = 1 worse between them
                      ([1.0, 1.5, 1.0, 0.5], 0)):  # C = 0 ties C = 1
        worth = [(1 + sum([0.5, 0.5][:C])) * sps[1 + C] for C in range(3)]
        assert min(C for C in range(3) if worth[C] == max(worth)) == want and worth.count(max(worth)) == 2
        assert sched.capacity_search(c, 1, sps, 2) == want, sps


@pytest.mark.parametrize("kind,given,needle", [
    ("hardware", "rates", "set_sps: an SPS table is a dict with 'steps_per_second' (profile_sps, "
                          "load_or_profile), got list"),
    ("threshold", "table", "set_sps: scheduler 'threshold' reads no SPS table (only hardware and async do)"),
    ("none", "table", "set_sps: scheduler 'none' reads no SPS table"),
    ("async", "batch 5", "set_sps: the table's profile_points [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 40] are not "
                         "this scheduler's [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48]"),
])
def test_set_sps_refuses_what_is_not_this_schedulers_table(kind, given, needle):
    """A bare list of rates (an AttributeError), a table for a scheduler that reads none (a TypeError) and
    a batch-5 table of as many points on a batch-6 scheduler (taken in silence: the rate measured at 40
    tokens used at 48) are one line each."""
    s = sched.Scheduler(kind, 7, 6, threshold=0.5 * (kind == "threshold"))
    points = sched.verify_buckets(6 * 8)
    rates = [1.0] * len(points)
    tables = {"rates": rates, "table": {"steps_per_second": rates},
              "batch 5": {"steps_per_second": rates, "profile_points": sched.verify_buckets(5 * 8)}}
    assert len(tables["batch 5"]["profile_points"]) == len(points)
    with pytest.raises(speculate.UserError) as e:
        s.set_sps(tables[given])
    assert str(e.value).startswith(needle) and "\n" not in str(e.value), str(e.value)
    if s.sps is not None:  # the same table with this scheduler's points is taken
        s.set_sps({"steps_per_second": rates, "profile_points": points})
        assert s.measured


@pytest.mark.parametrize("kw,needle", [
    (dict(scheduler="bogus"), "--scheduler 'bogus': one of none, threshold, hardware, async"),
    (dict(scheduler="threshold", threshold=0.5, buckets=[3]),
     "--verify-buckets: the largest bucket 3 is below 5, the tokens of a full round (1 row(s) x 5)"),
    (dict(scheduler="threshold", threshold=float("nan")), "--confidence-threshold: invalid value nan (valid: "),
    (dict(scheduler="threshold", threshold=1.5), "--confidence-threshold: invalid value 1.5 (valid: "),
    (dict(scheduler="threshold"), "--scheduler threshold: needs --confidence-threshold above 0"),
    (dict(scheduler="threshold", threshold=0.5, drafter="plain"),
     "--confidence-threshold 0.5: the --drafter has no confidence head"),
    (dict(scheduler="hardware", drafter="plain"), "--scheduler hardware: the --drafter has no confidence head"),
    (dict(threshold=0.5), "--confidence-threshold 0.5: only --scheduler threshold uses it, not --scheduler none"),
    (dict(scheduler="hardware", threshold=-0.5), "--confidence-threshold: invalid value -0.5 (valid: "),
])
def test_an_engine_built_by_hand_checks_its_schedule(env, kw, needle):
    """Engine's scheduler arguments are checked as their flags are, when it is built: an unknown kind failed
    mid-decode, buckets below a full round were a bare StopIteration, a NaN θ verified nothing, a
    drafter without a confidence head was scheduled on confidences it does not have, and a θ under
    another kind was left unread in silence."""
    from support.checkpoint import load_drafter

    target = load_target(env["target"])
    drafter = load_drafter(env[kw.pop("drafter", "drafter")], target)
    with pytest.raises(speculate.UserError) as e:
        speculate.Engine(target, drafter, batch_size=1, max_seq=64, **kw)
    assert str(e.value).startswith(needle) and "\n" not in str(e.value), str(e.value)
    # what the flags take is taken: θ 1, the full round as the largest bucket; none reads no confidence
    speculate.Engine(target, load_drafter(env["drafter"], target), batch_size=1, max_seq=64, scheduler="threshold",
                     threshold=1.0, buckets=[2, 5])
    speculate.Engine(target, load_drafter(env["plain"], target), batch_size=1, max_seq=64)


def test_set_sps_checks_the_table_it_is_given(env):
    """Engine users call set_sps themselves (api.md): a table of another length (a per-B curve) or with a
    zero was taken in silence or failed deep inside; one line now, as a --sps-table file gets."""
    from support.checkpoint import load_drafter

    target = load_target(env["target"])
    engine = speculate.Engine(target, load_drafter(env["drafter"], target), batch_size=2, max_seq=64,
                              scheduler="hardware")
    points = len(engine.scheduler.profile_points)
    for rates in ([1.0] * (points + 1), [1.0, 2.0], [0.0] * points, None):
        with pytest.raises(speculate.UserError, match=rf"^set_sps: 'steps_per_second' must be {points} numbers"):
            engine.scheduler.set_sps({"steps_per_second": rates})
    with pytest.raises(speculate.UserError, match="ragged=False: the async schedule"):
        speculate.Engine(target, engine.drafter, batch_size=2, max_seq=64, scheduler="async", ragged=False)
