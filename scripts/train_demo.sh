#!/usr/bin/env bash
# Rebuild the demo pair (a target and a drafter like demo/target + demo/drafter) from scratch, on
# CPU, from the running Python's standard library — text every machine has offline.
#
# usage: bash scripts/train_demo.sh --out DIR [--force]     (from anywhere; ~45 min on 2 CPU cores)
#
#   --out DIR    where the pair goes: DIR/target, DIR/drafter (DIR/eagle3 with DRAFTER_KIND=eagle3 or
#                both), DIR/heldout.txt, DIR/heldout.jsonl and DIR/corpus.json. A DIR that exists and
#                is not empty is refused without --force, so the committed pair is replaced only when
#                asked: --out demo --force.
#   --force      replace what DIR holds: its pair and held-out files and, with a new target, a drafter of
#                the other kind (DIR/eagle3 or DIR/drafter: trained on the old target, it goes with the
#                old pair); anything else in DIR stays.
#   -h, --help   this text.
#
# Environment: TARGET_STEPS (500), DRAFTER_STEPS (2000) and SELFDATA_PROMPTS (2048; at most 1000000) set
# the training steps and the drafter's data (small values for a quick try), TARGET_LAYERS (4; at least 2
# for an Eagle3 drafter, at most 1024) and TARGET_HIDDEN (256; a multiple of 128, at most 65536) the
# target's shape, BLOCK_SIZE (7; at most 255) the drafter's block, THREADS the CPU threads (all cores);
# DRAFTER_ONLY=1 keeps DIR/target and redoes the drafter (its corpus must be the one DIR/corpus.json
# records); DRAFTER_KIND picks the drafter: dspark (the default: DIR/drafter), eagle3 (DIR/eagle3, the
# paper's Eagle3 baseline, trained the same way on the same data: train.py --drafter-kind eagle3, its
# chain BLOCK_SIZE long) or both. The trainers show their progress: a bar on a terminal, else a line every
# 15 s.
#
# Steps: 0. the corpus (scripts/demo_corpus.py): the standard library's top-level *.py files, every
#           20th held out (never trained on), named in DIR/heldout.txt; DIR/corpus.json and one printed
#           line say which Python's library it was (another version gives another corpus, so another pair);
#        1. BPE tokenizer (vocab 4096) + a 4-layer, hidden-256 Qwen3 target (scripts/train_target.py);
#        2. its weights rounded to bfloat16 (the stored precision: the pair must stay small);
#        3. the drafter's data: the bf16 target's greedy continuations of SELFDATA_PROMPTS training-corpus
#           prompts (scripts/demo_selfdata.py) — what the demo's greedy decoding will ask it to guess;
#        4. a block-7, depth-1 DSpark drafter (vanilla Markov rank 64, confidence head) distilled
#           from the bf16 target on that data (and/or an Eagle3 drafter: DeepSpec's TTT loss, 7 steps,
#           the same target layers, data, batch, lr and steps); 5. the drafter rounded to bfloat16 too;
#        6. the held-out prompts, DIR/heldout.jsonl (scripts/demo_prompts.py).
# Everything is built in a temporary directory and moved into DIR at the end: a run that fails or
# is stopped leaves DIR as it was (stopped while the pair moves in, DIR gets its old pair back).
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
fail() { echo "error: $*" >&2; exit 2; }

OUT="" FORCE=0
while [ $# -gt 0 ]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --out) [ $# -ge 2 ] && [ -n "$2" ] || fail "--out: needs a directory"; OUT=$2; shift 2 ;;
        --out=*) OUT=${1#--out=}; [ -n "$OUT" ] || fail "--out: needs a directory"; shift ;;
        --force) FORCE=1; shift ;;
        *) fail "$1: unknown argument (usage: bash scripts/train_demo.sh --out DIR [--force]; --help for more)" ;;
    esac
