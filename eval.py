"""Benchmarks: acceptance length τ and per-position acceptance per dataset, confidence
calibration (ECE / AUROC / Brier, Sequential Temperature Scaling), data-parallel with torchrun.

    python eval.py                                       # the demo pair on its held-out prompts
    python eval.py --target DIR --drafter DIR \
        --datasets gsm8k,mt-bench --max-samples 8 --max-new-tokens 256 --out results.json
    torchrun --nproc_per_node 8 eval.py ...   # each rank decodes a shard of every dataset

What is notable here:
- The authors' protocol (DeepSpec's eval) is the default: seed 980406; a dataset longer than its
  sample count is shuffled with random.Random(seed) and cut; sample i is decoded with its own
  random stream seeded seed + i (the engine's per-request generators), so sampled figures do not
  depend on the number of processes or the batch size; temperature 1.0; the first turn through
  the chat template with thinking off. Their metrics come under their names and definitions
  (`metrics.py`): acceptance_length, draft_tokens_per_proposal, verify_rate,
  accept_rates_by_position — a stop token among a round's accepted drafts ends the round there.
- Decoding is speculate.py's `Engine` with speculate's loading code and flag meanings; this
  file only feeds it datasets and counts what comes back.
- Metrics are built from raw counts (`metrics.count`). Under torchrun the counts are summed
  across ranks, never averages of averages, so a data-parallel run reports exactly what one
  process reports. Each dataset's row is printed, and --out rewritten, as soon as it is done.
- Calibration reads the per-round records: for position k, the prefix survival
  a_k = Π_{i≤k} c_i against the event "drafts 1..k all accepted", over the rounds that sent
  draft k to the target (docs/algorithm.md, "Confidence head and prefix survival"). STS fits one temperature per position, left to right,
  on the first part of every dataset's requests and is scored on the rest.
- STS is fitted on the raw confidence logits: with --calibration the recorded (calibrated)
  confidences are mapped back first, so the temperatures written are always absolute.
- The reliability diagram is drawn by plots.py (matplotlib), PNG or SVG by the extension.
"""

from __future__ import annotations

import math
import os
import random
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from typing import Literal, Optional

import numpy as np
import torch

import metrics as mt
import plots
import runlog
import scheduler as sched
from common import (AutoBool, Interrupted, UserError, check_outputs, check_ranges, check_threads, cli_main, device_name,
                    dist_init, optional_file, set_threads, torchrun_env, read_json, write_json)
from inputs import auto_chat, calibration_note, check_prompts, check_sampling, load_models, load_prompts, resolve_checkpoint
from runlog import WandbFlags
from scheduler import check_schedulable, resolve_scheduler
from compiling import CompileMode, auto_compile, check_compile_flags, use_compile_cache
from speculate import DEMO_DIR, Engine, Request, cache_length

# The paper's protocol (Table 1, DeepSpec's eval): per-dataset sample counts, the seed, ECE bins.
DEFAULT_SAMPLES = {"gsm8k": 500, "math500": 500, "aime25": 30, "humaneval": 164, "mbpp": 256,
                   "livecodebench": 500, "mt-bench": 80, "alpaca": 500, "arena-hard-v2": 500}
PAPER_DATASETS = tuple(DEFAULT_SAMPLES)
AUTHORS_SEED = 980406
ECE_BINS = 20
BUDGET = 2048  # new tokens per request: the authors' script and DFlash's benchmarks
DEMO_BUDGET = 128  # the demo pair's held-out figures (README)
DEFAULT_OUT = "results.json"
DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "eval")
# STS's 1-D search space: temperatures for c_k's logit, geometric from 1/20 to 20 (1.0 included).
STS_GRID = np.unique(np.concatenate([np.geomspace(0.05, 20.0, 241), [1.0]]))


