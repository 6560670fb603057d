#!/usr/bin/env bash
# The GPU benchmark in one device call (budget: 8 minutes): random-init Qwen3-8B and a block-7,
# 5-layer DSpark drafter in bf16, autoregressive vs speculative at batch 1, 8 and 32, one table.
# Needs only torch (+ triton) on the device: bench.run is called directly, without tyro.
#   run from the repository root:  bash scripts/device_bench.sh   (results also in $OUT if set)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
# The Triton kernels on the GPU against their references, and traced by torch.compile (a minute or so).
python tests/test_triton.py --device || echo "TRITON DEVICE CHECK FAILED"
python - <<'PY'
import os, torch
import bench
out = os.path.join(os.environ.get("OUT", "."), "bench_qwen3_8b.json")
with torch.inference_mode():
    bench.run(bench.BenchArgs(model="qwen3-8b", device="cuda", dtype="bfloat16", batch_sizes="1,8,32",
                              prompt_len=128, max_new_tokens=128, compile_mode=os.environ.get("COMPILE_MODE", "reduce-overhead"),
                              reference=False, out=out))
print("wrote", out)
PY