done
[ -n "$OUT" ] || fail "--out DIR: where to put the rebuilt pair (the committed one is demo/: --out demo --force replaces it)"
for v in TARGET_STEPS DRAFTER_STEPS SELFDATA_PROMPTS TARGET_LAYERS TARGET_HIDDEN BLOCK_SIZE THREADS; do
    val=${!v:-1}
    [[ "$val" =~ ^[1-9][0-9]{0,8}$ ]] || fail "$v=$val: not a positive integer"
done
[ "${DRAFTER_ONLY:-0}" = 0 ] || [ "${DRAFTER_ONLY:-0}" = 1 ] || fail "DRAFTER_ONLY=$DRAFTER_ONLY: 0 or 1"
case "${DRAFTER_KIND:-dspark}" in
    dspark) DRAFTERS=(drafter) ;;
    eagle3) DRAFTERS=(eagle3) ;;
    both) DRAFTERS=(drafter eagle3) ;;
    *) fail "DRAFTER_KIND=$DRAFTER_KIND: dspark, eagle3 or both" ;;
esac
SEQ_LEN=256  # tokens per training row, the target's and the drafter's
# The limits of the programs below, checked before the training rather than after it: train.py's block
# (at most MAX_BLOCK, 256, and inside a row) and demo_selfdata.py's --num-prompts.
if [ "${BLOCK_SIZE:-7}" -ge "$SEQ_LEN" ]; then
    fail "BLOCK_SIZE=$BLOCK_SIZE: 1 to $((SEQ_LEN - 1)) (train.py: a block fits in a $SEQ_LEN-token training row)"
fi
if [ "${SELFDATA_PROMPTS:-2048}" -gt 1000000 ]; then
    fail "SELFDATA_PROMPTS=$SELFDATA_PROMPTS: 1 to 1000000 (demo_selfdata.py's limit)"
fi
if [ "${TARGET_LAYERS:-4}" -gt 1024 ]; then
    fail "TARGET_LAYERS=$TARGET_LAYERS: 1 to 1024 (train_target.py's --layers)"
fi
if [ "${TARGET_HIDDEN:-256}" -gt 65536 ]; then
    fail "TARGET_HIDDEN=$TARGET_HIDDEN: 128 to 65536 (train_target.py's --hidden-size)"
fi
if [ "${DRAFTER_ONLY:-0}" = 0 ] && [ "${DRAFTERS[-1]}" = eagle3 ] && [ "${TARGET_LAYERS:-4}" -lt 2 ]; then
    fail "TARGET_LAYERS=$TARGET_LAYERS: at least 2 with DRAFTER_KIND=$DRAFTER_KIND" \
        "(Eagle3 reads a decoder layer below the last)"
fi
if [ -e "$OUT" ] && [ ! -d "$OUT" ]; then fail "--out $OUT: exists and is not a directory"; fi
if [ -d "$OUT" ] && [ -n "$(ls -A "$OUT")" ] && [ "$FORCE" != 1 ]; then
    fail "--out $OUT: exists and is not empty; add --force to replace its pair"
fi
# Where the pair will go must take it, now rather than after the training: its nearest existing folder a
# writable directory (a parent that is a file, or read-only, fails here).
probe=$OUT
while [ ! -e "$probe" ]; do probe=$(dirname "$probe"); done
[ -d "$probe" ] && [ -w "$probe" ] || fail "--out $OUT: cannot be created ($probe is not a writable directory)"
if [ "${DRAFTER_ONLY:-0}" = 1 ] && [ ! -f "$OUT/target/model.safetensors" ]; then
    fail "DRAFTER_ONLY=1: $OUT/target/model.safetensors not found (the target to keep)"
fi
if [ "${DRAFTER_ONLY:-0}" = 1 ] && [ ! -f "$OUT/corpus.json" ]; then
    fail "DRAFTER_ONLY=1: $OUT/corpus.json not found (it says which corpus the target was trained on)"
