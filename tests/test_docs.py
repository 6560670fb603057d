"""The documentation holds together: its links lead somewhere, and it names the files that exist.

- Every relative link in README.md, BENCHMARKS.md and docs/*.md leads to a file of the repository, and
  every `#anchor` to a heading of the page it names, by GitHub's rules for a heading's anchor.
- The README's code map names every program, module and script, and no file that does not exist;
  neither do the docs.
- The code the README and the docs name in backticks, `module.name` or `Class.name`, exists.
- docs/api.md's copy of the Python API example is the README's (the newcomer test runs that one).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from conftest import REPO_ROOT

PAGES = sorted([REPO_ROOT / "README.md", REPO_ROOT / "BENCHMARKS.md", *(REPO_ROOT / "docs").glob("*.md")])
FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
IMAGE = re.compile(r"!\[[^\]]*\]\(\s*([^)\s]+)\s*\)")


def prose(text: str) -> list[str]:
    """The lines outside fenced code blocks, inline code blanked (a link or heading there is not one)."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            out.append("")
            continue
        out.append("" if fenced else re.sub(r"`[^`]*`", "``", line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text (links and code as their text), lowercased, every
    character but letters, digits, `_`, `-` and spaces dropped, spaces made hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor on a page; a repeated one gets -1, -2, ... as GitHub numbers them."""
    seen: dict[str, int] = {}
    out = set()
    text, fenced = page.read_text(encoding="utf-8"), False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            s = slug(m.group(1))
            out.add(s if s not in seen else f"{s}-{seen[s]}")
            seen[s] = seen.get(s, 0) + 1
    return out


def links(page: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link and image on a page, outside code."""
    found = []
    for n, line in enumerate(prose(page.read_text(encoding="utf-8")), 1):
        found += [(n, m.group(1)) for m in LINK.finditer(line)] + [(n, m.group(1)) for m in IMAGE.finditer(line)]
    return found


def test_the_slug_rules():
    assert slug("Python API") == "python-api"
    assert slug("`python speculate.py`") == "python-speculatepy"
    assert slug("Published figures (quoted from the paper, not measured here)") == \
        "published-figures-quoted-from-the-paper-not-measured-here"
    assert slug("Qwen3-8B on one 8-GPU node — an estimate, not a measurement") == \
        "qwen3-8b-on-one-8-gpu-node--an-estimate-not-a-measurement"
    assert slug("What `bench.py` measures") == "what-benchpy-measures"
    assert slug("eval_step and [a link](x.md)") == "eval_step-and-a-link"


def test_pages_are_found():
    names = {p.relative_to(REPO_ROOT).as_posix() for p in PAGES}
    assert {"README.md", "BENCHMARKS.md", "docs/cli.md", "docs/algorithm.md"} <= names, names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_every_link_resolves(page: Path):
    bad = []
    for n, target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # https:, mailto: ...: not this repository's
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(REPO_ROOT)}:{n}: ({target})"
        if REPO_ROOT.resolve() not in dest.parents and dest != REPO_ROOT.resolve():
            bad.append(f"{where} leads outside the repository")
        elif not dest.exists():
            bad.append(f"{where}: no such file")
        elif anchor:
            if dest.suffix != ".md":
                bad.append(f"{where}: an anchor into a file that is not markdown")
            elif anchor not in anchors(dest):
                bad.append(f"{where}: no heading #{anchor} in {dest.relative_to(REPO_ROOT.resolve())}")
    assert not bad, "\n".join(bad)


def programs_and_modules() -> set[str]:
    return {p.relative_to(REPO_ROOT).as_posix() for p in
            [*REPO_ROOT.glob("*.py"), *(REPO_ROOT / "support").glob("*.py"), *(REPO_ROOT / "support").glob("*.cpp"),
             *(REPO_ROOT / "scripts").glob("*.py"), *(REPO_ROOT / "scripts").glob("*.sh")]
            if p.name != "__init__.py"}


def test_the_code_map_names_every_file():
    """The README's table of files: one row per module, program and script, each of them there."""
    text = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    rows = set(re.findall(r"^\| `([^`]+)` \|", text, re.MULTILINE))
    files = programs_and_modules()
    assert not files - rows, f"files missing from the README's code map: {sorted(files - rows)}"
    assert not rows - files, f"the README's code map names files that do not exist: {sorted(rows - files)}"


@pytest.mark.parametrize("page", [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))],
                         ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_no_mention_of_a_file_that_is_gone(page: Path):
    """A program, module or script named in the README or the docs exists (BENCHMARKS.md gives its
    commands as they ran, so it may name a script since removed, and says so)."""
    text = page.read_text(encoding="utf-8")
    named = set(re.findall(r"(?<![\w/.-])((?:scripts/|support/)?[A-Za-z_]\w*\.(?:py|sh|cpp))\b", text))
    known = programs_and_modules() | {p.relative_to(REPO_ROOT).as_posix() for p in (REPO_ROOT / "tests").glob("*.py")}
    bare = {Path(f).name for f in known}
    foreign = {"shutil.py"}  # the standard library's (the demo's first prompt is cut from it)
    gone = sorted(f for f in named if f not in known and not ("/" not in f and (f in bare or f in foreign)))
    assert not gone, f"{page.relative_to(REPO_ROOT)} names files that do not exist: {gone}"


def test_api_doc_repeats_the_readme_example():
    block = re.compile(r"^<!-- api-example -->\s*```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
    readme = block.search((REPO_ROOT / "README.md").read_text(encoding="utf-8"))
    api = block.search((REPO_ROOT / "docs" / "api.md").read_text(encoding="utf-8"))
    assert readme and api, "README.md and docs/api.md each hold an <!-- api-example --> python block"
    assert api.group(1) == readme.group(1), "docs/api.md's API example differs from the README's"


def code_names() -> tuple[dict, dict]:
    """Per project module, its top-level names; per class, its members (methods, class attributes, and
    what its methods assign to self)."""
    modules, classes = {}, {}
    for f in [*REPO_ROOT.glob("*.py"), *(REPO_ROOT / "support").glob("*.py"), *(REPO_ROOT / "scripts").glob("*.py")]:
        tree = ast.parse(f.read_text(encoding="utf-8"))
        top = set()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                top.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    top |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                top |= {(a.asname or a.name).split(".")[0] for a in node.names}
        modules[f"scripts/{f.stem}" if f.parent.name == "scripts" else f.stem] = top
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            members = classes.setdefault(cls.name, set())
            for node in ast.walk(cls):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    members.add(node.name)
                elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                    members.add(node.attr)
                elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node in cls.body:
                    for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                        members |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
    return modules, classes


@pytest.mark.parametrize("page", [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))],
                         ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_the_code_named_exists(page: Path):
    modules, classes = code_names()
    missing = []
    for code in re.findall(r"`([^`\n]+)`", page.read_text(encoding="utf-8")):
        m = re.fullmatch(r"([A-Za-z_]\w*)\.([A-Za-z_]\w*)(\(.*\))?", code.strip())
        if not m or m.group(2) in ("py", "md", "cpp", "sh", "json", "jsonl", "safetensors", "txt"):
            continue
        owner, name = m.group(1), m.group(2)
        if owner in modules and name not in modules[owner] and name not in classes.get(owner, ()) or owner in classes and owner not in modules and name not in classes[owner]:
            missing.append(code)
    assert not missing, f"{page.relative_to(REPO_ROOT)} names code that does not exist: {sorted(set(missing))}"