@dataclass
class EvalArgs(WandbFlags):
    """Acceptance length and per-position acceptance per dataset; confidence calibration."""

    target: Optional[str] = None
    """Hugging Face Qwen3 directory (config.json, safetensors, tokenizer.json), or a hub id ORG/NAME[@REVISION]
    taken from the Hugging Face cache or downloaded into it (HF_HUB_OFFLINE=1: the cache only). Default,
    with no --drafter either: demo mode, the demo pair in demo/."""
    drafter: Optional[str] = None
    """Drafter directory or hub id (any DSpark / DFlash spelling); omitted: the autoregressive baseline."""
    data_dir: Optional[str] = None
    """Directory of <dataset>.jsonl files (JSON lines with "turns" — the first turn is the prompt — or
    "prompt" / "prompt_ids"). Default: data/eval, the benchmark prompts that ship with the repository
    (data/eval/README.md); in demo mode without --datasets: demo/."""
    datasets: Optional[str] = None
    """Comma-separated dataset names (default: the paper's nine, missing files skipped; in demo mode
    without --data-dir: heldout, the demo pair's 20 held-out code prompts in demo/heldout.jsonl)."""
    max_samples: Optional[int] = None
    """Prompts per dataset (default: the paper's count per dataset). A longer file is shuffled with
    random.Random(--seed) and cut to this many, as the authors' evaluation does."""
    max_new_tokens: Optional[int] = None
    """Token budget per request. Default: 2048 (the paper does not state one; the authors' script and
    DFlash's benchmarks use 2048), 128 in demo mode; a default is capped, with a one-line note, to
    what the context leaves the longest prompt. A value given is kept: one that does not fit is an error."""
    temperature: float = 1.0
    """0 = greedy; the paper reports τ at 1.0."""
    chat: AutoBool = None
    """Render prompts with the target's chat template, thinking off (as speculate.py; --no-chat: raw).
    Default: on when the tokenizer has a template."""
    batch_size: int = 1
    """Requests decoded together (per process under torchrun)."""
    confidence_threshold: float = 0.0
    """Verify drafts only up to the first confidence below this; 0 = the whole block."""
    scheduler: Optional[Literal["none", "threshold", "hardware", "async"]] = None
    """How many drafts a round verifies, as speculate.py's --scheduler (default: threshold when
    --confidence-threshold > 0, else none); hardware and async profile SPS(B) at start (per rank)."""
    sps_table: Optional[str] = None
    """With --scheduler hardware or async: read SPS(B) from this JSON, or profile and write it (as
    speculate.py)."""
    seed: int = AUTHORS_SEED
    """The authors' seed: it picks the shuffled subset of a long dataset, and sample i of a dataset
    draws from its own random stream seeded seed + i (whatever rank or batch row decodes it)."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where to run (under torchrun with cuda: the rank's LOCAL_RANK GPU)."""
    dtype: Optional[Literal["float32", "bfloat16", "float16"]] = None
    """Weights and activations. Default: bfloat16 on cuda, float32 on cpu."""
    threads: Optional[int] = None
    """CPU threads for torch in each process. Default: OMP_NUM_THREADS when set, else half the CPUs this
    process may use (printed at start); under torchrun on a CPU, give each rank its share."""
    compile: AutoBool = None
    """torch.compile the round. Default: on for cuda, off for cpu."""
    compile_mode: Optional[CompileMode] = None
    """With --compile: this torch.compile mode instead of the project's recipe (as for speculate.py)."""
    compile_cache: Optional[str] = None
    """With --compile: the directory of torch.compile's on-disk caches, which later runs of the same
    shapes reuse. Default: $TORCHINDUCTOR_CACHE_DIR when set, else ~/.cache/dspark-fast/inductor."""
    verbose: bool = False
    """With --compile: show what compiling prints (Inductor's autotuning tables, on stderr)."""
    out: Optional[str] = None
    """Where to write the results (JSON); a file given by name is replaced. Default: results.json in the
    current directory, refused when that file exists (so an earlier run's results are never replaced
    unasked)."""
    progress: bool = True
    """Progress on stderr (rank 0 only): a bar on a terminal, else a plain line at most once a minute."""
    calibration: Optional[str] = None
    """Apply STS temperatures from an earlier --calibration-out before the threshold (as speculate.py)."""
    calibration_split: float = 0.5
    """STS fits on this fraction of every dataset's requests (the first ones) and is scored on the
    rest; 0 = no STS (the calibration metrics of the raw head are still reported)."""
    calibration_out: Optional[str] = None
    """Write the STS temperatures here (JSON: {"temperatures": [K floats], ...})."""
    calibration_plot: Optional[str] = None
    """Write a reliability diagram here (.png or .svg): one panel per position, before / after STS."""
    ece_bins: int = ECE_BINS
    """Equal-width bins of the expected calibration error (the authors use 20)."""
    step: Optional[int] = None
    """A training step to attach these results to (recorded in --out, and the step of the rows --wandb logs)."""
    dist_timeout: float = 600.0
    """Under torchrun: seconds to wait for the other processes before giving up with a message."""


# ----------------------------------------------------------------------------------------
# Calibration metrics (numpy, float64)

def ece(p, y, bins: int = ECE_BINS) -> Optional[float]:
    """Expected calibration error: Σ_b (n_b / N) |mean(y_b) - mean(p_b)| over equal-width bins
    [b/bins, (b+1)/bins) (the last one closed). None without samples."""
    p, y = np.asarray(p, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if p.size == 0:
        return None
    idx = np.minimum((p * bins).astype(np.int64), bins - 1)
    gap = np.abs(np.bincount(idx, weights=y, minlength=bins) - np.bincount(idx, weights=p, minlength=bins))
    return float(gap.sum() / p.size)  # Σ_b n_b/N · |Σy_b - Σp_b| / n_b


def auroc(p, y) -> Optional[float]:
    """Area under the ROC curve by ranks (Mann-Whitney U), tied scores sharing their mean rank.
    None when only one class is present."""
    p, y = np.asarray(p, dtype=np.float64), np.asarray(y).astype(bool)
    n1 = int(y.sum())
    n0 = y.size - n1
    if n1 == 0 or n0 == 0:
        return None
    _, inverse, counts = np.unique(p, return_inverse=True, return_counts=True)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])  # 0-based rank of each distinct value's first copy
    ranks = (first + (counts + 1) / 2.0)[inverse]  # 1-based mean rank of the tie group
    return float((ranks[y].sum() - n1 * (n1 + 1) / 2.0) / (n1 * n0))


def brier(p, y) -> Optional[float]:
    """Mean squared error of the probabilities against the 0/1 outcomes. None without samples."""
    p, y = np.asarray(p, dtype=np.float64), np.asarray(y, dtype=np.float64)
    return float(np.mean((p - y) ** 2)) if p.size else None


