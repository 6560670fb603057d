"""Triton's front end (source to TTIR) on kernels.py's kernels, for an sm_90 target: no GPU needed.

tests/test_triton.py runs this in a process of its own, since a process that imported triton for its
interpreter cannot lower a kernel for the GPU compiler. It reads launches on stdin, a JSON list of
{"kernel": name, "signature": {argument: type or "constexpr"}, "constexprs": {argument: value}},
and writes, per launch, the TTIR's lines that hold an f64 value, or the compiler's error:

    python tests/triton_lowering.py < launches.json
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.pop("TRITON_INTERPRET", None)

from triton._C.libtriton import ir  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import CUDABackend  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import kernels  # noqa: E402


def lower(kernel, signature: dict, constexprs: dict) -> str:
    """The kernel's TTIR with these argument types."""
    target = GPUTarget("cuda", 90, 32)
    backend = CUDABackend(target)
    options = backend.parse_options({})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    names = kernel.arg_names
    constants = {(names.index(name),): value for name, value in constexprs.items()}
    source = ASTSource(kernel, signature, constexprs=constants)
    codegen = backend.get_codegen_implementation(options)
    module = source.make_ir(target, options, codegen, backend.get_module_map(), context)
    return str(module)


def f64_lines(ttir: str) -> list[str]:
    """The lines of TTIR code (not its source locations) that name an f64 value."""
    lines = []
    for line in ttir.splitlines():
        if "f64" in line and not line.startswith("#loc"):
            lines.append(line.strip())
    return lines


def main() -> int:
    kernels._import_triton()
    assert not kernels._TRITON_IMPORT_INTERPRET, "triton was imported for its interpreter"
    jitted = kernels._build_triton_kernels()
    results = []
    for launch in json.load(sys.stdin):
        kernel = jitted[launch["kernel"]]
        try:
            ttir = lower(kernel, launch["signature"], launch["constexprs"])
        except Exception as e:  # noqa: BLE001 - the compiler's message is the result
            results.append({"kernel": launch["kernel"], "error": f"{type(e).__name__}: {e}"})
            continue
        results.append({"kernel": launch["kernel"], "f64": f64_lines(ttir)})
    json.dump(results, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
