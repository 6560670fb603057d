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
- Checkpoints in DeepSpec's layout (`drafter.save_drafter`), loaded like a published one; --eval-every runs
  eval.py on a checkpoint; the MFU estimate counts `step_flops`. The training state records digests of the
  training rows and of the target's files (`data_digest`, `target_digest`): --resume refuses other ones.
- The loop — AdamW and its schedule, torchrun, crash-safe checkpoints, exact resume, progress — and its
  shared flags (`TrainArgs`) are trainer.py's, shared with `scripts/train_target.py` (the demo's target).
"""

from __future__ import annotations

import hashlib
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields, replace
from typing import ClassVar, Literal, Optional

import torch
import torch.nn.functional as F

import data
import runlog
from common import (UserError, check_ranges, device_name, dist_init, parse_ints, resolve_device, resolve_dtype,
                    torchrun_env)
from drafter import MARKOV_TYPES, Drafter, DrafterConfig, drafter_config_json, load_drafter_weights, save_drafter
from inputs import resolve_checkpoint
from model import ModelArgs, Transformer, init_random_, load_target, safetensors_files
from text import Tokenizer
from trainer import (Run, TrainArgs, check_identity, check_out_dir, check_train_args, checkpoint_dir, optimize,
                     save_state, train_main)


@dataclass
class Args(TrainArgs):
    """Distil a DSpark / DFlash drafter from a frozen target (docs/algorithm.md, "Training")."""

    target: Optional[str] = None
    """Hugging Face Qwen3 directory of the frozen target, or a hub id ORG/NAME[@REVISION] taken from the
    Hugging Face cache or downloaded into it (HF_HUB_OFFLINE=1: the cache only)."""

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
    such positions fills the rest with unsupervised blocks). Per row: with packing, shared by the row's
    conversations (see --pack)."""
    pack: bool = True
    """Chat data: pack several conversations into each --seq-len row (best fit). --no-pack: one a row, as
    DeepSpec trains — the anchor budget is then per conversation (the authors' density of blocks), at the
    cost of the rows' padding."""
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
        "confidence_with_markov", "anchors_per_seq", "pack", "gamma", "alpha_ce", "alpha_tv", "alpha_conf")
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


# ----------------------------------------------------------------------------------------
# What a run reads, by digest (the training state records them; --resume compares)

DIGEST_CHUNK = 64 << 20  # bytes hashed by one thread at a time


def data_digest(corpus: data.Corpus) -> str:
    """sha256 of the training rows, in order: their token ids (and for chat data the loss mask and each
    token's document) as stored, with their shapes and dtypes — over 64 MiB chunks hashed in parallel
    threads (hashlib lets go of the GIL), then over the chunks' digests: a corpus of 1.5G tokens costs
    about a second a core rather than its 6 GB at one core's 1-2 GB/s."""
    chunks, head = [], hashlib.sha256()
    for name, t in (("tokens", corpus.tokens), ("loss_mask", corpus.loss_mask), ("doc", corpus.doc)):
        if t is not None:
            head.update(f"{name} {list(t.shape)} {t.dtype}\n".encode())
            raw = memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")  # the bytes, no copy
            chunks += [raw[i:i + DIGEST_CHUNK] for i in range(0, len(raw), DIGEST_CHUNK)]
    with ThreadPoolExecutor(min(32, os.cpu_count() or 1)) as pool:
        digests = list(pool.map(lambda c: hashlib.sha256(c).digest(), chunks))
    for d in digests:
        head.update(d)
    return head.hexdigest()


def target_digest(directory: str) -> str:
    """sha256 over the target's config.json and weight files (each file's name and the sha256 of its
    bytes): exact, where names, sizes and dates would not be. It costs one more read of every weight
    file (from the page cache: load_target has just read them) and its hashing, the files in parallel
    threads; sha256 runs at 1.2-2 GB/s a core, so an 8B bf16 target (16 GB in 5 shards) takes a few
    seconds at each start of a run (every process under torchrun), a tiny one nothing."""
    files = [os.path.join(directory, "config.json"), *safetensors_files(directory)]

    def one(path):
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()

    with ThreadPoolExecutor(min(8, len(files))) as pool:
        digests = list(pool.map(one, files))
    return hashlib.sha256("".join(f"{os.path.basename(p)} {d}\n" for p, d in zip(files, digests)).encode()).hexdigest()


# ----------------------------------------------------------------------------------------
# The training loop (shared with scripts/train_target.py)

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


