"""The code stays as lean as the design asks (scripts/loc.py's figures against its limits): a change that
pushes the algorithm files, what `python speculate.py` imports, or a file past its limit fails here."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "scripts"))
import loc  # noqa: E402


def test_the_figures_are_inside_their_limits():
    f = loc.figures()
    over = {k: (f[k], limit) for k, limit in loc.LIMITS.items() if f[k] > limit}
    assert not over, f"over the limits (figure, limit): {over}"
    assert "speculate.py" in f["speculate_modules"] and "cpu_kernels.cpp" in f["speculate_modules"]


def test_the_closure_follows_lazy_imports(tmp_path, monkeypatch):
    """An import inside a function counts: a module speculate.py reaches only lazily is still in the total."""
    (tmp_path / "a.py").write_text("import b\n\ndef f():\n    import c\n")
    for name in ("b", "c"):
        (tmp_path / f"{name}.py").write_text("x = 1\n")
    (tmp_path / "c.cpp").write_text("int x;\n")
    monkeypatch.setattr(loc, "ROOT", str(tmp_path))
    assert loc.closure("a") == ["a", "b", "c"] and loc.built_sources(["a", "b", "c"]) == ["c.cpp"]


def test_the_script_exits_1_over_a_limit(monkeypatch, capsys):
    monkeypatch.setitem(loc.LIMITS, "speculate_imports", 10)
    assert loc.main([]) == 1
    assert "over the limits: speculate_imports" in capsys.readouterr().out
    p = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "loc.py")], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