def _logit(c):
    c = np.clip(np.asarray(c, dtype=np.float64), 1e-12, 1 - 1e-12)  # float32 sigmoids reach 0 and 1 exactly
    return np.log(c) - np.log1p(-c)


def _sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # = 1/(1+e^-x), without overflow warnings


def apply_temperatures(confidence, temperatures):
    """c_k -> σ(logit(c_k) / T_k) for every position (monotone in c_k for T_k > 0)."""
    return _sigmoid(_logit(confidence) / np.asarray(temperatures, dtype=np.float64))


def survival_events(confidence, verified, accepted, k: int):
    """Prefix survival a_k = Π_{i≤k} c_i and the event "drafts 1..k accepted", over the rounds
    that verified draft k (1-based k). confidence [N, K], verified [N], accepted [N]."""
    mask = np.asarray(verified) >= k
    a = np.prod(np.asarray(confidence, dtype=np.float64)[mask, :k], axis=1)
    return a, (np.asarray(accepted)[mask] >= k)


def position_metrics(confidence, verified, accepted, bins: int = ECE_BINS) -> list[dict]:
    """Per position k: rounds that verified draft k, how many accepted 1..k, mean a_k, ECE, AUROC, Brier."""
    out = []
    for k in range(1, np.shape(confidence)[1] + 1):
        a, y = survival_events(confidence, verified, accepted, k)
        out.append({"position": k, "rounds": int(a.size), "survived": int(y.sum()),
                    "mean_survival": float(a.mean()) if a.size else None,
                    "observed_survival": float(y.mean()) if a.size else None,
                    "ece": ece(a, y, bins), "auroc": auroc(a, y), "brier": brier(a, y)})
    return out


def fit_sts(confidence, verified, accepted, grid=STS_GRID, bins: int = ECE_BINS) -> list[float]:
    """Sequential Temperature Scaling (docs/algorithm.md): for k = 1..K in order, the temperature of
    c_k's logit that minimises the ECE of a_k = Π_{i≤k} c_i, the earlier positions already
    calibrated and fixed. Ties go to the temperature nearest 1; positions never verified keep 1."""
    C = np.asarray(confidence, dtype=np.float64)
    N, K = C.shape
    logits = _logit(C)
    verified, accepted = np.asarray(verified), np.asarray(accepted)
    temps = np.ones(K)
    prefix = np.ones(N)  # Π_{i<k} of the calibrated c_i
    order = np.argsort(np.abs(np.log(grid)), kind="stable")  # nearest-to-1 first: the tie-break
    for k in range(K):
        mask = verified >= k + 1
        if mask.any():
            y = accepted[mask] >= k + 1
            errs = [ece(prefix[mask] * _sigmoid(logits[mask, k] / t), y, bins) for t in grid[order]]
            temps[k] = grid[order][int(np.argmin(errs))]
        prefix = prefix * _sigmoid(logits[:, k] / temps[k])
    return [float(t) for t in temps]


def round_arrays(requests: list[Request], dataset: int, K: int, stop_ids=()) -> dict:
    """The rounds of finished requests as compact arrays (dataset index, request, round,
    confidence [N, K] float32 — exactly the engine's float32 values — verified, accepted). A round
    that accepted a stop token ends there (`metrics.round_counts`): positions past it are not
    calibration records."""
    rounds = [(r.index, dict(rd, **dict(zip(("accepted", "verified"), mt.round_counts(rd, stop_ids)[:2]))))
              for r in requests for rd in r.rounds]
    n = len(rounds)
    return {"dataset": np.full(n, dataset, dtype=np.int32),
            "request": np.array([i for i, _ in rounds], dtype=np.int64).reshape(n),
            "round": np.array([rd["round"] for _, rd in rounds], dtype=np.int64).reshape(n),
            "confidence": np.array([rd["confidence"] for _, rd in rounds], dtype=np.float32).reshape(n, K),
            "verified": np.array([rd["verified"] for _, rd in rounds], dtype=np.int64).reshape(n),
            "accepted": np.array([rd["accepted"] for _, rd in rounds], dtype=np.int64).reshape(n)}


def concat_rounds(parts: list[dict]) -> dict:
    """Concatenate round arrays and sort them by dataset, request, round (the file order)."""
    rec = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    order = np.lexsort((rec["round"], rec["request"], rec["dataset"]))
    return {k: v[order] for k, v in rec.items()}