def train_drafter(args: Args, log: Optional[runlog.Log] = None) -> dict:
    if args.target is None:
        raise UserError("--target: no target directory given")
    rank, world, device = dist_init(resolve_device(args.device), args.dist_timeout)
    run = Run(rank, world, device, log)
    say = (lambda msg: print(msg, file=sys.stderr)) if rank == 0 else (lambda msg: None)  # noqa: E731
    dtype = resolve_dtype(args.dtype, device)
    target = load_target(args.target, device, dtype if device.startswith("cuda") else torch.float32)
    corpus = data.load_corpus(args, target.args, say)
    identity = {"target": target_digest(args.target), "data": data_digest(corpus)}
    if args.resume:  # the same target and data as the run resumed, or one line naming which differs
        source = f"--data {args.data}" if args.data is not None else f"--data-ids {args.data_ids}"
        check_identity(checkpoint_dir(args.resume), identity, {"target": f"--target {args.target}", "data": source})
    drafter = build_drafter(args, target, args.target, device)
    if args.resume:
        load_drafter_weights(drafter, checkpoint_dir(args.resume), args.target, args.anchors_per_seq)
    T, K, G = args.seq_len, drafter.cfg.num_slots, args.batch_size * args.grad_accum * world
    N = min(args.anchors_per_seq, T - 1)
    banner = (drafter.cfg.describe() + f" | {sum(p.numel() for p in drafter.parameters()):,} trained parameters | "
              f"{len(corpus)} sequences of {T} tokens, {N} anchors each | global batch {G} = {args.batch_size} x "
              f"{args.grad_accum} x {world} process(es)")
    if log is not None:  # what the flags resolved to, and what is trained
        log.config(world_size=world, global_batch=G, hardware=device_name(device),
                   dtype_resolved=str(dtype).removeprefix("torch."), num_sequences=len(corpus), anchors_resolved=N,
                   trained_parameters=sum(p.numel() for p in drafter.parameters()),
                   step_flops=step_flops(target.args, drafter.cfg, G, T, N),
                   target_config=runlog.checkpoint_config(args.target),
                   drafter_config=drafter_config_json(args.target, drafter.cfg, args.anchors_per_seq),
                   drafter_resolved=drafter.cfg.describe())
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

    def save(directory, step, opt):
        save_drafter(directory, drafter, args.target, args.anchors_per_seq, step=step)
        save_state(directory, step, drafter, opt, args, len(corpus), world, identity)

    evaluate = (lambda step: evaluate_checkpoint(args, step, device)) if args.eval_every else None
    return optimize(args, DraftStep(drafter, target, args), micro_batches,
                    lambda sums: summarize_drafter(sums, K, drafter.cfg.confidence_head), save, run, dtype,
                    len(corpus), step_flops(target.args, drafter.cfg, G, T, N), evaluate, banner)


def check_eval_args(args: Args):
    """--eval-every's flags, and its benchmark files, before any training."""
    check_ranges(args, eval_every="[0, inf)", eval_samples="[1, inf)", eval_max_new_tokens="[1, inf)")
    if args.eval_data_dir is not None and not args.eval_data_dir.strip():  # not eval.py's folder in its place
        raise UserError("--eval-data-dir: empty path (leave the flag out for eval.py's data/eval)")
    if args.eval_every:
        import eval as evaluation
        folder = args.eval_data_dir or evaluation.DATA_DIR
        names = [n for n in args.eval_datasets.split(",") if n.strip()]
        missing = [n for n in names if not os.path.isfile(os.path.join(folder, f"{n.strip()}.jsonl"))]
        if not names or missing:
            raise UserError(f"--eval-datasets: no {(missing or ['<name>'])[0]}.jsonl in {folder}")


def check_unused_flags(args: Args):
    """A flag whose feature is off would train the very same drafter (a sweep over it compares identical
    runs): refused, as --log-every without --wandb is. Given = different from its default."""
    off = ((("markov_rank",), args.markov == "none", "--markov none"),
           (("alpha_conf",), not args.confidence, "--no-confidence"),
           (("min_lr_frac",), args.schedule == "constant", "--schedule constant"),
           (("eval_datasets", "eval_data_dir", "eval_samples", "eval_max_new_tokens"), not args.eval_every,
            "no --eval-every"))
    default = {f.name: f.default for f in fields(Args)}
    for names, is_off, why in off:
        given = [n for n in names if is_off and getattr(args, n) != default[n]]
        if given:
            raise UserError(f"--{given[0].replace('_', '-')} {getattr(args, given[0])}: changes nothing with {why}")


def evaluate_checkpoint(args: Args, step: int, device: str) -> dict:
    """eval.py on the checkpoint just written (every rank decodes a shard), results in --out/eval_step<N>.json;
    returns what the training run logs at that step (--wandb): each dataset's figures and acceptance by
    position under eval/<dataset>/, the confidence head's ECE and Brier by position under eval/calibration/."""
    import eval as evaluation

    e = evaluation.EvalArgs(target=args.target, drafter=args.out, datasets=args.eval_datasets, step=step,
                            data_dir=args.eval_data_dir or evaluation.DATA_DIR, max_samples=args.eval_samples,
                            max_new_tokens=args.eval_max_new_tokens, device="cuda" if device.startswith("cuda") else "cpu",
                            compile=False, progress=False, out=os.path.join(args.out, f"eval_step{step}.json"))
    with torch.inference_mode():
        results = evaluation.run(e)
    found = {}
    for r in results["datasets"]:
        found.update({f"eval/{r['dataset']}/{k}": r[k] for k in ("acceptance_length", "draft_tokens_per_proposal",
                                                                 "verify_rate", "tokens_per_second") if r[k] is not None})
        found.update({f"eval/{r['dataset']}/accept_rate@{j}": a for j, a in enumerate(r["accept_rates_by_position"])
                      if a is not None})
    for m in (results["calibration"] or {}).get("raw", []):
        found.update({f"eval/calibration/{k}_{m['position']}": m[k] for k in ("ece", "brier") if m[k] is not None})
    return found


def run(args: Args) -> dict:
    """Everything `python train.py` does; returns the loss history. Raises UserError on bad input."""
    check_train_args(args, block_size="[1, 256]", depth="[1, 1024]", markov_rank="[1, 65536]",
                     anchors_per_seq="[1, 1000000]", gamma="(0, 1e6]", alpha_ce="[0, 1e6]", alpha_tv="[0, 1e6]",
                     alpha_conf="[0, 1e6]")
    check_eval_args(args)
    check_unused_flags(args)
    if args.target is not None:  # a hub id becomes its snapshot directory (--out is checked against that too)
        args = replace(args, target=resolve_checkpoint(args.target, "--target"))
        check_out_dir(args, inputs=[args.target])
    with runlog.session(args, "train", "train.py", enabled=torchrun_env()[0] == 0) as log:  # --wandb: rank 0's run
        return train_drafter(args, log)


def main(argv: Optional[list[str]] = None) -> int:
    return train_main(Args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
