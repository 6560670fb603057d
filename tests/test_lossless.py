"""End-to-end losslessness of speculative decoding, through `speculate.main` and its trace file.

- Greedy: speculative output equals the target-only output (speculate.py without --drafter, the
  baseline, itself checked against transformers in test_cli.py) token for token, for every
  Markov head type, DeepSpec DFlash and z-lab layouts, a mostly-wrong drafter, with and without
  a confidence threshold, at batch size 1 and in a mixed-length batch.
- Token budget and EOS: exactly max_new_tokens without a stop token; a stop token inside an
  accepted run ends that row right there while the other rows of the batch go on.
- Trace file: every key of docs/trace-format.md, with its type, and the numbers consistent with each other.
- Sampling: the joint distribution of the first generated tokens matches the target's exact
  distribution (chi-square, from transformers' own forward), for a drafter that is often right
  and one that is mostly wrong; a deliberately biased acceptance fails the same check.
- Seeds: the same seed repeats a sampled run exactly; another seed does not.

Checkpoints are tiny random models built once per module (tests/drafters.py).
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import math
import os
import shutil
import sys
from dataclasses import dataclass, field
from typing import Optional

import pytest
import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (_HERE, os.path.dirname(_HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from conftest import chi2_pvalue  # noqa: E402
from drafters import make_any, make_target  # noqa: E402

import sampling  # noqa: E402
import speculate  # noqa: E402
from drafter import MARKOV_HEADS  # noqa: E402

torch.set_num_threads(1)

K = 4  # block size of the DSpark drafters here (K drafts a round); the z-lab one drafts K - 1
MAX_NEW = 32
PROMPTS = [[1, 2, 3, 4, 5], [7, 30, 2], [9], [40, 41, 42, 43, 44, 45, 46, 3]]  # mixed lengths
BATCH = 3  # 4 prompts at --batch-size 3: one mixed-length batch of 3, then a batch of 1
P_MIN = 1e-3


# ----------------------------------------------------------------------------------------
# Running the CLI and reading its trace

@dataclass
class Trace:
    lines: list
    rounds: list
    requests: dict  # request index -> its end line
    summary: dict
    stdout: str = ""
    _by_request: Optional[dict] = None

    def rounds_of(self, i):
        if self._by_request is None:
            self._by_request = {}
            for r in self.rounds:
                self._by_request.setdefault(r["request"], []).append(r)
        return self._by_request.get(i, [])

    def outputs(self):
        return [self.requests[i]["output_ids"] for i in sorted(self.requests)]


def read_trace(path) -> Trace:
    with open(path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    rounds = [l for l in lines if "round" in l]
    ends = [l for l in lines if "output_ids" in l]
    summaries = [l for l in lines if l.get("summary") is True]
    assert len(summaries) == 1 and lines[-1] is summaries[0], "exactly one summary line, the last"
    assert len(rounds) + len(ends) + 1 == len(lines), "every line is a round, request or summary line"
    requests = {}
    for e in ends:
        assert e["request"] not in requests, f"request {e['request']} ends twice"
        requests[e["request"]] = e
    return Trace(lines, rounds, requests, summaries[0])


_counter = itertools.count()


def run_traced(workdir, args) -> Trace:
    """speculate.main in-process with a fresh --trace-file; asserts exit status 0."""
    path = os.path.join(str(workdir), f"trace{next(_counter)}.jsonl")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = speculate.main([str(a) for a in args] + ["--trace-file", path])
    assert rc == 0, err.getvalue()
    tr = read_trace(path)
    tr.stdout = out.getvalue()
    return tr


def _is_int(x):
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def accepted_drafts(r):
    """The drafts a round accepted: a chain's first `accepted`, a tree's nodes along its path."""
    if "path" in r:
        return [r["draft"][node - 1] for node in r["path"]]
    return r["draft"][:r["accepted"]]


def counted(r, stop_ids=()):
    """(accepted, verified, committed) of a round as the metrics count it (docs/algorithm.md,
    "Evaluation"): a stop token among the accepted drafts ends the round at it, with no bonus."""
    eos = [j for j, t in enumerate(accepted_drafts(r)) if t in stop_ids]
    return (eos[0] + 1,) * 3 if eos else (r["accepted"], r["verified"], r["accepted"] + 1)


def sent(r, a, v):
    """How deep the drafts a round sent reach past its accepted ones: a chain's ℓ; a tree's path, one
    node deeper where the last accepted node (the root when none) has a child."""
    if "path" not in r:
        return v
    last = r["path"][a - 1] if a else 0
    children = [node for node, parent in enumerate(r["parents"], 1) if parent == last]
    return min(v, a + (1 if children else 0))


def recompute_accept_rates(rounds, K, stop_ids=()):
    rates = []
    for k in range(1, K + 1):
        av = [counted(r, stop_ids)[:2] for r in rounds]
        av = [(a, sent(r, a, v)) for (a, v), r in zip(av, rounds)]
        tried = sum(1 for a, v in av if a >= k - 1 and v >= k)
        ok = sum(1 for a, _ in av if a >= k)
        rates.append(ok / tried if tried else None)  # no round tried draft k: undefined
    return rates


def check_trace(tr: Trace, *, n_requests: int, K: int, V: int, confidence: bool, max_new: int,
                stop_ids=(), tree_budget: int = 0):
    """Everything docs/trace-format.md promises about the trace, and the numbers' mutual consistency.
    K: drafts a round (with tree_budget, a tree's depth: the positions acceptance is counted by)."""
    assert sorted(tr.requests) == list(range(n_requests))
    position = {id(l): i for i, l in enumerate(tr.lines)}
    stop_ids = set(stop_ids)
    for i in range(n_requests):
        end = tr.requests[i]
        rounds = tr.rounds_of(i)
        # Request line: keys and types.
        for key in ("request", "output_ids", "num_rounds", "acceptance_length", "finish_reason"):
            assert key in end, f"request line lacks {key!r}: {end}"
        out = end["output_ids"]
        assert isinstance(out, list) and all(_is_int(t) and 0 <= t < V for t in out)
        assert _is_int(end["num_rounds"]) and end["num_rounds"] == len(rounds)
        assert end["finish_reason"] in ("stop", "length")
        # It comes after all of its rounds, which are numbered 0, 1, ... in order.
        assert all(position[id(r)] < position[id(end)] for r in rounds)
        assert [r["round"] for r in rounds] == list(range(len(rounds)))
        if rounds:
            tau = sum(counted(r, stop_ids)[2] for r in rounds) / len(rounds)
            assert _is_num(end["acceptance_length"]) and abs(end["acceptance_length"] - tau) < 1e-9
        else:
            assert end["acceptance_length"] is None or end["acceptance_length"] in (0, 0.0)
        # Round lines: keys, types, bounds; the committed tokens rebuild the output.
        assert out, "at least the prefill token"
        committed = [out[0]]
        for j, r in enumerate(rounds):
            for key in ("request", "round", "anchor", "draft", "confidence", "verified", "accepted", "bonus"):
                assert key in r, f"round line lacks {key!r}: {r}"
            assert _is_int(r["request"]) and _is_int(r["round"])
            assert _is_int(r["anchor"]) and _is_int(r["bonus"]) and 0 <= r["bonus"] < V
            assert isinstance(r["draft"], list) and len(r["draft"]) == (tree_budget or K)
            assert all(_is_int(t) and 0 <= t < V for t in r["draft"])
            if confidence:
                assert isinstance(r["confidence"], list) and len(r["confidence"]) == K
                assert all(_is_num(c) and 0 <= c <= 1 for c in r["confidence"])
            else:
                assert r["confidence"] is None
            assert _is_int(r["verified"]) and _is_int(r["accepted"])
            assert 0 <= r["accepted"] <= r["verified"] <= len(r["draft"])
            assert r["anchor"] == committed[-1], f"round {j} of request {i}: anchor is not the last token"
            if tree_budget:
                assert len(r["path"]) == r["accepted"] <= r["depth"] and len(r["parents"]) == tree_budget
                assert r["verified"] == sum(p >= 0 for p in r["parents"]), r  # the nodes the search reached
            elif r["accepted"] < r["verified"]:
                # A rejected draft is never what replaces it (greedy: it was not the argmax;
                # sampled: the residual max(p - q, 0) is 0 at a rejected token).
                assert r["draft"][r["accepted"]] != r["bonus"], r
            assert len(committed) < len(out), f"request {i}: round {j} ran after the output was complete"
            committed += accepted_drafts(r) + [r["bonus"]]
        # The rounds stop as soon as the output is complete.
        if rounds:
            last_before = len(committed) - (rounds[-1]["accepted"] + 1)
            assert last_before < len(out) <= len(committed)
        assert out == committed[:len(out)]
        # Exact budget, stop tokens.
        assert len(out) <= max_new
        first_stop = next((k for k, t in enumerate(out) if t in stop_ids), None)
        if end["finish_reason"] == "stop":
            assert first_stop == len(out) - 1, "stop: the output ends at its first stop token"
        else:
            assert first_stop is None and len(out) == max_new, "length: exactly max_new_tokens, no stop token"
        if not rounds:
            assert len(out) == 1
    # Summary line.
    s = tr.summary
    for key in ("summary", "tokens_per_second", "acceptance_length", "accept_rate_by_position",
                "prefill_seconds", "decode_seconds", "compile_seconds"):
        assert key in s, f"summary lacks {key!r}"
    for key in ("tokens_per_second", "prefill_seconds", "decode_seconds", "compile_seconds"):
        assert _is_num(s[key]) and s[key] >= 0, (key, s[key])
    if tr.rounds:
        tau = sum(counted(r, stop_ids)[2] for r in tr.rounds) / len(tr.rounds)
        assert _is_num(s["acceptance_length"]) and abs(s["acceptance_length"] - tau) < 1e-9
    rates = s["accept_rate_by_position"]
    assert isinstance(rates, list) and len(rates) == K and all(x is None or _is_num(x) for x in rates)
    want = recompute_accept_rates(tr.rounds, K, stop_ids)
    for got, w in zip(rates, want):
        assert (got is None) == (w is None) and (w is None or abs(got - w) < 1e-9), (rates, want)


# ----------------------------------------------------------------------------------------
# Greedy: a near-bigram target where the oracle drafters are right often but not always

DRAFTERS = {
    # name: (make_drafter options, has confidence head, drafts per round); every Markov head first
    **{head: (dict(markov=head, oracle=True, oracle_scale=4.0, norm_scale=0.05), True, K)
       for head in MARKOV_HEADS},
    "random": (dict(markov="vanilla", oracle=False), True, K),
    "dflash": (dict(spelling="deepspec", markov=None, confidence=False), False, K),
    "zlab": (dict(spelling="zlab", markov=None, confidence=False), False, K - 1),
    "eagle3": (dict(eagle3=True, ttt_length=K + 1), False, K + 1),
}
ORACLES = ("vanilla", "gated", "rnn")  # heads whose oracle weights make the chain right often
# make_drafter's confidence bias (1.0) keeps c_k above 0.5 nearly always; at 0.5 the tiny heads'
# confidences straddle the 0.5 threshold, so the threshold cuts rounds at every length.
CONFIDENCE_BIAS = 0.5


def set_confidence_bias(drafter_dir: str, bias: float):
    from safetensors.torch import load_file, save_file

    path = os.path.join(drafter_dir, "model.safetensors")
    w = load_file(path)
    w["confidence_head.proj.bias"] = torch.tensor([bias])
    save_file(w, path)


@dataclass
class GreedyEnv:
    dir: str
    target: str
    V: int
    drafters: dict
    prompts_file: str
    cache: dict = field(default_factory=dict)

    def run(self, drafter: Optional[str] = None, threshold: float = 0.0, batch_size: int = 1,
            max_new: int = MAX_NEW, target: Optional[str] = None) -> Trace:
        key = (drafter, threshold, batch_size, max_new, target)
        if key not in self.cache:
            args = ["--target", target or self.target, "--prompts-file", self.prompts_file,
                    "--max-new-tokens", max_new, "--batch-size", batch_size]
            if drafter is not None:
                args += ["--drafter", self.drafters[drafter]]
            if threshold:
                args += ["--confidence-threshold", threshold]
            self.cache[key] = run_traced(self.dir, args)
        return self.cache[key]


@pytest.fixture(scope="module")
def genv(tmp_path_factory) -> GreedyEnv:
    d = tmp_path_factory.mktemp("lossless_greedy")
    target = make_target(d / "target", attn_scale=0.01)
    drafters = {}
    for name, (opts, _, _) in DRAFTERS.items():
        if not opts.get("eagle3"):
            opts = dict(opts, block_size=K)
        drafters[name] = make_any(d / name, target, **opts)
    for name, (_, conf, _) in DRAFTERS.items():
        if conf:
            set_confidence_bias(drafters[name], CONFIDENCE_BIAS)
    pf = d / "prompts.jsonl"
    pf.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in PROMPTS))
    V = json.load(open(os.path.join(target, "config.json")))["vocab_size"]
    return GreedyEnv(str(d), target, V, drafters, str(pf))


