"""The loop of train.py and scripts/train_target.py: shared flags, AdamW, DDP under torchrun, crash-safe
checkpoints (each renamed into place whole, then named by --out/latest) and exact resume."""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass, fields
from fractions import Fraction
from typing import Callable, ClassVar, Literal, Optional

import torch

from support import runlog
from support.checkpoint import read_weights
from support.cli import (
    SEED_RANGE,
    Interrupted,
    UserError,
    check_ranges,
    cli_main,
    flag,
    omp_threads,
    refuse_standard_output,
    signals_deferred,
)
from support.data import JSON_SUFFIXES, TEXT_SUFFIXES
from support.distributed import peak_tflops, rank0, run_and_leave
from support.files import (
    atomic_write,
    check_input,
    directory_problem,
    file_problem,
    read_json,
    write_json,
    wrong_kind,
)
from support.runlog import WandbFlags
from support.runlog import check as check_wandb

STATE_TENSORS = "training_state.safetensors"
STATE_JSON = "training_state.json"
LOG_JSONL = "train_log.jsonl"  # rank 0's metrics, one line per step
LATEST = "latest"
SPEED_WINDOW = 20  # the last steps tokens/s is averaged over


@dataclass
class TrainArgs(WandbFlags):
    """What every training program here shares: data, output, the optimisation and how it runs."""

    data: Optional[str] = None
    """A .txt/.py/.md/.rst file, a .jsonl/.json file of JSON lines, or a directory of both (.jsonl;
    recursive). Plain text ({"text"}, {"turns"}): documents joined by <|endoftext|>, cut into windows.
    Chat records ({"messages"} or {"conversations"} of role/content turns, {"prompt", "response"};
    train.py): templated, loss on the assistant's tokens, packed."""
    data_ids: Optional[str] = None
    """Instead of --data: JSON lines of {"prompt_ids": [int]}, one stream as plain text but joined as they
    are (no separator: a record ending a document carries its own end token)."""
    out: Optional[str] = None
    """Output directory: config.json + model.safetensors (+ the training state for --resume)."""
    resume: Optional[str] = None
    """Continue the run saved in this directory (a previous --out), with any number of processes giving
    the same global batch. A resumed run takes the original run's flags again (--data or --data-ids,
    --out, the model and optimisation flags; train.py: --target too); --steps may change."""
    steps: int = 1000
    """Optimizer steps the schedule spans. Resumed with another count, the run follows the new count's
    schedule from its step: warm-up and decay are worked out anew, so the learning rate jumps there (back
    into warm-up if the step is inside the new one); --stop-at keeps one schedule across stops."""
    stop_at: Optional[int] = None
    """Stop after this step (checkpointed), the schedule still spanning --steps."""
    batch_size: int = 4
    """Sequences per micro-batch and process (global batch: x --grad-accum x processes)."""
    grad_accum: int = 1
    """Micro-batches per process and step (gradients accumulated)."""
    seq_len: int = 1024
    """Tokens per sequence (a window of plain text; a padded row of whole conversations)."""
    lr: float = 6e-4
    """Peak learning rate (AdamW)."""
    warmup_frac: float = 0.04
    """Fraction of --steps warming up linearly, from lr/W to lr over its W = ceil(frac x --steps) steps."""
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay after warm-up, to --min-lr-frac x lr one step past the last (DeepSpec's: over --steps - W)."""
    min_lr_frac: float = 0.0
    """Where the decay ends, one step past the last, as a fraction of --lr (DeepSpec: 0)."""
    weight_decay: float = 0.0
    """AdamW weight decay (DeepSpec: 0)."""
    grad_clip: float = 1.0
    """Gradient-norm clip (0 = off)."""
    seed: int = 0
    """Initialization, batch order and anchors."""
    init_std: float = 0.02
    """Std of the trained matrices' normal init (norms 1, biases 0)."""
    device: Optional[Literal["cpu", "cuda"]] = None
    """Default: cuda when available (under torchrun: the rank's LOCAL_RANK GPU)."""
    dtype: Optional[Literal["float32", "bfloat16"]] = None
    """Autocast precision (weights, AdamW float32). Default: bfloat16 on cuda, float32 on cpu."""
    compile: bool = False
    """torch.compile the training forward and loss."""
    save_every: int = 0
    """Also checkpoint every this many steps (0: at the end only)."""
    log_every: int = 10
    """With --wandb: log the step's figures every this many steps."""
    progress: bool = True
    """Progress on stderr: a line while --data is tokenized, then a bar on a terminal, else a line every
    15 s and at the last step."""
    peak_tflops: Optional[float] = None
    """One device's peak TFLOP/s for the MFU (default: a known GPU's dense bf16 figure, else no MFU)."""
    wandb_artifacts: bool = False
    """With --wandb: upload every checkpoint as a model artifact."""
    dist_timeout: float = 1800.0
    """Seconds a process waits for the others before giving up."""

    # What a resumed run must repeat (the global batch is checked apart; --steps may change).
    resume_keys: ClassVar[tuple[str, ...]] = (
        "seq_len", "lr", "warmup_frac", "schedule", "min_lr_frac", "weight_decay", "grad_clip",
        "seed", "init_std",
    )
    required: ClassVar[tuple[str, ...]] = ()  # the program's own flags a run must give (train.py: target)
    kind: ClassVar[str]  # what the program trains: a state of another kind is not resumed


def lr_at(step: int, args: TrainArgs) -> float:
    W = 0
    if args.warmup_frac > 0:
        # frac x steps of the fraction as written: 0.07 x 100 is 7, where the float product is just above
        W = math.ceil(Fraction(repr(args.warmup_frac)) * args.steps)
    if step < W:
        return args.lr * (step + 1) / W
    if args.schedule == "constant":
        return args.lr
    # DeepSpec's CosineAnnealingWarmupLR: T_max = steps - W, so the end (frac 1) is one step past the
    # last, whose lr is not 0
    decay_steps = args.steps - W
    frac = min(max((step - W) / decay_steps, 0.0), 1.0)
    m = args.min_lr_frac
    if args.schedule == "cosine":
        cosine = 0.5 * (1 + math.cos(math.pi * frac))
        return args.lr * (m + (1 - m) * cosine)
    return args.lr * (m + (1 - m) * (1 - frac))


def layer_params(a) -> int:
    q = a.num_attention_heads * a.head_dim
    kv = a.num_key_value_heads * a.head_dim
    H = a.hidden_size
    return 2 * H * q + 2 * H * kv + 3 * H * a.intermediate_size


def causal_flops(a, T: int) -> float:
    """Matmul FLOPs (2 a multiply-add) of a causal forward over T tokens, lm_head left out."""
    L = a.num_hidden_layers
    matmuls = 2 * T * L * layer_params(a)
    attention = 2 * L * T * T * a.num_attention_heads * a.head_dim
    return matmuls + attention


# Checkpoints (safetensors + JSON, never pickle)

def save_tensors(path: str, tensors: dict, step: Optional[int] = None):
    """A safetensors file, atomically; `step` goes into its metadata. A write the system refuses (a full
    disk) is an OSError naming `path`, as any other file's: safetensors raises its own error for it."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    metadata = {"format": "pt"}
    if step is not None:
        metadata["step"] = str(step)
    try:
        atomic_write(path, lambda p: save_file(tensors, p, metadata=metadata))
    except SafetensorError as e:
        found = re.search(r"\(os error (\d+)\)", str(e))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), path) from None


def kept_after_stop(written: list[str], resumed: bool) -> str:
    """What a run stopped early leaves to go on from, as its last line says it."""
    if written:
        return f"its last checkpoint, {written[-1]}, is kept"
    hint = "--save-every N keeps finished steps"
    if resumed:
        return f"this run wrote no checkpoint; the one it resumed from is as it was ({hint})"
    return f"no checkpoint was written ({hint})"


def publish_checkpoint(out: str, step: int, write) -> list[str]:
    """--out/checkpoint-<step>, made whole by `write(directory)`, atomically. Returns its model files as
    linked to the top of --out."""
    name = f"checkpoint-{step}"
    final = os.path.join(out, name)
    tmp = os.path.join(out, f".{name}.tmp")
    for stale in os.listdir(out):  # a killed save's leftovers
        if stale.startswith(".checkpoint-") and stale.endswith(".tmp"):
            shutil.rmtree(os.path.join(out, stale), ignore_errors=True)
    # Ctrl-C or SIGTERM waits for the whole checkpoint (bounded work): a run stopped while saving, its
    # last steps done, keeps them; a failed write (a full disk) leaves the previous checkpoint
    with signals_deferred():
        try:
            os.makedirs(tmp)
            write(tmp)
            return _switch(out, name, final, tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def _switch(out: str, name: str, final: str, tmp: str) -> list[str]:
    """`tmp` becomes `final`, then `latest`, its model files linked to --out (returned), the older ones
    gone."""
    # the same step again (resumed before its last save): the new one wins
    if os.path.isdir(final):
        shutil.rmtree(final)
    os.replace(tmp, final)
    fd = os.open(out, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    atomic_write(os.path.join(out, LATEST), name + "\n")
    linked = []
    for f in sorted(os.listdir(final)):
        if f.startswith("training_state"):
            continue
        source = os.path.join(final, f)
        link = os.path.join(out, f".{f}.tmp")
        if os.path.exists(link):
            os.remove(link)
        try:
            os.link(source, link)
        except OSError:  # a filesystem without hard links
            shutil.copyfile(source, link)
        os.replace(link, os.path.join(out, f))
        linked.append(os.path.join(out, f))
    for old in os.listdir(out):
        if old.startswith("checkpoint-") and old != name:
            shutil.rmtree(os.path.join(out, old), ignore_errors=True)
    return linked


def checkpoint_dir(resume: str) -> str:
    """--resume DIR's checkpoint: `latest`'s, else DIR itself when it holds a training state (a checkpoint
    named directly), else the highest checkpoint-<step> there."""
    problem = directory_problem(resume, "training directory")
    if problem:
        raise UserError(f"--resume {resume}: {problem}")
    latest = os.path.join(resume, LATEST)
    if os.path.isfile(latest):
        with open(latest) as f:
            name = f.read().strip()
        named = os.path.join(resume, name)
        if not name.startswith("checkpoint-") or not os.path.isdir(named):
            raise UserError(
                f"{latest}: names {name!r}, which is not a checkpoint directory in {resume}")
        return named
    if os.path.isfile(os.path.join(resume, STATE_JSON)):
        return resume
    steps = []
    for n in os.listdir(resume):
        number = n.removeprefix("checkpoint-")
        if not n.startswith("checkpoint-") or not number.isdecimal():
            continue
        if os.path.isfile(os.path.join(resume, n, STATE_JSON)):
            steps.append(int(number))
    if steps:
        return os.path.join(resume, f"checkpoint-{max(steps)}")
    if os.path.isfile(os.path.join(resume, LOG_JSONL)):
        raise UserError(
            f"--resume {resume}: the run there stopped before its first checkpoint, nothing to resume; "
            f"start it afresh with --out {resume} (without --resume)")
    raise UserError(
        f"--resume {resume}: no {LATEST} and no {STATE_JSON} there (not a training directory)")


def save_state(out: str, step: int, module: torch.nn.Module, opt: torch.optim.Optimizer,
               args: TrainArgs, num_windows: int, world: int, identity: dict, log: Optional[runlog.Log]):
    """AdamW's moments by parameter name; the step, flags, `identity` (digests of what the run reads) and
    the W&B run's id (`log`; None without --wandb), which a --resume goes on with."""
    names = {id(p): n for n, p in module.named_parameters()}
    tensors = {}
    for p, st in opt.state.items():
        for key, val in st.items():
            if not torch.is_tensor(val):
                val = torch.tensor(val)
            tensors[f"{key}.{names[id(p)]}"] = val
    save_tensors(os.path.join(out, STATE_TENSORS), tensors, step=step)
    wandb_id = None
    if log is not None:
        wandb_id = log.run.id
    meta = {
        "step": step,
        "num_windows": num_windows,
        "kind": args.kind,
        "args": asdict(args),
        "world_size": world,
        "global_batch": args.batch_size * args.grad_accum * world,
        "identity": identity,
        "wandb_run_id": wandb_id,
        "note": ("batch and anchors of step s depend only on (seed, s, global_batch): "
                 "no RNG state to restore"),
    }
    write_json(os.path.join(out, STATE_JSON), meta)


def check_checkpoint(directory: str, step: int):
    from safetensors import safe_open

    for f in sorted(os.listdir(directory)):
        if not f.endswith(".safetensors"):
            continue
        path = os.path.join(directory, f)
        try:
            with safe_open(path, framework="pt") as st:
                metadata = st.metadata() or {}
            saved = metadata.get("step")
        except Exception as e:  # noqa: BLE001 - a torn or foreign file
            reason = str(e)[:120]
            raise UserError(f"{path}: cannot read safetensors ({reason})") from None
        if saved is not None and saved != str(step):
            raise UserError(
                f"{path}: written at step {saved}, the training state says {step} (a torn checkpoint)")


def check_resume_args(directory: str, args: TrainArgs):
    """The saved state's step and flags are readable, and `args` repeats its flags and kind (the global
    batch, which needs the world size, is `check_resume_progress`'s)."""
    state_json = os.path.join(directory, STATE_JSON)
    meta = read_json(state_json)
    saved = meta.get("args")
    step = meta.get("step")
    step_ok = isinstance(step, int) and not isinstance(step, bool) and step >= 0
    if not isinstance(saved, dict) or not step_ok:
        raise UserError(f"{state_json}: 'step' must be a step count and 'args' the saved "
                        f"flags (got step {step!r})")
    if meta.get("kind") != args.kind:
        raise UserError(
            f"--resume {directory}: a {meta.get('kind')} training state, not a {args.kind} one")
    now = asdict(args)
    for k in args.resume_keys:
        if k in saved and saved[k] != now[k]:
            raise UserError(f"--resume {directory}: {flag(k)} was {saved[k]!r}, now {now[k]!r} "
                            "(a resumed run must repeat the original flags)")


WANDB_ID_REFUSES = ":;,#?/'"  # characters a W&B run id cannot hold


def resumed_wandb_run(args: TrainArgs) -> Optional[str]:
    """The W&B run id --resume's training state recorded (`save_state`), which the resumed run goes on
    with; None without --resume or --wandb, where the state has none (a run without --wandb), or for a
    branch: a checkpoint resumed into another --out starts a W&B run of its own."""
    if args.resume is None or not args.wandb:
        return None
    checkpoint = checkpoint_dir(args.resume)
    run_dir = os.path.dirname(os.path.realpath(checkpoint))
    if run_dir != os.path.realpath(args.out):
        return None
    state_json = os.path.join(checkpoint, STATE_JSON)
    run_id = read_json(state_json).get("wandb_run_id")
    # what wandb.init would refuse as an id, refused here naming the file and the key
    not_an_id = not isinstance(run_id, str) or not run_id or any(c in run_id for c in WANDB_ID_REFUSES)
    if run_id is not None and not_an_id:
        raise UserError(f"{state_json}: 'wandb_run_id' must be a W&B run id or null (got {run_id!r})")
    return run_id


def check_identity(directory: str, identity: dict, flags: dict):
    saved = read_json(os.path.join(directory, STATE_JSON)).get("identity")
    if not isinstance(saved, dict):
        saved = {}
    for what, digest in identity.items():
        given = flags[what]
        if what not in saved:
            raise UserError(
                f"--resume {directory}: the saved state records no digest of its {what} (written by an "
                f"older version), so {given} cannot be checked against it; start a new run")
        if saved[what] != digest:
            why = f"the one {directory} was trained with"
            if what == "data":  # a digest of the rows as read
                why = (f"the rows read from it are not those {directory} was trained on: the file changed, "
                       f"or how train.py reads it")
            raise UserError(f"{given}: differs from the run's {what} ({why}; a resumed run must use the "
                            f"same {what})")


def check_resume_progress(args: TrainArgs, world: int):
    """--resume's saved step against --stop-at/--steps and its global batch against this run's, before
    the lock and W&B: a resume refused here leaves the original run's W&B run as it was."""
    if args.resume is None:
        return
    directory = checkpoint_dir(args.resume)
    meta = read_json(os.path.join(directory, STATE_JSON))  # its step checked (`check_resume_args`)
    g = args.batch_size * args.grad_accum * world
    saved_batch = meta.get("global_batch")
    if saved_batch != g:
        how = f"--batch-size {args.batch_size} x --grad-accum {args.grad_accum} x {world} process(es)"
        raise UserError(f"--resume {directory}: the saved run's global batch is {saved_batch!r} sequences, "
                        f"now {g} ({how})")
    end = args.stop_at or args.steps
    if meta["step"] >= end:
        raise UserError(
            f"--resume {args.resume}: already at step {meta['step']}, nothing to do up to step {end}")


ADAMW_STATE = ("step", "exp_avg", "exp_avg_sq")  # what torch's AdamW keeps for each parameter


def read_state(directory: str, module: torch.nn.Module, num_windows: int) -> tuple[int, dict]:
    """`save_state`'s step and AdamW state for `module`, checked whole (its flags, step and global batch
    already are: `check_train_args`, `check_resume_progress`) before the W&B run starts, so that a refusal
    leaves a resumed run's W&B run as it was; `optimize` puts the state in its optimizer."""
    meta = read_json(os.path.join(directory, STATE_JSON))
    path = os.path.join(directory, STATE_TENSORS)
    check_checkpoint(directory, meta["step"])
    saved_windows = meta.get("num_windows")
    if saved_windows != num_windows:
        raise UserError(f"--resume {directory}: the data gave {saved_windows} sequences, now "
                        f"{num_windows} (a resumed run must read the same data)")
    problem = file_problem(path)
    if problem:
        raise UserError(f"{path}: {problem}")
    tensors = read_weights([path], torch.float32, "cpu")  # finite floats, or one line
    index = {}
    shapes = {}
    for i, (n, p) in enumerate(module.named_parameters()):
        index[n] = i
        shapes[n] = tuple(p.shape)
    state = {}
    for key, t in tensors.items():
        kind, _, name = key.partition(".")
        if name not in index:
            raise UserError(f"{path}: optimizer state {key!r} matches no parameter")
        if kind not in ADAMW_STATE:
            raise UserError(f"{path}: optimizer state {key!r} is none of AdamW's {', '.join(ADAMW_STATE)}")
        if kind == "step" and t.numel() != 1:
            raise UserError(f"{path}: optimizer state {key!r} has {t.numel()} elements; a step count has one")
        if kind == "step" and int(t.item()) != meta["step"]:
            raise UserError(
                f"{path}: {key} is {int(t.item())}, the state says step {meta['step']} (a torn checkpoint)")
        if kind != "step" and tuple(t.shape) != shapes[name]:
            raise UserError(f"{path}: optimizer state {key!r} has shape {list(t.shape)}, the parameter "
                            f"{list(shapes[name])}")
        param_state = state.setdefault(index[name], {})
        param_state[kind] = t
    missing = [n for n, i in index.items() if i not in state]
    if state and missing:
        raise UserError(f"{path}: no optimizer state for parameter {missing[0]!r}")
    for n, i in index.items():  # a parameter's state is whole: AdamW's step reads every entry
        absent = [kind for kind in ADAMW_STATE if i in state and kind not in state[i]]
        if absent:
            key = f"{absent[0]}.{n}"
            raise UserError(f"{path}: optimizer state {key!r} missing (AdamW keeps {', '.join(ADAMW_STATE)} "
                            f"for each parameter)")
    return meta["step"], state


# Flags and the loop

def check_out_dir(args: TrainArgs, inputs):
    """--out: a new directory, the training directory resumed, or one a run left before its first checkpoint
    (that starts afresh); never one the run reads, the checkpoint resumed included."""
    out = args.out
    if out is None:
        raise UserError("--out: no output directory given")
    if not out.strip():
        raise UserError("--out: empty path")
    refuse_standard_output(out, "--out", "directory")
    real = os.path.realpath(out)
    inputs = list(inputs)
    if args.resume is not None:  # the checkpoint it reads is an input: its files stay as they are
        inputs.append(checkpoint_dir(args.resume))
    for src in filter(None, inputs):
        inp = os.path.realpath(src)
        inside = real.startswith(inp.rstrip(os.sep) + os.sep)
        if real == inp or inside:
            raise UserError(
                f"--out {out}: is (inside) {src}, which this run reads; give a new directory")
    if os.path.lexists(out) and not os.path.isdir(out):  # the path given: a link to nothing is not a new one
        raise UserError(f"--out {out}: {wrong_kind(out, 'directory')}")
    if os.path.isdir(real) and locked(real):  # before what its files say: they are that run's
        raise UserError(another_run(out))
    resuming_here = args.resume is not None and os.path.realpath(args.resume) == real
    holds_files = os.path.isdir(real) and os.listdir(real)
    if holds_files and not resuming_here and not unfinished_run(real):
        names = os.listdir(real)
        checkpointed = LATEST in names or any(n.startswith("checkpoint-") for n in names)
        if checkpointed:
            raise UserError(f"--out {out}: already holds a training run; give a new directory, or continue "
                            f"that run with --resume {out} (keeping --out {out})")
        raise UserError(f"--out {out}: already holds files, and no training run; give a new directory")
    parent = os.path.dirname(real)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise UserError(
            f"--out {out}: its parent directory {parent} does not exist or is not writable")
    folder = parent
    if os.path.isdir(real):
        folder = real
    problem = folder_write_problem(folder)  # no probe file: another rank may be listing the folder
    if problem:
        raise UserError(f"--out {out}: cannot write in {folder} ({problem})")


def another_run(out: str) -> str:
    return f"--out {out}: another run is writing it now; give each run its own --out"


def locked(directory: str) -> bool:
    """Whether a run holds `directory` (`out_held`'s lock), probed without taking it."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # no locks on this filesystem: out_held says so
        return False
    finally:
        os.close(fd)  # closing releases a lock the probe took
    return False


@contextlib.contextmanager
def out_held(out: str, main: bool, from_rank0: Callable = lambda error: error):
    """--out locked for the run by rank 0 (main), before any work: a second run writing the same --out at
    the same time is refused, not let to replace this one's log and checkpoints. The lock is the directory
    itself's (flock), so no file is added to it; --out is made here if missing, and removed again if the
    run leaves it empty. Under torchrun (the group joined, `distributed.from_rank0` given), a refusal stops
    every rank."""
    fd = None
    made = False
    error = None
    if main:
        made = not os.path.isdir(out)
        os.makedirs(out, exist_ok=True)
        fd = os.open(out, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            error = another_run(out)
            made = False  # made at the same moment as the run that holds it: that run's now
        except OSError as e:  # a filesystem without locks (NFS mounted nolock): unguarded, said once
            print(f"warning: --out {out}: cannot be locked ({e.strerror}); a second run writing it at the "
                  f"same time would not be refused", file=sys.stderr)
    error = from_rank0(error)
    try:
        if error is not None:
            raise UserError(error)
        yield
    finally:
        if fd is not None:
            os.close(fd)
        if made:
            with contextlib.suppress(OSError):  # removed only while empty
                os.rmdir(out)


def folder_write_problem(folder: str) -> Optional[str]:
    """Why no file can be made in `folder`, or None; found without making one (another rank may list it)."""
    try:
        if os.statvfs(folder).f_flag & os.ST_RDONLY:
            return "Read-only file system"
    except OSError as e:
        return e.strerror
    if not os.access(folder, os.W_OK | os.X_OK):
        return "Permission denied"
    return None


def unfinished_run(directory: str) -> bool:
    """Stopped before its first checkpoint."""
    names = os.listdir(directory)
    if LOG_JSONL not in names or LATEST in names or STATE_JSON in names:
        return False
    return not any(n.startswith("checkpoint-") for n in names)


def refuse_unused(args, off):
    """A flag whose feature is off would train the same model (a sweep over it would compare identical
    runs). off: (flag names, whether their feature is off, what turns it off), in order."""
    default = {f.name: f.default for f in fields(args)}
    for names, is_off, why in off:
        given = [n for n in names if is_off and getattr(args, n) != default[n]]
        if not given:
            continue
        name = given[0]
        value = getattr(args, name)
        shown = f"{flag(name)} {value}"
        if value is True:
            shown = flag(name)
        if value is False:
            shown = flag("no_" + name)
        raise UserError(f"{shown}: changes nothing with {why}")


def check_resume_flags(args: TrainArgs):
    """--resume with a flag every run needs left out: said as a resumed run's rule, not as a new run's."""
    missing = [flag(name) for name in args.required if getattr(args, name) is None]
    if args.data is None and args.data_ids is None:
        missing.append("--data")
    if args.out is None:
        missing.append("--out")
    if not missing:
        return
    needed = ", ".join(flag(name) for name in args.required)
    if needed:
        needed += ", "
    raise UserError(f"--resume {args.resume}: a resumed run takes the original run's flags again ({needed}"
                    f"--data or --data-ids, --out, ...): {', '.join(missing)} missing")


def check_train_args(args: TrainArgs, **ranges: str):
    check_ranges(
        args, steps="[1, 100000000]", batch_size="[1, 1000000]", grad_accum="[1, 1000000]",
        seq_len="[2, 10485760]", lr="(0, 10]", warmup_frac="[0, 1)", min_lr_frac="[0, 1]",
        grad_clip="[0, 1e9]", weight_decay="[0, 10]", init_std="(0, 10]", seed=SEED_RANGE,
        **ranges,
        log_every="[1, inf)", save_every="[0, inf)", stop_at=f"[1, {args.steps}]",
        peak_tflops="(0, 1e9]", dist_timeout="(0, 86400]",
    )
    refuse_unused(args, [(("min_lr_frac",), args.schedule == "constant", "--schedule constant")])
    if args.resume is not None:
        check_resume_flags(args)
    if (args.data is None) == (args.data_ids is None):
        raise UserError("give exactly one of --data, --data-ids")
    check_wandb(args)
    if args.data is not None:
        flag = "--data"
        data = args.data
    else:
        flag = "--data-ids"
        data = args.data_ids
    check_input(data, flag, "file or directory", "file or directory")
    if args.data is not None and os.path.isfile(data) and not data.endswith(TEXT_SUFFIXES + JSON_SUFFIXES):
        raise UserError(f"--data {data}: a file is read by its suffix: {'/'.join(TEXT_SUFFIXES)} as text, "
                        f"{'/'.join(JSON_SUFFIXES)} as JSON lines (rename it to say which)")
    if args.resume is not None and not args.resume.strip():
        raise UserError("--resume: empty path (leave the flag out to start afresh)")
    inputs = [data, getattr(args, "target", None), getattr(args, "tokenizer", None)]
    check_out_dir(args, inputs=inputs)
    if args.resume is not None:
        check_resume_args(checkpoint_dir(args.resume), args)


@dataclass
class Run:
    rank: int
    world: int
    device: str
    wandb: Optional[runlog.Log]  # None: no --wandb (and off rank 0)

    def barrier(self):
        if self.world > 1:
            torch.distributed.barrier()


def _log_upto(path: str, step: int) -> list[str]:
    out = []
    if not os.path.isfile(path):
        return out
    with open(path) as f:
        for line in f:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                if json.loads(line)["step"] <= step and line.endswith("\n"):
                    out.append(line)
    return out


def optimize(args: TrainArgs, step_module: torch.nn.Module, micro_batches, summarize, save,
             run: Run, dtype, resumed: Optional[tuple[int, dict]], flops: float, banner: str,
             evaluate=None) -> dict:
    """AdamW steps: `step_module(**mb)` -> (loss share, sums) for each of `micro_batches(step)`, from
    `resumed` (`read_state`'s step and state) when given; `evaluate(step)` on the checkpoints of
    --eval-every's steps (train.py's flag)."""
    module = step_module.model
    dev = run.device
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    start = 0
    if resumed is not None:
        start, state = resumed
        sd = opt.state_dict()
        sd["state"] = state
        opt.load_state_dict(sd)
    end = args.stop_at or args.steps  # past the saved step (`check_resume_progress`)
    main = run.rank == 0
    if main:
        print(banner, file=sys.stderr)
    ddp = step_module
    # gradients averaged over ranks: each rank's loss share is scaled by the world size
    if run.world > 1:
        device_ids = None
        if dev.startswith("cuda"):
            device_ids = [dev]
        ddp = torch.nn.parallel.DistributedDataParallel(step_module, device_ids=device_ids)
    from tqdm import tqdm

    shown = runlog.show(args.progress and main)
    no_bar = shown != "bar"
    bar = tqdm(total=end, initial=start, file=sys.stderr, disable=no_bar, dynamic_ncols=True)
    lines = None
    # off a terminal: a line every 15 s, so a two-minute run shows how it goes
    if shown == "lines":
        lines = runlog.Lines(every=15.0)
    log_file = None
    if main:  # a run resumed into its own --out drops the log lines after its state's step
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, LOG_JSONL)
        real_out = os.path.realpath(args.out)
        here = args.resume is not None and os.path.realpath(args.resume) == real_out
        if not here and os.path.exists(path):
            print(f"--out {args.out}: a run that stopped before its first checkpoint left its log there; "
                  "starting afresh", file=sys.stderr)
        kept_lines = []
        if here:
            kept_lines = _log_upto(path, start)
        atomic_write(path, "".join(kept_lines))
        log_file = open(path, "a")
    tokens_per_step = args.batch_size * args.grad_accum * run.world * args.seq_len
    peak_tf = args.peak_tflops or peak_tflops(dev) or 0
    peak = peak_tf * 1e12
    eval_every = getattr(args, "eval_every", 0)
    losses = []
    times = []
    pauses = 0.0  # seconds of checkpoints and evaluations between steps, which the ETA spreads over them
    speed = {}
    written = []  # the checkpoints this run published

    def checkpoint(step):
        if main:
            with signals_deferred():  # a stop during the save names what it published (the previous one is gone)
                files = publish_checkpoint(args.out, step, lambda directory: save(directory, step, opt))
                written.append(os.path.join(args.out, f"checkpoint-{step}"))
            if args.wandb_artifacts:  # the checkpoint's model files, not whatever else --out holds
                aliases = [f"step-{step}", "latest"]
                metadata = {"step": step}
                run.wandb.artifact("checkpoint", "model", files, metadata=metadata, aliases=aliases)
        run.barrier()  # every rank may read it next
        if eval_every and step % eval_every == 0:
            with tqdm.external_write_mode(file=sys.stderr):  # eval.py's lines above the bar, not on it
                found = evaluate(step)
            if run.wandb is not None:
                run.wandb.log(found, step=step)

    module.train()
    try:
        for step in range(start, end):
            t_step = time.perf_counter()
            lr = lr_at(step, args)
            for g in opt.param_groups:
                g["lr"] = lr
            opt.zero_grad(set_to_none=True)
            sums = None
            parts = micro_batches(step)
            for m, mb in enumerate(parts):
                # all-reduce the gradients once, after the last
                sync = run.world == 1 or m == len(parts) - 1
                gradient_sync = contextlib.nullcontext()
                if not sync:
                    gradient_sync = ddp.no_sync()
                precision = contextlib.nullcontext()
                if dtype != torch.float32:
                    precision = torch.autocast(dev.split(":")[0], dtype)
                with gradient_sync:
                    with precision:
                        share, s = ddp(**mb)
                    (share * run.world).backward()
                if sums is None:
                    sums = s
                else:
                    sums = sums + s
            if run.world > 1:
                torch.distributed.all_reduce(sums)
            metrics = summarize(sums.double().cpu())
            loss = metrics["loss"]
            if not math.isfinite(loss):  # every rank sees the same sums: all stop here
                raise UserError(f"step {step + 1}: the loss is {loss} (not finite); stopped before the "
                                f"optimizer step — {kept_after_stop(written, start > 0)}")
            max_norm = float("inf")
            if args.grad_clip > 0:
                max_norm = args.grad_clip
            gnorm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            if not math.isfinite(float(gnorm)):  # the gradients every rank averaged: all stop here
                raise UserError(f"step {step + 1}: the gradient norm is {float(gnorm)} (not finite, the loss "
                                f"{loss:.4f}); stopped before the optimizer step — "
                                f"{kept_after_stop(written, start > 0)}")
            opt.step()
            losses.append(loss)
            times.append(time.perf_counter() - t_step)
            timed = times[1:] or times  # this process's first step (a compiling one) left out once there are others
            recent = timed[-SPEED_WINDOW:]
            dt = sum(recent) / len(recent)  # tokens/s: this one figure, everywhere
            tokens_per_second = tokens_per_step / dt
            left = end - step - 1
            pause_per_step = pauses / (step + 1 - start)  # the checkpoints' and evaluations' share so far
            speed = {"tokens_per_second": tokens_per_second, "eta_seconds": (dt + pause_per_step) * left}
            if peak:
                speed["mfu"] = flops / dt / (peak * run.world)
            done = step + 1
            # the bar's figures: loss, tau or ppl, tokens/s, MFU
            postfix = {"loss": f"{loss:.4f}"}
            shown_quality = ""  # the line's τ (a drafter) or perplexity (the demo target)
            for k, v in metrics.items():
                if k in ("tau", "ppl"):
                    postfix[k] = f"{v:.3f}"
                    name = {"tau": "τ", "ppl": "ppl"}[k]
                    shown_quality += f", {name} {v:.3f}"
            postfix["tok_s"] = f"{tokens_per_second:,.0f}"
            shown_mfu = ""
            if "mfu" in speed:
                postfix["mfu"] = f"{speed['mfu']:.1%}"
                shown_mfu = f", MFU {speed['mfu']:.1%}"
            bar.update(1)
            bar.set_postfix(**postfix)
            if lines is not None:
                minutes_left = speed["eta_seconds"] / 60
                lines.say(f"step {done}/{end}: loss {loss:.4f}{shown_quality}, {tokens_per_second:,.0f} "
                          f"tokens/s{shown_mfu}, {minutes_left:.1f} min to go", final=done == end)
            record = {**metrics, "lr": lr, "grad_norm": float(gnorm), **speed}
            if main:
                log_file.write(json.dumps({"step": done, **record}) + "\n")
                log_file.flush()
            if run.wandb is not None and (done % args.log_every == 0 or done == end):
                run.wandb.log(record, step=done)
            save_due = args.save_every and done % args.save_every == 0
            eval_due = eval_every and done % eval_every == 0
            if done != end and (save_due or eval_due):
                t_pause = time.perf_counter()
                checkpoint(done)
                pauses += time.perf_counter() - t_pause
        bar.close()
        module.eval()
        checkpoint(end)
    except Interrupted as e:  # the interruption's line names the checkpoint a --resume continues from
        e.written = written[-1:] + (e.written or [])  # and the evaluation's file, when one stopped
        e.hint = "--save-every N keeps finished steps"
        if start > 0:
            e.hint = f"the checkpoint it resumed from is as it was; {e.hint}"
        raise
    finally:  # an interruption's line starts below the bar, not on it
        bar.close()
        if log_file is not None:  # however the run ends: train.main may run again in this process
            log_file.close()
    if main:
        window = min(max(len(times) - 1, 1), SPEED_WINDOW)
        over = f"over the last {window} steps"
        if window == 1:
            over = "over the last step"
        if len(times) > 1:  # as tokens_per_second is timed
            over += " (this process's first, with its one-off costs, left out)"
        tokens_per_second = speed["tokens_per_second"]
        print(f"step {end}: loss {losses[-1]:.4f}, {tokens_per_second:,.0f} tokens/s {over} "
              f"({run.world} process(es)), {args.kind} written to {args.out}")
    return {
        "start": start,
        "step": end,
        "losses": losses,
        "step_seconds": times,
        "tokens_per_second": speed["tokens_per_second"],
    }


def train_main(args_class, run_fn, argv: Optional[list[str]] = None) -> int:
    def run(args):
        omp_threads(fix="unset it")  # training runs on torch's threads: every core, or OMP_NUM_THREADS
        return run_fn(args)
    return cli_main(args_class, run_and_leave(run), argv, inference=False, rank0=rank0)