def calibration_report(rec: dict, split: float, bins: int = ECE_BINS,
                       names: Optional[list[str]] = None) -> Optional[dict]:
    """Calibration of the confidence head from round arrays (see `round_arrays`).

    `raw_by_dataset`: the head as it is, per dataset (`names[i]` for dataset index i) — how the authors
    report it; `raw`: over every dataset's rounds together (pooled: not an average of the per-dataset
    figures — a head right on average over an easy and a hard dataset can be wrong on each). With
    0 < split < 1, STS is fitted on the first `split` of every dataset's requests (file order; a
    request's rounds stay together), pooled, and `raw_heldout` / `sts_heldout` score the head before /
    after on the remaining requests."""
    C = rec["confidence"].astype(np.float64)
    if C.shape[0] == 0 or C.shape[1] == 0:
        return None
    ver, acc = rec["verified"], rec["accepted"]
    report = {"positions": C.shape[1], "bins": bins, "rounds": int(C.shape[0]),
              "raw": position_metrics(C, ver, acc, bins), "split": split,
              "raw_by_dataset": {(names[d] if names else str(d)): position_metrics(
                  C[rec["dataset"] == d], ver[rec["dataset"] == d], acc[rec["dataset"] == d], bins)
                  for d in np.unique(rec["dataset"])},
              "_all": (C, ver, acc)}  # "_" entries are for the plot, not written to JSON
    if not 0 < split < 1:
        return report
    fit = np.zeros(C.shape[0], dtype=bool)
    for d in np.unique(rec["dataset"]):
        mine = rec["dataset"] == d
        reqs = np.unique(rec["request"][mine])
        fit |= mine & np.isin(rec["request"], reqs[:int(math.floor(split * len(reqs)))])
    if not fit.any() or fit.all():
        report["sts_note"] = "too few requests to split into fit and held-out parts; no STS"
        return report
    temps = fit_sts(C[fit], ver[fit], acc[fit], bins=bins)
    held = ~fit
    Ch, vh, ah = C[held], ver[held], acc[held]
    report.update(temperatures=temps, fit_rounds=int(fit.sum()), heldout_rounds=int(held.sum()),
                  raw_heldout=position_metrics(Ch, vh, ah, bins),
                  sts_heldout=position_metrics(apply_temperatures(Ch, temps), vh, ah, bins))
    report["_heldout"] = (Ch, vh, ah)
    return report


# ----------------------------------------------------------------------------------------
# Distributed (torchrun): every rank a shard, raw counts summed

def all_sum(values: list[int], device: str) -> list[int]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return values
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def all_max(value: float, device: str) -> float:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def all_gather_list(items: list) -> list:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return items
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, items)
    return [x for part in out for x in part]


# ----------------------------------------------------------------------------------------
# Counting

def metrics(name: str, c: dict, seconds: float) -> dict:
    """A dataset's entry of results.json from its (summed) counts (`metrics.count`): the authors'
    metrics under their names first, then this project's."""
    return {
        "dataset": name,
        "num_samples": c["num_samples"],
        "acceptance_length": mt.acceptance_length(c),
        "draft_tokens_per_proposal": mt.verified_per_round(c),
        "verify_rate": mt.verify_rate(c),
        "accept_rates_by_position": mt.accept_rates_by_position(c),
        "num_rounds": c["num_rounds"],
        "num_tokens": c["tokens"],
        "accept_rate_by_position": mt.accept_rate_by_position(c),  # the paper's Figure 2: conditional
        "counts": {k: c[k] for k in mt.COUNT_KEYS + mt.LIST_KEYS},
        "tokens_per_second": c["tokens"] / seconds if seconds > 0 else None,
        "seconds": seconds,
    }


# ----------------------------------------------------------------------------------------
# Loading (speculate.py's code paths and checks)

def resolve_defaults(args: EvalArgs) -> tuple[EvalArgs, bool]:
    """(args with what was not given filled in, demo mode). Demo mode (no --target, no --drafter): the
    demo pair, and without --datasets and --data-dir its held-out prompts. --max-new-tokens stays None
    when not given: its default depends on the prompts (`budget`). A default --out that exists is refused."""
    for flag, value in (("--data-dir", args.data_dir), ("--datasets", args.datasets)):
        if value is not None and not value.strip():  # not the default folder or the nine datasets in its place
            raise UserError(f"{flag}: empty value (leave the flag out for the default)")
    demo = args.target is None and args.drafter is None
    if demo:
        args = replace(args, target=os.path.join(DEMO_DIR, "target"), drafter=os.path.join(DEMO_DIR, "drafter"))
        if args.datasets is None and args.data_dir is None:
            args = replace(args, data_dir=DEMO_DIR, datasets="heldout")
    if args.out is None:
        if os.path.lexists(DEFAULT_OUT):
            raise UserError(f"{DEFAULT_OUT}: exists (eval.py's default --out; an earlier run's results?); give "
                            f"--out PATH, or --out {DEFAULT_OUT} to replace it")
        args = replace(args, out=DEFAULT_OUT)
    return replace(args, data_dir=args.data_dir or DATA_DIR, datasets=args.datasets or ",".join(PAPER_DATASETS)), demo


def budget(args: EvalArgs, demo: bool, prompts: dict, context: int, verbose: bool = True) -> int:
    """--max-new-tokens: as given, or the default (BUDGET; DEMO_BUDGET in demo mode) capped to what
    `context` leaves the longest prompt, said in one line when it is."""
    if args.max_new_tokens is not None:
        return args.max_new_tokens
    want = DEMO_BUDGET if demo else BUDGET
    longest = max(len(p) for ps in prompts.values() for p in ps)
    if longest + want <= context:
        return want
    if longest >= context:  # not even one new token (load_prompts refuses longer prompts already)
        raise UserError(f"a prompt of {longest} tokens fills the {context}-token context; no room for new tokens")
    if verbose:
        print(f"note: --max-new-tokens {context - longest}: the default {want} capped to what the {context}-token "
              f"context leaves the longest prompt ({longest} tokens); give --max-new-tokens to choose",
              file=sys.stderr)
    return context - longest