def test_baseline_is_batch_invariant(genv):
    ref = genv.run(None, batch_size=1)
    check_trace(ref, n_requests=len(PROMPTS), K=0, V=genv.V, confidence=False, max_new=MAX_NEW)
    assert all(r["draft"] == [] and r["accepted"] == 0 and r["verified"] == 0 for r in ref.rounds)
    batched = genv.run(None, batch_size=BATCH)
    check_trace(batched, n_requests=len(PROMPTS), K=0, V=genv.V, confidence=False, max_new=MAX_NEW)
    assert batched.outputs() == ref.outputs()
    # The outputs are not degenerate (a constant output would make equality cheap).
    assert all(len(set(o)) >= 3 for o in ref.outputs())


GREEDY_CASES = [(name, thr) for name, (_, conf, _) in DRAFTERS.items() for thr in ((0.0, 0.5) if conf else (0.0,))]


@pytest.mark.parametrize("name,threshold", GREEDY_CASES, ids=[f"{n}-thr{t}" for n, t in GREEDY_CASES])
def test_greedy_speculative_equals_baseline(genv, name, threshold):
    _, conf, nd = DRAFTERS[name]
    ref = genv.run(None, batch_size=1).outputs()
    single = genv.run(name, threshold, batch_size=1)
    batched = genv.run(name, threshold, batch_size=BATCH)
    for tr in (single, batched):
        check_trace(tr, n_requests=len(PROMPTS), K=nd, V=genv.V, confidence=conf, max_new=MAX_NEW)
        for i, (got, want) in enumerate(zip(tr.outputs(), ref)):
            assert got == want, f"request {i} (prompt {PROMPTS[i]}): speculative {got} != baseline {want}"
    # The batch does not change what the drafter proposes either (its context is right per row):
    # the same rounds, the same drafts, the same verification.
    for i in range(len(PROMPTS)):
        a, b = single.rounds_of(i), batched.rounds_of(i)
        assert [(r["draft"], r["verified"], r["accepted"], r["bonus"]) for r in a] == \
               [(r["draft"], r["verified"], r["accepted"], r["bonus"]) for r in b], f"request {i}"
    rounds = single.rounds + batched.rounds
    if name in ORACLES and threshold == 0:
        assert any(r["accepted"] >= 2 for r in rounds), "the oracle drafter should get several tokens accepted"
        assert any(r["accepted"] < r["verified"] for r in rounds), "and be wrong sometimes"
    if threshold > 0:
        assert any(r["verified"] < nd for r in rounds), "the threshold should cut some rounds short"
        assert any(r["verified"] == nd for r in rounds), "and leave others whole"
        for r in rounds:  # ℓ = the drafts before the first confidence below the threshold
            low = [k for k, c in enumerate(r["confidence"]) if c < threshold]
            assert r["verified"] == (low[0] if low else nd), r
    else:
        assert all(r["verified"] == nd for r in rounds)


