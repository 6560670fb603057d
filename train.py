"""Distil a DSpark / DFlash drafter from a frozen target (docs/algorithm.md, "Training").

    python train.py --target DIR --data FILE_OR_DIR --out DIR [--steps N --block-size 7 --depth 5 ...]

What is notable here:
- Online capture: every batch runs the frozen target once (no grad), cache-free and causal
  (`Transformer.hidden` without positions), to get the context features of `target_layer_ids` and
  its final hidden states. The target's logits are computed only at the positions the blocks
  supervise (DeepSpec does the same), so no [B, T, V] tensor and no feature cache on disk.
- Packed blocks: `--anchors-per-seq` anchors per sequence, each a K-slot block [x_a, m, .., m]
  at positions a..a+K-1 (slot j predicts token a+j+1), all run at once by
  `drafter.Drafter.train_forward` (context rows as prepended K/V under `drafter.block_mask`), which
  equals the inference drafter block by block (tests/test_train.py checks this to 1e-4).
- Teacher-forced Markov inputs [x_a, labels[:-1]] through the drafter's own head modules'
  `step()`, and the confidence logits from the same features as inference (`Drafter.head_outputs`).
- Losses as DeepSpec's loss.py: per slot j the weight w_j = exp(-j/γ), zero for slots whose
  label runs past the sequence end; each term is a weighted mean Σ w·ℓ / Σ w over every
  supervised slot of the batch; L = 0.1·CE + 0.9·‖p_d − p_t‖_1 + 1.0·BCE(conf logit,
  c* = 1 − ½‖p_d − p_t‖_1, detached).
- AdamW (weight decay 0, as DeepSpec), linear warm-up over `--warmup-frac` of the steps from
  lr/W to lr, then cosine decay to `--min-lr-frac`·lr at the last step (or linear, or constant);
  gradient-norm clip 1.0. The embedding and lm_head are the target's, frozen.
- Checkpoints in DeepSpec's layout (config.json = target config copy + the drafter keys,
  model.safetensors with the head tensors under their module names and copies of the
  target's embed_tokens / lm_head), so `drafter.load_drafter` reads them like a published one.
- Resumable exactly: the batch order and the anchors of step s are pure functions of
  (--seed, s), so no RNG state needs saving; the optimizer moments go to
  training_state.safetensors and the step/arguments to training_state.json (no pickle).
  N steps straight and N/2 + resume N/2 give the same weights.
- The optimisation loop, its flags (`TrainArgs`), data reading and checkpoint state are shared
  with `scripts/train_target.py`, which pre-trains the demo's small target.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, fields
from typing import ClassVar, Literal, Optional

import torch
import torch.nn.functional as F

from common import (UserError, atomic_write, check_ranges, cli_main, parse_ints, read_json, read_jsonl,
                    resolve_device, resolve_dtype, write_json)
from drafter import MARKOV_TYPES, Drafter, DrafterConfig
from model import (ModelArgs, Tokenizer, Transformer, assign_strict, init_random_, load_target, read_safetensors,
                   safetensors_files, stop_token_ids)

STATE_TENSORS = "training_state.safetensors"
STATE_JSON = "training_state.json"
TEXT_SUFFIXES = (".txt", ".py", ".md", ".rst")
JSON_SUFFIXES = (".jsonl", ".json")
MASK_TOKEN = "<|mask|>"
EOS_TOKEN = "<|endoftext|>"


@dataclass
class TrainArgs:
    """What every training program here shares: data, output, the optimisation and how it runs."""

    data: Optional[str] = None
    """Training text: a .txt/.py/.md/.rst file, a directory of such files and .jsonl (recursive, sorted;
    non-UTF-8 files skipped), or JSON lines (.jsonl/.json) with "text" (a string) or "turns" (strings,
    joined by blank lines). Tokenized with the model's tokenizer; documents joined by <|endoftext|>."""
    data_ids: Optional[str] = None
    """Instead of --data: JSON lines of {"prompt_ids": [int]} (already tokenized)."""
    out: Optional[str] = None
    """Output directory: config.json + model.safetensors (+ the training state for --resume)."""
    resume: Optional[str] = None
    """Continue from the training state in this directory (a previous --out), at its saved step."""

    # Optimization
    steps: int = 1000
    """Optimizer steps in the whole run (the learning-rate schedule spans them)."""
    stop_at: Optional[int] = None
    """Stop after this step (checkpoint included) while the schedule still spans --steps; resume later."""
    batch_size: int = 4
    """Sequences per step."""
    seq_len: int = 1024
    """Tokens per sequence: the corpus is concatenated (documents separated by EOS) and cut into these."""
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
    """Initialization, batch order and anchors (step s's batch and anchors depend only on seed and s)."""
    init_std: float = 0.02
    """Std of the normal initialization of the trained matrices (norms 1, biases 0)."""

    # Running
    device: Optional[Literal["cpu", "cuda"]] = None
    """Default: cuda when available."""
    dtype: Optional[Literal["float32", "bfloat16"]] = None
    """Compute precision (autocast; weights and optimizer stay float32). Default: bfloat16 on cuda."""
    compile: bool = False
    """torch.compile the training forward + loss (static shapes: every batch has the same B, T, N)."""
    save_every: int = 0
    """Also write the checkpoint every this many steps (0: only at the end / --stop-at)."""
    log_every: int = 10
    """wandb logging period in steps."""
    progress: bool = True
    """tqdm progress bar on stderr."""
    wandb: bool = False
    """Log to Weights & Biases (WANDB_MODE=offline works without network)."""
    wandb_project: str = "dspark-fast"
    """Weights & Biases project of --wandb."""

    # What a resumed run must repeat: anything that changes the model, the data or the step function.
    # --steps may change (training longer): the rest of the schedule then stretches to the new end.
    resume_keys: ClassVar[tuple[str, ...]] = ("batch_size", "seq_len", "lr", "warmup_frac", "schedule", "min_lr_frac",
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
    anchors_per_seq: int = 128
    """Blocks packed per sequence (anchors sampled without replacement from 0..seq_len-2)."""
    gamma: float = 4.0
    """Slot weights exp(-j/gamma), j = 0..K-1."""
    alpha_ce: float = 0.1
    """Weight of the cross-entropy on the labels."""
    alpha_tv: float = 0.9
    """Weight of ‖p_draft − p_target‖_1."""
    alpha_conf: float = 1.0
    """Weight of the confidence BCE against 1 − ½‖p_draft − p_target‖_1."""

    resume_keys: ClassVar[tuple[str, ...]] = TrainArgs.resume_keys + (
        "block_size", "depth", "target_layer_ids", "mask_token_id", "markov", "markov_rank", "confidence",
        "confidence_with_markov", "anchors_per_seq", "gamma", "alpha_ce", "alpha_tv", "alpha_conf")
    kind: ClassVar[str] = "drafter"


# ----------------------------------------------------------------------------------------
# Data

def _read_text_file(path: str, texts: list, skipped: list):
    if path.endswith(JSON_SUFFIXES):
        texts.extend(_read_jsonl_texts(path))
        return
    try:
        with open(path, encoding="utf-8") as f:
            texts.append(f.read())
    except UnicodeDecodeError:
        skipped.append(path)


def _read_jsonl_texts(path: str) -> list[str]:
    out = []
    for where, obj in read_jsonl(path):
        if isinstance(obj, dict) and isinstance(obj.get("text"), str):
            out.append(obj["text"])
        elif (isinstance(obj, dict) and isinstance(obj.get("turns"), list) and obj["turns"]
              and all(isinstance(t, str) for t in obj["turns"])):
            out.append("\n\n".join(obj["turns"]))
        else:
            raise UserError(f"{where}: expected {{\"text\": str}} or {{\"turns\": [str]}}")
    return out


def read_texts(path: str) -> list[str]:
    """The documents of --data: one file, or every text file under a directory (sorted, recursive)."""
    if os.path.isfile(path):
        files = [path]
    elif os.path.isdir(path):
        # .json files in a tree are often data of other kinds (the stdlib's tests have some): only .jsonl there.
        files = sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs
                       if f.endswith(TEXT_SUFFIXES + (".jsonl",)))
        if not files:
            raise UserError(f"--data {path}: no {'/'.join(TEXT_SUFFIXES + ('.jsonl',))} files in the directory")
    else:
        raise UserError(f"--data {path}: file or directory not found")
    texts, skipped = [], []
    for f in files:
        _read_text_file(f, texts, skipped)
    if skipped:
        print(f"--data: skipped {len(skipped)} file(s) that are not UTF-8 (first: {skipped[0]})", file=sys.stderr)
    texts = [t for t in texts if t]
    if not texts:
        raise UserError(f"--data {path}: no text")
    return texts