def resolve_datasets(args: EvalArgs) -> tuple[list[tuple[str, str, int]], list[str]]:
    """(name, path, sample count) for every requested dataset whose file exists; and the files of the
    known datasets that are missing (skipped, with a warning once every input has been checked)."""
    data_dir = args.data_dir or DATA_DIR
    if not os.path.isdir(data_dir):
        raise UserError(f"--data-dir {data_dir}: directory not found")
    names = [n.strip() for n in (args.datasets or ",".join(PAPER_DATASETS)).split(",") if n.strip()]
    if not names:
        raise UserError("--datasets: no dataset named")
    bad = [n for n in names if n in (".", "..") or any(c in n for c in "/\\\0")]
    if bad:
        raise UserError(f"--datasets: {bad[0]!r} is not a dataset name (a <name>.jsonl in --data-dir)")
    twice = [n for i, n in enumerate(names) if n in names[:i]]
    if twice:
        raise UserError(f"--datasets: {twice[0]!r} is named twice")
    out, skipped = [], []
    for name in names:
        path = os.path.join(data_dir, f"{name}.jsonl")
        present = optional_file(path)
        if not present and name not in DEFAULT_SAMPLES:
            raise UserError(f"--datasets: unknown dataset {name!r} (known: {', '.join(PAPER_DATASETS)}; "
                                  f"or any <name>.jsonl in {data_dir})")
        if not present:
            skipped.append(path)
            continue
        out.append((name, path, args.max_samples or DEFAULT_SAMPLES.get(name, 0)))  # 0: every row
    if not out:
        raise UserError(f"--datasets: none of {', '.join(names)} is in {data_dir}")
    return out, skipped


def run(args: EvalArgs) -> dict:
    """Everything `python eval.py` does; returns the results. Raises UserError on bad input."""
    args, demo = resolve_defaults(args)
    check_ranges(args, batch_size="[1, 65536]", max_new_tokens="[1, 10485760]", max_samples="[1, 10000000]",
                 confidence_threshold="[0, 1]", calibration_split="[0, 1)",
                 ece_bins="[1, 10000]", step=f"[0, {2**62}]", seed=f"[0, {2**62}]", dist_timeout="(0, 86400]")
    check_sampling(args.temperature)
    check_threads(args.threads)
    runlog.check(args)
    check_compile_flags(auto_compile(args.compile, args.device), args.compile_cache, args.verbose, args.compile_mode)
    kind = resolve_scheduler(args)
    rank, world, _ = torchrun_env()
    if args.target is None:
        raise UserError("--target: no target directory given")
    if args.calibration_out and args.calibration_split == 0:
        raise UserError("--calibration-out needs STS: a --calibration-split between 0 and 1")
    datasets, skipped = resolve_datasets(args)
    sps_exists = args.sps_table is not None and os.path.isfile(args.sps_table)  # read if it exists, else written
    outputs = {"--out": args.out, "--calibration-out": args.calibration_out, "--calibration-plot": args.calibration_plot,
               "--sps-table": None if sps_exists else args.sps_table}
    check_outputs(outputs, inputs=[args.target, args.drafter, args.calibration, args.sps_table if sps_exists else None]
                  + [p for _, p, _ in datasets])
    plots.check_plot_path(args.calibration_plot, "--calibration-plot")
    target_dir, drafter_dir = resolve_checkpoint(args.target, "--target"), resolve_checkpoint(args.drafter, "--drafter")
    check_outputs(outputs, inputs=[target_dir, drafter_dir])
    if auto_compile(args.compile, args.device):  # the cache directory made (or refused) before any loading
        args = replace(args, compile_cache=use_compile_cache(args.compile_cache))
    for path in skipped if rank == 0 else []:  # every input checked: what will not run is said
        print(f"warning: {path} not found; skipping dataset {os.path.basename(path)[:-len('.jsonl')]}", file=sys.stderr)
    with runlog.session(args, "eval", "eval.py", enabled=rank == 0) as log:  # --wandb: rank 0's run around the work
        return evaluate(args, kind, datasets, target_dir, drafter_dir, log, demo)