@pytest.mark.parametrize("max_new", [1, 2, 3, 6])
def test_exact_token_budget(genv, max_new):
    ref = genv.run(None, batch_size=1).outputs()
    for name in ("vanilla", "random"):
        tr = genv.run(name, batch_size=BATCH, max_new=max_new)
        check_trace(tr, n_requests=len(PROMPTS), K=K, V=genv.V, confidence=True, max_new=max_new)
        for got, want in zip(tr.outputs(), ref):
            assert len(got) == max_new and got == want[:max_new]
        assert all(e["finish_reason"] == "length" for e in tr.requests.values())
        if max_new == 1:
            assert tr.rounds == []  # the prefill token fills the budget: no round at all


def _committed_sources(tr: Trace, i: int):
    """For each output index of request i: (round index or None for prefill, inside the accepted run?)."""
    src = [(None, False)]
    for r in tr.rounds_of(i):
        src += [(r["round"], True)] * r["accepted"] + [(r["round"], False)]
    return src[:len(tr.requests[i]["output_ids"])]


def test_eos_inside_accepted_run_ends_the_row(genv, tmp_path):
    """Pick a token the greedy output reaches for the first time inside an accepted run (round with
    accepted >= 2, output index >= 3) that some other prompt's output never produces, make it the
    target's EOS, and decode the batch again."""
    base = genv.run("vanilla", batch_size=1)
    outs = base.outputs()
    choice = None
    for i, out in enumerate(outs):
        src = _committed_sources(base, i)
        for idx in range(3, len(out)):
            t = out[idx]
            rnd, inside = src[idx]
            if not inside or out.index(t) != idx or base.rounds_of(i)[rnd]["accepted"] < 2:
                continue
            if any(t not in o for o in outs):
                choice = (i, idx, t)
                break
        if choice:
            break
    assert choice is not None, "no usable EOS candidate; change the prompts"
    row, idx, eos = choice
    eos_target = tmp_path / "eos_target"
    shutil.copytree(genv.target, eos_target)
    cfg_path = eos_target / "config.json"
    cfg = json.load(open(cfg_path))
    cfg["eos_token_id"] = eos
    json.dump(cfg, open(cfg_path, "w"))

    for drafter, bs in (("vanilla", 1), ("vanilla", len(PROMPTS)), (None, len(PROMPTS))):
        args = ["--target", eos_target, "--prompts-file", genv.prompts_file, "--max-new-tokens", MAX_NEW,
                "--batch-size", bs]
        if drafter:
            args += ["--drafter", genv.drafters[drafter]]
        tr = run_traced(tmp_path, args)
        check_trace(tr, n_requests=len(PROMPTS), K=K if drafter else 0, V=genv.V, confidence=bool(drafter),
                    max_new=MAX_NEW, stop_ids=(eos,))
        for i, (got, full) in enumerate(zip(tr.outputs(), outs)):
            if eos in full:
                want = full[:full.index(eos) + 1]
                assert got == want and tr.requests[i]["finish_reason"] == "stop", (i, got, want)
            else:  # the other rows of the batch go on to the budget
                assert got == full and tr.requests[i]["finish_reason"] == "length", (i, got, full)
        assert tr.outputs()[row] == outs[row][:idx + 1]
        if drafter:
            # The stop came inside an accepted run: the row's last round accepted more than the
            # stop token's place in it, and the tokens after it were dropped.
            last = tr.rounds_of(row)[-1]
            k = last["draft"].index(eos)
            assert k < last["accepted"] and last["accepted"] >= 2
            assert tr.requests[row]["num_rounds"] == _committed_sources(base, row)[idx][0] + 1


