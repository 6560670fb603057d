"""Distil a DSpark / DFlash drafter from a frozen target (docs/algorithm.md, "Training"), or train the
paper's Eagle3 baseline as DeepSpec does (docs/training.md, "Eagle3").

    python train.py --target DIR --data FILE_OR_DIR --out DIR [--steps N --block-size 7 --depth 5 ...]
    python train.py --drafter-kind eagle3 --target DIR --data FILE_OR_DIR --out DIR [--ttt-length 7 ...]
    torchrun --nproc_per_node 8 train.py ... --batch-size 1 --grad-accum 64   # global batch 512

The target runs once a batch, no grad, for the features and its logits at the drafter's slots;
the drafter runs all of a row's blocks at once (Eagle3: every position of a row, one unrolled step after
another). Each loss term is normalised by the step's global batch, so any split over processes gives the
same step. The demo target's drafter, at demo scale on a CPU (docs/training.md has its time):

    python train.py --target demo/target --data "$(python -c 'import logging; print(logging.__path__[0])')" \
        --out /tmp/demo-drafter --steps 120 --seq-len 128 --batch-size 8 --anchors-per-seq 32 --block-size 4 \
        --depth 1 --markov-rank 64 --lr 5e-3 --device cpu
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, fields, replace
from functools import partial
from types import SimpleNamespace
from typing import ClassVar, Literal, Optional

import torch
import torch.nn.functional as F

from drafter import MARKOV_HEADS, Drafter, DrafterConfig, Eagle3Drafter
from model import ModelArgs, Rope, Transformer, rope_table
from support import data, runlog
from support.checkpoint import (
    attach,
    check_target_memory,
    init_random_,
    load_drafter,
    load_target,
    published,
    read_target_args,
    resolve_checkpoint,
    weight_files,
)
from support.cli import (
    MAX_BLOCK,
    AutoBool,
    UserError,
    check_ranges,
    device_name,
    dtype_name,
    from_flat,
    parse_ints,
    resolve_device,
    resolve_dtype,
)
from support.configs import config_json, eagle3_config_json
from support.distributed import dist_init, from_rank0, rank0
from support.eval_report import dataset_figures
from support.files import directory_problem, files_digest, write_json
from support.text import Tokenizer, auto_chat
from support.trainer import (
    Run,
    TrainArgs,
    causal_flops,
    check_identity,
    check_out_dir,
    check_resume_progress,
    check_train_args,
    checkpoint_dir,
    layer_params,
    optimize,
    out_held,
    read_state,
    refuse_unused,
    resumed_wandb_run,
    save_state,
    save_tensors,
    train_main,
)


@dataclass
class Args(TrainArgs):
    """Distil a DSpark / DFlash drafter from a frozen target (docs/algorithm.md, "Training"), or train an
    Eagle3 drafter as DeepSpec does (--drafter-kind eagle3; docs/training.md, "Eagle3")."""

    target: Optional[str] = None
    """The frozen target: a Hugging Face Qwen3 directory, or a hub id ORG/NAME[@REVISION]."""
    drafter_kind: Literal["dspark", "eagle3"] = "dspark"
    """dspark: a DSpark / DFlash block drafter, distilled; eagle3: the paper's autoregressive baseline, one
    layer trained with DeepSpec's training-time-test loss (the DSpark-only flags then do not apply)."""
    ttt_length: int = 7
    """Eagle3: steps unrolled in training (training-time test), saved as the drafts a round proposes."""
    step_loss_decay: float = 0.8
    """Eagle3: step j's loss weighs step_loss_decay^j."""
    block_size: int = 7
    """DSpark: K, slots per block = drafts per round (DSpark "shift label" layout)."""
    depth: int = 5
    """DSpark: drafter decoder layers (Eagle3 has one)."""
    target_layer_ids: Optional[str] = None
    """Comma-separated target layers of the context feature (default: DeepSpec's, 1,9,17,25,33 at 36)."""
    mask_token_id: Optional[int] = None
    """DSpark: fills the slots after the anchor (default: <|mask|>, else the first id past the tokenizer's,
    else the vocabulary's last)."""
    markov: Literal[(*MARKOV_HEADS, "none")] = "vanilla"
    """DSpark: Markov head (drafter.MARKOV_HEADS); none = no sequential stage. A DFlash drafter as DeepSpec's
    dflash configs train it: --markov none --no-confidence --alpha-ce 1 --alpha-tv 0 (cross-entropy only)."""
    markov_rank: int = 256
    """DSpark: r of the Markov head (W1: [V, r], W2: r -> V)."""
    confidence: bool = True
    """DSpark: train a confidence head."""
    confidence_with_markov: AutoBool = None
    """DSpark: the confidence head also reads W1[x_{k-1}] (needs a Markov head). None (left out): on
    with a Markov head, off with --markov none."""
    anchors_per_seq: int = 512
    """DSpark: blocks per sequence (DeepSpec: 512), at most --seq-len - 1 (the default: cut to it; chat
    data: anchors in a response)."""
    pack: bool = True
    """Chat data: pack conversations into rows (best fit); --no-pack: one a row, as DeepSpec trains."""
    gamma: float = 4.0
    """DSpark: slot weights exp(-j/gamma), j = 0..K-1."""
    alpha_ce: float = 0.1
    """DSpark: weight of the cross-entropy on the labels."""
    alpha_tv: float = 0.9
    """DSpark: weight of ‖p_draft − p_target‖_1."""
    alpha_conf: float = 1.0
    """DSpark: weight of the confidence BCE against 1 − ½‖p_draft − p_target‖_1."""
    eval_every: int = 0
    """Every this many steps checkpoint and run eval.py on it (T = 1; --out/eval_step<N>.json); 0: never."""
    eval_datasets: str = "mt-bench,gsm8k"
    """Comma-separated benchmarks of --eval-every (<name>.jsonl in --eval-data-dir)."""
    eval_data_dir: Optional[str] = None
    """Directory of the --eval-every benchmarks (default: eval.py's data/eval)."""
    eval_samples: int = 8
    """Prompts per dataset of --eval-every (the authors' seeded subset)."""
    eval_max_new_tokens: int = 256
    """Token budget per prompt of --eval-every."""

    # (target_layer_ids and mask_token_id, resolved from the target when left out, are compared as resolved:
    # the checkpoint's drafter config against the flags', `resumed_drafter`)
    resume_keys: ClassVar[tuple[str, ...]] = (
        "drafter_kind",
        *TrainArgs.resume_keys,
        "block_size", "depth", "markov", "markov_rank", "confidence",
        "confidence_with_markov", "anchors_per_seq", "pack", "gamma", "alpha_ce", "alpha_tv", "alpha_conf",
        "ttt_length", "step_loss_decay",
    )
    required: ClassVar[tuple[str, ...]] = ("target",)
    kind: ClassVar[str] = "drafter"