def evaluate(args: EvalArgs, kind: str, datasets: list, target_dir: Optional[str], drafter_dir: Optional[str],
             log: Optional[runlog.Log], demo: bool) -> dict:
    """Load the models and decode every dataset: its row printed, --out rewritten and (--wandb) logged as
    soon as it is done; then calibration and the outputs."""
    rank, world, device = dist_init(args.device, args.dist_timeout)
    threads = set_threads(args.threads)
    m = load_models(target_dir, drafter_dir, device=device, dtype=args.dtype, calibration=args.calibration,
                    seed=args.seed)
    target, drafter, tokenizer, chat = m.target, m.drafter, m.tokenizer, auto_chat(args.chat, m.tokenizer)
    if rank == 0 and (note := calibration_note(args.calibration, drafter_dir, args.temperature)):
        print(note, file=sys.stderr)
    check_schedulable(kind, drafter, args.confidence_threshold)
    compile = auto_compile(args.compile, device)
    cache_dir = args.compile_cache if compile else None
    has_conf = drafter is not None and drafter.cfg.confidence_head
    if (args.calibration_out or args.calibration_plot) and not has_conf:
        raise UserError("--calibration-out / --calibration-plot need a --drafter with a confidence head")
    K = drafter.cfg.num_drafts if drafter is not None else 0

    # Every rank tokenizes every dataset, so max_seq (and with it every cache shape) is the one
    # a single process would use: sharding then cannot change a single logit.
    context = target.args.max_position_embeddings
    if drafter is not None:
        context = min(context, drafter.cfg.layers.max_position_embeddings)
    prompts = {}
    for name, path, n in datasets:
        sources = []
        ps = load_prompts(tokenizer=tokenizer, chat=chat, prompts_file=path,
                          max_len=max(context - (args.max_new_tokens or 1), 1), sources=sources)
        chosen = select(list(zip(ps, sources)), n, args.seed)  # the same shuffle as of the prompts alone
        prompts[name] = [p for p, _ in chosen]
        check_prompts(prompts[name], target, args.max_new_tokens or 1, drafter=drafter, sources=[s for _, s in chosen])
    args = replace(args, max_new_tokens=budget(args, demo, prompts, context, verbose=rank == 0))
    if (args.calibration_out or args.calibration_plot) and args.max_new_tokens == 1:
        raise UserError(f"--{'calibration-out' if args.calibration_out else 'calibration-plot'}: --max-new-tokens 1 "
                        f"ends every request at its first token, before any round: nothing to calibrate")
    if args.calibration_out and not any(math.floor(args.calibration_split * len(ps)) for ps in prompts.values()):
        raise UserError(f"--calibration-out: --calibration-split {args.calibration_split} of "
                        f"{' / '.join(str(len(ps)) for ps in prompts.values())} requests leaves none to fit STS on; "
                        f"more --max-samples or a larger split")
    max_seq = cache_length(max(len(p) for ps in prompts.values() for p in ps), args.max_new_tokens, drafter)
    most = max(len(range(rank, len(ps), world)) for ps in prompts.values())
    batch = max(1, min(args.batch_size, most))
    engine = Engine(target, drafter, batch_size=batch, max_seq=max_seq, temperature=args.temperature,
                    seed=args.seed, device=device, stop_ids=m.stop_ids, scheduler=kind,
                    threshold=args.confidence_threshold, compile=compile, compile_mode=args.compile_mode,
                    compile_verbose=args.verbose)
    if log is not None:  # what the flags resolved to, and what was loaded
        log.config(world_size=world, hardware=device_name(device), dtype_resolved=str(m.dtype).removeprefix("torch."),
                   threads_resolved=torch.get_num_threads(), scheduler_resolved=kind, chat_resolved=chat,
                   compile_resolved=compile, num_drafts=K, datasets_resolved={n: len(ps) for n, ps in prompts.items()},
                   target_config=runlog.checkpoint_config(target_dir),
                   drafter_config=runlog.checkpoint_config(drafter_dir),
                   drafter_resolved=drafter.cfg.describe() if drafter is not None else None)
    if rank == 0:  # every input checked, the caches allocated: say what runs
        print(threads, file=sys.stderr)
        if drafter is not None or m.hub_snapshots:
            print(m.describe(), file=sys.stderr)
    if compile:
        engine.warmup()  # compile before anything is timed (its noise does not touch the run's generator)
        if rank == 0:
            print(f"compiled the round in {engine.compile_seconds:.1f} s (compile cache: {cache_dir})", file=sys.stderr)
    if kind in sched.SPS_KINDS:
        engine.scheduler.set_sps(sched.load_or_profile(engine, args.sps_table, verbose=rank == 0))

    bar, lines, shown = None, None, runlog.progress(args.progress and rank == 0)
    total, done = sum(len(ps) for ps in prompts.values()), [0]
    if shown == "bar":
        from tqdm import tqdm
        bar = tqdm(total=total, file=sys.stderr, unit="prompt", dynamic_ncols=True)
    elif shown == "lines":
        lines = runlog.Lines()

    def on_finish(req):
        done[0] += world
        if bar is not None:
            bar.update(world)
        if lines is not None:
            lines.say(f"{name}: {min(done[0], total)}/{total} prompts of all datasets done")
    entries, parts = [], []

    def stopped():  # what is done stays in --out, marked incomplete and interrupted
        if rank == 0:
            write_json(args.out, {"config": config(args, world, K, engine, drafter, chat, compile, m, prompts),
                                  "complete": False, "interrupted": True, "datasets": entries, "calibration": None})

    for name, _, _ in datasets:
        try:  # a signal may land anywhere in here, writing --out included: what is done is written again, marked
            ps = prompts[name]
            requests = [Request(i, ps[i], [], []) for i in range(rank, len(ps), world)]  # interleaved shard
            seconds0 = engine.prefill_seconds + engine.decode_seconds
            if bar is not None:
                bar.set_description(name)
            # All of the shard at once: continuous batching keeps the rows busy; the bar moves per request.
            engine.generate(requests, args.max_new_tokens, on_finish=on_finish if shown else None)
            seconds = all_max(engine.prefill_seconds + engine.decode_seconds - seconds0, device)
            c = mt.unflatten(all_sum(mt.flatten(mt.count(requests, K, m.stop_ids)), device), K)
            entries.append(metrics(name, c, seconds))
            if has_conf:
                parts.append(round_arrays(requests, len(entries) - 1, K, m.stop_ids))
            if rank == 0:  # the row now, and --out rewritten: a crash later keeps what is done
                write(bar.write if bar is not None else print, format_table(entries[-1:], header=len(entries) == 1))
                write_json(args.out, {"config": config(args, world, K, engine, drafter, chat, compile, m, prompts),
                                      "complete": False, "datasets": entries, "calibration": None})
            if log is not None:
                runlog.log_eval_dataset(log, entries[-1], args.step)
        except Interrupted:
            stopped()
            raise
    if bar is not None:
        bar.close()

    calibration = None
    try:
        if has_conf:
            rec = concat_rounds(all_gather_list(parts))
            lost = 0
            if args.calibration is not None:  # back to the raw head's confidences: STS is fitted on raw logits
                lost = saturated(rec["confidence"])
                rec["confidence"] = uncalibrate(rec["confidence"], read_json(args.calibration)["temperatures"])
            calibration = calibration_report(rec, args.calibration_split, args.ece_bins,
                                             [e["dataset"] for e in entries])
            if lost:
                calibration["unrecoverable"] = lost
                if rank == 0:
                    print(f"warning: --calibration {args.calibration}: {lost} recorded confidences are exactly 0 or 1 "
                          f"in float32 (sigmoid(logit / T_k) saturated), so the raw head's values cannot be recovered "
                          f"from them: the raw calibration figures and the STS temperatures are not the raw head's; "
                          f"calibrate without --calibration", file=sys.stderr)
    except Interrupted:
        stopped()
        raise
    if calibration is not None and kind != "none":
        calibration["scheduled"] = kind
        if rank == 0:
            print(f"warning: calibration measured under --scheduler {kind}: the schedule chose from these "
                  f"same confidences which drafts were verified, so the figures are biased (the authors "
                  f"record calibration unscheduled)", file=sys.stderr)

    results = {"config": config(args, world, K, engine, drafter, chat, compile, m, prompts), "complete": True,
               "datasets": entries,
               "calibration": {k: v for k, v in calibration.items() if not k.startswith("_")} if calibration else None}
    if rank == 0:
        write_outputs(args, results, calibration, log, drafter_dir)
    return results