def test_batch_row_finishing_with_overshoot_keeps_the_batch_going(genv, tmp_path):
    """Regression: prompts [1] and [5], --batch-size 2, --max-new-tokens 6, the oracle vanilla
    drafter (K=4). Request 1 commits 4 tokens in round 0 and ends in round 1 (2 accepted + bonus,
    only 1 fits the budget), so its anchor moves past its budget, while request 0 goes on: the next
    rounds verify request 1 at positions 8..12. With caches of prompt + max_new + K + 1 = 12 rows
    this raised IndexError in model.py's RoPE lookup; the caches must leave room for it."""
    pf = tmp_path / "p.jsonl"
    pf.write_text('{"prompt_ids": [1]}\n{"prompt_ids": [5]}\n')
    args = ["--target", genv.target, "--drafter", genv.drafters["vanilla"], "--prompts-file", pf,
            "--max-new-tokens", 6]
    ref = run_traced(tmp_path, args + ["--batch-size", 1])
    got = run_traced(tmp_path, args + ["--batch-size", 2])
    assert got.outputs() == ref.outputs()
    # The scenario really happened: request 1 overshot its budget in its last round while
    # request 0 still had rounds to go.
    assert len(got.rounds_of(1)) < len(got.rounds_of(0))
    assert sum(len(r["draft"][:r["accepted"]]) + 1 for r in got.rounds_of(1)) + 1 > 6
    check_trace(got, n_requests=2, K=K, V=genv.V, confidence=True, max_new=6)


