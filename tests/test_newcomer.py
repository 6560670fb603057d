"""The README as a newcomer follows it: its marked commands, in order, in a new virtual environment.

Every fenced bash block of README.md right after a `<!-- newcomer-step -->` line is taken, in the
order the README gives them, and each command in it runs from a fresh copy of the repository (its
tracked and not-ignored files: what a clone holds). Each must exit 0 and print no traceback and no
warning (no "warning" in any case, on stdout or stderr). So the README and this test cannot drift: a
command changed there is the command run here.

Where this test departs from a newcomer's machine, and why:
- The virtual environment is made with `--system-site-packages` and `pip install -r requirements.txt`
  then resolves to the packages already installed. A truly fresh environment took 68 s here
  (`python -m venv` 4 s, `pip install -r requirements.txt` 64 s from the local wheel cache, 1.2 GB;
  2-core machine, load ~3), more than this test's share of CI's time. The suite's test-only
  `transformers` is visible through the system packages, so it is hidden in the new environment (a
  .pth line makes `import transformers` fail), as it is for someone who installed requirements.txt
  only — bench.py must then skip its reference loop with a note. (Run from inside a virtual
  environment, the suite's own packages are made visible the same way, by a .pth file.)
- The CPU torch line (`pip install torch==... --index-url .../cpu`) needs the network, which tests
  do not have: instead the environment's torch must be that version's CPU build.
- A run of `python X --help` lines runs in one process (each file executed as `__main__` with
  `--help`), not one process each: every start imports torch (~3 s each here).
- `pip install -e .` builds through pip's build isolation, which downloads setuptools. Here it runs
  as `pip install -e . --no-build-isolation --no-deps` with the setuptools the suite's Python has
  (the new environment's own older copy, which cannot build an editable wheel, is removed first);
  where no setuptools can, the test writes what the editable install would: a .pth line naming the
  checkout. Right after it the README's Python API example (the `<!-- api-example -->` block) runs
  from a folder outside the checkout, as someone who installed the project would run it.
Beyond each command's exit status and output, the test checks that the --help block names every
program and script, that --help wrote nothing, that the committed demo pair is unchanged at the end,
and that whatever the commands wrote is ignored by .gitignore.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO_ROOT

MARK = "<!-- newcomer-step -->"
# The whole run (install to --help) must stay within this test's share of CI's 15 minutes.
BUDGET_S = 150


def readme_steps(text: str) -> list[str]:
    """The commands of every bash block right after a MARK line, in order (continuation lines joined)."""
    lines, steps, i = text.splitlines(), [], 0
    while i < len(lines):
        if lines[i].strip() != MARK:
            i += 1
            continue
        i += 1
        while i < len(lines) and not lines[i].strip():
            i += 1
        assert i < len(lines) and lines[i].strip() == "```bash", f"README line {i + 1}: {MARK} must precede a bash block"
        i += 1
        block = []
        while lines[i].strip() != "```":
            block.append(lines[i])
            i += 1
        joined = "\n".join(block).replace("\\\n", " ")
        steps += [c.strip() for c in joined.splitlines() if c.strip() and not c.strip().startswith("#")]
    return steps


def api_example(text: str) -> str:
    """The README's Python API example: the python block right after the `<!-- api-example -->` line."""
    m = re.search(r"^<!-- api-example -->\s*```python\n(.*?)^```", text, re.DOTALL | re.MULTILINE)
    assert m, "README.md has no <!-- api-example --> python block"
    return m.group(1)


# Whether the environment's setuptools can build an editable wheel (bdist_wheel: setuptools >= 70.1,
# or the wheel package beside an older one).
CAN_BUILD = ("python -c 'import importlib.util as u, sys; "
             "sys.exit(0 if u.find_spec(\"setuptools\") and (u.find_spec(\"setuptools.command.bdist_wheel\") "
             "or u.find_spec(\"wheel\")) else 1)'")


def test_readme_steps_are_found():
    """The parser on a small README: marked blocks only, continuations joined, comments dropped."""
    text = (f"x\n{MARK}\n\n```bash\npython a.py \\\n    --flag 1\n# a comment\nls\n```\n"
            f"```bash\nnot me\n```\n{MARK}\n```bash\nb\n```\n")
    assert readme_steps(text) == ["python a.py      --flag 1", "ls", "b"]