# The drafter in training: every block of a row at once, teacher-forced

def block_mask(anchors, seq_len: int, K: int, doc=None) -> torch.Tensor:
    """[B, N*K, seq_len + N*K], True = may attend: block i sees context p < anchors[:, i] (in its
    document, with `doc`) and its own rows."""
    B, N = anchors.shape
    block_of = torch.arange(N * K, device=anchors.device) // K
    anchor_of = anchors[:, block_of]  # [B, N*K]
    positions = torch.arange(seq_len, device=anchors.device)
    context = positions[None, None, :] < anchor_of[:, :, None]
    if doc is not None:
        anchor_doc = doc.gather(1, anchor_of)
        context = context & (doc[:, None, :] == anchor_doc[:, :, None])
    same_block = block_of[:, None] == block_of[None, :]
    own = same_block.expand(B, N * K, N * K)
    return torch.cat([context, own], dim=-1)


def block_forward(drafter: Drafter, features, tokens, anchors, doc=None):
    """features [B, T, n*H], tokens [B, T], anchors [B, N] -> hidden [B, N, K, H]: every block
    [x_a, m, .., m] in one batch under `block_mask`, the context's K/V computed, not cached."""
    cfg = drafter.cfg
    a = cfg.layers
    K = cfg.block_size
    B, T = tokens.shape
    N = anchors.shape[1]
    dev = tokens.device
    dtype = drafter.fc.weight.dtype
    table = rope_table(a.head_dim, a.rope_theta, T + K, dev)
    # the context at 0..T-1; block slot j at its anchor + j
    ctx_table = table[:T][None].expand(B, T, 2, a.head_dim)
    rope_ctx = Rope.at(ctx_table, dtype)
    slot_pos = anchors[:, :, None] + torch.arange(K, device=dev)
    rope_blk = Rope.at(table[slot_pos.view(B, N * K)], dtype)
    block = torch.full((B, N, K), cfg.mask_token_id, dtype=torch.long, device=dev)
    block[:, :, 0] = tokens.gather(1, anchors)
    x = drafter.target.embed_tokens(block.view(B, N * K))
    context = drafter.context(features)  # [B, T, H] what every block attends to
    mask = block_mask(anchors, T, K, doc)
    for layer in drafter.layers:
        context_kv = layer.self_attn.kv(context, rope_ctx)
        x = layer(x, rope_blk, mask=mask, prefix_kv=context_kv)
    return drafter.norm(x).view(B, N, K, -1)


def head_outputs(drafter: Drafter, h, prev):
    """z = U + b teacher-forced (prev [..., K] = [x_a, labels[:-1]]) and the confidence logits."""
    U = drafter.target.lm_head(h)  # [..., K, V] the block's own logits
    z = U
    if drafter.markov_head is not None:
        # b_j, s_j = step(h_j, prev_j, s_{j-1}): the chain of decoding, on the labels instead of draws,
        # on rows as decoding calls it: h [rows, H], prev [rows]
        K, H = h.shape[-2:]
        rows_h = h.reshape(-1, K, H)
        rows_prev = prev.reshape(-1, K)
        biases = []
        state = None
        for j in range(K):
            b, state = drafter.markov_head.step(rows_h[:, j], rows_prev[:, j], state)
            biases.append(b)
        z = U + torch.stack(biases, dim=1).view(U.shape)  # [rows, K, V] back to [..., K, V]
    conf = drafter.confidence_logit(h, prev)
    return z, conf


# Losses

def slot_weights(K: int, gamma: float, device=None) -> torch.Tensor:
    """w_j = exp(-j/γ): under prefix acceptance earlier slots count more."""
    j = torch.arange(K, device=device, dtype=torch.float32)
    return torch.exp(-j / gamma)


def distill_losses(draft_logits, target_logits, labels, valid, conf_logits, gamma: float,
                   den=None) -> dict:
    """Each term Σ w·ℓ / Σ w (w = exp(-j/γ)·valid; `den`: the global Σ w), ℓ: -log p_d(label) (ce),
    ‖p_d − p_t‖_1 (tv), BCE(conf, c*), c* = 1 − ½‖p_d − p_t‖_1 detached (conf; `accept`)."""
    K = draft_logits.shape[-2]
    w = slot_weights(K, gamma, draft_logits.device) * valid.float()
    if den is None:
        den = w.sum().clamp_min(1e-12)
    logp = torch.log_softmax(draft_logits.float(), dim=-1)
    p_d = logp.exp()
    p_t = torch.softmax(target_logits.float(), dim=-1)
    ce = -logp.gather(-1, labels[..., None])[..., 0]  # -log p_d(x_{a+j+1})
    # ‖p_d − p_t‖_1, in [0, 2]: the paper's L_tv (eq. 10), twice the total variation; logged as "tv"
    # (DeepSpec logs it as l1_loss)
    l1 = (p_d - p_t).abs().sum(-1)
    # 1 − ½‖p_d − p_t‖_1 = Σ_v min(p_d, p_t): the chance speculative sampling accepts the slot's draft,
    # the confidence head's target
    accept = (1 - 0.5 * l1).clamp(0, 1).detach()
    out = {
        "ce": (ce * w).sum() / den,
        "tv": (l1 * w).sum() / den,
        "accept": accept,  # [B, N, K], not a loss: the step's τ and accept@j read it
    }
    if conf_logits is not None:
        bce = F.binary_cross_entropy_with_logits(conf_logits.float(), accept, reduction="none")
        out["conf"] = (bce * w).sum() / den
    return out


def total_loss(terms: dict, args: Args) -> torch.Tensor:
    """α_ce·ce + α_tv·tv + α_conf·conf, each term already Σ w·ℓ / Σ w."""
    loss = args.alpha_ce * terms["ce"] + args.alpha_tv * terms["tv"]
    if "conf" in terms:
        loss = loss + args.alpha_conf * terms["conf"]
    return loss


@torch.no_grad()
def target_features(target: Transformer, drafter, tokens, doc):
    """The target's last hidden states and the features of the layers `drafter` reads, every document
    of a packed row (`doc`) attending only to itself."""
    mask = None
    if doc is not None:
        mask = data.document_mask(doc)
    capture = drafter.cfg.target_layer_ids
    return target.hidden(tokens, capture=capture, mask=mask)


