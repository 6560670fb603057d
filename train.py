"""Distil a DSpark / DFlash drafter from a frozen target (docs/algorithm.md, "Training").

    python train.py --target DIR --data FILE_OR_DIR --out DIR [--steps N --block-size 7 --depth 5 ...]
    torchrun --nproc_per_node 8 train.py ... --batch-size 1 --grad-accum 64   # global batch 512

What is notable here:
- Online capture: every batch runs the frozen target once (no grad), cache-free and causal (within each
  document of packed chat rows), for the context features of `target_layer_ids` and its final hidden
  states; its logits only at the supervised positions (as DeepSpec), so no [B, T, V] tensor, no feature cache.
- Data (data.py): plain text as one stream cut into windows, or chat records rendered with the chat template
  (thinking off), a loss mask over the assistant's tokens, conversations packed whole per row.
- Packed blocks: `--anchors-per-seq` K-slot blocks [x_a, m, .., m] per row at positions a..a+K-1 (slot j
  predicts a+j+1), run at once by `Drafter.train_forward` under `drafter.block_mask`, equal to the inference
  drafter block by block (tests check it); Markov inputs teacher-forced [x_a, labels[:-1]] through the heads'
  own `step()`, confidence logits from the inference features (`Drafter.head_outputs`).
- Losses as DeepSpec's loss.py: slot weights w_j = exp(-j/γ) (0 if unsupervised), each term Σ w·ℓ / Σ w over
  the step's global batch; L = 0.1·CE + 0.9·‖p_d − p_t‖_1 + 1.0·BCE(conf logit, c* = 1 − ½‖p_d − p_t‖_1).
- torchrun (gloo on CPU, NCCL on GPU): the drafter under DistributedDataParallel, the frozen target replicated
  (an 8B bf16 target and a 1B drafter's float32 AdamW state fit an 80 GB card; sharding would save only the
  drafter's ~17 GB). Step s's global batch (G = --batch-size x --grad-accum x world rows) and its anchors
  depend only on (--seed, s, G); rank r's micro-batch m is rows (r·A + m)·B .. +B of it and adds its Σ w·ℓ
  over the whole batch's Σ w (known before any forward). So 1 process x --grad-accum 2 and 2 processes x 1
  give the same loss and gradient, up to float summation order.
- AdamW (weight decay 0), linear warm-up over `--warmup-frac` from lr/W, cosine (or linear, constant) decay
  to `--min-lr-frac`·lr at the last step, gradient-norm clip 1.0; the embedding and lm_head are the target's.
- Checkpoints (rank 0) in DeepSpec's layout (`drafter.save_drafter`), loaded like a published one; exact
  resume at any world size for the same G: no RNG state to save, the optimizer moments go to
  training_state.safetensors and the step/arguments to training_state.json (no pickle).
- Progress: tokens/s, an MFU estimate (`step_flops` / --peak-tflops) and the ETA in the bar, wandb and
  --out/train_log.jsonl; --eval-every runs eval.py on a checkpoint; --wandb-artifacts uploads checkpoints.
- The loop, its flags (`TrainArgs`) and state are shared with `scripts/train_target.py` (the demo's target).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, fields
from typing import ClassVar, Literal, Optional

import torch
import torch.nn.functional as F

import data
from common import (UserError, atomic_write, check_ranges, cli_main, dist_init, parse_ints, peak_tflops, read_json,
                    resolve_device, resolve_dtype, save_tensors, write_json)
from drafter import MARKOV_TYPES, Drafter, DrafterConfig, load_drafter_weights, save_drafter
from model import ModelArgs, Tokenizer, Transformer, init_random_, load_target, read_safetensors

STATE_TENSORS = "training_state.safetensors"
STATE_JSON = "training_state.json"
LOG_JSONL = "train_log.jsonl"  # rank 0's metrics, one line per step


@dataclass
class TrainArgs:
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
    """Optimizer steps in the whole run (the learning-rate schedule spans them)."""
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
    """wandb logging period in steps."""
    progress: bool = True
    """tqdm progress bar on stderr (rank 0): loss, tokens/s, MFU, ETA."""
    peak_tflops: Optional[float] = None
    """Peak TFLOP/s of one device for the MFU estimate (default: the data-sheet dense bf16 figure of a known
    GPU — H100/H200 989, A100 312 — else no MFU). MFU = step_flops / step time / (peak x processes)."""
    wandb: bool = False
    """Log to Weights & Biases (WANDB_MODE=offline works without network)."""
    wandb_project: str = "dspark-fast"
    """Weights & Biases project of --wandb."""
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


@dataclass
class Args(TrainArgs):
    """Distil a DSpark / DFlash drafter from a frozen target (docs/algorithm.md, "Training")."""

    target: Optional[str] = None
    """Hugging Face Qwen3 directory of the frozen target."""

    # Drafter shape and heads
    block_size: int = 7
    """K: slots per block = drafts per round (DSpark "shift label" layout)."""
    depth: int = 5
    """Drafter decoder layers."""
    target_layer_ids: Optional[str] = None
    """Comma-separated target layers whose outputs form the context feature (default: DeepSpec's
    spacing, 1,9,17,25,33 for a 36-layer target; 0..L-2 for targets under 5 layers)."""
    mask_token_id: Optional[int] = None
    """Fills the block slots after the anchor (default: the tokenizer's <|mask|>, else the first
    embedding row past the tokenizer's vocabulary — 151669 for Qwen3 — else vocab_size-1)."""
    markov: Literal["vanilla", "gated", "rnn", "none"] = "vanilla"
    """Markov head type; none = no sequential stage (with --no-confidence: a DFlash-style drafter)."""
    markov_rank: int = 256
    """r of the Markov head (W1: [V, r], W2: r -> V)."""
    confidence: bool = True
    """Train a confidence head."""
    confidence_with_markov: bool = True
    """The confidence head also reads W1[x_{k-1}] (needs a Markov head)."""
    anchors_per_seq: int = 512
    """Blocks packed per sequence (DeepSpec: 512), at most --seq-len - 1: anchors drawn without replacement
    from 0..seq_len-2 (chat data: where the anchor and its successor are in a response; a row with fewer
    such positions fills the rest with unsupervised blocks)."""
    gamma: float = 4.0
    """Slot weights exp(-j/gamma), j = 0..K-1."""
    alpha_ce: float = 0.1
    """Weight of the cross-entropy on the labels."""
    alpha_tv: float = 0.9
    """Weight of ‖p_draft − p_target‖_1."""
    alpha_conf: float = 1.0
    """Weight of the confidence BCE against 1 − ½‖p_draft − p_target‖_1."""

    # Evaluation during training (eval.py on a checkpoint)
    eval_every: int = 0
    """Every this many steps write the checkpoint and run eval.py on it (acceptance per dataset, recorded with
    its step in --out/eval_step<N>.json and wandb); 0 = never. Decodes eagerly, sampled (T = 1)."""
    eval_datasets: str = "mt-bench,gsm8k"
    """Comma-separated benchmark files of --eval-every (<name>.jsonl in --eval-data-dir)."""
    eval_data_dir: Optional[str] = None
    """Directory of the --eval-every benchmark files (default: eval.py's, the shipped data/eval)."""
    eval_samples: int = 8
    """Prompts per dataset of --eval-every (the authors' seeded subset)."""
    eval_max_new_tokens: int = 256
    """Token budget per prompt of --eval-every."""

    resume_keys: ClassVar[tuple[str, ...]] = TrainArgs.resume_keys + (
        "block_size", "depth", "target_layer_ids", "mask_token_id", "markov", "markov_rank", "confidence",
        "confidence_with_markov", "anchors_per_seq", "gamma", "alpha_ce", "alpha_tv", "alpha_conf")
    kind: ClassVar[str] = "drafter"


# ----------------------------------------------------------------------------------------
# Losses (the drafter's packed forward and heads are drafter.py's: train_forward, head_outputs)

def slot_weights(K: int, gamma: float, device=None) -> torch.Tensor:
    """w_j = exp(-j/γ), j = 0..K-1 (docs/algorithm.md, "Training": earlier slots count more under prefix acceptance)."""
    return torch.exp(-torch.arange(K, device=device, dtype=torch.float32) / gamma)


def distill_losses(draft_logits, target_logits, labels, valid, conf_logits, gamma: float, den=None) -> dict:
    """The three terms of docs/algorithm.md's "Training", each a weighted mean over the supervised slots.

    draft_logits, target_logits [..., K, V]; labels, valid [..., K]; conf_logits [..., K] or None.
    With w = exp(-j/γ)·valid: term = Σ w·ℓ / Σ w over the whole batch (DeepSpec's normalization; `den`:
    the Σ w of the step's global batch when these rows are a part of it), where ℓ is -log p_d(label) (ce),
    ‖p_d − p_t‖_1 (tv), and BCE(σ(conf), c*) with the soft label c* = 1 − ½‖p_d − p_t‖_1, detached
    (conf). Also returns `accept` = c* (detached) for logging.
    """
    K = draft_logits.shape[-2]
    w = slot_weights(K, gamma, draft_logits.device) * valid.float()
    den = w.sum().clamp_min(1e-12) if den is None else den  # no supervised slot: every term is 0
    logp = torch.log_softmax(draft_logits.float(), dim=-1)
    p_t = torch.softmax(target_logits.float(), dim=-1)
    ce = -logp.gather(-1, labels[..., None])[..., 0]
    l1 = (logp.exp() - p_t).abs().sum(-1)
    accept = (1 - 0.5 * l1).clamp(0, 1).detach()
    out = {"ce": (ce * w).sum() / den, "tv": (l1 * w).sum() / den, "accept": accept}
    if conf_logits is not None:
        bce = F.binary_cross_entropy_with_logits(conf_logits.float(), accept, reduction="none")
        out["conf"] = (bce * w).sum() / den
    return out


def total_loss(terms: dict, args: Args) -> torch.Tensor:
    loss = args.alpha_ce * terms["ce"] + args.alpha_tv * terms["tv"]
    if "conf" in terms:
        loss = loss + args.alpha_conf * terms["conf"]
    return loss


def drafter_loss(drafter: Drafter, target: Transformer, tokens: torch.Tensor, anchors: torch.Tensor, args: Args, *,
                 keep=None, loss_mask=None, doc=None, den=None):
    """One batch: online capture, packed forward, heads, losses. Returns (loss, terms, valid).
    keep [B, N]: real blocks (False: filler); loss_mask, doc [B, T]: chat rows (data.py); den: the global
    batch's Σ w (default: these rows'). Slots are supervised as `data.supervised` says."""
    K = drafter.cfg.num_slots
    B, T = tokens.shape
    keep = torch.ones_like(anchors, dtype=torch.bool) if keep is None else keep
    with torch.no_grad():  # cache-free, causal (within each document of packed rows)
        mask = data.document_mask(doc) if doc is not None else None
        hidden_t, features = target.hidden(tokens, capture=drafter.cfg.target_layer_ids, mask=mask)
    h = drafter.train_forward(features, tokens, anchors, doc)  # [B, N, K, H]
    slot_pos = anchors[:, :, None] + torch.arange(K, device=tokens.device)  # slot j sits at a+j, predicts a+j+1
    valid = data.supervised(anchors, keep, K, T, loss_mask, doc)
    labels = tokens.gather(1, (slot_pos + 1).clamp(max=T - 1).view(B, -1)).view_as(slot_pos)
    prev = torch.cat([tokens.gather(1, anchors)[:, :, None], labels[:, :, :-1]], dim=-1)  # teacher-forced
    with torch.no_grad():  # the target's distribution for the same token, only where it is needed
        idx = slot_pos.clamp(max=T - 1).view(B, -1, 1).expand(-1, -1, hidden_t.shape[-1])
        target_logits = target.lm_head(hidden_t.gather(1, idx)).view(B, anchors.shape[1], K, -1)
    z, conf = drafter.head_outputs(h, prev)
    terms = distill_losses(z, target_logits, labels, valid, conf, args.gamma, den)
    return total_loss(terms, args), terms, valid


def _layer_params(a: ModelArgs) -> int:
    q, kv, H = a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim, a.hidden_size
    return 2 * H * q + 2 * H * kv + 3 * H * a.intermediate_size  # q, o; k, v; gate, up, down


def step_flops(t: ModelArgs, d: DrafterConfig, G: int, T: int, N: int) -> float:
    """Model FLOPs of one optimizer step over G rows of T tokens with N blocks each — an ESTIMATE for MFU:
    2 FLOPs per multiply-add of the matmuls (norms, softmax, RoPE, the Markov chain's gathers left out).
      target (forward, no grad): 2·T·L·P_layer + 2·L·T²·q (causal QKᵀ and AV) + 2·N·K·H·V (lm_head at the
        supervised positions), per row;
      drafter (forward + backward = 3 x forward): context rows 2·T·(n·H·H + D·2·H·kv) (fc, each layer's k/v),
        block rows 2·N·K·(D·P_layer + H·V + r·V) (layers, lm_head, Markov W2), attention 4·D·N·K·(T + N·K)·q
        (the masked attention computes every score), per row;
    with P_layer the q/k/v/o and MLP weights of a layer, q = heads·head_dim, kv = kv_heads·head_dim."""
    K, H, V, L = d.num_slots, t.hidden_size, t.vocab_size, t.num_hidden_layers
    q, kv, D = t.num_attention_heads * t.head_dim, t.num_key_value_heads * t.head_dim, d.layers.num_hidden_layers
    target = 2 * T * L * _layer_params(t) + 2 * L * T * T * q + 2 * N * K * H * V
    context = 2 * T * (len(d.target_layer_ids) * H * H + D * 2 * H * kv)
    blocks = 2 * N * K * (D * _layer_params(d.layers) + H * V + d.markov_rank * V) + 4 * D * N * K * (T + N * K) * q
    return float(G * (target + 3 * (context + blocks)))



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

def save_state(out: str, step: int, module: torch.nn.Module, opt: torch.optim.Optimizer, args: TrainArgs,
               num_windows: int, world: int = 1):
    """The optimizer's moments by parameter name (safetensors) and the step, arguments and global batch (JSON)."""
    names = {id(p): n for n, p in module.named_parameters()}
    tensors = {}
    for p, st in opt.state.items():
        for key, val in st.items():
            tensors[f"{key}.{names[id(p)]}"] = val if torch.is_tensor(val) else torch.tensor(val)
    save_tensors(os.path.join(out, STATE_TENSORS), tensors)
    write_json(os.path.join(out, STATE_JSON), {
        "step": step, "num_windows": num_windows, "kind": args.kind, "args": asdict(args), "world_size": world,
        "global_batch": args.batch_size * args.grad_accum * world,
        "note": "batch and anchors of step s depend only on (seed, s, global_batch): no RNG state to restore"})


def check_resume_args(directory: str, args: TrainArgs, world: Optional[int] = None) -> dict:
    """training_state.json of `directory`, after checking that `args` repeats the flags of the saved run
    (`args.resume_keys`) and its global batch (with `world` processes; None: not known yet), and that it
    trained the same kind of model."""
    meta = read_json(os.path.join(directory, STATE_JSON))
    saved = meta.get("args")
    if not isinstance(saved, dict) or not isinstance(meta.get("step"), int):
        raise UserError(f"{os.path.join(directory, STATE_JSON)}: missing 'step' or 'args'")
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


def load_state(directory: str, module: torch.nn.Module, opt: torch.optim.Optimizer, args: TrainArgs,
               num_windows: int, world: int = 1) -> int:
    """Restore the optimizer state saved by `save_state`; returns the step to continue from."""
    meta = check_resume_args(directory, args, world)
    path = os.path.join(directory, STATE_TENSORS)
    if meta.get("num_windows") != num_windows:
        raise UserError(f"--resume {directory}: the data gave {meta.get('num_windows')} sequences, now "
                              f"{num_windows} (a resumed run must read the same data)")
    if not os.path.isfile(path):
        raise UserError(f"{path}: file not found")
    tensors = read_safetensors([path], torch.float32, "cpu")
    index = {n: i for i, (n, _) in enumerate(module.named_parameters())}
    state = {}
    for key, t in tensors.items():
        kind, _, name = key.partition(".")
        if name not in index:
            raise UserError(f"{path}: optimizer state {key!r} matches no parameter")
        state.setdefault(index[name], {})[kind] = t
    sd = opt.state_dict()
    missing = [n for n, i in index.items() if i not in state]
    if state and missing:
        raise UserError(f"{path}: no optimizer state for parameter {missing[0]!r}")
    sd["state"] = state
    opt.load_state_dict(sd)
    return meta["step"]


# ----------------------------------------------------------------------------------------
# Building the drafter

def default_layer_ids(L: int) -> tuple[int, ...]:
    """DeepSpec's spacing: 1 + i(L-4)/4 for i = 0..4 (1, 9, 17, 25, 33 at 36 layers; 1, 10, .. 37 at 40);
    for targets under 5 layers every layer but the last."""
    if L >= 5:
        return tuple(sorted({1 + i * (L - 4) // 4 for i in range(5)}))
    return tuple(range(0, L - 1)) or (-1,)


def default_mask_token_id(target_dir: str, V: int) -> int:
    """<|mask|> if the tokenizer has it; else the first embedding row past the tokenizer (151669 for Qwen3);
    else the last id."""
    if os.path.isfile(os.path.join(target_dir, "tokenizer.json")):
        tok = Tokenizer(target_dir).tok
        mid = tok.token_to_id(data.MASK_TOKEN)
        if mid is not None and mid < V:
            return mid
        n = tok.get_vocab_size(with_added_tokens=True)
        if n < V:
            return n
    return V - 1


def build_drafter(args: Args, target: Transformer, target_dir: str, device) -> Drafter:
    t = target.args
    ids = (parse_ints(args.target_layer_ids, "--target-layer-ids", skip_blank=True) if args.target_layer_ids
           else default_layer_ids(t.num_hidden_layers))
    if not ids:
        raise UserError("--target-layer-ids: empty list")
    if list(ids) != sorted(set(ids)):
        raise UserError(f"--target-layer-ids: {list(ids)} must be strictly increasing")
    ids = tuple(ids)
    target.check_capture(ids, "--target-layer-ids")
    mask = args.mask_token_id if args.mask_token_id is not None else default_mask_token_id(target_dir, t.vocab_size)
    if not 0 <= mask < t.vocab_size:
        raise UserError(f"--mask-token-id: {mask} is outside the vocabulary (0..{t.vocab_size - 1})")
    markov = None if args.markov == "none" else args.markov
    assert markov is None or markov in MARKOV_TYPES
    if args.confidence and args.confidence_with_markov and markov is None:
        raise UserError("--confidence-with-markov needs a Markov head (--markov none given): "
                              "add --no-confidence-with-markov")
    layers = ModelArgs(**{f.name: getattr(t, f.name) for f in fields(ModelArgs)})
    layers.num_hidden_layers = args.depth
    layers.eos_token_ids = ()
    cfg = DrafterConfig(layers=layers, block_size=args.block_size, target_layer_ids=ids, mask_token_id=mask,
                        layout="dspark", markov_head_type=markov, markov_rank=args.markov_rank if markov else 0,
                        confidence_head=args.confidence,
                        confidence_with_markov=args.confidence and args.confidence_with_markov and markov is not None)
    with torch.device(device):
        drafter = Drafter(cfg)
    init_random_(drafter, args.seed, args.init_std)
    drafter.attach(target)
    return drafter


# ----------------------------------------------------------------------------------------
# The training loop (shared with scripts/train_target.py)

def check_train_args(args: TrainArgs, **ranges: str):
    """The shared flags' ranges (and `ranges`, a program's own), --out, one data source, and the saved
    state of --resume. One-line UserErrors."""
    check_ranges(args, steps="[1, inf)", batch_size="[1, inf)", grad_accum="[1, inf)", seq_len="[2, inf)",
                 lr="(0, inf)", warmup_frac="[0, 1)", min_lr_frac="[0, 1]", grad_clip="[0, inf)", **ranges,
                 log_every="[1, inf)", save_every="[0, inf)", stop_at=f"[1, {args.steps}]",
                 peak_tflops="(0, inf)", dist_timeout="(0, inf)")
    if args.out is None:
        raise UserError("--out: no output directory given")
    if (args.data is None) == (args.data_ids is None):
        raise UserError("give exactly one of --data, --data-ids")
    if args.wandb_artifacts and not args.wandb:
        raise UserError("--wandb-artifacts: needs --wandb")
    if args.resume:
        if not os.path.isfile(os.path.join(args.resume, STATE_JSON)):
            raise UserError(f"--resume {args.resume}: no {STATE_JSON} there")
        check_resume_args(args.resume, args)


def _autocast(device: str, dtype: torch.dtype):
    """Mixed precision for the forward: weights and AdamW state stay float32 (master weights)."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.split(":")[0], dtype=dtype)


@dataclass
class Run:
    """Where this process stands: rank, world size and device, and the Weights & Biases run (rank 0)."""
    rank: int
    world: int
    device: str
    wandb: object = None

    def barrier(self):
        if self.world > 1:
            import torch.distributed as dist
            dist.barrier()


def log_artifact(run: Run, out: str, step: int):
    """--wandb-artifacts: the checkpoint directory's files as a model artifact of the run."""
    import wandb

    art = wandb.Artifact(f"{run.wandb.id}-checkpoint", type="model", metadata={"step": step})
    for f in sorted(os.listdir(out)):
        if f.endswith((".json", ".safetensors")):
            art.add_file(os.path.join(out, f))
    run.wandb.log_artifact(art, aliases=[f"step-{step}", "latest"])


def _log_upto(path: str, step: int) -> list[str]:
    """The lines of an earlier train_log.jsonl up to `step` (a killed run's torn last line dropped)."""
    out = []
    for line in open(path) if os.path.isfile(path) else []:
        with contextlib.suppress(ValueError, KeyError, TypeError):
            if json.loads(line)["step"] <= step and line.endswith("\n"):
                out.append(line)
    return out


def optimize(args: TrainArgs, step_module: torch.nn.Module, micro_batches, summarize, save, run: Run, dtype,
             num_rows: int, flops: Optional[float] = None, evaluate=None) -> dict:
    """AdamW steps from the resumed step to --stop-at / --steps. `step_module.model` is what trains;
    `step_module(**mb)` -> (this micro-batch's share of the step loss, a 1-D tensor of sums) for each of
    `micro_batches(step)` (this rank's, on its device); `summarize(sums over every micro-batch and rank)`
    -> logged metrics with "loss"; `save(step, optimizer)` writes a checkpoint (rank 0); `evaluate(step)`
    (every rank, after a checkpoint, every --eval-every steps) -> metrics to log; `flops`: one step's."""
    module, dev = step_module.model, run.device
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    start = load_state(args.resume, module, opt, args, num_rows, run.world) if args.resume else 0
    end = args.stop_at or args.steps
    if start >= end:
        raise UserError(f"--resume {args.resume}: already at step {start}, nothing to do up to step {end}")
    ddp = step_module
    if run.world > 1:  # gradients averaged over ranks: each rank's loss is scaled by the world size below
        ddp = torch.nn.parallel.DistributedDataParallel(step_module, device_ids=[dev] if dev.startswith("cuda") else None)
    main = run.rank == 0
    if args.wandb and main:
        import wandb
        run.wandb = wandb.init(project=args.wandb_project, config=dict(asdict(args), world_size=run.world))
    from tqdm import tqdm

    bar = tqdm(total=end, initial=start, file=sys.stderr, disable=not (args.progress and main), dynamic_ncols=True)
    if main:  # one JSON line per step; a run resumed into its own --out drops the lines after its state's step
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, LOG_JSONL)
        atomic_write(path, "".join(_log_upto(path, start)))
        log = open(path, "a")
    tokens_per_step = args.batch_size * args.grad_accum * run.world * args.seq_len
    peak = (args.peak_tflops or peak_tflops(dev) or 0) * 1e12  # MFU only against a known peak
    eval_every = getattr(args, "eval_every", 0)
    losses, times, t0 = [], [], time.time()

    def checkpoint(step):
        if main:
            save(step, opt)
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
    if run.wandb is not None:
        run.wandb.finish()
    seconds, n = time.time() - t0, end - start
    tokens_per_s = n * tokens_per_step / max(seconds, 1e-9)
    if main:
        print(f"step {end}: loss {losses[-1]:.4f}, {n} steps in {seconds:.1f} s ({tokens_per_s:,.0f} tokens/s, "
              f"{run.world} process(es)), {args.kind} written to {args.out}")
    return {"start": start, "step": end, "losses": losses, "seconds": seconds, "step_seconds": times,
            "tokens_per_second": tokens_per_s}


# ----------------------------------------------------------------------------------------
# Drafter distillation

class DraftStep(torch.nn.Module):
    """One micro-batch's share of the step loss, as DDP wraps it (its forward must run through the wrapper):
    the drafter is the submodule that trains; the target is held outside the module tree (frozen, replicated)."""

    def __init__(self, drafter: Drafter, target: Transformer, args: Args):
        super().__init__()
        self.model, self._target, self.args = drafter, [target], args
        self.core = torch.compile(drafter_loss, dynamic=False) if args.compile else drafter_loss

    def forward(self, tokens, anchors, keep, loss_mask, doc, den):
        loss, terms, valid = self.core(self.model, self._target[0], tokens, anchors, self.args, keep=keep,
                                       loss_mask=loss_mask, doc=doc, den=den)
        with torch.no_grad():  # sums over this micro-batch (summarize_drafter turns them into metrics)
            acc, v = terms["accept"], valid.float()
            tau = (((acc * v).cumprod(-1).sum(-1) + 1) * keep).sum()
            zero = loss.new_zeros(())
            head = torch.stack([loss.detach(), terms["ce"], terms["tv"], terms.get("conf", zero), tau, keep.sum()])
            sums = torch.cat([head.float(), (acc * v).sum((0, 1)), v.sum((0, 1))])
        return loss, sums


def summarize_drafter(sums: torch.Tensor, K: int, has_conf: bool) -> dict:
    """Logged numbers: the loss and its terms, acceptance per slot and the expected τ (DeepSpec's
    tau_probabilistic: 1 + Σ_k Π_{i≤k} c*_i per real block)."""
    s = sums.tolist()
    out = {"loss": s[0], "ce": s[1], "tv": s[2], **({"conf": s[3]} if has_conf else {}), "tau": s[4] / max(s[5], 1)}
    out.update({f"accept@{j}": s[6 + j] / max(s[6 + K + j], 1) for j in range(K)})
    return out


def train_drafter(args: Args) -> dict:
    if args.target is None:
        raise UserError("--target: no target directory given")
    rank, world, device = dist_init(resolve_device(args.device), args.dist_timeout)
    run = Run(rank, world, device)
    say = (lambda msg: print(msg, file=sys.stderr)) if rank == 0 else (lambda msg: None)  # noqa: E731
    dtype = resolve_dtype(args.dtype, device)
    target = load_target(args.target, device, dtype if device.startswith("cuda") else torch.float32)
    corpus = data.load_corpus(args, target.args, say)
    drafter = build_drafter(args, target, args.target, device)
    if args.resume:
        load_drafter_weights(drafter, args.resume, args.target, args.anchors_per_seq)
    T, K, G = args.seq_len, drafter.cfg.num_slots, args.batch_size * args.grad_accum * world
    N = min(args.anchors_per_seq, T - 1)
    say(drafter.cfg.describe() + f" | {sum(p.numel() for p in drafter.parameters()):,} trained parameters | "
        f"{len(corpus)} sequences of {T} tokens, {N} anchors each | global batch {G} = {args.batch_size} x "
        f"{args.grad_accum} x {world} process(es)")
    batches = data.Batches(len(corpus), G, args.seed)
    w = slot_weights(K, args.gamma)
    mine = data.micro_slices(args.batch_size, args.grad_accum, rank)

    def micro_batches(step):
        tokens, mask, doc = corpus.rows(batches(step))
        g = torch.Generator().manual_seed(data.seed_for("anchors", args.seed, step))
        anchors, keep = data.sample_anchors(G, T, N, g, data.anchor_candidates(mask, doc))
        den = (w * data.supervised(anchors, keep, K, T, mask, doc).float()).sum().clamp_min(1e-12)
        to = lambda t, sl: None if t is None else t[sl].to(device)  # noqa: E731
        return [dict(tokens=to(tokens, sl), anchors=to(anchors, sl), keep=to(keep, sl), loss_mask=to(mask, sl),
                     doc=to(doc, sl), den=den.to(device)) for sl in mine]

    def save(step, opt):
        save_drafter(args.out, drafter, args.target, args.anchors_per_seq)
        save_state(args.out, step, drafter, opt, args, len(corpus), world)

    evaluate = (lambda step: evaluate_checkpoint(args, step, device)) if args.eval_every else None
    return optimize(args, DraftStep(drafter, target, args), micro_batches,
                    lambda sums: summarize_drafter(sums, K, drafter.cfg.confidence_head), save, run, dtype,
                    len(corpus), step_flops(target.args, drafter.cfg, G, T, N), evaluate)


def check_eval_args(args: Args):
    """--eval-every's flags, and its benchmark files, before any training."""
    check_ranges(args, eval_every="[0, inf)", eval_samples="[1, inf)", eval_max_new_tokens="[1, inf)")
    if args.eval_every:
        import eval as evaluation
        folder = args.eval_data_dir or evaluation.DATA_DIR
        names = [n for n in args.eval_datasets.split(",") if n.strip()]
        missing = [n for n in names if not os.path.isfile(os.path.join(folder, f"{n.strip()}.jsonl"))]
        if not names or missing:
            raise UserError(f"--eval-datasets: no {(missing or ['<name>'])[0]}.jsonl in {folder}")


def evaluate_checkpoint(args: Args, step: int, device: str) -> dict:
    """eval.py on the checkpoint just written (every rank decodes a shard), results in --out/eval_step<N>.json;
    returns per-dataset acceptance for the training log."""
    import eval as evaluation

    e = evaluation.EvalArgs(target=args.target, drafter=args.out, datasets=args.eval_datasets, step=step,
                            data_dir=args.eval_data_dir or evaluation.DATA_DIR, max_samples=args.eval_samples,
                            max_new_tokens=args.eval_max_new_tokens, device="cuda" if device.startswith("cuda") else "cpu",
                            compile=False, progress=False, out=os.path.join(args.out, f"eval_step{step}.json"))
    with torch.inference_mode():
        results = evaluation.run(e)
    return {f"eval/{r['dataset']}/{k}": r[k] for r in results["datasets"]
            for k in ("acceptance_length", "draft_tokens_per_proposal")}


def run(args: Args) -> dict:
    """Everything `python train.py` does; returns the loss history. Raises UserError on bad input."""
    check_train_args(args, block_size="[1, inf)", depth="[1, inf)", markov_rank="[1, inf)",
                     anchors_per_seq="[1, inf)", gamma="(0, inf)")
    check_eval_args(args)
    return train_drafter(args)


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


def main(argv: Optional[list[str]] = None) -> int:
    return train_main(Args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