def test_a_help_text_may_speak_of_warnings():
    """A --help text may name warnings; a warning itself (on stderr, or in its own form) still fails."""
    import pytest
    ok = subprocess.CompletedProcess([], 0, "usage: x\n  --strict  turn warnings into errors\n", "")
    clean("x --help", ok, help_text=True)
    for bad in (subprocess.CompletedProcess([], 0, "usage: x\n", "x.py:3: UserWarning: old\n"),
                subprocess.CompletedProcess([], 0, "usage: x\nWARNING: old flag\n", "")):
        with pytest.raises(AssertionError, match="a warning"):
            clean("x --help", bad, help_text=True)
    with pytest.raises(AssertionError, match="a warning"):
        clean("x", ok)


def copy_checkout(dst: Path):
    """What a clone holds: the tracked files and the new ones git does not ignore (as they are now)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO_ROOT,
                             capture_output=True, check=True, timeout=60).stdout
        files = [f for f in out.decode().split("\0") if f and os.path.isfile(REPO_ROOT / f)]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: everything but caches
        files = [str(p.relative_to(REPO_ROOT)) for p in REPO_ROOT.rglob("*") if p.is_file()
                 and not {".git", "__pycache__", ".venv", ".pytest_cache"} & set(p.relative_to(REPO_ROOT).parts)]
    for f in files:
        (dst / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO_ROOT / f, dst / f)


def listing(root: Path) -> set[str]:
    skip = {"__pycache__", ".venv"}
    return {str(p.relative_to(root)) for p in root.rglob("*") if not skip & set(p.relative_to(root).parts)}


def digest(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def clean(cmd: str, p: subprocess.CompletedProcess, help_text: bool = False):
    """Exit 0, no traceback, no warning. A --help text (help_text) may speak of warnings: there stdout is
    searched only for a warning's own form (`...Warning:`, `WARNING:`), stderr for the word."""
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"{cmd}: exit {p.returncode}\n{out[-3000:]}"
    assert "Traceback" not in out, f"{cmd}: a traceback\n{out[-3000:]}"
    hit = (re.search(r"^.*warning.*$", p.stderr, re.IGNORECASE | re.MULTILINE)
           or re.search(r"^.*warning\s*:.*$", p.stdout, re.IGNORECASE | re.MULTILINE) if help_text
           else re.search(r"^.*warning.*$", out, re.IGNORECASE | re.MULTILINE))
    assert hit is None, f"{cmd}: a warning: {hit.group(0)!r}"


# Runs `python FILE --help` for each FILE given, in this one process, as `python` would run it.
HELP_DRIVER = r'''
import contextlib, io, json, runpy, sys, warnings
done = {}
for path in sys.argv[1:]:
    out, err, code = io.StringIO(), io.StringIO(), 0
    sys.argv = [path, "--help"]
    sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(path)))
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            import traceback; traceback.print_exc(); code = 1
    sys.path.pop(0)
    done[path] = {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}
print(json.dumps(done))
'''


# Imports each module named on its command line; prints {module: its file} as one JSON line.
IMPORT_ALL = ("import importlib, json, sys; "
              "print(json.dumps({m: importlib.import_module(m).__file__ for m in sys.argv[1:]}))")