def drafter_loss(drafter: Drafter, target: Transformer, tokens: torch.Tensor, anchors: torch.Tensor,
                 args: Args, *, keep=None, loss_mask=None, doc=None, den=None):
    """One batch -> (loss, terms, valid); keep [B, N]: real blocks."""
    K = drafter.cfg.block_size
    B, T = tokens.shape
    N = anchors.shape[1]
    if keep is None:
        keep = torch.ones_like(anchors, dtype=torch.bool)
    hidden_t, features = target_features(target, drafter, tokens, doc)
    h = block_forward(drafter, features, tokens, anchors, doc)  # [B, N, K, H]
    # slot j at a+j predicts a+j+1
    slot_pos = anchors[:, :, None] + torch.arange(K, device=tokens.device)
    valid = data.supervised(anchors, keep, K, T, loss_mask, doc)
    label_pos = (slot_pos + 1).clamp(max=T - 1).view(B, -1)
    labels = tokens.gather(1, label_pos).view_as(slot_pos)
    # teacher-forced: each slot's previous token is the anchor's token or the label before it
    anchor_tokens = tokens.gather(1, anchors)[:, :, None]
    prev = torch.cat([anchor_tokens, labels[:, :, :-1]], dim=-1)
    with torch.no_grad():  # the target's logits at a+j: its distribution of slot j's label
        H = hidden_t.shape[-1]
        slot_rows = slot_pos.clamp(max=T - 1).view(B, -1, 1)  # past T: unsupervised, any row
        idx = slot_rows.expand(-1, -1, H)
        slot_hidden = hidden_t.gather(1, idx)  # [B, N*K, H]
        target_logits = target.lm_head(slot_hidden).view(B, N, K, -1)
    z, conf = head_outputs(drafter, h, prev)
    terms = distill_losses(z, target_logits, labels, valid, conf, args.gamma, den)
    loss = total_loss(terms, args)
    return loss, terms, valid


def step_flops(t: ModelArgs, d: DrafterConfig, G: int, T: int, N: int) -> float:
    """Matmul FLOPs of a step (for MFU): the target's forward, its lm_head at the N·K slots, 3x the
    drafter's matmuls (forward, input and weight gradients): the context rows' k/v, block rows and their
    masked attention over T + N·K keys; 2x fc over the target's features (no input gradient) and the
    drafter's pass through the target's frozen lm_head (no weight gradient)."""
    K = d.block_size
    H = t.hidden_size
    V = t.vocab_size
    D = d.layers.num_hidden_layers
    q = t.num_attention_heads * t.head_dim
    kv = t.num_key_value_heads * t.head_dim
    slots = N * K
    fc = 2 * T * len(d.target_layer_ids) * H * H
    context = 2 * T * D * 2 * H * kv  # each layer's k/v of the context rows
    per_slot = D * layer_params(d.layers) + d.markov_rank * V
    block_matmuls = 2 * slots * per_slot
    block_attention = 4 * D * slots * (T + slots) * q
    blocks = block_matmuls + block_attention
    lm_head = 2 * slots * H * V
    target = causal_flops(t, T) + lm_head
    return float(G * (target + 3 * (context + blocks) + 2 * (fc + lm_head)))


# Eagle3: DeepSpec's training-time test (compute_eagle3_loss), every position of a row at once, step by step

def ttt_mask(T: int, steps: int, doc=None, device=None) -> torch.Tensor:
    """[B or 1, T, steps·T], True = may attend; step j reads the first (j+1)·T keys: query i sees step 0's
    keys 0..i (in its document, with `doc`) and its own index i in steps 1..j."""
    if doc is None:
        causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()[None]
    else:
        causal = data.document_mask(doc)
    own = torch.eye(T, dtype=torch.bool, device=device).expand_as(causal)
    return torch.cat([causal] + [own] * (steps - 1), dim=-1)


def ttt_positions(loss_mask, doc, B: int, T: int, steps: int, device=None) -> torch.Tensor:
    """[steps, B, T] bool, step j's supervised indices: pm_0 = the loss mask with each row's (document's)
    last position off (no next token to learn there); pm_j[i] = pm_0[i + j] (off past the end), and i + j
    in i's document."""
    if loss_mask is None:
        pm = torch.ones(B, T, dtype=torch.bool, device=device)
    else:
        pm = loss_mask.bool()
    last = torch.zeros(B, T, dtype=torch.bool, device=device)
    last[:, -1] = True  # the row's last position
    if doc is not None:  # and each document's
        next_differs = doc[:, 1:] != doc[:, :-1]
        last[:, :-1] = next_differs
    pm = pm & ~last
    out = torch.zeros(steps, B, T, dtype=torch.bool, device=device)
    for j in range(steps):
        n = T - j  # indices i with i + j in the row
        out[j, :, :n] = pm[:, j:]
        if doc is not None:
            out[j, :, :n] &= doc[:, :n] == doc[:, j:]
    return out


def drafting_mask(loss_mask, doc) -> torch.Tensor:
    """The loss mask [B, T] as Eagle3's training reads it: each document's loss tokens and the two
    before each run of them. `ttt_positions` supervises the draft of x_{k+2} where position k is in
    the mask, DeepSpec's rule for its mask, which starts at the empty think block before a response;
    from a mask that starts at the response, the response's second token, every response's first
    draft (from the prompt's last position), would never be a target."""
    extended = loss_mask.bool()
    for back in (1, 2):
        same_doc = torch.ones_like(extended[:, back:])
        if doc is not None:
            same_doc = doc[:, :-back] == doc[:, back:]
        ahead = torch.zeros_like(extended)
        ahead[:, :-back] = loss_mask[:, back:].bool() & same_doc  # position k + back's, at k
        extended = extended | ahead
    return extended


def ttt_forward(drafter: Eagle3Drafter, features, tokens, steps: int, doc=None) -> list[torch.Tensor]:
    """DeepSpec's training-time test, cache-free: step j = 0..steps-1 reads, at index i, the token x_{i+j+1}
    and h: fc(features_i) at step 0, step j-1's un-normed output after; RoPE at i + j; the keys of every
    step so far (`ttt_mask`). Its output at i (normed, lm_head) drafts x_{i+j+2}, as the decode chain from
    committed position i does at its draft j+1. Returns each step's h [B, T, H], un-normed."""
    a = drafter.cfg.layers
    B, T = tokens.shape
    dev = tokens.device
    dtype = drafter.fc.weight.dtype
    mask = ttt_mask(T, steps, doc, dev)
    # x_{i+1}; 0 past the end
    ahead = torch.cat([tokens[:, 1:], tokens.new_zeros(B, steps)], dim=1)
    table = rope_table(a.head_dim, a.rope_theta, T + steps, dev)
    layer = drafter.layers[0]
    h = drafter.fc(features)
    past = None
    out = []
    for j in range(steps):
        step_table = table[j:j + T][None].expand(B, T, 2, a.head_dim)
        rope = Rope.at(step_table, dtype)
        embedded = drafter.target.embed_tokens(ahead[:, j:j + T])
        step_mask = mask[:, :, :(j + 1) * T]
        h, past = layer.unrolled(h, embedded, rope, step_mask, past)
        out.append(h)
    return out


