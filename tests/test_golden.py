"""The same traces before and after a change of code or kernels.

tests/golden/traces/ holds what speculate.py wrote, greedy, for fixed runs on the demo pair and on the
committed small random pairs (tests/golden/pairs: every Markov head, the z-lab layout, the threshold
and hardware schedules, batches with continuous batching, text prompts through the chat template),
with the summary's timing fields removed. Each case is rerun here and must match line for line: every
token, count, id and string exactly; real numbers (the confidences) to FLOAT_TOLERANCE, the rounding of
another GEMM kernel (the CPU kernels move them by at most 1e-6 and no token).
`python tests/golden/make_golden.py` rewrites them — only for a deliberate behaviour change.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden"))

import make_golden  # noqa: E402

import speculate  # noqa: E402

FLOAT_TOLERANCE = 1e-5


def same(got, want) -> bool:
    """Equal JSON values, except that two real numbers may differ by FLOAT_TOLERANCE."""
    if isinstance(got, float) or isinstance(want, float):
        return isinstance(got, float) and isinstance(want, float) and abs(got - want) <= FLOAT_TOLERANCE
    if isinstance(got, dict) and isinstance(want, dict):
        return list(got) == list(want) and all(same(got[k], want[k]) for k in want)
    if isinstance(got, list) and isinstance(want, list):
        return len(got) == len(want) and all(same(g, w) for g, w in zip(got, want))
    return type(got) is type(want) and got == want


def test_same_is_exact_but_for_rounding():
    assert same({"draft": [1, 2], "confidence": [0.5]}, {"draft": [1, 2], "confidence": [0.5 + 1e-7]})
    assert not same({"draft": [1, 2]}, {"draft": [1, 3]}) and not same({"c": 0.5}, {"c": 0.5 + 1e-4})
    assert not same({"a": 1, "b": 2}, {"b": 2, "a": 1}) and not same([1], [1.0]) and not same(True, 1)
    assert not same({"t": "x"}, {"t": "y"}) and not same([0.5], [0.5, 0.5])


@pytest.fixture(scope="module")
def sps_table(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("golden") / "sps.json")
    make_golden.write_sps_table(path, 3)
    return path


@pytest.mark.parametrize("name", list(make_golden.CASES))
def test_trace_is_the_same(name, sps_table, tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    rc = speculate.main(make_golden.flags(name, sps_table) + ["--trace-file", str(trace)])
    err = capsys.readouterr().err
    assert rc == 0, err
    got = make_golden.normalize(trace.read_text()).splitlines()
    with open(os.path.join(make_golden.TRACES, name + ".jsonl")) as f:
        want = f.read().splitlines()
    for i, (g, w) in enumerate(zip(got, want)):
        assert same(json.loads(g), json.loads(w)), f"{name}: line {i + 1} differs\n got: {g}\nwant: {w}"
    assert len(got) == len(want), f"{name}: {len(got)} lines, the golden trace has {len(want)}"