fi
if [ "${DRAFTER_ONLY:-0}" = 1 ] && [ "${DRAFTERS[-1]}" = eagle3 ]; then  # the kept target's layers count
    kept_layers=$(grep -o '"num_hidden_layers": *[0-9]*' "$OUT/target/config.json" | grep -o '[0-9]*$' || true)
    if [ -n "$kept_layers" ] && [ "$kept_layers" -lt 2 ]; then
        fail "DRAFTER_ONLY=1: $OUT/target has $kept_layers layer(s); an Eagle3 drafter reads a decoder layer" \
            "below the last, so DRAFTER_KIND=$DRAFTER_KIND needs at least 2"
    fi
fi

REPO=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONUNBUFFERED=1
TARGET_STEPS=${TARGET_STEPS:-500}
DRAFTER_STEPS=${DRAFTER_STEPS:-2000}
SELFDATA_PROMPTS=${SELFDATA_PROMPTS:-2048}
TARGET_LAYERS=${TARGET_LAYERS:-4}
TARGET_HIDDEN=${TARGET_HIDDEN:-256}
BLOCK_SIZE=${BLOCK_SIZE:-7}
[ $((TARGET_HIDDEN % 128)) = 0 ] || fail "TARGET_HIDDEN=$TARGET_HIDDEN: a multiple of 128 (heads of 64, two of them sharing each K/V head)"
THREADS=${THREADS:-$(nproc)}
export OMP_NUM_THREADS=$THREADS
WORK=$(mktemp -d)
PAIR=$WORK/pair  # what moves into $OUT at the end
ITEMS=(target "${DRAFTERS[@]}" heldout.txt heldout.jsonl corpus.json)
# With a new target, a drafter of the other kind in DIR (trained on the old target) goes with the old pair.
GONE=()
if [ "${DRAFTER_ONLY:-0}" = 0 ]; then
    for kind in drafter eagle3; do
        if [[ " ${DRAFTERS[*]} " != *" $kind "* ]]; then GONE+=("$kind"); fi
    done