def ttt_loss(drafter: Eagle3Drafter, features, target_logits, tokens, steps: int, decay: float,
             loss_mask=None, doc=None, den=None):
    """DeepSpec's Eagle3 loss (compute_eagle3_loss): step j's soft cross-entropy against the target's softmax
    at i+1+j (its distribution of x_{i+j+2}) where `ttt_positions` says, summed and divided by `den` (default
    B·T, the padded batch), weighted decay^j. Returns (loss, stats): stats holds each step's loss and (no
    grad) its supervised indices `valid`, its hits of the target's argmax `correct` and its acceptance
    probabilities 1 − ½‖p_draft − p_target‖₁ `accept`."""
    B, T = tokens.shape
    V = target_logits.shape[-1]
    if den is None:
        den = B * T
    # index i: the target's distribution at i + 1; uniform past the end (never supervised)
    with torch.no_grad():
        p_t = torch.softmax(target_logits.float(), dim=-1)
        uniform = p_t.new_full((B, steps + 1, V), 1.0 / V)
        p_next = torch.cat([p_t[:, 1:], uniform], dim=1)
        best = p_next.argmax(-1)
        valid = ttt_positions(loss_mask, doc, B, T, steps, tokens.device)
    loss = 0.0
    stats = {"step": [], "valid": valid, "correct": [], "accept": []}
    for j, h in enumerate(ttt_forward(drafter, features, tokens, steps, doc)):
        logp = torch.log_softmax(drafter.logits(h).float(), dim=-1)
        p_j = p_next[:, j:j + T]
        ce = -(p_j * logp).sum(-1)  # [B, T]
        step_loss = torch.where(valid[j], ce, torch.zeros_like(ce)).sum() / den
        loss = loss + decay ** j * step_loss
        stats["step"].append(step_loss)
        with torch.no_grad():
            hits = logp.argmax(-1) == best[:, j:j + T]
            stats["correct"].append(hits & valid[j])
            l1 = (logp.exp() - p_j).abs().sum(-1)
            accept = (1 - 0.5 * l1).clamp(0, 1)
            stats["accept"].append(accept * valid[j])
    return loss, stats


def eagle3_loss(drafter: Eagle3Drafter, target: Transformer, tokens, args: Args, *, loss_mask=None,
                doc=None, den=None):
    """One batch -> (loss, stats): the target's features and logits online (no grad), then `ttt_loss`."""
    hidden_t, features = target_features(target, drafter, tokens, doc)
    with torch.no_grad():
        target_logits = target.lm_head(hidden_t)
    steps = args.ttt_length
    decay = args.step_loss_decay
    return ttt_loss(drafter, features, target_logits, tokens, steps, decay, loss_mask, doc, den)


def eagle3_flops(t: ModelArgs, d: DrafterConfig, G: int, T: int) -> float:
    """Matmul FLOPs of an Eagle3 step: the target's forward and lm_head at every position, 3x the
    drafter's matmuls (forward, input and weight gradients): each step's layer (2H wide q/k/v) and
    masked attention over (j+1)·T keys; 2x fc over the target's features, once (no input gradient), and
    each step's pass through the target's frozen lm_head (no weight gradient)."""
    H = t.hidden_size
    V = t.vocab_size
    I = t.intermediate_size  # noqa: E741
    S = d.block_size
    q = t.num_attention_heads * t.head_dim
    kv = t.num_key_value_heads * t.head_dim
    attention = 2 * H * (q + 2 * kv) + q * H
    layer = attention + 3 * H * I
    step_matmuls = 2 * T * S * layer
    # step j's attention reads (j+1)·T keys: Σ_j (j+1) = S(S+1)/2
    step_attention = 4 * T * T * q * S * (S + 1) // 2
    steps = step_matmuls + step_attention
    fc = 2 * T * len(d.target_layer_ids) * H * H
    step_lm_head = 2 * T * S * H * V
    target = causal_flops(t, T) + 2 * T * H * V
    return float(G * (target + 3 * steps + 2 * (fc + step_lm_head)))


# The drafter

