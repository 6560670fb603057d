"""How the code reads, in figures that packing cannot improve (a mirror, not a gate: nothing fails on them).

    python scripts/loc.py

For the algorithm files (model.py, drafter.py, sampling.py, kernels.py, speculate.py), each and together:
- code tokens: Python's tokens, comments, docstrings and layout (newlines, indentation) left out;
- code lines: lines holding code (not blank, not only a comment, not inside a docstring);
- AST nodes per code line: how much each line holds (docstrings left out);
- lines of 100+ characters, as a share of code lines;
- conditional expressions (`a if c else b`) per 1,000 code lines.
Then the code tokens of everything `python speculate.py` can import from the project: every module
reachable from speculate.py through an import statement anywhere in a file (lazy imports included),
support/ package modules included. The anchor's figures (gpt-fast's model.py + generate.py), measured the
same way, are printed beside.
"""

from __future__ import annotations

import argparse
import ast
import io
import os
import sys
import tokenize
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALGORITHM = ("model.py", "drafter.py", "sampling.py", "kernels.py", "speculate.py")
# gpt-fast's model.py + generate.py (commit 32971d3), counted by `figures_of`: the row printed beside ours.
ANCHOR_NAME = "gpt-fast model+generate"
ANCHOR_COUNTS = {"code_tokens": 5773, "code_lines": 606, "nodes": 6050, "long_lines": 36, "conditionals": 3}
LAYOUT = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING,
          tokenize.ENDMARKER}
LONG = 100


def docstrings(tree: ast.AST) -> list[ast.Expr]:
    """String statements: module, class and function docstrings and any other bare string."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            found.append(node)
    return found


def figures_of(source: str) -> dict:
    """One file's raw counts."""
    tree = ast.parse(source)
    strings = docstrings(tree)
    starts = {(d.lineno, d.col_offset) for d in strings}
    doc_lines = set()
    for d in strings:
        doc_lines.update(range(d.lineno, d.end_lineno + 1))
    tokens = 0
    for t in tokenize.generate_tokens(io.StringIO(source).readline):
        if t.type in LAYOUT:
            continue
        if t.type == tokenize.STRING and t.start in starts:
            continue
        tokens += 1
    lines = source.splitlines()
    code = []
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if text and not text.startswith("#") and number not in doc_lines:
            code.append(line)
    nodes = sum(1 for _ in ast.walk(tree)) - 2 * len(strings)  # a docstring is an Expr and its Constant
    conditionals = sum(1 for n in ast.walk(tree) if isinstance(n, ast.IfExp))
    long_lines = sum(1 for line in code if len(line) >= LONG)
    return {"code_tokens": tokens, "code_lines": len(code), "nodes": nodes, "long_lines": long_lines,
            "conditionals": conditionals}


def summary(counts: dict) -> dict:
    lines = max(counts["code_lines"], 1)
    return {"code_tokens": counts["code_tokens"], "code_lines": counts["code_lines"],
            "nodes_per_line": counts["nodes"] / lines, "long_lines": counts["long_lines"] / lines,
            "conditionals_per_1000": 1000 * counts["conditionals"] / lines}


def module_path(name: str) -> Optional[str]:
    """The project file of a dotted module name (a module or a package's __init__), if any."""
    parts = name.split(".")
    for candidate in (os.path.join(ROOT, *parts) + ".py", os.path.join(ROOT, *parts, "__init__.py")):
        if os.path.isfile(candidate):
            return candidate
    return None


def project_imports(path: str) -> set[str]:
    """Project modules a file names in any import statement (`from package import module` included)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if module_path(name) is not None:
                found.add(name)
    return found


def closure(start: str) -> list[str]:
    """Every project module `start` can import, itself included (files, relative to the root)."""
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        path = module_path(name)
        if name in seen or path is None:
            continue
        seen.add(name)
        todo += project_imports(path)
    return sorted({os.path.relpath(module_path(n), ROOT) for n in seen})


def read(relative: str) -> str:
    with open(os.path.join(ROOT, relative), encoding="utf-8") as f:
        return f.read()


def figures() -> dict:
    per_file = {}
    for f in ALGORITHM:
        if os.path.isfile(os.path.join(ROOT, f)):
            per_file[f] = figures_of(read(f))
    total = {}  # the raw counts summed over the algorithm files
    for counts in per_file.values():
        for k, v in counts.items():
            total[k] = total.get(k, 0) + v
    imported = closure("speculate")
    imported_tokens = sum(figures_of(read(f))["code_tokens"] for f in imported)
    return {"files": {f: summary(c) for f, c in per_file.items()},
            "algorithm": summary(total),
            "speculate_imports": imported,
            "speculate_import_tokens": imported_tokens}


def row(name: str, f: dict) -> str:
    return (f"{name:<26}{f['code_tokens']:>8,}{f['code_lines']:>7,}{f['nodes_per_line']:>9.1f}"
            f"{100 * f['long_lines']:>8.1f}%{f['conditionals_per_1000']:>9.0f}")


class Flags(argparse.ArgumentParser):
    def error(self, message):  # one line, as every program here says a bad flag
        self.exit(2, f"error: {message}\n")


def main(argv: Optional[list[str]] = None) -> int:
    Flags(description="Print how the code reads: code tokens, AST nodes per code line, long lines and "
                      "conditional expressions of the algorithm files, and the code tokens of what "
                      "`python speculate.py` imports. A mirror, not a gate.").parse_args(argv)
    f = figures()
    print(f"{'':<26}{'tokens':>8}{'lines':>7}{'nodes/l':>9}{'100+ ch':>9}{'if-else/1k':>11}")
    for name, fig in f["files"].items():
        print(row(name, fig))
    print(row("algorithm files", f["algorithm"]))
    print(row(ANCHOR_NAME, summary(ANCHOR_COUNTS)))
    print(f"python speculate.py imports {len(f['speculate_imports'])} project files, "
          f"{f['speculate_import_tokens']:,} code tokens: {', '.join(f['speculate_imports'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
