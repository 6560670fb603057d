"""How lean the code reads: the figures the design holds the core to.

    python scripts/loc.py

- the four algorithm files (model.py, drafter.py, kernels.py, speculate.py): non-blank lines, the
  mean width of a non-blank line (leading spaces not counted), and the share of their non-whitespace
  characters that are comments and docstrings;
- what `python speculate.py` can import from the project: every project module reachable from
  speculate.py through an import statement anywhere in a file (lazy imports included), plus the C++
  sources those modules build; non-blank lines;
- the longest of the project's Python files (top level and scripts/), blank lines included.
"""

from __future__ import annotations

import ast
import glob
import io
import os
import sys
import tokenize
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = ("model.py", "drafter.py", "kernels.py", "speculate.py")
LIMITS = {"core_lines": 2000, "core_width": 65, "core_comments": 0.20, "speculate_imports": 4000, "longest_file": 700}


def non_blank(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [line for line in f.read().splitlines() if line.strip()]


def comment_chars(source: str) -> int:
    """Non-whitespace characters in comments and docstrings (a string that is a statement of its own)."""
    n = sum(len("".join(t.string.split())) for t in tokenize.generate_tokens(io.StringIO(source).readline)
            if t.type == tokenize.COMMENT)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            n += len("".join(ast.get_source_segment(source, node).split()))
    return n


def project_imports(path: str) -> set[str]:
    """Project modules a file names in any import statement."""
    found = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
        found |= {n.split(".")[0] for n in names if os.path.isfile(os.path.join(ROOT, n.split(".")[0] + ".py"))}
    return found


def closure(start: str) -> list[str]:
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += project_imports(os.path.join(ROOT, m + ".py"))
    return sorted(seen)


def built_sources(modules: list[str]) -> list[str]:
    """C++ files next to the modules that build them (a module foo.py builds foo.cpp)."""
    return [m + ".cpp" for m in modules if os.path.isfile(os.path.join(ROOT, m + ".cpp"))]


def figures() -> dict:
    lines = {f: non_blank(os.path.join(ROOT, f)) for f in CORE}
    chars = sum(len("".join(open(os.path.join(ROOT, f), encoding="utf-8").read().split())) for f in CORE)
    comments = sum(comment_chars(open(os.path.join(ROOT, f), encoding="utf-8").read()) for f in CORE)
    body = [line.strip() for ls in lines.values() for line in ls]
    modules = closure("speculate")
    sizes = {os.path.relpath(p, ROOT): len(open(p, encoding="utf-8").read().splitlines())
             for p in glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, "scripts", "*.py"))}
    longest = max(sizes.items(), key=lambda kv: kv[1])
    files = [m + ".py" for m in modules] + built_sources(modules)
    return {"core_lines_by_file": {f: len(v) for f, v in lines.items()},
            "core_lines": sum(len(v) for v in lines.values()),
            "core_width": sum(map(len, body)) / len(body),
            "core_comments": comments / chars,
            "speculate_modules": files,
            "speculate_imports_by_file": {f: len(non_blank(os.path.join(ROOT, f))) for f in files},
            "speculate_imports": sum(len(non_blank(os.path.join(ROOT, f))) for f in files),
            "longest_file": longest[1], "longest_file_name": longest[0]}


def main(argv: Optional[list[str]] = None) -> int:
    import argparse
    argparse.ArgumentParser(description="Print how lean the code reads (core lines, width, comment share, what "
                            "`python speculate.py` imports, the longest file); exit 1 when a figure is over its "
                            "limit.").parse_args(argv)
    f = figures()
    print("core files, non-blank lines: " + ", ".join(f"{k} {v}" for k, v in f["core_lines_by_file"].items())
          + f" = {f['core_lines']} (limit {LIMITS['core_lines']})")
    print(f"core mean non-blank line: {f['core_width']:.1f} characters (limit {LIMITS['core_width']})")
    print(f"core comments and docstrings: {100 * f['core_comments']:.1f}% of non-whitespace characters "
          f"(limit {100 * LIMITS['core_comments']:.0f}%)")
    print("python speculate.py imports: " + ", ".join(f"{k} {v}" for k, v in f["speculate_imports_by_file"].items())
          + f" = {f['speculate_imports']} non-blank lines (limit {LIMITS['speculate_imports']})")
    print(f"longest file: {f['longest_file_name']} {f['longest_file']} lines (limit {LIMITS['longest_file']})")
    over = [k for k in LIMITS if f[k] > LIMITS[k]]
    if over:
        print("over the limits: " + ", ".join(over))
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