def select(prompts: list, n: int, seed: int) -> list:
    """The authors' subset: a dataset longer than its count n is shuffled with random.Random(seed)
    and cut to n; a shorter one (or n = 0: all) stays whole, in file order."""
    if n and len(prompts) > n:
        prompts = list(prompts)
        random.Random(seed).shuffle(prompts)
        prompts = prompts[:n]
    return prompts


def saturated(confidence: np.ndarray) -> int:
    """How many recorded float32 confidences are exactly 0 or 1: sigmoid(logit / T) saturated there, and
    `uncalibrate` (which clips them) cannot give the raw head's value back."""
    c = np.asarray(confidence, dtype=np.float32)
    return int(np.count_nonzero((c <= 0) | (c >= 1)))


def uncalibrate(confidence: np.ndarray, temperatures: list[float]) -> np.ndarray:
    """The raw head's c_k from recorded σ(logit_k / T_k): σ(T_k · logit(c_k)), in float64."""
    return _sigmoid(_logit(confidence) * np.asarray(temperatures, dtype=np.float64)).astype(np.float32)


def config(args: EvalArgs, world: int, K: int, engine, drafter, chat: bool, compile: bool, m, prompts: dict) -> dict:
    """The run's configuration as results.json records it: the flags and what "auto" resolved to."""
    return dict(asdict(args), world_size=world, num_drafts=K, compile_seconds=engine.compile_seconds,
                drafter_config=drafter.cfg.describe() if drafter else None, chat_resolved=chat,
                compile_resolved=compile, dtype_resolved=str(m.dtype).removeprefix("torch."),
                skipped=[n for n in args.datasets.split(",") if n.strip() and n.strip() not in prompts])


def write(out, text: str):
    """Print a block of lines through `out` (print, or a progress bar's write)."""
    for line in text.splitlines():
        out(line)


# ----------------------------------------------------------------------------------------
# Output

def _fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def format_table(entries: list[dict], header: bool = True) -> str:
    """The authors' columns in their order (#propose = drafts verified per round "+1" for the bonus,
    accept_len, verify_rate, accept_rate@j), then this project's: samples, rounds, tokens/s and the
    paper's conditional acceptance by position."""
    K = max((len(e["accept_rates_by_position"]) for e in entries), default=0)
    head = (f"{'dataset':<16}{'#propose':>10}{'accept_len':>11}{'verify_rate':>12}"
            + "".join(f"{f'accept_rate@{j}':>15}" for j in range(K))
            + f"{'samples':>9}{'rounds':>8}{'tok/s':>9}  conditional accept by position")
    lines = [head, "-" * len(head)] if header else []
    for e in entries:
        rates = e["accept_rates_by_position"] + [None] * (K - len(e["accept_rates_by_position"]))
        cond = " ".join(_fmt(r, ".2f") for r in e["accept_rate_by_position"])
        propose = "-" if e["draft_tokens_per_proposal"] is None else f"{e['draft_tokens_per_proposal']:.2f}+1"
        lines.append(f"{e['dataset']:<16}{propose:>10}{_fmt(e['acceptance_length']):>11}"
                     f"{_fmt(e['verify_rate'], '.4f'):>12}" + "".join(f"{_fmt(r, '.4f'):>15}" for r in rates)
                     + f"{e['num_samples']:>9}{e['num_rounds']:>8}{_fmt(e['tokens_per_second'], '.1f'):>9}  {cond}")
    return "\n".join(lines)


