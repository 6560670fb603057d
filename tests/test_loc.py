"""scripts/loc.py: the figures it reports are the ones its docstring defines."""

from __future__ import annotations

import loc

SPREAD = '''"""A module docstring: not code."""


def f(a, b):
    """A docstring: not code."""
    # a comment: not code
    total = a + b
    return total
'''

PACKED = '''def f(a, b):
    total = a + b; return total
'''


def test_tokens_leave_out_comments_docstrings_and_layout():
    spread = loc.figures_of(SPREAD)
    packed = loc.figures_of(PACKED)
    assert packed["code_tokens"] == spread["code_tokens"] + 1  # the packed line's ";" alone differs
    assert spread["code_lines"] == 3
    assert packed["code_lines"] == 2
    assert spread["nodes"] == packed["nodes"]  # the docstrings' nodes are left out
    assert packed["nodes"] / packed["code_lines"] > spread["nodes"] / spread["code_lines"]


def test_long_lines_and_conditional_expressions():
    source = "x = 1 if y else 2\n" + "z = '" + "a" * 120 + "'\n"
    counts = loc.figures_of(source)
    assert counts["conditionals"] == 1
    assert counts["long_lines"] == 1
    figures = loc.summary(counts)
    assert figures["conditionals_per_1000"] == 500
    assert figures["long_lines"] == 0.5


def test_closure_follows_imports_into_support():
    files = loc.closure("speculate")
    assert "speculate.py" in files and "model.py" in files
    assert "support/checkpoint.py" in files  # a package's modules, named in `from support import ...`
    assert "train.py" not in files and "eval.py" not in files


def test_main_prints_every_algorithm_file_and_the_total(capsys):
    assert loc.main([]) == 0
    out = capsys.readouterr().out
    for name in loc.ALGORITHM:
        assert name in out
    assert "algorithm files" in out
    assert "python speculate.py imports" in out
    anchor = next(line for line in out.splitlines() if line.startswith(loc.ANCHOR_NAME))
    assert anchor.split()[-5:] == ["5,773", "606", "10.0", "5.9%", "5"]  # its lines counted, as ours


def test_a_bad_flag_is_one_line(capsys):
    import pytest

    with pytest.raises(SystemExit) as e:
        loc.main(["--bogus"])
    assert e.value.code == 2
    assert capsys.readouterr().err == "error: unrecognized arguments: --bogus\n"