# ----------------------------------------------------------------------------------------
# Sampling follows the target's exact distribution

SV = 8  # vocabulary of the sampling target: the joint of M tokens has SV**M cells
M = 4  # tokens whose joint is tested: the prefill token, then (K_S = 2) two drafts and the bonus
K_S = 2
N_SAMPLES = 6000
SAMPLE_PROMPT = [1, 2, 3]
SAMPLE_DRAFTERS = {
    "oracle": dict(markov="vanilla", oracle=True, oracle_scale=1.0, norm_scale=0.05, block_size=K_S),
    "random": dict(markov="vanilla", oracle=False, block_size=K_S),
    "rnn-oracle": dict(markov="rnn", oracle=True, oracle_scale=1.0, norm_scale=0.05, block_size=K_S),
    "zlab": dict(spelling="zlab", markov=None, confidence=False, block_size=K_S + 1),
    "eagle3": dict(eagle3=True, ttt_length=K_S, norm_scale=0.05),
}


@dataclass
class SampleEnv:
    dir: str
    target: str
    drafters: dict
    prefixes: torch.Tensor
    logits: torch.Tensor  # the target's logits after every prefix of M - 1 generated tokens

    def joint(self, temperature: float = 1.0) -> torch.Tensor:
        """[SV ** M] exact probabilities of the first M generated tokens."""
        return exact_joint(self.prefixes, self.logits, temperature)