def default_layer_ids(L: int) -> tuple[int, ...]:
    """DeepSpec's spacing 1 + i(L-4)/4, i = 0..4; under 5 layers every layer but the last; one layer: the
    embeddings (-1)."""
    if L >= 5:
        return tuple(sorted({1 + i * (L - 4) // 4 for i in range(5)}))
    if L == 1:
        return (-1,)
    return tuple(range(0, L - 1))


def default_mask_token_id(target_dir: str, V: int) -> int:
    if os.path.isfile(os.path.join(target_dir, "tokenizer.json")):
        tok = Tokenizer(target_dir).tok
        mid = tok.token_to_id(data.MASK_TOKEN)
        if mid is not None and mid < V:
            return mid
        n = tok.get_vocab_size(with_added_tokens=True)
        if n < V:
            return n
    return V - 1


def layer_ids(args: Args, L: int, lowest: int = -1) -> tuple[int, ...]:
    """--target-layer-ids, checked against the target's L layers (Eagle3: decoder layers only, lowest 0)."""
    if args.target_layer_ids is not None:
        ids = tuple(parse_ints(args.target_layer_ids, "--target-layer-ids"))
    else:
        ids = default_layer_ids(L)
    increasing = list(ids) == sorted(set(ids))
    if not increasing or ids[0] < lowest or ids[-1] > L - 2:
        if lowest == -1:
            first = "-1 (the embeddings)"
        else:
            first = f"{lowest} (Eagle3 reads decoder layers' outputs)"
        given = args.target_layer_ids or ",".join(map(str, ids))
        raise UserError(f"--target-layer-ids {given}: strictly increasing layer ids from {first} to "
                        f"{L - 2}, the target's last layer ({L - 1}) excluded")
    return ids


def markov_feature(args: Args) -> bool:
    """--confidence-with-markov as given; left out, on with a Markov head and off without."""
    if args.confidence_with_markov is None:
        return args.markov != "none"
    return args.confidence_with_markov


def drafter_config(args: Args, target: Transformer, target_dir: str) -> DrafterConfig:
    """The flags' drafter, as the loader reads it back."""
    t = target.args
    L = t.num_hidden_layers
    if args.drafter_kind == "eagle3":  # one layer, the chain's length; no mask token, no heads
        if L < 2:
            raise UserError(f"--target {args.target}: {L} layer, too few for an Eagle3 drafter (it reads "
                            f"the outputs of decoder layers below the last, so at least 2)")
        layers = replace(t, num_hidden_layers=1, eos_token_ids=(), tie_word_embeddings=False)
        ids = layer_ids(args, L, lowest=0)
        return DrafterConfig(layers=layers, block_size=args.ttt_length, target_layer_ids=ids,
                             mask_token_id=0, layout="eagle3", markov_head_type=None, markov_rank=0,
                             confidence_head=False, confidence_with_markov=False, num_target_layers=L)
    ids = layer_ids(args, L)
    mask = args.mask_token_id
    if mask is None:
        mask = default_mask_token_id(target_dir, t.vocab_size)
    if not 0 <= mask < t.vocab_size:
        last = t.vocab_size - 1
        raise UserError(f"--mask-token-id: {mask} is outside the vocabulary (0..{last})")
    markov = args.markov
    if markov == "none":
        markov = None
    with_markov = args.confidence and markov_feature(args)
    if with_markov and markov is None:
        raise UserError("--confidence-with-markov needs a Markov head (--markov none given): "
                        "add --no-confidence-with-markov")
    layers = replace(t, num_hidden_layers=args.depth, eos_token_ids=(), tie_word_embeddings=False)
    rank = 0
    if markov is not None:
        rank = args.markov_rank
    return DrafterConfig(layers=layers, block_size=args.block_size, target_layer_ids=ids,
                         mask_token_id=mask, layout="dspark", markov_head_type=markov, markov_rank=rank,
                         confidence_head=args.confidence, confidence_with_markov=with_markov,
                         num_target_layers=L)


def build_drafter(cfg: DrafterConfig, args: Args, target: Transformer, device) -> Drafter:
    """A new drafter of `cfg`, randomly initialised (the target's embedding and lm_head shared, frozen)."""
    with torch.device(device):
        if cfg.layout == "eagle3":
            drafter = Eagle3Drafter(cfg)
        else:
            drafter = Drafter(cfg)
    init_random_(drafter, args.seed, args.init_std)
    attach(drafter, target)
    return drafter


def anchors_per_row(args: Args) -> int:
    """The anchors a row trains: --anchors-per-seq, at most --seq-len - 1 (the default, DeepSpec's 512, is
    cut to a shorter sequence; a value given is checked to fit)."""
    return min(args.anchors_per_seq, args.seq_len - 1)


def drafter_json(args: Args, cfg: DrafterConfig) -> dict:
    """The config.json the flags' drafter is saved with (num_anchors: as trained)."""
    if cfg.layout == "eagle3":
        return eagle3_config_json(args.target, cfg, args.step_loss_decay)
    return config_json(args.target, cfg, anchors_per_row(args))


def shared_weights(target_dir: str) -> dict:
    """The target's embedding and lm_head as its files hold them (equal to the target at any dtype)."""
    from safetensors import safe_open

    found = {}
    for path in weight_files(target_dir):
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                name = key.removeprefix("model.")
                if name in ("embed_tokens.weight", "lm_head.weight"):
                    found[name] = f.get_tensor(key)
    found.setdefault("lm_head.weight", found["embed_tokens.weight"].clone())
    return found


def save_drafter(out: str, drafter: Drafter, target_dir: str, config: dict, step: Optional[int] = None):
    """config.json (`drafter_json`'s) + model.safetensors, DeepSpec's layout: separate q/k/v and
    gate/up, and copies of the target's embedding and lm_head."""
    tensors = published({k: v.float() for k, v in drafter.state_dict().items()})
    tensors = {**tensors, **shared_weights(target_dir)}
    save_tensors(os.path.join(out, "model.safetensors"), tensors, step=step)
    write_json(os.path.join(out, "config.json"), config)


def resumed_drafter(directory: str, cfg: DrafterConfig, target: Transformer, device) -> Drafter:
    drafter = load_drafter(directory, target, device, torch.float32)
    if drafter.cfg != cfg:
        name = next(f.name for f in fields(cfg) if getattr(cfg, f.name) != getattr(drafter.cfg, f.name))
        held = repr(getattr(drafter.cfg, name))[:80]
        asked = repr(getattr(cfg, name))[:80]
        raise UserError(f"{directory}: holds another drafter than the flags build ({name} {held} there, "
                        f"{asked} from the flags; a resumed run must repeat the original flags)")
    return drafter.requires_grad_(True)


# The run

# A step's sums, added up across micro-batches and processes: these figures first, in this order, then
# the block drafter's K acceptance sums and K supervised counts; Eagle3's S step losses, S hit counts,
# S acceptance sums and S supervised counts.
BLOCK_FIGURES = ("loss", "ce", "tv", "conf", "tau", "blocks")
EAGLE3_FIGURES = ("loss", "tau", "tau_greedy", "chains")


class LossStep(torch.nn.Module):
    """A micro-batch's share of the step loss and its sums, for DDP: the drafter is the module tree, the
    frozen target stays outside it; `loss_fn` is compiled when asked."""

    def __init__(self, drafter, target: Transformer, args: Args, loss_fn):
        super().__init__()
        self.model = drafter
        self._target = [target]
        self.args = args
        self.loss_fn = loss_fn
        if args.compile:
            self.loss_fn = torch.compile(loss_fn, dynamic=False)


class DraftStep(LossStep):
    """The block drafter's step (DSpark / DFlash): the loss and the sums `summarize_block` turns into metrics."""

    def __init__(self, drafter: Drafter, target: Transformer, args: Args):
        super().__init__(drafter, target, args, drafter_loss)

    def forward(self, tokens, anchors, keep, loss_mask, doc, den):
        loss, terms, valid = self.loss_fn(self.model, self._target[0], tokens, anchors, self.args,
                                       keep=keep, loss_mask=loss_mask, doc=doc, den=den)
        with torch.no_grad():
            v = valid.float()
            accepted = terms["accept"] * v
            expected_run = accepted.cumprod(-1).sum(-1)  # [B, N] Σ_k Π_{i≤k} c*_i
            tau = ((expected_run + 1) * keep).sum()  # and the bonus token, over real blocks
            conf = terms.get("conf", loss.new_zeros(()))
            figures = {"loss": loss.detach(), "ce": terms["ce"], "tv": terms["tv"], "conf": conf, "tau": tau,
                       "blocks": keep.sum()}
            head = torch.stack([figures[name].float() for name in BLOCK_FIGURES])
            per_slot_accepted = accepted.sum((0, 1))
            per_slot_counts = v.sum((0, 1))
            sums = torch.cat([head, per_slot_accepted, per_slot_counts])
        return loss, sums


class Eagle3Step(LossStep):
    """The Eagle3 drafter's step: the loss (`den` = the global B·T) and the sums `summarize_eagle3` reads."""

    def __init__(self, drafter: Eagle3Drafter, target: Transformer, args: Args):
        super().__init__(drafter, target, args, eagle3_loss)

    def forward(self, tokens, loss_mask, doc, den):
        loss, stats = self.loss_fn(self.model, self._target[0], tokens, self.args,
                                   loss_mask=loss_mask, doc=doc, den=den)
        return loss, eagle3_sums(loss, stats)


@torch.no_grad()
def eagle3_sums(loss, stats: dict) -> torch.Tensor:
    """`ttt_loss`'s figures as sums over the batch, which add up across micro-batches and processes and
    `summarize_eagle3` turns into metrics."""
    valid = stats["valid"].float()  # [S, B, T]
    correct = torch.stack(stats["correct"]).float()
    accept = torch.stack(stats["accept"]).float()
    start = valid[0]  # a chain starts where step 0 is supervised, as DeepSpec's τ counts them
    tau_greedy = ((correct.cumprod(0).sum(0) + 1) * start).sum()
    tau = ((accept.cumprod(0).sum(0) + 1) * start).sum()
    figures = {"loss": loss.detach(), "tau": tau, "tau_greedy": tau_greedy, "chains": start.sum()}
    head = torch.stack([figures[name].float() for name in EAGLE3_FIGURES])
    steps = torch.stack(stats["step"]).detach().float()
    hits = correct.sum((1, 2))
    accepted = accept.sum((1, 2))
    counts = valid.sum((1, 2))
    return torch.cat([head, steps, hits, accepted, counts])


def summarize_eagle3(sums: torch.Tensor, S: int) -> dict:
    """The loss and each step's (loss@j, before its decay^j weight), top-1 agreement with the target's argmax
    (acc@j) and acceptance probability at temperature 1 (accept@j); τ = 1 + Σ_k Π_{j≤k} accept@j per chain
    (tau, as DSpark's) and its greedy twin over the hits (tau_greedy), DeepSpec's train metrics."""
    s = sums.tolist()
    first = len(EAGLE3_FIGURES)
    head = dict(zip(EAGLE3_FIGURES, s[:first]))
    n = max(head["chains"], 1)
    losses = s[first:first + S]
    hits = s[first + S:first + 2 * S]
    accepted = s[first + 2 * S:first + 3 * S]
    counts = [max(c, 1) for c in s[first + 3 * S:first + 4 * S]]
    out = {"loss": head["loss"], "tau": head["tau"] / n, "tau_greedy": head["tau_greedy"] / n}
    out.update({f"loss@{j}": losses[j] for j in range(S)})
    out.update({f"acc@{j}": hits[j] / counts[j] for j in range(S)})
    out.update({f"accept@{j}": accepted[j] / counts[j] for j in range(S)})
    return out


def summarize_block(sums: torch.Tensor, K: int, has_conf: bool) -> dict:
    """Loss terms, acceptance per slot, DeepSpec's expected τ (1 + Σ_k Π_{i≤k} c*_i a block)."""
    s = sums.tolist()
    first = len(BLOCK_FIGURES)
    head = dict(zip(BLOCK_FIGURES, s[:first]))
    out = {"loss": head["loss"], "ce": head["ce"], "tv": head["tv"]}
    if has_conf:
        out["conf"] = head["conf"]
    out["tau"] = head["tau"] / max(head["blocks"], 1)
    accepted = s[first:first + K]
    counts = [max(c, 1) for c in s[first + K:first + 2 * K]]
    out.update({f"accept@{j}": accepted[j] / counts[j] for j in range(K)})
    return out


def train_drafter(args: Args) -> dict:
    """The target, the drafter and the data, loaded and checked against a resumed state; then the run, in
    its W&B run (a resumed one's only once those checks pass: a refusal leaves it as it was)."""
    rank, world, device = dist_init(resolve_device(args.device), args.dist_timeout)

    def say(msg):
        if rank == 0:
            print(msg, file=sys.stderr)

    dtype = resolve_dtype(args.dtype, device)
    target_dtype = torch.float32
    if device.startswith("cuda"):
        target_dtype = dtype
    check_target_memory(args.target, device, target_dtype, kernels=False)  # training installs no CPU kernels
    target = load_target(args.target, device, target_dtype)
    cfg = drafter_config(args, target, args.target)  # the flags against the target, before the data is read
    if args.eval_every:
        check_eval_prompts(args, target, device)
    if args.resume:  # the drafter it holds against the flags, before the minutes --data takes
        where = checkpoint_dir(args.resume)
        drafter = resumed_drafter(where, cfg, target, device)
    corpus = data.load_corpus(args, target.args, say)
    target_files = [os.path.join(args.target, "config.json"), *weight_files(args.target)]
    identity = {"target": files_digest(target_files), "data": data.digest(corpus)}
    if args.resume:
        if args.data is not None:
            source = f"--data {args.data}"
        else:
            source = f"--data-ids {args.data_ids}"
        check_identity(where, identity, {"target": f"--target {args.target}", "data": source})
        resumed = read_state(where, drafter, len(corpus))
    else:
        drafter = build_drafter(cfg, args, target, device)
        resumed = None
    run_id = resumed_wandb_run(args)  # a resumed run goes on in its W&B run
    with runlog.logged_run(args, "train", "train.py", enabled=rank0(), from_rank0=from_rank0,
                           run_id=run_id) as log:
        return train_loaded(args, drafter, target, corpus, identity, dtype, log, resumed)


def train_loaded(args: Args, drafter: Drafter, target: Transformer, corpus: data.Corpus, identity: dict,
                 dtype, log: Optional[runlog.Log], resumed: Optional[tuple[int, dict]]) -> dict:
    """train_drafter's run, its inputs loaded and checked (`resumed`: the optimizer state resumed)."""
    rank, world, device = dist_init(resolve_device(args.device), args.dist_timeout)
    run = Run(rank, world, device, log)

    def save(directory, step, opt):
        config = drafter_json(args, drafter.cfg)
        save_drafter(directory, drafter, args.target, config, step=step)
        save_state(directory, step, drafter, opt, args, len(corpus), world, identity, log)

    evaluate = partial(evaluate_checkpoint, args, device=device)  # at --eval-every's steps
    if drafter.cfg.layout == "eagle3":
        return train_eagle3(args, drafter, target, corpus, run, dtype, save, evaluate, resumed)
    T = args.seq_len
    K = drafter.cfg.block_size
    G = args.batch_size * args.grad_accum * world
    N = anchors_per_row(args)
    trained = sum(p.numel() for p in drafter.parameters())
    flops = step_flops(target.args, drafter.cfg, G, T, N)
    banner = (f"{drafter.cfg.describe()} | {trained:,} trained parameters | "
              f"{len(corpus)} sequences of {T} tokens, {N} anchors each | "
              f"global batch {G} = {args.batch_size} x {args.grad_accum} x {world} process(es)")
    if run.wandb is not None:
        run.wandb.config(world_size=world, global_batch=G, hardware=device_name(device),
                         dtype_resolved=dtype_name(dtype), num_sequences=len(corpus),
                         anchors_resolved=N, trained_parameters=trained, step_flops=flops,
                         target_config=runlog.checkpoint_config(args.target),
                         drafter_config=drafter_json(args, drafter.cfg),
                         drafter_resolved=drafter.cfg.describe())
    batches = data.Batches(len(corpus), G, args.seed)
    w = slot_weights(K, args.gamma)
    mine = data.micro_slices(args.batch_size, args.grad_accum, rank)

    def micro_batches(step):
        tokens, mask, doc = corpus.rows(batches(step))
        g = torch.Generator().manual_seed(data.seed_for("anchors", args.seed, step))
        candidates = data.anchor_candidates(mask, doc)
        anchors, keep = data.sample_anchors(G, T, N, g, candidates)
        # the global batch's Σ w (w as distill_losses weighs a slot), shared by every micro-batch
        supervised = data.supervised(anchors, keep, K, T, mask, doc).float()
        den = (w * supervised).sum().clamp_min(1e-12)
        out = []
        for sl in mine:
            mb = {
                "tokens": on_device(tokens, sl, device),
                "anchors": on_device(anchors, sl, device),
                "keep": on_device(keep, sl, device),
                "loss_mask": on_device(mask, sl, device),
                "doc": on_device(doc, sl, device),
                "den": den.to(device),
            }
            out.append(mb)
        return out

    def summarize_step(sums):
        return summarize_block(sums, K, drafter.cfg.confidence_head)

    step_module = DraftStep(drafter, target, args)
    return optimize(args, step_module, micro_batches, summarize_step, save, run, dtype, resumed,
                    flops, banner, evaluate)


def on_device(t, sl, device):
    """A micro-batch's rows of an optional batch tensor, on the device."""
    if t is None:
        return None
    return t[sl].to(device)


def train_eagle3(args: Args, drafter: Eagle3Drafter, target: Transformer, corpus: data.Corpus, run: Run,
                 dtype, save, evaluate, resumed: Optional[tuple[int, dict]]) -> dict:
    """train_drafter's Eagle3 loop (`save` and `evaluate` its): every position of each row is a chain start,
    no anchors to draw."""
    T = args.seq_len
    S = drafter.cfg.block_size
    G = args.batch_size * args.grad_accum * run.world
    trained = sum(p.numel() for p in drafter.parameters())
    flops = eagle3_flops(target.args, drafter.cfg, G, T)
    banner = (f"{drafter.cfg.describe()} | {trained:,} trained parameters | "
              f"{len(corpus)} sequences of {T} tokens, {S} TTT steps, "
              f"step weights {args.step_loss_decay}^j | "
              f"global batch {G} = {args.batch_size} x {args.grad_accum} x {run.world} process(es)")
    if run.wandb is not None:
        run.wandb.config(world_size=run.world, global_batch=G, hardware=device_name(run.device),
                         dtype_resolved=dtype_name(dtype), num_sequences=len(corpus),
                         trained_parameters=trained, step_flops=flops,
                         target_config=runlog.checkpoint_config(args.target),
                         drafter_config=drafter_json(args, drafter.cfg),
                         drafter_resolved=drafter.cfg.describe())
    batches = data.Batches(len(corpus), G, args.seed)
    mine = data.micro_slices(args.batch_size, args.grad_accum, run.rank)
    den = torch.tensor(float(G * T))  # DeepSpec's B·T of the padded batch, over the global batch

    def micro_batches(step):
        tokens, mask, doc = corpus.rows(batches(step))
        if mask is not None:
            mask = drafting_mask(mask, doc)
        out = []
        for sl in mine:
            mb = {
                "tokens": on_device(tokens, sl, run.device),
                "loss_mask": on_device(mask, sl, run.device),
                "doc": on_device(doc, sl, run.device),
                "den": den.to(run.device),
            }
            out.append(mb)
        return out

    def summarize_step(sums):
        return summarize_eagle3(sums, S)

    step_module = Eagle3Step(drafter, target, args)
    return optimize(args, step_module, micro_batches, summarize_step, save, run, dtype, resumed,
                    flops, banner, evaluate)


def check_eval_args(args: Args):
    check_ranges(args, eval_every="[0, inf)", eval_samples="[1, inf)",
                 eval_max_new_tokens="[1, inf)")
    if args.eval_every > args.steps:
        raise UserError(f"--eval-every {args.eval_every}: past --steps {args.steps}, "
                        "so no evaluation would run")
    if args.eval_data_dir is not None and not args.eval_data_dir.strip():
        raise UserError("--eval-data-dir: empty path (leave the flag out for eval.py's data/eval)")
    if args.eval_every:
        import eval as evaluation
        folder = args.eval_data_dir or evaluation.DATA_DIR
        problem = directory_problem(folder, "data directory")
        if problem:
            raise UserError(f"--eval-data-dir {folder}: {problem}")
        names = evaluation.dataset_names(args.eval_datasets, "--eval-datasets", "--eval-data-dir")
        for name in names:
            if not os.path.isfile(os.path.join(folder, f"{name}.jsonl")):
                raise UserError(f"--eval-datasets: no {name}.jsonl in {folder}")


DSPARK_ONLY = ("block_size", "depth", "mask_token_id", "markov", "markov_rank", "confidence",
               "confidence_with_markov", "anchors_per_seq", "gamma", "alpha_ce", "alpha_tv", "alpha_conf")
EAGLE3_ONLY = ("ttt_length", "step_loss_decay")


def check_unused_flags(args: Args):
    """A flag whose feature is off would train the same drafter."""
    eagle3 = args.drafter_kind == "eagle3"
    eval_flags = ("eval_datasets", "eval_data_dir", "eval_samples", "eval_max_new_tokens")
    refuse_unused(args, [
        (DSPARK_ONLY, eagle3, "--drafter-kind eagle3 (a DSpark drafter's flag)"),
        (EAGLE3_ONLY, not eagle3, "--drafter-kind dspark (an Eagle3 drafter's flag)"),
        (("markov_rank",), args.markov == "none", "--markov none"),
        (("alpha_conf", "confidence_with_markov"), not args.confidence, "--no-confidence"),
        (eval_flags, not args.eval_every, "no --eval-every"),
        (("pack",), args.data_ids is not None,
         "--data-ids (windows of a token stream; only chat records are packed)"),
    ])


def eval_args(args: Args, step: int, device: str):
    """eval.py's flags for the checkpoint written at `step` (--eval-every's), into --out/eval_step<N>.json."""
    import eval as evaluation

    eval_device = "cpu"
    if device.startswith("cuda"):
        eval_device = "cuda"
    # the checkpoint's own folder: --out's model files are replaced at the next save
    drafter = os.path.join(args.out, f"checkpoint-{step}")
    flags = dict(target=args.target, drafter=drafter, datasets=args.eval_datasets, step=step,
                 data_dir=args.eval_data_dir or evaluation.DATA_DIR, max_samples=args.eval_samples,
                 max_new_tokens=args.eval_max_new_tokens, device=eval_device, compile=False,
                 progress=False, out=os.path.join(args.out, f"eval_step{step}.json"),
                 threads=torch.get_num_threads())  # the training's: eval.py's default would change them
    return from_flat(evaluation.EvalArgs, flags)


def check_eval_prompts(args: Args, target: Transformer, device: str):
    """The evaluation's prompts read and checked against the target as eval.py reads them, before the first
    step: a prompt that cannot run is found now, not at the first --eval-every step."""
    import eval as evaluation

    e, _ = evaluation.resolve_defaults(eval_args(args, 0, device))
    s = evaluation.check_flags(e)
    datasets, _ = evaluation.resolve_datasets(e)
    tokenizer = Tokenizer(args.target)
    chat = auto_chat(e.rendering.chat, tokenizer)
    models = SimpleNamespace(tokenizer=tokenizer, target=target)  # what read_datasets reads of the models
    context = target.args.max_position_embeddings
    try:
        evaluation.read_datasets(e, s, datasets, models, [], chat, context)
    except UserError as err:  # named for eval.py's flags: --max-new-tokens is --eval-max-new-tokens here
        raise UserError(f"--eval-every {args.eval_every}: eval.py would refuse it ({err}; "
                        f"its --max-new-tokens is --eval-max-new-tokens here)") from None


def evaluate_checkpoint(args: Args, step: int, device: str) -> dict:
    """eval.py on the checkpoint just written; returns what to log."""
    import eval as evaluation

    e = eval_args(args, step, device)
    with torch.inference_mode():
        results = evaluation.run(e)
    found = {}
    for r in results["datasets"]:  # as eval.py logs them, under eval/
        found.update(dataset_figures(r, "eval/"))
    calibration = results["calibration"] or {}
    for m in calibration.get("raw", []):
        for k in ("ece", "brier"):
            if m[k] is not None:
                found[f"eval/calibration/{k}_{m['position']}"] = m[k]
    return found


def run(args: Args) -> dict:
    """Everything `python train.py` does; returns the loss history."""
    given = args  # check_unused_flags tells a flag left out (None) from one given
    args = replace(args, confidence_with_markov=markov_feature(args))
    check_train_args(args, block_size=f"[1, {MAX_BLOCK}]", depth="[1, 1024]", markov_rank="[1, 65536]",
                     anchors_per_seq="[1, 1000000]", gamma="(0, 1e6]", alpha_ce="[0, 1e6]",
                     alpha_tv="[0, 1e6]", alpha_conf="[0, 1e6]", ttt_length=f"[1, {MAX_BLOCK}]",
                     step_loss_decay="(0, 1e3]")
    check_eval_args(args)
    check_unused_flags(given)
    eagle3 = args.drafter_kind == "eagle3"
    T = args.seq_len
    # the default (DeepSpec's 512) is cut to a shorter --seq-len; a value given must fit
    if args.anchors_per_seq != Args.anchors_per_seq and args.anchors_per_seq >= T:
        raise UserError(f"--anchors-per-seq {args.anchors_per_seq}: a --seq-len {T} sequence has "
                        f"at most {T - 1} anchors (--seq-len - 1)")
    weights = [args.alpha_ce, args.alpha_tv]
    named = "--alpha-ce, --alpha-tv (--no-confidence)"
    if args.confidence:
        weights.append(args.alpha_conf)
        named = "--alpha-ce, --alpha-tv, --alpha-conf"
    if not any(weights):
        raise UserError(f"{named}: every loss weight is 0, so nothing would be trained")
    if eagle3 and args.ttt_length >= T:  # step j reads token i + j + 1 of its sequence
        raise UserError(f"--ttt-length {args.ttt_length}: the chain unrolls within each --seq-len "
                        f"{T} sequence, so at most {T - 1} steps")
    if not eagle3 and args.block_size >= T:  # slot k's label is token a + k of the anchor a's sequence
        raise UserError(f"--block-size {args.block_size}: a block's drafts follow its anchor within each "
                        f"--seq-len {T} sequence, so at most {T - 1} (the slots past them are never trained)")
    if args.target is None:
        raise UserError("--target: no target directory given")
    # --out is checked against the resolved target too
    target = resolve_checkpoint(args.target, "--target")
    args = replace(args, target=target)
    check_out_dir(args, inputs=[args.target])
    context = read_target_args(target).max_position_embeddings
    if T > context:
        raise UserError(f"--seq-len {T}: longer than the context of --target {target} "
                        f"(max_position_embeddings {context})")
    if args.eval_every and args.eval_max_new_tokens >= context:
        raise UserError(f"--eval-max-new-tokens {args.eval_max_new_tokens}: leaves no room for a prompt in "
                        f"the context of --target {target} (max_position_embeddings {context})")
    # before the lock and W&B: every rank stops
    _, world, _ = dist_init(resolve_device(args.device), args.dist_timeout)
    check_resume_progress(args, world)
    with out_held(args.out, rank0(), from_rank0):
        return train_drafter(args)


def main(argv: Optional[list[str]] = None) -> int:
    return train_main(Args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