def format_calibration(cal: dict) -> str:
    lines = [f"confidence calibration (prefix survival a_k vs drafts 1..k accepted; ECE with {cal['bins']} bins)"]
    head = f"{'k':>3}{'rounds':>8}{'mean a_k':>10}{'observed':>10}{'ECE':>8}{'AUROC':>8}{'Brier':>8}"
    sts = "temperatures" in cal
    if sts:
        head += f"{'T_k':>8}{'held-out ECE raw -> STS':>26}"
    lines += [head, "-" * len(head)]
    for j, m in enumerate(cal["raw"]):
        line = (f"{m['position']:>3}{m['rounds']:>8}{_fmt(m['mean_survival'], '.3f'):>10}"
                f"{_fmt(m['observed_survival'], '.3f'):>10}{_fmt(m['ece'], '.3f'):>8}{_fmt(m['auroc'], '.3f'):>8}"
                f"{_fmt(m['brier'], '.3f'):>8}")
        if sts:
            line += (f"{cal['temperatures'][j]:>8.3f}"
                     f"{_fmt(cal['raw_heldout'][j]['ece'], '.3f') + ' -> ' + _fmt(cal['sts_heldout'][j]['ece'], '.3f'):>26}")
        lines.append(line)
    if "sts_note" in cal:
        lines.append(cal["sts_note"])
    by = cal.get("raw_by_dataset") or {}
    if len(by) > 1:  # the table above pools them; per dataset is how the authors report calibration
        lines += ["", "ECE of a_k per dataset (the table above pools every dataset's rounds)"]
        head = f"{'dataset':<16}{'rounds':>8}" + "".join(f"{f'k={k}':>7}" for k in range(1, cal["positions"] + 1))
        lines += [head, "-" * len(head)]
        for name, ms in by.items():
            lines.append(f"{name:<16}{ms[0]['rounds']:>8}" + "".join(f"{_fmt(m['ece'], '.3f'):>7}" for m in ms))
    return "\n".join(lines)


def reliability_panels(calibration: dict, bins: int) -> list[dict]:
    """The reliability diagram's panels (plots.reliability_diagram): before / after STS on the held-out
    requests, or the raw head over every round without STS."""
    if "_heldout" in calibration:
        C, ver, acc = calibration["_heldout"]
        Cs = apply_temperatures(C, calibration["temperatures"])
        panels = [{"position": k, "before": survival_events(C, ver, acc, k),
                   "after": survival_events(Cs, ver, acc, k)} for k in range(1, C.shape[1] + 1)]
    else:
        C, ver, acc = calibration["_all"]
        panels = [{"position": k, "before": survival_events(C, ver, acc, k), "after": None}
                  for k in range(1, C.shape[1] + 1)]
    for p in panels:
        p.update(ece_before=ece(*p["before"], bins), ece_after=ece(*p["after"], bins) if p["after"] else None,
                 auroc=auroc(*p["before"]))
    return panels


def write_outputs(args: EvalArgs, results: dict, calibration: Optional[dict], log: Optional[runlog.Log] = None,
                  drafter_dir: Optional[str] = None):
    write_json(args.out, results)
    print(f"results written to {args.out}", file=sys.stderr)
    asked = [f for f, v in (("--calibration-out", args.calibration_out), ("--calibration-plot", args.calibration_plot))
             if v]
    if asked and calibration is None:  # not a file left unwritten without a word
        raise UserError(f"{asked[0]}: no request ran a round (each ended at its first token), so there is "
                        f"nothing to calibrate; {args.out} has the rest")
    print()
    print(format_table(results["datasets"]))
    if calibration is not None:
        print()
        print(format_calibration(calibration))
    if calibration is not None and args.calibration_plot:
        plots.reliability_diagram(args.calibration_plot, reliability_panels(calibration, args.ece_bins),
                                  bins=args.ece_bins)
    if args.calibration_out and calibration is not None:
        if "temperatures" not in calibration:
            raise UserError(f"--calibration-out: {calibration.get('sts_note', 'no STS')}")
        write_json(args.calibration_out, {
            "temperatures": calibration["temperatures"], "method": "sequential temperature scaling",
            "apply": "c_k = sigmoid(logit_k / T_k) on the head's raw logit, before the threshold",
            "drafter": args.drafter, "target": args.target, "datasets": [e["dataset"] for e in results["datasets"]],
            "drafter_dir": os.path.realpath(drafter_dir) if drafter_dir else None, "temperature": args.temperature,
            "split": calibration["split"], "fit_rounds": calibration["fit_rounds"], "bins": calibration["bins"],
            "grid": [float(STS_GRID[0]), float(STS_GRID[-1])],
            "heldout_ece_raw": [m["ece"] for m in calibration["raw_heldout"]],
            "heldout_ece_sts": [m["ece"] for m in calibration["sts_heldout"]]})
    if log is not None:
        files = {"results": args.out, "calibration": args.calibration_out}
        with tempfile.TemporaryDirectory() as tmp:  # the diagram as a PNG for wandb.Image, drawn if not asked for
            image = None
            if calibration is not None:
                image = args.calibration_plot
                if image is None or not image.lower().endswith(".png"):
                    image = os.path.join(tmp, "reliability_diagram.png")
                    plots.reliability_diagram(image, reliability_panels(calibration, args.ece_bins), bins=args.ece_bins)
            runlog.log_eval(log, results, args.step, image, files)


def main(argv: Optional[list[str]] = None) -> int:
    def run_and_leave(args):
        try:
            run(args)
        finally:
            import torch.distributed as dist
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
    return cli_main(EvalArgs, run_and_leave, argv)


if __name__ == "__main__":
    sys.exit(main())
