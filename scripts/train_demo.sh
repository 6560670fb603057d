#!/usr/bin/env bash
# Reproduce the demo pair (demo/target + demo/drafter) from scratch, on CPU, from the Python
# standard library's own top-level *.py files — text every machine has offline.
#
#   bash scripts/train_demo.sh            # from the repository root; ~38 min on 2 CPU cores
#
# Held-out split (never trained on; used for the README's τ / speed figures): the files
# `sorted(glob(stdlib/*.py))[i]` with i % 20 == 0 (5%), listed in demo/heldout.txt.
# Steps: 1. BPE tokenizer (vocab 4096) + a 4-layer, hidden-256 Qwen3 target (scripts/train_target.py);
#        2. its weights rounded to bfloat16 (the stored precision: the pair must stay small);
#        3. a block-5, depth-1 DSpark drafter (vanilla Markov rank 64, confidence head) distilled
#           from the bf16 target; 4. the drafter rounded to bfloat16 too.
# TARGET_STEPS / DRAFTER_STEPS / THREADS override the defaults (for quick tries); DRAFTER_ONLY=1 keeps the
# existing $OUT/target and redoes steps 3-4 only.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
TARGET_STEPS=${TARGET_STEPS:-500}
DRAFTER_STEPS=${DRAFTER_STEPS:-2000}
THREADS=${THREADS:-$(nproc)}
export OMP_NUM_THREADS=$THREADS
OUT=${DEMO_OUT:-demo}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# SRC -> DST (made anew): model.safetensors with floating tensors rounded to bfloat16, config.json
# saying so — the stored precision, so that the pair stays small.
to_bf16() {
rm -rf "$2" && mkdir -p "$2"
python - "$1" "$2" <<'PY'
import json, os, sys
from safetensors.torch import load_file, save_file
src, dst = sys.argv[1:]
t = load_file(os.path.join(src, "model.safetensors"))
save_file({k: v.bfloat16() if v.is_floating_point() else v for k, v in t.items()},
          os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
cfg = json.load(open(os.path.join(src, "config.json")))
cfg["torch_dtype"] = "bfloat16"
json.dump(cfg, open(os.path.join(dst, "config.json"), "w"), indent=2)
PY
}

# 1. The corpus: stdlib top-level *.py minus the held-out 5%.
mkdir -p "$OUT" "$WORK/corpus"
python - "$WORK/corpus" "$OUT/heldout.txt" <<'PY'
import glob, os, shutil, sys, sysconfig
files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
held = [f for i, f in enumerate(files) if i % 20 == 0]
with open(sys.argv[2], "w") as f:
    f.write("".join(os.path.basename(h) + "\n" for h in held))
for f in files:
    if f not in held:
        shutil.copy(f, sys.argv[1])
print(f"corpus: {len(files) - len(held)} training files, {len(held)} held out", file=sys.stderr)
PY

# 2. Tokenizer + target.
if [ "${DRAFTER_ONLY:-0}" != 1 ]; then
python scripts/train_target.py --tokenizer-from-corpus --vocab-size 4096 --data "$WORK/corpus" \
    --out "$WORK/target" --hidden-size 256 --layers 4 --heads 4 --kv-heads 2 --head-dim 64 \
    --intermediate-size 768 --seq-len 256 --batch-size 16 --steps "$TARGET_STEPS" --lr 2e-3 \
    --max-position-embeddings 2048 --seed 0 --device cpu --no-progress
to_bf16 "$WORK/target" "$OUT/target"
cp "$WORK/target/tokenizer.json" "$WORK/target/generation_config.json" "$OUT/target/"
fi

# 3. Drafter, distilled from the stored (bf16) target.
python train.py --target "$OUT/target" --data "$WORK/corpus" --out "$WORK/drafter" \
    --block-size 5 --depth 1 --markov vanilla --markov-rank 64 --confidence \
    --seq-len 256 --batch-size 8 --anchors-per-seq 64 --steps "$DRAFTER_STEPS" --lr 2e-3 \
    --seed 0 --device cpu --no-progress
to_bf16 "$WORK/drafter" "$OUT/drafter"
du -sh "$OUT"/target "$OUT"/drafter