def target_logits_after(target_dir: str, prompt: list, m: int, V: int):
    """transformers' Qwen3 logits after the prompt followed by every sequence of m - 1 tokens:
    (prefixes [V^(m-1), m-1], logits [V^(m-1), m, V]; position j predicts generated token j+1)."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    prefixes = torch.tensor(list(itertools.product(range(V), repeat=m - 1)), dtype=torch.long)
    tokens = torch.cat([torch.tensor(prompt).expand(len(prefixes), len(prompt)), prefixes], dim=1)
    with torch.no_grad():
        logits = hf(input_ids=tokens, use_cache=False).logits.double()
    return prefixes, logits[:, len(prompt) - 1:]


def exact_joint(prefixes: torch.Tensor, logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """P(t_1 .. t_m | prompt) at `temperature` for every sequence, index t_1 * V^(m-1) + ... + t_m."""
    m = logits.shape[1]
    logp = torch.log_softmax(logits / temperature, dim=-1)
    lp = logp[:, :m - 1].gather(2, prefixes[:, :, None])[:, :, 0].sum(1)  # log P(t_1 .. t_{m-1})
    joint = (lp[:, None] + logp[:, m - 1]).exp().reshape(-1)
    assert abs(joint.sum().item() - 1) < 1e-6
    return joint


def seq_index(seqs, V):
    idx = torch.zeros(len(seqs), dtype=torch.long)
    for j in range(len(seqs[0])):
        idx = idx * V + torch.tensor([s[j] for s in seqs])
    return idx


@pytest.fixture(scope="module")
def senv(tmp_path_factory) -> SampleEnv:
    d = tmp_path_factory.mktemp("lossless_sampled")
    target = make_target(d / "target", vocab_size=SV, attn_scale=0.05)
    drafters = {name: make_any(d / name, target, **opts) for name, opts in SAMPLE_DRAFTERS.items()}
    return SampleEnv(str(d), target, drafters, *target_logits_after(target, SAMPLE_PROMPT, M, SV))


def sample_run(senv: SampleEnv, drafter: str, temperature: float = 1.0, seed: int = 0) -> Trace:
    args = ["--target", senv.target, "--drafter", senv.drafters[drafter],
            "--prompt-ids", ",".join(map(str, SAMPLE_PROMPT)), "--num-samples", N_SAMPLES,
            "--batch-size", N_SAMPLES, "--max-new-tokens", M, "--temperature", temperature, "--seed", seed]
    return run_traced(senv.dir, args)


def test_exact_joint_is_not_degenerate(senv):
    # The check below means something only if the first tokens are genuinely random.
    first = senv.joint().reshape(SV, -1).sum(1)
    assert first.max() < 0.8 and (senv.joint() > 1e-3).sum() > 30


SAMPLE_CASES = [(name, 1.0) for name in SAMPLE_DRAFTERS] + [("oracle", 0.6)]


@pytest.mark.parametrize("drafter,temperature", SAMPLE_CASES, ids=[f"{n}-T{t}" for n, t in SAMPLE_CASES])
def test_sampled_output_follows_target_distribution(senv, drafter, temperature):
    tr = sample_run(senv, drafter, temperature)
    nd = K_S
    confidence = SAMPLE_DRAFTERS[drafter].get("confidence", not SAMPLE_DRAFTERS[drafter].get("eagle3"))
    check_trace(tr, n_requests=N_SAMPLES, K=nd, V=SV, confidence=confidence, max_new=M)
    outs = tr.outputs()
    assert all(len(o) == M for o in outs)
    p = chi2_pvalue(seq_index(outs, SV), senv.joint(temperature))
    assert p > P_MIN, f"{drafter} at T={temperature}: chi-square p = {p:.2e}"
    # Every path of the round was exercised: acceptances, rejections (corrections) and bonuses.
    first = [r for r in tr.rounds if r["round"] == 0]
    acc = [r["accepted"] for r in first]
    assert acc.count(0) > 50 and acc.count(nd) > 50, {a: acc.count(a) for a in range(nd + 1)}
    if drafter == "oracle":  # q ≈ p: most drafts pass
        assert sum(acc) / len(acc) > 0.8
    if drafter == "random":
        assert sum(acc) / len(acc) < 0.8


def _accept_everything(orig):
    """Verification that pretends q == p, so that every draft is accepted."""
    def verify_sampled(drafts, q, target_logits, verify_len, temperature, *rest, **kwargs):
        fake_q = sampling.probs(target_logits[:, :drafts.shape[1]], temperature)
        return orig(drafts, fake_q, target_logits, verify_len, temperature, *rest, **kwargs)
    return verify_sampled


def _q_without_markov(orig):
    """A chain that drafts with the Markov head but reports q without its bias (a head that the
    verification silently does not see)."""
    def markov_chain(base_logits, hidden, anchor, markov, temperature, *rest, **kwargs):
        drafts, q = orig(base_logits, hidden, anchor, markov, temperature, *rest, **kwargs)
        return drafts, sampling.probs(base_logits, temperature)
    return markov_chain


@pytest.mark.parametrize("drafter,kernel,bias", [("random", "accept_sampled", _accept_everything),
                                                 ("oracle", "markov_chain", _q_without_markov)],
                         ids=["accept-everything", "q-without-markov"])
def test_chi_square_has_power_against_biased_sampling(senv, monkeypatch, drafter, kernel, bias):
    """The same check fails a deliberately biased engine (so passing it means something)."""
    # The round calls sampling.py's references by name: bias one of them.
    monkeypatch.setattr(sampling, kernel, bias(getattr(sampling, kernel)))
    tr = sample_run(senv, drafter)
    if kernel == "accept_sampled":
        assert all(r["accepted"] == r["verified"] for r in tr.rounds)
    p = chi2_pvalue(seq_index(tr.outputs(), SV), senv.joint())
    assert p < P_MIN, f"the biased run passed: p = {p:.2e}"


def test_same_seed_same_trace_other_seed_differs(genv):
    def run(seed, bs):
        args = ["--target", genv.target, "--drafter", genv.drafters["vanilla"], "--prompts-file",
                genv.prompts_file, "--max-new-tokens", 20, "--batch-size", bs, "--temperature", 1.0,
                "--seed", seed, "--num-samples", 2, "--confidence-threshold", 0.5]
        tr = run_traced(genv.dir, args)
        check_trace(tr, n_requests=2 * len(PROMPTS), K=K, V=genv.V, confidence=True, max_new=20)
        return tr

    a, b, c = run(3, 5), run(3, 5), run(4, 5)
    assert a.lines[:-1] == b.lines[:-1]  # everything but the summary's timings
    assert a.outputs() != c.outputs()
    # num-samples: the two samples of one prompt are independent draws, not copies.
    outs = a.outputs()
    assert any(outs[2 * i] != outs[2 * i + 1] for i in range(len(PROMPTS)))


def test_sampled_output_exact_in_rows_refilled_by_continuous_batching(senv, tmp_path):
    """Rows that held a longer prompt are refilled with SAMPLE_PROMPT (stale cache and context past
    its end): its samples still follow the target's exact distribution."""
    long_prompt = [5, 6, 7, 1, 2, 4, 3, 0, 6, 5, 1, 1]
    pf = tmp_path / "mixed.jsonl"
    pf.write_text(json.dumps({"prompt_ids": long_prompt}) + "\n" + json.dumps({"prompt_ids": SAMPLE_PROMPT}) + "\n")
    half = N_SAMPLES // 2
    tr = run_traced(senv.dir, ["--target", senv.target, "--drafter", senv.drafters["oracle"], "--prompts-file", pf,
                               "--num-samples", half, "--batch-size", half // 2, "--max-new-tokens", M,
                               "--temperature", 1.0])
    outs = tr.outputs()  # requests 0..half-1: the long prompt; half..: SAMPLE_PROMPT, in refilled rows
    assert all(len(o) == M for o in outs)
    p = chi2_pvalue(seq_index(outs[half:], SV), senv.joint())
    assert p > P_MIN, f"chi-square p = {p:.2e}"