def test_a_newcomer_follows_the_readme(tmp_path):
    t_start = time.monotonic()
    steps = readme_steps((REPO_ROOT / "README.md").read_text(encoding="utf-8"))
    repo = tmp_path / "repo"
    copy_checkout(repo)
    before, demo_before = listing(repo), digest(repo / "demo")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET", "VIRTUAL_ENV",
                                                             "PYTHONWARNINGS", "OMP_NUM_THREADS")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    timings, outputs = [], {}

    def sh(cmd: str, label: str = "", timeout: float = 120) -> subprocess.CompletedProcess:
        t0 = time.monotonic()
        p = subprocess.run(["bash", "-c", cmd], cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)
        timings.append((label or cmd, time.monotonic() - t0))
        return p

    help_cmd = re.compile(r"^python (\S+\.py) --help$")
    elsewhere = tmp_path / "elsewhere"  # outside the checkout: the API example runs from here
    elsewhere.mkdir()
    api_out = None
    helps = [help_cmd.match(s).group(1) for s in steps if help_cmd.match(s)]
    i = 0
    while i < len(steps):
        cmd = steps[i]
        venv = re.fullmatch(r"python -m venv (\S+) && \. (\S+)/bin/activate", cmd)
        torch_line = re.fullmatch(r"pip install torch==(\S+) --index-url (\S+)", cmd)
        if venv:
            assert venv.group(1) == venv.group(2), cmd
            t0 = time.monotonic()
            subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", venv.group(1)], cwd=repo,
                           check=True, timeout=120)
            timings.append((cmd + "  [--system-site-packages]", time.monotonic() - t0))
            home = repo / venv.group(1)
            site = next(Path(p) for p in glob.glob(str(home / "lib" / "python*" / "site-packages")))
            (site / "zz_no_transformers.pth").write_text("import sys; sys.modules['transformers'] = None\n")
            if sys.prefix != sys.base_prefix:  # the suite itself runs in a virtual environment: see its packages too
                import site as here
                (site / "outer.pth").write_text("".join(p + "\n" for p in here.getsitepackages()))
            env.update(VIRTUAL_ENV=str(home), PATH=f"{home / 'bin'}{os.pathsep}{env.get('PATH', '')}")
            i += 1
        elif torch_line:
            assert "VIRTUAL_ENV" in env, "the README installs torch before making the virtual environment"
            p = sh("python -c 'import importlib.metadata as m; print(m.version(\"torch\"))'",
                   f"{cmd}  [no network: the installed torch checked instead]")
            clean(cmd, p)
            want = torch_line.group(1) + ("+cpu" if torch_line.group(2).rstrip("/").endswith("/cpu") else "")
            import importlib.metadata

            import pytest
            mine = importlib.metadata.version("torch")
            if mine != want and p.stdout.strip() == mine:  # the suite run on another torch (README: torch 2.11)
                pytest.skip(f"the suite runs on torch {mine}; the README's walkthrough installs {want} "
                            "and is followed on that torch only")
            assert p.stdout.strip() == want, f"{cmd}: the environment's torch is {p.stdout.strip()}, not {want}"
            i += 1
        elif cmd == "pip install -e .":
            assert "VIRTUAL_ENV" in env, "the README installs the project before making the virtual environment"
            t0, n0 = time.monotonic(), len(timings)
            how = "[offline: --no-build-isolation --no-deps]"
            python = str(Path(env["VIRTUAL_ENV"]) / "bin" / "python")  # the new environment's, named, not PATH's
            if sh(CAN_BUILD, "").returncode != 0:  # the venv's own setuptools (3.11 bundles 65.5) shadows the suite's
                subprocess.run([python, "-m", "pip", "uninstall", "-y", "-q", "setuptools"], cwd=repo, env=env,
                               capture_output=True, timeout=120)
            if sh(CAN_BUILD, "").returncode == 0:
                p = sh(f"{cmd} --no-build-isolation --no-deps", "")
                clean(cmd, p)
            else:  # no setuptools here can build it: what an editable install of flat modules amounts to
                venv_site = glob.glob(str(Path(env["VIRTUAL_ENV"]) / "lib" / "python*" / "site-packages"))[0]
                (Path(venv_site) / "dspark_fast_checkout.pth").write_text(str(repo) + "\n")
                how = "[no setuptools can build it offline: a .pth line naming the checkout]"
            timings[n0:] = [(f"{cmd}  {how}", time.monotonic() - t0)]
            example = elsewhere / "api_example.py"
            example.write_text(api_example((repo / "README.md").read_text(encoding="utf-8")), encoding="utf-8")
            t0 = time.monotonic()
            api_out = subprocess.run([python, str(example)], cwd=elsewhere, env=env, capture_output=True, text=True,
                                     timeout=120)
            timings.append(("the README's Python API example, run from outside the checkout", time.monotonic() - t0))
            clean("the README's Python API example (run outside the checkout)", api_out)
            assert api_out.stdout.strip(), "the API example printed nothing"
            where = subprocess.run([python, "-c", "import speculate; print(speculate.__file__)"], cwd=elsewhere,
                                   env=env, capture_output=True, text=True, timeout=60)
            assert Path(where.stdout.strip()).resolve().parent == repo.resolve(), where.stdout + where.stderr
            # Every module imports from outside the checkout: the programs and support/, each from the checkout.
            modules = sorted(p.stem for p in repo.glob("*.py")) + sorted(
                f"support.{p.stem}" for p in (repo / "support").glob("*.py") if p.stem != "__init__")
            t0 = time.monotonic()
            imported = subprocess.run([python, "-c", IMPORT_ALL, *modules], cwd=elsewhere, env=env,
                                      capture_output=True, text=True, timeout=120)
            timings.append((f"import every module ({len(modules)}) from outside the checkout", time.monotonic() - t0))
            clean("importing every module from outside the checkout", imported)
            files = json.loads(imported.stdout.splitlines()[-1])
            assert sorted(files) == sorted(modules), imported.stdout
            outside = {m: f for m, f in files.items() if not Path(f).resolve().is_relative_to(repo.resolve())}
            assert not outside, f"imported from elsewhere than the checkout: {outside}"
            i += 1
        elif help_cmd.match(cmd):
            run = []
            while i < len(steps) and help_cmd.match(steps[i]):
                run.append(help_cmd.match(steps[i]).group(1))
                i += 1
            files = listing(repo)
            p = sh(f"python -c {shlex.quote(HELP_DRIVER)} " + " ".join(run),
                   f"python FILE --help for {len(run)} files, in one process")
            clean("the --help lines", p, help_text=True)
            for path, r in json.loads(p.stdout.splitlines()[-1]).items():
                clean(f"python {path} --help", subprocess.CompletedProcess([], r["code"], r["stdout"], r["stderr"]),
                      help_text=True)
                assert "usage" in r["stdout"].lower(), f"python {path} --help: no usage\n{r['stdout'][:500]}"
            assert listing(repo) == files, "--help wrote files"
        else:
            files = listing(repo) if cmd.endswith(" --help") else None
            p = outputs[cmd] = sh(cmd)
            clean(cmd, p, help_text=files is not None)
            if files is not None:
                assert "usage" in (p.stdout + p.stderr).lower() and listing(repo) == files, cmd
            i += 1
    took = time.monotonic() - t_start
    report = "\n".join(f"{s:6.1f} s  {c}" for c, s in timings)
    print(f"README steps ({took:.0f} s in all):\n{report}")

    # What the steps must have covered: the install, the demo, eval, bench, every program's --help.
    assert any(c.startswith("python -m venv") for c, _ in timings)
    assert any(s.split(" -c ")[0] == "pip install -r requirements.txt" for s in steps), steps
    assert api_out is not None, "no `pip install -e .` step: the API example was not run from outside the checkout"
    assert "python speculate.py" in steps and "python eval.py" in steps
    assert any(s.startswith("python scripts/bench.py ") and "--help" not in s for s in steps)
    programs = {os.path.relpath(f, repo) for f in glob.glob(str(repo / "*.py"))
                + glob.glob(str(repo / "scripts" / "*.py")) if '__name__ == "__main__"' in Path(f).read_text("utf-8")}
    assert set(helps) == programs, f"--help lines missing from the README: {sorted(programs - set(helps))}"
    shells = {os.path.relpath(f, repo) for f in glob.glob(str(repo / "scripts" / "*.sh"))}
    assert all(f"bash {s} --help" in steps for s in shells), shells
    # bench ran without transformers, as requirements.txt installs: its reference loop said it was skipped.
    (bench_out,) = [p for c, p in outputs.items() if c.startswith("python scripts/bench.py ")]
    assert "skipped: transformers is not installed" in bench_out.stderr, bench_out.stderr
    assert digest(repo / "demo") == demo_before, "the committed demo pair changed"
    new = sorted({Path(f).parts[0] + ("/" if (repo / Path(f).parts[0]).is_dir() else "")
                  for f in listing(repo) - before} | {".venv/"})
    if shutil.which("git"):
        ignored = subprocess.run(["git", "check-ignore", "--no-index", "--", *new], cwd=REPO_ROOT,
                                 capture_output=True, text=True).stdout.split()
        assert sorted(ignored) == new, f"written by the README's steps, not in .gitignore: {set(new) - set(ignored)}"
    assert took < BUDGET_S, f"the README's steps took {took:.0f} s (budget {BUDGET_S} s)\n{report}"


def test_pyproject_lists_every_module():
    """`pip install -e .` installs what pyproject.toml names: every top-level module of the checkout in
    py-modules (none named that is not there), and support/ in packages with its modules. Cheap, no install:
    the walkthrough above imports them all from outside the checkout, where the install is run."""
    import pytest

    tomllib = pytest.importorskip("tomllib")  # Python 3.11's
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    listed, packages = set(config.get("py-modules", [])), set(config.get("packages", []))
    here = {p.stem for p in REPO_ROOT.glob("*.py")}
    assert not here - listed, f"pyproject.toml's py-modules lacks {sorted(here - listed)}: not installed"
    assert not listed - here, f"pyproject.toml's py-modules names {sorted(listed - here)}, not in the checkout"
    folders = {".".join(p.parent.relative_to(REPO_ROOT).parts) for p in (REPO_ROOT / "support").rglob("*.py")
               if "__pycache__" not in p.parts}
    assert folders <= packages, f"pyproject.toml's packages lacks {sorted(folders - packages)}: not installed"
    assert all((REPO_ROOT / f.replace(".", os.sep) / "__init__.py").is_file() for f in folders), folders