def read_id_lists(path: str, vocab_size: int) -> list[list[int]]:
    """--data-ids: JSON lines of {"prompt_ids": [int]}, every id below vocab_size."""
    if not os.path.isfile(path):
        raise UserError(f"--data-ids {path}: file not found")
    out = []
    for where, obj in read_jsonl(path):
        ids = obj.get("prompt_ids") if isinstance(obj, dict) else None
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise UserError(f"{where}: expected {{\"prompt_ids\": [int, ...]}}")
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise UserError(f"{where}: token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
        out.append(ids)
    if not out:
        raise UserError(f"--data-ids {path}: no sequences")
    return out


def pack_windows(docs: list[list[int]], seq_len: int, separator: Optional[int], source: str) -> torch.Tensor:
    """Concatenate the documents (separator between them) and cut [N, seq_len] windows; the tail is dropped."""
    stream = []
    for d in docs:
        stream.extend(d)
        if separator is not None:
            stream.append(separator)
    n = len(stream) // seq_len
    if n == 0:
        raise UserError(f"{source}: {len(stream)} tokens, fewer than one sequence of --seq-len {seq_len}")
    return torch.tensor(stream[:n * seq_len], dtype=torch.long).view(n, seq_len)


def read_windows(args: TrainArgs, tok: Optional[Tokenizer], vocab_size: int, separator: Optional[int],
                 texts: Optional[list[str]] = None) -> torch.Tensor:
    """The [N, seq_len] training windows of --data (tokenized by `tok`, documents joined by `separator`;
    `texts`: --data already read) or of --data-ids (ids below vocab_size, joined as they are)."""
    if args.data is not None:
        texts = read_texts(args.data) if texts is None else texts
        docs = [e.ids for e in tok.tok.encode_batch(texts, add_special_tokens=False)]
        return pack_windows(docs, args.seq_len, separator, f"--data {args.data}")
    return pack_windows(read_id_lists(args.data_ids, vocab_size), args.seq_len, None, f"--data-ids {args.data_ids}")


def _seed_for(tag: str, *xs: int) -> int:
    """A 60-bit seed from a tag and integers, so (seed, step) streams are independent of each other."""
    return int(hashlib.sha256(":".join([tag, *map(str, xs)]).encode()).hexdigest()[:15], 16)


class Batches:
    """Step s's batch: rows s*B .. s*B+B-1 of an endless stream of shuffled epochs over the windows."""

    def __init__(self, windows: torch.Tensor, batch_size: int, seed: int):
        self.windows, self.B, self.seed = windows, batch_size, seed
        self._perms = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(_seed_for("epoch", self.seed, epoch))
            self._perms = {epoch: torch.randperm(len(self.windows), generator=g)}  # keep one epoch
        return self._perms[epoch]

    def __call__(self, step: int) -> torch.Tensor:
        N = len(self.windows)
        rows = [self._perm(k // N)[k % N] for k in range(step * self.B, (step + 1) * self.B)]
        return self.windows[torch.stack(rows)]


# ----------------------------------------------------------------------------------------
# Losses (the drafter's packed forward and heads are drafter.py's: train_forward, head_outputs)

def sample_anchors(batch: int, seq_len: int, n: int, generator: torch.Generator) -> torch.Tensor:
    """[batch, n] sorted anchor positions, drawn without replacement from 0..seq_len-2 (the first label is in the sequence)."""
    keys = torch.rand(batch, seq_len - 1, generator=generator)
    return keys.argsort(dim=1)[:, :n].sort(dim=1).values


def slot_weights(K: int, gamma: float, device=None) -> torch.Tensor:
    """w_j = exp(-j/γ), j = 0..K-1 (docs/algorithm.md, "Training": earlier slots count more under prefix acceptance)."""
    return torch.exp(-torch.arange(K, device=device, dtype=torch.float32) / gamma)


def distill_losses(draft_logits, target_logits, labels, valid, conf_logits, gamma: float) -> dict:
    """The three terms of docs/algorithm.md's "Training", each a weighted mean over the supervised slots.

    draft_logits, target_logits [..., K, V]; labels, valid [..., K]; conf_logits [..., K] or None.
    With w = exp(-j/γ)·valid: term = Σ w·ℓ / Σ w over the whole batch (DeepSpec's normalization),
    where ℓ is -log p_d(label) (ce), ‖p_d − p_t‖_1 (tv), and BCE(σ(conf), c*) with the soft label
    c* = 1 − ½‖p_d − p_t‖_1, detached (conf). Also returns `accept` = c* (detached) for logging.
    """
    K = draft_logits.shape[-2]
    w = slot_weights(K, gamma, draft_logits.device) * valid.float()
    den = w.sum().clamp_min(1e-12)  # no supervised slot: every term is 0
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


def drafter_loss(drafter: Drafter, target: Transformer, tokens: torch.Tensor, anchors: torch.Tensor, args: Args):
    """One batch: online capture, packed forward, heads, losses. Returns (loss, terms, valid)."""
    K = drafter.cfg.num_slots
    B, T = tokens.shape
    with torch.no_grad():
        hidden_t, features = target.hidden(tokens, capture=drafter.cfg.target_layer_ids)  # cache-free, causal
    h = drafter.train_forward(features, tokens, anchors)  # [B, N, K, H]
    slot_pos = anchors[:, :, None] + torch.arange(K, device=tokens.device)  # slot j sits at a+j, predicts a+j+1
    valid = slot_pos + 1 < T  # labels past the sequence end are not supervised
    labels = tokens.gather(1, (slot_pos + 1).clamp(max=T - 1).view(B, -1)).view_as(slot_pos)
    prev = torch.cat([tokens.gather(1, anchors)[:, :, None], labels[:, :, :-1]], dim=-1)  # teacher-forced
    with torch.no_grad():  # the target's distribution for the same token, only where it is needed
        idx = slot_pos.clamp(max=T - 1).view(B, -1, 1).expand(-1, -1, hidden_t.shape[-1])
        target_logits = target.lm_head(hidden_t.gather(1, idx)).view(B, anchors.shape[1], K, -1)
    z, conf = drafter.head_outputs(h, prev)
    terms = distill_losses(z, target_logits, labels, valid, conf, args.gamma)
    return total_loss(terms, args), terms, valid


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

def save_tensors(path: str, tensors: dict):
    """A safetensors file, written whole or not at all (a crash mid-write leaves the previous one)."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    atomic_write(path, lambda p: save_file(tensors, p, metadata={"format": "pt"}))


def _raw_tensor(directory: str, names: tuple) -> Optional[torch.Tensor]:
    """The first of `names` in a checkpoint directory's files, in the file's own dtype."""
    from safetensors import safe_open

    for path in safetensors_files(directory):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in names:
                if name in f.keys():
                    return f.get_tensor(name)
    return None


def drafter_config_json(target_dir: str, cfg: DrafterConfig, num_anchors: int) -> dict:
    """DeepSpec's drafter config.json: the target's config with the drafter's depth and keys."""
    tcfg = read_json(os.path.join(target_dir, "config.json"))
    out = {k: v for k, v in tcfg.items() if k not in ("architectures", "auto_map", "dtype", "torch_dtype")}
    D = cfg.layers.num_hidden_layers
    out.update(architectures=["Qwen3DSparkModel"], num_target_layers=tcfg["num_hidden_layers"], num_hidden_layers=D,
               layer_types=["full_attention"] * D, tie_word_embeddings=False, torch_dtype="float32",
               block_size=cfg.block_size, target_layer_ids=list(cfg.target_layer_ids), mask_token_id=cfg.mask_token_id,
               num_anchors=num_anchors, markov_rank=cfg.markov_rank, markov_head_type=cfg.markov_head_type,
               enable_confidence_head=cfg.confidence_head,
               confidence_head_with_markov=cfg.confidence_with_markov)
    return out


def save_drafter(out: str, drafter: Drafter, target_dir: str, num_anchors: int):
    """config.json + model.safetensors in DeepSpec's layout, with copies of the target's embedding and lm_head
    (in the target file's dtype, so `load_drafter`'s equality check holds at any load dtype)."""
    os.makedirs(out, exist_ok=True)
    tensors = {k: v.float() for k, v in drafter.state_dict().items()}
    emb = _raw_tensor(target_dir, ("model.embed_tokens.weight", "embed_tokens.weight"))
    head = _raw_tensor(target_dir, ("lm_head.weight", "model.lm_head.weight"))
    tensors["embed_tokens.weight"] = emb
    tensors["lm_head.weight"] = head if head is not None else emb.clone()  # tied target
    save_tensors(os.path.join(out, "model.safetensors"), tensors)
    write_json(os.path.join(out, "config.json"), drafter_config_json(target_dir, drafter.cfg, num_anchors))


def save_state(out: str, step: int, module: torch.nn.Module, opt: torch.optim.Optimizer, args: TrainArgs,
               num_windows: int):
    """The optimizer's moments by parameter name (safetensors) and the step and arguments (JSON)."""
    names = {id(p): n for n, p in module.named_parameters()}
    tensors = {}
    for p, st in opt.state.items():
        for key, val in st.items():
            tensors[f"{key}.{names[id(p)]}"] = val if torch.is_tensor(val) else torch.tensor(val)
    save_tensors(os.path.join(out, STATE_TENSORS), tensors)
    write_json(os.path.join(out, STATE_JSON), {
        "step": step, "num_windows": num_windows, "kind": args.kind, "args": asdict(args),
        "note": "batch order and anchors of step s depend only on (seed, s): no RNG state to restore"})


def check_resume_args(directory: str, args: TrainArgs) -> dict:
    """training_state.json of `directory`, after checking that `args` repeats the flags of the saved run
    (`args.resume_keys`) and that it trained the same kind of model."""
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
    return meta


def load_state(directory: str, module: torch.nn.Module, opt: torch.optim.Optimizer, args: TrainArgs,
               num_windows: int) -> int:
    """Restore the optimizer state saved by `save_state`; returns the step to continue from."""
    meta = check_resume_args(directory, args)
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
        mid = tok.token_to_id(MASK_TOKEN)
        if mid is not None and mid < V:
            return mid
        n = tok.get_vocab_size(with_added_tokens=True)
        if n < V:
            return n
    return V - 1


def build_drafter(args: Args, target: Transformer, target_dir: str, device) -> Drafter:
    t = target.args
    ids = (parse_ints(args.target_layer_ids, "--target-layer-ids") if args.target_layer_ids
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


def load_drafter_weights(drafter: Drafter, directory: str, target_dir: str, num_anchors: int):
    """--resume: the drafter's float32 weights from a previous run's model.safetensors (same config)."""
    cfg_path = os.path.join(directory, "config.json")
    saved, now = read_json(cfg_path), drafter_config_json(target_dir, drafter.cfg, num_anchors)
    for k in ("block_size", "num_hidden_layers", "target_layer_ids", "mask_token_id", "markov_head_type",
              "markov_rank", "enable_confidence_head", "confidence_head_with_markov", "hidden_size", "vocab_size"):
        if saved.get(k) != now[k]:
            raise UserError(f"{cfg_path}: {k} is {saved.get(k)!r}, the flags give {now[k]!r}")
    files = safetensors_files(directory)
    tensors = read_safetensors(files, torch.float32, drafter.fc.weight.device)
    tensors.pop("embed_tokens.weight", None)
    tensors.pop("lm_head.weight", None)
    params = dict(drafter.named_parameters())
    with torch.device("meta"):
        probe = Drafter(drafter.cfg)
    assign_strict(probe, tensors, files[0])  # names and shapes, one line for the first misfit
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(tensors[name])


# ----------------------------------------------------------------------------------------
# The training loop (shared with scripts/train_target.py)

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
    if os.path.isdir(real) and os.listdir(real) and not resuming_here:
        raise UserError(f"--out {out}: already holds files (a previous run's?); give a new directory, or continue "
                        f"that run with --resume {out}")
    parent = os.path.dirname(real)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise UserError(f"--out {out}: its parent directory {parent} does not exist or is not writable")


def check_train_args(args: TrainArgs, **ranges: str):
    """The shared flags' ranges (and `ranges`, a program's own), --out, one data source, and the saved
    state of --resume. One-line UserErrors."""
    check_ranges(args, steps="[1, 100000000]", batch_size="[1, 1000000]", seq_len="[2, 10485760]", lr="(0, 10]",
                 warmup_frac="[0, 1)", min_lr_frac="[0, 1]", grad_clip="[0, 1e9]", weight_decay="[0, 10]",
                 init_std="(0, 10]", seed=f"[0, {2**62}]", **ranges,
                 log_every="[1, inf)", save_every="[0, inf)", stop_at=f"[1, {args.steps}]")
    if (args.data is None) == (args.data_ids is None):
        raise UserError("give exactly one of --data, --data-ids")
    data = args.data if args.data is not None else args.data_ids
    if not os.path.exists(data):
        raise UserError(f"--data{'' if args.data is not None else '-ids'} {data}: file or directory not found")
    check_out_dir(args, inputs=[data, getattr(args, "target", None), getattr(args, "tokenizer", None)])
    if args.resume:
        if not os.path.isfile(os.path.join(args.resume, STATE_JSON)):
            raise UserError(f"--resume {args.resume}: no {STATE_JSON} there")
        check_resume_args(args.resume, args)


def _autocast(device: str, dtype: torch.dtype):
    """Mixed precision for the forward: weights and AdamW state stay float32 (master weights)."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device, dtype=dtype)


def optimize(args: TrainArgs, module: torch.nn.Module, loss_fn, windows: torch.Tensor, device: str,
             dtype: torch.dtype, save) -> dict:
    """AdamW steps over `windows` [N, seq_len] from the resumed step to --stop-at / --steps;
    `loss_fn(tokens, step)` -> (loss, metrics), `save(step, optimizer)` writes a checkpoint."""
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    start = load_state(args.resume, module, opt, args, len(windows)) if args.resume else 0
    batches = Batches(windows, args.batch_size, args.seed)
    end = args.stop_at or args.steps
    if start >= end:
        raise UserError(f"--resume {args.resume}: already at step {start}, nothing to do up to step {end}")
    run = None
    if args.wandb:
        import wandb
        run = wandb.init(project=args.wandb_project, config=asdict(args))
    from tqdm import tqdm

    bar = tqdm(total=end, initial=start, file=sys.stderr, disable=not args.progress, dynamic_ncols=True)
    losses, t0 = [], time.time()
    module.train()
    for step in range(start, end):
        lr = lr_at(step, args)
        for g in opt.param_groups:
            g["lr"] = lr
        tokens = batches(step).to(device)
        with _autocast(device, dtype):
            loss, metrics = loss_fn(tokens, step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip if args.grad_clip > 0 else float("inf"))
        opt.step()
        losses.append(loss.item())
        bar.update(1)
        bar.set_postfix(loss=f"{losses[-1]:.4f}", **{k: f"{v:.3f}" for k, v in metrics.items() if k in ("tau", "ppl")})
        if run is not None and ((step + 1) % args.log_every == 0 or step + 1 == end):
            run.log({"loss": losses[-1], "lr": lr, "grad_norm": float(gnorm), **metrics}, step=step + 1)
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 != end:
            save(step + 1, opt)
    bar.close()
    module.eval()
    save(end, opt)
    if run is not None:
        run.finish()
    seconds, n = time.time() - t0, end - start
    tokens_per_s = n * args.batch_size * args.seq_len / max(seconds, 1e-9)
    print(f"step {end}: loss {losses[-1]:.4f}, {n} steps in {seconds:.1f} s ({tokens_per_s:,.0f} tokens/s), "
          f"{args.kind} written to {args.out}")
    return {"start": start, "step": end, "losses": losses, "seconds": seconds}


def _metrics(terms: dict, valid: torch.Tensor) -> dict:
    """Logged numbers (host floats): the loss terms, acceptance per slot and the expected τ (DeepSpec's
    tau_probabilistic: 1 + Σ_k Π_{i≤k} c*_i per block)."""
    with torch.no_grad():
        acc, v = terms["accept"], valid.float()
        per_slot = (acc * v).sum((0, 1)) / v.sum((0, 1)).clamp_min(1)
        tau = ((acc * v).cumprod(-1).sum(-1) + 1).mean()
    out = {k: float(terms[k].detach()) for k in ("ce", "tv", "conf") if k in terms}
    out["tau"] = float(tau)
    out.update({f"accept@{j}": float(x) for j, x in enumerate(per_slot)})
    return out


# ----------------------------------------------------------------------------------------
# Drafter distillation

def train_drafter(args: Args) -> dict:
    if args.target is None:
        raise UserError("--target: no target directory given")
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    target = load_target(args.target, device, dtype if device == "cuda" else torch.float32)
    V = target.args.vocab_size
    tok, sep = None, None
    if args.data is not None:
        if not os.path.isfile(os.path.join(args.target, "tokenizer.json")):
            raise UserError(f"--data needs the target's tokenizer.json ({args.target}); or give --data-ids")
        tok = Tokenizer(args.target)
        sep = tok.tok.token_to_id(EOS_TOKEN)
        stops = stop_token_ids(args.target, target.args)
        sep = sep if sep is not None else (stops[0] if stops else None)
    windows = read_windows(args, tok, V, sep)
    drafter = build_drafter(args, target, args.target, device)
    if args.resume:
        load_drafter_weights(drafter, args.resume, args.target, args.anchors_per_seq)
    N = min(args.anchors_per_seq, args.seq_len - 1)
    print(drafter.cfg.describe() + f" | {sum(p.numel() for p in drafter.parameters()):,} trained parameters | "
          f"{len(windows)} sequences of {args.seq_len} tokens, {N} anchors each", file=sys.stderr)

    core = torch.compile(drafter_loss, dynamic=False) if args.compile else drafter_loss

    def loss_fn(tokens, step):
        g = torch.Generator().manual_seed(_seed_for("anchors", args.seed, step))
        anchors = sample_anchors(tokens.shape[0], args.seq_len, N, g).to(tokens.device)
        loss, terms, valid = core(drafter, target, tokens, anchors, args)
        return loss, _metrics(terms, valid)

    def save(step, opt):
        save_drafter(args.out, drafter, args.target, args.anchors_per_seq)
        save_state(args.out, step, drafter, opt, args, len(windows))

    return optimize(args, drafter, loss_fn, windows, device, dtype, save)


def run(args: Args) -> dict:
    """Everything `python train.py` does; returns the loss history. Raises UserError on bad input."""
    check_train_args(args, block_size="[1, 256]", depth="[1, 1024]", markov_rank="[1, 65536]",
                     anchors_per_seq="[1, 1000000]", gamma="(0, 1e6]", alpha_ce="[0, 1e6]", alpha_tv="[0, 1e6]",
                     alpha_conf="[0, 1e6]")
    return train_drafter(args)


def main(argv: Optional[list[str]] = None) -> int:
    return cli_main(Args, run, argv, inference=False)


if __name__ == "__main__":
    sys.exit(main())
