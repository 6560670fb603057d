"""The optimisation loop the training programs share (train.py's drafter, scripts/train_target.py's
small target): their common flags, the learning-rate schedule, crash-safe checkpoints and exact
resume, and the step loop under torchrun.

What is notable here:
- AdamW (weight decay 0), linear warm-up over `--warmup-frac` from lr/W, cosine (or linear, constant) decay
  to `--min-lr-frac`·lr at the last step, gradient-norm clip 1.0.
- torchrun (gloo on CPU, NCCL on GPU): the trained module under DistributedDataParallel. Step s's global
  batch (G = --batch-size x --grad-accum x world rows) depends only on (--seed, s, G) and each micro-batch's
  loss share is normalised by the whole batch, so any split of the same G gives the same step.
- Checkpoints (rank 0): --out/checkpoint-<step>/ written whole and renamed into place, then --out/latest
  switched to it and the model's files linked to the top of --out; the previous one goes last. A kill at
  any moment leaves a complete checkpoint that --resume takes; it validates it (steps agree across files,
  tensors finite and of their parameters' shapes) and, where the program records them, that the run reads
  the same data and target (`check_identity`). No RNG state to save; no pickle. A non-finite loss stops
  the run before the optimizer steps.
- Progress: tokens/s, an MFU estimate and the ETA in the bar, wandb and --out/train_log.jsonl.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from typing import ClassVar, Literal, Optional

import torch

from common import (UserError, atomic_write, check_ranges, cli_main, folder_write_problem, peak_tflops, read_json,
                    save_tensors, signals_deferred, write_json)
from model import read_safetensors
import runlog
from runlog import WandbFlags, check as check_wandb

STATE_TENSORS = "training_state.safetensors"
STATE_JSON = "training_state.json"
LOG_JSONL = "train_log.jsonl"  # rank 0's metrics, one line per step


@dataclass
class TrainArgs(WandbFlags):
    """What every training program here shares: data, output, the optimisation and how it runs."""

    data: Optional[str] = None
    """A .txt/.py/.md/.rst file, a directory of such files and .jsonl (recursive, sorted), or JSON lines. Plain
    text (files, {"text"}, {"turns"} joined by blank lines): documents joined by <|endoftext|>, cut into windows.
    Chat records ({"messages": [{"role", "content"}]}, {"conversations"}, {"prompt", "response"}; train.py):
    the chat template, loss on the assistant's tokens only, conversations packed whole per sequence."""
    data_ids: Optional[str] = None
    """Instead of --data: JSON lines of {"prompt_ids": [int]} (already tokenized, one stream as plain text)."""
    out: Optional[str] = None
    """Output directory: config.json + model.safetensors (+ the training state for --resume)."""
    resume: Optional[str] = None
    """Continue from the training state in this directory (a previous --out), at its saved step; any number
    of processes, if --batch-size x --grad-accum x processes is the saved run's global batch."""

    # Optimization
    steps: int = 1000
    """Optimizer steps in the whole run (the learning-rate schedule spans them). --resume with another
    --steps stretches the rest of the schedule to the new end: not the run that many steps from the start."""
    stop_at: Optional[int] = None
    """Stop after this step (checkpoint included) while the schedule still spans --steps; resume later."""
    batch_size: int = 4
    """Sequences per micro-batch per process; a step's global batch is --batch-size x --grad-accum x processes."""
    grad_accum: int = 1
    """Micro-batches per process per optimizer step (gradients accumulated)."""
    seq_len: int = 1024
    """Tokens per sequence (plain text: a window of the stream; chat: a row of whole conversations, padded)."""
    lr: float = 6e-4
    """Peak learning rate (AdamW)."""
    warmup_frac: float = 0.04
    """Fraction of --steps with a linear warm-up from lr/W to lr."""
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay after warm-up, down to --min-lr-frac x lr at the last step."""
    min_lr_frac: float = 0.0
    """Final learning rate as a fraction of --lr (DeepSpec: 0)."""
    weight_decay: float = 0.0
    """AdamW weight decay (DeepSpec: 0)."""
    grad_clip: float = 1.0
    """Gradient-norm clip (0 = off)."""
    seed: int = 0
    """Initialization, batch order and anchors (step s's batch and anchors depend only on seed, s and the global batch)."""
    init_std: float = 0.02
    """Std of the normal initialization of the trained matrices (norms 1, biases 0)."""

    # Running
    device: Optional[Literal["cpu", "cuda"]] = None
    """Default: cuda when available (under torchrun: the rank's LOCAL_RANK GPU)."""
    dtype: Optional[Literal["float32", "bfloat16"]] = None
    """Compute precision (autocast; weights and optimizer stay float32). Default: bfloat16 on cuda."""
    compile: bool = False
    """torch.compile the training forward + loss (static shapes: every batch has the same B, T, N)."""
    save_every: int = 0
    """Also write the checkpoint every this many steps (0: only at the end / --stop-at)."""
    log_every: int = 10
    """With --wandb: log the step's figures (loss terms, lr, grad norm, tokens/s, MFU, ETA) every this many steps."""
    progress: bool = True
    """Progress on stderr (rank 0): a tqdm bar (loss, tokens/s, MFU, ETA) on a terminal, else a plain line a minute."""
    peak_tflops: Optional[float] = None
    """Peak TFLOP/s of one device for the MFU estimate (default: the data-sheet dense bf16 figure of a known
    GPU — H100/H200 989, A100 312 — else no MFU). MFU = step_flops / step time / (peak x processes)."""
    wandb_artifacts: bool = False
    """With --wandb: upload every checkpoint written as a model artifact (aliases step-N, latest)."""
    dist_timeout: float = 1800.0
    """Seconds a process waits for the others (joining torchrun's group, every collective) before giving up."""

    # What a resumed run must repeat: anything that changes the model, the data or the step function (and
    # the global batch, checked apart: --batch-size x --grad-accum x processes). --steps may change (training
    # longer): the rest of the schedule then stretches to the new end.
    resume_keys: ClassVar[tuple[str, ...]] = ("seq_len", "lr", "warmup_frac", "schedule", "min_lr_frac",
                                              "weight_decay", "grad_clip", "seed")
    kind: ClassVar[str]  # what the program trains ("drafter", "target"): a state of another kind is not resumed



# ----------------------------------------------------------------------------------------
# Schedule

def lr_at(step: int, args: TrainArgs) -> float:
    """Learning rate of update `step` (0-based): linear warm-up, then cosine / linear / constant decay."""
    W = math.ceil(args.warmup_frac * args.steps) if args.warmup_frac > 0 else 0
    if step < W:
        return args.lr * (step + 1) / W
    if args.schedule == "constant":
        return args.lr
    progress = (step - W) / max(1, args.steps - 1 - W)  # 0 at the end of warm-up, 1 at the last step
    progress = min(max(progress, 0.0), 1.0)
    m = args.min_lr_frac
    if args.schedule == "cosine":
        return args.lr * (m + (1 - m) * 0.5 * (1 + math.cos(math.pi * progress)))
    return args.lr * (m + (1 - m) * (1 - progress))



# ----------------------------------------------------------------------------------------
# Checkpoints (safetensors + JSON, never pickle)
#
# --out/checkpoint-<step>/ holds one complete checkpoint: the model's files and the training state.
# It is written into a temporary directory and renamed into place whole; then --out/latest (one line,
# written atomically) switches to it, the model's files are linked to the top of --out (what
# `--drafter OUT` loads), and only then the previous checkpoint goes. A kill at any moment leaves a
# complete checkpoint that --resume takes: the one `latest` names, or, killed between the first
# checkpoint's rename and `latest`, the only one there (`checkpoint_dir`). --resume validates the one
# it takes: the step in every file agrees, every tensor is finite and has its parameter's shape.

LATEST = "latest"


def publish_checkpoint(out: str, step: int, write):
    """`write(directory)` writes a checkpoint's files; make it --out/checkpoint-<step>, atomically."""
    name = f"checkpoint-{step}"
    final, tmp = os.path.join(out, name), os.path.join(out, f".{name}.tmp")
    for stale in os.listdir(out):  # a killed save's leftovers
        if stale.startswith(".checkpoint-") and stale.endswith(".tmp"):
            shutil.rmtree(os.path.join(out, stale), ignore_errors=True)
    try:
        os.makedirs(tmp)
        write(tmp)  # each file written and fsynced by atomic_write; the long part, Ctrl-C stays live
        # The switch is short: Ctrl-C / SIGTERM wait until it is done, so an interrupted run leaves one
        # checkpoint, named by `latest`, and no half-made links (SIGKILL is the kill tests' business).
        with signals_deferred():
            _switch(out, name, final, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # (gone already once the switch renamed it)
        raise


def _switch(out: str, name: str, final: str, tmp: str):
    """The written checkpoint `tmp` becomes `final`, `latest` names it, its model files are linked to
    the top of --out, and the older checkpoints go."""
    if os.path.isdir(final):  # the same step again (a run resumed before its last save): the new one wins
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(out)
    atomic_write(os.path.join(out, LATEST), name + "\n")
    for f in sorted(os.listdir(final)):  # the exported model: hard links, each swapped in atomically
        if not f.startswith("training_state"):
            link = os.path.join(out, f".{f}.tmp")
            if os.path.exists(link):
                os.remove(link)
            try:
                os.link(os.path.join(final, f), link)
            except OSError:  # a filesystem without hard links
                shutil.copyfile(os.path.join(final, f), link)
            os.replace(link, os.path.join(out, f))
    for old in os.listdir(out):
        if old.startswith("checkpoint-") and old != name:
            shutil.rmtree(os.path.join(out, old), ignore_errors=True)


def _fsync_dir(path: str):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_dir(resume: str) -> str:
    """The complete checkpoint --resume DIR names: DIR/latest's; with no `latest` (a run killed between its
    first checkpoint's rename and `latest`), the highest-numbered checkpoint-<step>/ there; or DIR itself (a
    checkpoint directory, or the single-directory layout of older runs)."""
    latest = os.path.join(resume, LATEST)
    if os.path.isfile(latest):
        with open(latest) as f:
            name = f.read().strip()
        if not name.startswith("checkpoint-") or not os.path.isdir(os.path.join(resume, name)):
            raise UserError(f"{latest}: names {name!r}, which is not a checkpoint directory in {resume}")
        return os.path.join(resume, name)
    if os.path.isfile(os.path.join(resume, STATE_JSON)):
        return resume
    names = os.listdir(resume) if os.path.isdir(resume) else []
    steps = [int(n.removeprefix("checkpoint-")) for n in names
             if n.startswith("checkpoint-") and n.removeprefix("checkpoint-").isdecimal()
             and os.path.isfile(os.path.join(resume, n, STATE_JSON))]
    if steps:  # each renamed into place whole: complete
        return os.path.join(resume, f"checkpoint-{max(steps)}")
    if os.path.isfile(os.path.join(resume, LOG_JSONL)):
        raise UserError(f"--resume {resume}: the run there stopped before its first checkpoint, nothing to resume; "
                        f"start it afresh with --out {resume} (without --resume)")
    raise UserError(f"--resume {resume}: no {LATEST} and no {STATE_JSON} there (not a training directory)")


def save_state(out: str, step: int, module: torch.nn.Module, opt: torch.optim.Optimizer, args: TrainArgs,
               num_windows: int, world: int = 1, identity: Optional[dict] = None):
    """The optimizer's moments by parameter name (safetensors) and the step, arguments and global batch (JSON);
    `identity`: digests of what the run reads ({"data": .., "target": ..}), which `check_identity` compares."""
    names = {id(p): n for n, p in module.named_parameters()}
    tensors = {}
    for p, st in opt.state.items():
        for key, val in st.items():
            tensors[f"{key}.{names[id(p)]}"] = val if torch.is_tensor(val) else torch.tensor(val)
    save_tensors(os.path.join(out, STATE_TENSORS), tensors, step=step)
    write_json(os.path.join(out, STATE_JSON), {
        "step": step, "num_windows": num_windows, "kind": args.kind, "args": asdict(args), "world_size": world,
        "global_batch": args.batch_size * args.grad_accum * world, **({"identity": identity} if identity else {}),
        "note": "batch and anchors of step s depend only on (seed, s, global_batch): no RNG state to restore"})


def check_checkpoint(directory: str, step: int):
    """Every safetensors file of a checkpoint says it was written at `step` (files written by a run
    before steps were recorded say nothing and pass)."""
    from safetensors import safe_open

    for f in sorted(os.listdir(directory)):
        if f.endswith(".safetensors"):
            path = os.path.join(directory, f)
            try:
                with safe_open(path, framework="pt") as st:
                    saved = (st.metadata() or {}).get("step")
            except Exception as e:  # noqa: BLE001 - a torn or foreign file
                raise UserError(f"{path}: cannot read safetensors ({str(e)[:120]})") from None
            if saved is not None and saved != str(step):
                raise UserError(f"{path}: written at step {saved}, the training state says {step} (a torn checkpoint)")


def check_resume_args(directory: str, args: TrainArgs, world: Optional[int] = None) -> dict:
    """training_state.json of `directory`, after checking that `args` repeats the flags of the saved run
    (`args.resume_keys`) and its global batch (with `world` processes; None: not known yet), and that it
    trained the same kind of model."""
    meta = read_json(os.path.join(directory, STATE_JSON))
    saved = meta.get("args")
    step = meta.get("step")
    if not isinstance(saved, dict) or isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise UserError(f"{os.path.join(directory, STATE_JSON)}: 'step' must be a step count and 'args' the saved "
                        f"flags (got step {step!r})")
    kind = meta.get("kind", saved.get("mode"))  # older states: train.py's --mode
    if kind is not None and kind != args.kind:
        raise UserError(f"--resume {directory}: a {kind} training state, not a {args.kind} one")
    now = asdict(args)
    for k in args.resume_keys:
        if k in saved and saved[k] != now[k]:
            raise UserError(f"--resume {directory}: --{k.replace('_', '-')} was {saved[k]!r}, now {now[k]!r} "
                                  "(a resumed run must repeat the original flags)")
    saved_g = meta.get("global_batch", saved.get("batch_size"))  # older states: one process, no accumulation
    g = args.batch_size * args.grad_accum * (world or 1)
    if world is not None and saved_g is not None and saved_g != g:
        raise UserError(f"--resume {directory}: the saved run's global batch is {saved_g} sequences, now {g} "
                        f"(--batch-size {args.batch_size} x --grad-accum {args.grad_accum} x {world} process(es))")
    return meta


def check_identity(directory: str, identity: dict, flags: dict):
    """--resume: every digest of `identity` ({"data": .., "target": ..}, as `save_state` records them) is the
    saved run's; `flags[what]` names the flag and value it comes from. A state that records none (written
    before they were) is refused: that the run reads the same could not be checked."""
    saved = read_json(os.path.join(directory, STATE_JSON)).get("identity")
    saved = saved if isinstance(saved, dict) else {}
    for what, digest in identity.items():
        if what not in saved:
            raise UserError(f"--resume {directory}: the saved state records no digest of its {what} (written by an "
                            f"older version), so {flags[what]} cannot be checked against it; start a new run")
        if saved[what] != digest:
            raise UserError(f"{flags[what]}: differs from the run's {what} (the one {directory} was trained with; "
                            f"a resumed run must use the same {what})")


def load_state(directory: str, module: torch.nn.Module, opt: torch.optim.Optimizer, args: TrainArgs,
               num_windows: int, world: int = 1) -> int:
    """Restore the optimizer state saved by `save_state`; returns the step to continue from."""
    meta = check_resume_args(directory, args, world)
    path = os.path.join(directory, STATE_TENSORS)
    check_checkpoint(directory, meta["step"])
    if meta.get("num_windows") != num_windows:
        raise UserError(f"--resume {directory}: the data gave {meta.get('num_windows')} sequences, now "
                              f"{num_windows} (a resumed run must read the same data)")
    if not os.path.isfile(path):
        raise UserError(f"{path}: file not found")
    tensors = read_safetensors([path], torch.float32, "cpu")  # finite floats, or one line
    index = {n: i for i, (n, _) in enumerate(module.named_parameters())}
    shapes = {n: tuple(p.shape) for n, p in module.named_parameters()}
    state = {}
    for key, t in tensors.items():
        kind, _, name = key.partition(".")
        if name not in index:
            raise UserError(f"{path}: optimizer state {key!r} matches no parameter")
        if kind == "step" and t.numel() == 1 and int(t.item()) != meta["step"]:
            raise UserError(f"{path}: {key} is {int(t.item())}, the state says step {meta['step']} (a torn checkpoint)")
        if kind != "step" and tuple(t.shape) != shapes[name]:
            raise UserError(f"{path}: optimizer state {key!r} has shape {list(t.shape)}, the parameter {list(shapes[name])}")
        state.setdefault(index[name], {})[kind] = t
    sd = opt.state_dict()
    missing = [n for n, i in index.items() if i not in state]
    if state and missing:
        raise UserError(f"{path}: no optimizer state for parameter {missing[0]!r}")
    sd["state"] = state
    opt.load_state_dict(sd)
    return meta["step"]



# ----------------------------------------------------------------------------------------
# Flags and the loop

def check_out_dir(args: TrainArgs, inputs):
    """--out, before any work: a new directory (its parent exists and is writable), or the directory
    being resumed (--resume DIR --out DIR); never a file, never a model or data the run reads."""
    out = args.out
    if out is None:
        raise UserError("--out: no output directory given")
    if not out.strip():
        raise UserError("--out: empty path")
    real = os.path.realpath(out)
    for src in inputs:
        if src is None:
            continue
        inp = os.path.realpath(src)
        if real == inp or real.startswith(inp.rstrip(os.sep) + os.sep):
            raise UserError(f"--out {out}: is (inside) {src}, which this run reads; give a new directory")
    if os.path.exists(real) and not os.path.isdir(real):
        raise UserError(f"--out {out}: is a file, not a directory")
    resuming_here = args.resume is not None and os.path.realpath(args.resume) == real
    if os.path.isdir(real) and os.listdir(real) and not resuming_here and not unfinished_run(real):
        raise UserError(f"--out {out}: already holds files (a previous run's?); give a new directory, or continue "
                        f"that run with --resume {out}")
    parent = os.path.dirname(real)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise UserError(f"--out {out}: its parent directory {parent} does not exist or is not writable")
    folder = real if os.path.isdir(real) else parent  # where the first write lands: checked now, not after loading
    problem = folder_write_problem(folder)
    if problem:
        raise UserError(f"--out {out}: cannot write in {folder} ({problem})")


def unfinished_run(directory: str) -> bool:
    """Whether `directory` holds a run that stopped before its first checkpoint (failed, killed): its
    train_log.jsonl and no checkpoint. --out may start afresh there (a run with a checkpoint is resumed,
    never overwritten)."""
    names = os.listdir(directory)
    return (LOG_JSONL in names and LATEST not in names and STATE_JSON not in names
            and not any(n.startswith("checkpoint-") for n in names))


def check_train_args(args: TrainArgs, **ranges: str):
    """The shared flags' ranges (and `ranges`, a program's own), --out, one data source, and the saved
    state of --resume. One-line UserErrors."""
    check_ranges(args, steps="[1, 100000000]", batch_size="[1, 1000000]", grad_accum="[1, 1000000]",
                 seq_len="[2, 10485760]", lr="(0, 10]", warmup_frac="[0, 1)", min_lr_frac="[0, 1]",
                 grad_clip="[0, 1e9]", weight_decay="[0, 10]", init_std="(0, 10]", seed=f"[0, {2**62}]", **ranges,
                 log_every="[1, inf)", save_every="[0, inf)", stop_at=f"[1, {args.steps}]",
                 peak_tflops="(0, 1e9]", dist_timeout="(0, 86400]")
    if (args.data is None) == (args.data_ids is None):
        raise UserError("give exactly one of --data, --data-ids")
    check_wandb(args)  # --wandb-artifacts and the other --wandb-* flags need --wandb
    data = args.data if args.data is not None else args.data_ids
    if not os.path.exists(data):
        raise UserError(f"--data{'' if args.data is not None else '-ids'} {data}: file or directory not found")
    check_out_dir(args, inputs=[data, getattr(args, "target", None), getattr(args, "tokenizer", None)])
    if args.resume:
        check_resume_args(checkpoint_dir(args.resume), args)



def _autocast(device: str, dtype: torch.dtype):
    """Mixed precision for the forward: weights and AdamW state stay float32 (master weights)."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.split(":")[0], dtype=dtype)


@dataclass
class Run:
    """Where this process stands: rank, world size and device, and the Weights & Biases run (rank 0 with
    --wandb: a runlog.Log, started by the program's `run` around the work)."""
    rank: int
    world: int
    device: str
    wandb: object = None

    def barrier(self):
        if self.world > 1:
            import torch.distributed as dist
            dist.barrier()


def log_artifact(run: Run, out: str, step: int):
    """--wandb-artifacts: the model's files at the top of --out (what `--drafter OUT` loads) as a model
    artifact of the run, versions aliased step-N and latest."""
    files = [os.path.join(out, f) for f in sorted(os.listdir(out)) if f.endswith((".json", ".safetensors"))]
    run.wandb.artifact("checkpoint", "model", files, metadata={"step": step}, aliases=[f"step-{step}", "latest"])


def _log_upto(path: str, step: int) -> list[str]:
    """The lines of an earlier train_log.jsonl up to `step` (a killed run's torn last line dropped)."""
    out = []
    for line in open(path) if os.path.isfile(path) else []:
        with contextlib.suppress(ValueError, KeyError, TypeError):
            if json.loads(line)["step"] <= step and line.endswith("\n"):
                out.append(line)
    return out


def optimize(args: TrainArgs, step_module: torch.nn.Module, micro_batches, summarize, save, run: Run, dtype,
             num_rows: int, flops: Optional[float] = None, evaluate=None, banner: str = "") -> dict:
    """AdamW steps from the resumed step to --stop-at / --steps. `step_module.model` is what trains;
    `step_module(**mb)` -> (this micro-batch's share of the step loss, a 1-D tensor of sums) for each of
    `micro_batches(step)` (this rank's, on its device); `summarize(sums over every micro-batch and rank)`
    -> logged metrics with "loss"; `save(directory, step, optimizer)` writes a checkpoint's files (rank 0);
    `evaluate(step)` (every rank, after a checkpoint, every --eval-every steps) -> metrics to log; `flops`:
    one step's; `banner`: what is trained, said once the resumed state (if any) has been checked."""
    module, dev = step_module.model, run.device
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    start = load_state(checkpoint_dir(args.resume), module, opt, args, num_rows, run.world) if args.resume else 0
    end = args.stop_at or args.steps
    if start >= end:
        raise UserError(f"--resume {args.resume}: already at step {start}, nothing to do up to step {end}")
    if banner and run.rank == 0:
        print(banner, file=sys.stderr)
    ddp = step_module
    if run.world > 1:  # gradients averaged over ranks: each rank's loss is scaled by the world size below
        ddp = torch.nn.parallel.DistributedDataParallel(step_module, device_ids=[dev] if dev.startswith("cuda") else None)
    main = run.rank == 0
    from tqdm import tqdm

    shown = runlog.progress(args.progress and main)
    bar = tqdm(total=end, initial=start, file=sys.stderr, disable=shown != "bar", dynamic_ncols=True)
    lines = runlog.Lines() if shown == "lines" else None
    if main:  # one JSON line per step; a run resumed into its own --out drops the lines after its state's step
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, LOG_JSONL)
        here = args.resume is not None and os.path.realpath(args.resume) == os.path.realpath(args.out)
        if not here and os.path.exists(path):  # check_out_dir let it through: `unfinished_run`
            print(f"--out {args.out}: a run that stopped before its first checkpoint left its log there; "
                  "starting afresh", file=sys.stderr)
        atomic_write(path, "".join(_log_upto(path, start) if here else []))
        log = open(path, "a")
    tokens_per_step = args.batch_size * args.grad_accum * run.world * args.seq_len
    peak = (args.peak_tflops or peak_tflops(dev) or 0) * 1e12  # MFU only against a known peak
    eval_every = getattr(args, "eval_every", 0)
    losses, times, t0 = [], [], time.time()

    def checkpoint(step):
        if main:
            publish_checkpoint(args.out, step, lambda directory: save(directory, step, opt))
            if args.wandb_artifacts:
                log_artifact(run, args.out, step)
        run.barrier()  # every rank may read it next (--eval-every)
        if evaluate is not None and eval_every and step % eval_every == 0:
            found = evaluate(step)
            if run.wandb is not None:
                run.wandb.log(found, step=step)

    module.train()
    for step in range(start, end):
        t_step = time.perf_counter()
        lr = lr_at(step, args)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        sums = None
        parts = micro_batches(step)
        for m, mb in enumerate(parts):
            sync = run.world == 1 or m == len(parts) - 1  # all-reduce the gradients once, after the last
            with contextlib.nullcontext() if sync else ddp.no_sync():
                with _autocast(dev, dtype):
                    share, s = ddp(**mb)
                (share * run.world).backward()
            sums = s if sums is None else sums + s
        if run.world > 1:
            torch.distributed.all_reduce(sums)
        metrics = summarize(sums.double().cpu())
        if not math.isfinite(metrics["loss"]):  # every rank sees the same sums: all stop here
            raise UserError(f"step {step + 1}: the loss is {metrics['loss']} (not finite); stopped before the optimizer "
                            f"step — the last complete checkpoint in {args.out} is kept")
        gnorm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip if args.grad_clip > 0 else float("inf"))
        opt.step()
        losses.append(metrics["loss"])
        times.append(time.perf_counter() - t_step)
        dt = sum(times[-20:]) / len(times[-20:])
        speed = {"tokens_per_second": tokens_per_step / dt, "eta_seconds": dt * (end - step - 1)}
        if flops is not None and peak:
            speed["mfu"] = flops / dt / (peak * run.world)
        bar.update(1)
        bar.set_postfix(loss=f"{metrics['loss']:.4f}", **{k: f"{v:.3f}" for k, v in metrics.items() if k in ("tau", "ppl")},
                        tok_s=f"{speed['tokens_per_second']:,.0f}",
                        **({"mfu": f"{speed['mfu']:.1%}"} if "mfu" in speed else {}))
        if lines is not None:
            lines.say(f"step {step + 1}/{end}: loss {metrics['loss']:.4f}, {speed['tokens_per_second']:,.0f} tokens/s"
                      + (f", MFU {speed['mfu']:.1%}" if "mfu" in speed else "")
                      + f", {speed['eta_seconds'] / 60:.1f} min to go", final=step + 1 == end)
        record = {**metrics, "lr": lr, "grad_norm": float(gnorm), **speed}
        if main:
            log.write(json.dumps({"step": step + 1, **record}) + "\n")
            log.flush()
        if run.wandb is not None and ((step + 1) % args.log_every == 0 or step + 1 == end):
            run.wandb.log(record, step=step + 1)
        if step + 1 != end and ((args.save_every and (step + 1) % args.save_every == 0)
                                or (eval_every and (step + 1) % eval_every == 0)):
            checkpoint(step + 1)
    bar.close()
    if main:
        log.close()
    module.eval()
    checkpoint(end)
    seconds, n = time.time() - t0, end - start
    tokens_per_s = n * tokens_per_step / max(seconds, 1e-9)
    if main:
        print(f"step {end}: loss {losses[-1]:.4f}, {n} steps in {seconds:.1f} s ({tokens_per_s:,.0f} tokens/s, "
              f"{run.world} process(es)), {args.kind} written to {args.out}")
    return {"start": start, "step": end, "losses": losses, "seconds": seconds, "step_seconds": times,
            "tokens_per_second": tokens_per_s}



def train_main(args_class, run_fn, argv: Optional[list[str]] = None) -> int:
    """A training program's main(): cli_main, leaving torchrun's process group at the end."""
    def run_and_leave(args):
        try:
            return run_fn(args)
        finally:
            import torch.distributed as dist
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
    return cli_main(args_class, run_and_leave, argv, inference=False)
