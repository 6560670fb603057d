"""Byte-identical traces before and after a change of code shape (the before/after check of issue [7]).

tests/golden/traces/ holds what speculate.py wrote, greedy, for fixed runs on the demo pair and on the
committed small random pairs (tests/golden/pairs: every Markov head, the z-lab layout, the threshold
and hardware schedules, batches with continuous batching, text prompts through the chat template),
with the summary's timing fields removed. Each case is rerun here and must match line for line.
`python tests/golden/make_golden.py` rewrites them — only for a deliberate behaviour change.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden"))

import make_golden  # noqa: E402
import speculate  # noqa: E402


@pytest.fixture(scope="module")
def sps_table(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("golden") / "sps.json")
    make_golden.write_sps_table(path, 3)
    return path


@pytest.mark.parametrize("name", list(make_golden.CASES))
def test_trace_is_byte_identical(name, sps_table, tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    rc = speculate.main(make_golden.flags(name, sps_table) + ["--trace-file", str(trace)])
    err = capsys.readouterr().err
    assert rc == 0, err
    got = make_golden.normalize(trace.read_text()).splitlines()
    with open(os.path.join(make_golden.TRACES, name + ".jsonl")) as f:
        want = f.read().splitlines()
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"{name}: line {i + 1} differs\n got: {g}\nwant: {w}"
    assert len(got) == len(want), f"{name}: {len(got)} lines, the golden trace has {len(want)}"