fi
STAGE="" HAD="" SWAP="" STOP="" MADE=0
# Put the old pair back: what came into $OUT goes, what was moved aside (*.old) returns.
rollback() {
    local failed=0
    for item in "${ITEMS[@]}" "${GONE[@]}"; do
        if [ -e "$OUT/$item.old" ]; then rm -rf "${OUT:?}/$item" && mv "$OUT/$item.old" "$OUT/$item" || failed=1
        elif [[ " $HAD " != *" $item "* ]]; then rm -rf "${OUT:?}/$item" || failed=1; fi
    done
    return $failed
}
cleanup() {
    trap '' INT TERM  # another Ctrl-C does not cut the rollback short
    if [ "$SWAP" = started ]; then rollback || echo "error: $OUT: the old pair not all put back (see *.old)" >&2; fi
    if [ "$SWAP" = done ]; then for item in "${ITEMS[@]}" "${GONE[@]}"; do rm -rf "${OUT:?}/$item.old"; done; fi
    rm -rf "$WORK" ${STAGE:+"$STAGE"}
    if [ "$SWAP" != done ] && [ "$MADE" = 1 ]; then rmdir "$OUT" 2>/dev/null || true; fi
}
trap cleanup EXIT

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
chmod a+r "$2"/*  # safetensors writes its file owner-only (0600); the pair is for everyone to read
}

# 0. The corpus: stdlib top-level *.py minus the held-out 5%; says which Python's library it is.
SAME=()
if [ "${DRAFTER_ONLY:-0}" = 1 ]; then SAME=(--same-as "$OUT/corpus.json"); fi
python "$REPO/scripts/demo_corpus.py" --corpus "$WORK/corpus" --out "$PAIR" "${SAME[@]}"

# 1-2. Tokenizer + target.
if [ "${DRAFTER_ONLY:-0}" != 1 ]; then
python "$REPO/scripts/train_target.py" --tokenizer-from-corpus --vocab-size 4096 --data "$WORK/corpus" \
    --out "$WORK/target" --hidden-size "$TARGET_HIDDEN" --layers "$TARGET_LAYERS" \
    --heads $((TARGET_HIDDEN / 64)) --kv-heads 2 --head-dim 64 --intermediate-size $((3 * TARGET_HIDDEN)) \
    --seq-len "$SEQ_LEN" --batch-size 16 --steps "$TARGET_STEPS" --lr 2e-3 \
    --max-position-embeddings 2048 --seed 0 --device cpu
to_bf16 "$WORK/target" "$PAIR/target"
cp "$WORK/target/tokenizer.json" "$WORK/target/generation_config.json" "$PAIR/target/"
else
cp -r "$OUT/target" "$PAIR/target"
fi

# 3. The drafter's data: the stored (bf16) target's own greedy continuations of training prompts.
python "$REPO/scripts/demo_selfdata.py" --target "$PAIR/target" --corpus "$WORK/corpus" \
    --out "$WORK/selfdata.jsonl" --num-prompts "$SELFDATA_PROMPTS" --prompt-tokens 64 --new-tokens 192

# 4-5. Drafter(s), trained from the stored (bf16) target on that data: the same rows, batch, lr, steps and
# seed; the target layers are train.py's default for both (0,1,2 at 4 layers).
for kind in "${DRAFTERS[@]}"; do
if [ "$kind" = drafter ]; then
python "$REPO/train.py" --target "$PAIR/target" --data-ids "$WORK/selfdata.jsonl" --out "$WORK/drafter" \
    --block-size "$BLOCK_SIZE" --depth 1 --markov vanilla --markov-rank 64 --confidence \
    --seq-len "$SEQ_LEN" --batch-size 8 --anchors-per-seq 64 --steps "$DRAFTER_STEPS" --lr 2e-3 \
    --seed 0 --device cpu
else
python "$REPO/train.py" --drafter-kind eagle3 --target "$PAIR/target" --data-ids "$WORK/selfdata.jsonl" \
    --out "$WORK/eagle3" --ttt-length "$BLOCK_SIZE" --step-loss-decay 0.8 \
    --seq-len "$SEQ_LEN" --batch-size 8 --steps "$DRAFTER_STEPS" --lr 2e-3 \
    --seed 0 --device cpu
fi
to_bf16 "$WORK/$kind" "$PAIR/$kind"
done

# 6. The held-out prompts, cut with this pair's tokenizer.
python "$REPO/scripts/demo_prompts.py" --demo "$PAIR" --out "$PAIR/heldout.jsonl"

# Into $OUT: the new pair first moved beside the old one (a copy if $WORK is on another filesystem), then
# swapped in by renames, the old items (and a GONE drafter) moved aside as *.old. A stop (INT, TERM: the
# trap notes it, the swap goes on to a safe point) or a failure before the end puts the old pair back
# (cleanup): DIR holds the old pair or the new one, never a mix.
[ -d "$OUT" ] || MADE=1
mkdir -p "$OUT"
trap 'STOP=130' INT
trap 'STOP=143' TERM
STAGE=$(mktemp -d "$OUT/.new-pair.XXXXXX")
for item in "${ITEMS[@]}"; do mv "$PAIR/$item" "$STAGE/$item"; done
for item in "${ITEMS[@]}" "${GONE[@]}"; do
    rm -rf "${OUT:?}/$item.old"
    if [ -e "$OUT/$item" ]; then HAD+=" $item"; fi
done
[ -z "$STOP" ] || exit "$STOP"
SWAP=started
for item in "${ITEMS[@]}"; do
    if [ -e "$OUT/$item" ]; then mv "$OUT/$item" "$OUT/$item.old"; fi
    mv "$STAGE/$item" "$OUT/$item"
done
for item in "${GONE[@]}"; do
    if [ -e "$OUT/$item" ]; then mv "$OUT/$item" "$OUT/$item.old"; fi
done
[ -z "$STOP" ] || exit "$STOP"
SWAP=done  # the new pair is in; the old one goes at exit (cleanup)
trap - INT TERM
for item in target "${DRAFTERS[@]}"; do du -sh "$OUT/$item"; done
echo "the pair is in $OUT; $OUT/corpus.json says which corpus built it"
