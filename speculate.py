"""Speculative decoding with a DSpark / DFlash drafter — or, without one, plain autoregressive decoding
by the same engine (the baseline).

    python speculate.py --target DIR --drafter DIR --prompt "..." --max-new-tokens 128

Read top to bottom: one round (`draft`, then `verify`: one target pass, the acceptance rule, the
commit); the engine that runs rounds for a batch of requests; the Python API (`load`, `generate`,
and `decode`, the driver the command line uses too); the command line (`main`). The decode settings
are declared once, in support/flags.py (`Settings`)."""

from __future__ import annotations

import functools
import os
import sys
import time
import warnings
import weakref
from dataclasses import dataclass, field, fields
from types import FunctionType
from typing import NamedTuple, Optional

import torch

import kernels
import sampling
import scheduler as sched
from model import Ragged, Transformer, TreeSlots, caches_fit
from sampling import NO_FILTERS, Filters
from support import cpu_kernels, flags, metrics, runlog
from support.checkpoint import Models, load_models, resolve_checkpoint
from support.cli import UserError, cli_main, one_process, path_argument
from support.flags import Args, Settings
from support.report import Report
from support.text import StopStrings, check_prompts, encode

HERE = os.path.dirname(os.path.abspath(__file__))
DEMO_DIR = os.path.join(HERE, "demo")  # the committed demo pair


# One round, in static shapes (what torch.compile captures):
#   1. Draft: K tokens after each row's anchor, a chain or a tree (`draft`)
#   2. Schedule: how many drafts each row sends the target (`draft`)
#   3. Verify: one target pass over the anchor and the drafts, capturing features (`verify`)
#   4. Accept: the longest prefix the rejection rule keeps, then one token of the target's own (`verify`)
#   5. Commit: the target's features into the drafter's context; the next anchors (`verify`)

class Proposal(NamedTuple):
    drafts: torch.Tensor                # [B, K] x_1 .. x_K; a tree's [B, N], its nodes after the root
    verify_len: torch.Tensor            # [B] ℓ: how many drafts go to the target, 0 .. K (a tree: N)
    q: Optional[torch.Tensor] = None           # [B, K, V] what they were drawn from (None at T=0)
    confidence: Optional[torch.Tensor] = None  # [B, K] c_1 .. c_K (None without a confidence head)
    # --tree-budget: a draft tree instead of a chain, holding its own q (q and confidence are None)
    tree: Optional[sampling.Tree] = None


def draft(drafter, anchor, anchor_pos, active, *, noise, temperature, filters,
          schedule: sched.Scheduler, backend, num_drafts: int, tree_budget: int,
          tree_temperature: float, capacity, carried) -> Proposal:
    """Steps 1-2 for the anchors [B] (each row's last committed token, at anchor_pos [B]).
    noise: the chain's Exp(1) [B, K, V], or a sampled tree's [B, R, V] (None at T=0);
    schedule: the engine's `scheduler.Scheduler`, ℓ [B] from the confidences [B, K];
    capacity: the async scheduler's C; num_drafts: an Eagle3 chain's K (a block drafter
    drafts its block); tree_budget: draft a tree of this many nodes instead of a chain;
    carried: an Eagle3 drafter's `carried`, passed in so that a compiled graph reads it as
    an input (freezing would fold it)."""
    B = anchor.shape[0]
    device = anchor.device
    if drafter is None:
        no_drafts = anchor.new_zeros((B, 0))
        none_verified = anchor.new_zeros((B,))
        return Proposal(drafts=no_drafts, verify_len=none_verified)
    if drafter.cfg.layout == "eagle3":  # 1. Draft: K one-token steps; every draft verified
        K = num_drafts
        drafts, q = sampling.eagle3_chain(drafter, carried[:B], anchor_pos, K, temperature,
                                          noise=noise, filters=filters)
        verify_len = torch.full((B,), K, dtype=torch.long, device=device)
        return Proposal(drafts=drafts, verify_len=verify_len, q=q)
    # 1. Draft: the block in one parallel pass, the Markov chain left to right, the confidences.
    hidden, base_logits = drafter(anchor, anchor_pos)  # [B, K, H], [B, K, V]
    markov = drafter.markov_head
    if tree_budget:  # ... or the tree of the block's most likely continuations, verified whole
        N = tree_budget
        survival = None  # the children ranked at tree_temperature, unless ...
        if temperature > 0 and drafter.confidence_head is not None:
            survival = functools.partial(tree_survival, drafter, hidden)  # ... the head shapes it
        tree = sampling.build_tree(base_logits, hidden, anchor, markov, N, tree_temperature,
                                   temperature=temperature, filters=filters, noise=noise,
                                   survival=survival)
        nodes = tree.tokens[:, 1:]  # [B, N] every node after the root
        every_node = torch.full((B,), N, dtype=torch.long, device=device)
        return Proposal(drafts=nodes, verify_len=every_node, tree=tree)
    if backend == "triton":
        chain = kernels.markov_chain
    else:
        chain = sampling.markov_chain
    drafts, q = chain(base_logits, hidden, anchor, markov, temperature, noise=noise,
                      filters=filters)
    x_0 = anchor[:, None]  # [B, 1]
    previous = torch.cat([x_0, drafts[:, :-1]], dim=1)  # x_0 .. x_{K-1}
    confidence = drafter.confidence(hidden, previous)
    # 2. Schedule: how many drafts each row sends to the target.
    verify_len = schedule(confidence, active, capacity)
    return Proposal(drafts=drafts, q=q, confidence=confidence, verify_len=verify_len)


def tree_survival(drafter, hidden, depth: int, parent_tokens) -> torch.Tensor:
    """[B, M]: the confidence head's chance that a draft at `depth` survives after each of M tree nodes
    at depth - 1 holding `parent_tokens` [B, M] (the chain's c at that position, were it that branch)."""
    B, M = parent_tokens.shape
    slot = depth - 1
    h = hidden[:, slot, None].expand(B, M, -1)  # [B, M, H]
    return drafter.confidence(h, parent_tokens, slot=slot)


def tokens_sent(verify_len, active) -> torch.Tensor:
    """[B] the tokens each row sends the target: the anchor and ℓ drafts, none from a free row."""
    sent = verify_len + 1
    return torch.where(active, sent, 0)


def captured(drafter) -> tuple[int, ...]:
    """The target layers whose features the drafter reads: none without a drafter."""
    if drafter is None:
        return ()
    return drafter.cfg.target_layer_ids


def verify(target, drafter, anchor, anchor_pos, active, proposal: Proposal, *, temperature,
           filters, u, bonus_noise, backend, num_tokens: Optional[int]):
    """Steps 3-5, the round's second half (its graph when compiled): `verify_chain`, or `verify_tree`
    for a draft tree. Returns the round's packed record (`pack_record`), the next anchors and their
    positions."""
    attention = None  # the target's own cache attention, or the Triton kernel
    if backend == "triton":
        attention = kernels.cached_attention
    if proposal.tree is not None:
        return verify_tree(target, drafter, anchor, anchor_pos, active, proposal.tree,
                           temperature=temperature, filters=filters, u=u, bonus_noise=bonus_noise,
                           attention=attention)
    return verify_chain(target, drafter, anchor, anchor_pos, active, proposal, temperature=temperature,
                        filters=filters, u=u, bonus_noise=bonus_noise, backend=backend,
                        attention=attention, num_tokens=num_tokens)


def verify_chain(target, drafter, anchor, anchor_pos, active, proposal: Proposal, *, temperature,
                 filters, u, bonus_noise, backend, attention, num_tokens: Optional[int]):
    """Steps 3-5 for a chain: one target pass over each row's anchor and drafts with capture,
    acceptance, commit. num_tokens None: each row sends its K+1 slots; N: the rows' 1 + ℓ tokens
    flattened and padded to N (`model.Ragged`). attention: the cache attention `verify` chose."""
    drafts, verify_len, q, confidence, _ = proposal
    K = drafts.shape[1]
    device = anchor.device
    capture = captured(drafter)
    # 3. Verify: the target scores the anchor and the drafts sent (all K, or 1 + ℓ a row when ragged)
    # in one pass, capturing features.
    tokens = torch.cat([anchor[:, None], drafts], dim=1)  # [B, K+1]
    steps = torch.arange(K + 1, device=device)
    positions = anchor_pos[:, None] + steps  # [B, K+1]
    if num_tokens is None:
        logits, features = target(tokens, positions, capture=capture, attention=attention)
    else:
        counts = tokens_sent(verify_len, active)
        ragged = Ragged.build(counts, K + 1, num_tokens)
        flat = ragged.flatten(tokens)  # [1, N]
        # positions stay [B, K+1]: the cache is written and masked per row, `ragged` maps the tokens
        logits, features = target(flat, positions, capture=capture, ragged=ragged, attention=attention)
        logits = ragged.pad(logits)  # [B, K+1, V]: zeros past a row's 1 + ℓ tokens, never read
        if features is not None:
            features = ragged.pad(features)
    # 4. Accept: the longest prefix the rejection rule keeps, then one token of the target's own.
    if temperature == 0:
        accepted, next_token = sampling.accept_greedy(drafts, logits, verify_len)
    else:
        accept = sampling.accept_sampled
        if backend == "triton":
            accept = kernels.accept_sampled
        accepted, next_token = accept(drafts, q, logits, verify_len, temperature, u=u,
                                      noise=bonus_noise, filters=filters)
    # 5. Commit: the drafter's context cache gets the target's features at positions a .. a+K. Past
    # a+n they are stale, as are the target's: the anchor moves to a+n+1, and every position a later
    # pass reads past its anchor is one that pass writes first.
    if drafter is not None:
        commit_drafter(drafter, features, positions, drafts, accepted, next_token)
    used = torch.minimum(steps, accepted[:, None])  # logits 0 .. n: the accepted drafts', the next token's
    finite = finite_rows(logits).gather(1, used).all(dim=1)
    # the drafter's side too: the q its drafts were sampled from, the confidences a schedule reads
    if q is not None:
        finite = finite & finite_rows(q).all(dim=1)
    if confidence is not None:
        finite = finite & torch.isfinite(confidence).all(dim=1)
    packed = pack_record(drafts=drafts, verified=verify_len, accepted=accepted, bonus=next_token,
                         finite=finite, confidence=confidence)
    next_anchor, next_pos = advance(active, anchor, anchor_pos, accepted, next_token)
    return packed, next_anchor, next_pos


def finite_rows(logits) -> torch.Tensor:
    """[...]: whether every logit of each row of logits [..., V] is finite. One NaN makes a sampled
    row's softmax all NaN, whichever token the race then returns. A NaN or an infinity anywhere in a
    row shows in its max or its min: two reductions, no [..., V] temporaries."""
    row_max = logits.amax(dim=-1)
    row_min = logits.amin(dim=-1)
    return torch.isfinite(row_max) & torch.isfinite(row_min)


def commit_drafter(drafter, features, positions, drafts, accepted, next_token):
    """The drafter's context gains the verified positions [B, K+1], each with the token after it:
    the next draft while it was accepted, then the bonus."""
    bonus = next_token[:, None]  # [B, 1]
    ahead = torch.cat([drafts, bonus], dim=1)  # [B, K+1]
    steps = torch.arange(ahead.shape[1], device=ahead.device)
    kept = steps < accepted[:, None]
    following = torch.where(kept, ahead, bonus)
    drafter.commit_context(features, positions, following, last=accepted)


def advance(active, anchor, anchor_pos, accepted, next_token):
    """The next round's anchors and their positions: an active row's bonus, after its accepted drafts."""
    next_anchor = torch.where(active, next_token, anchor)
    bonus_pos = anchor_pos + accepted + 1
    next_pos = torch.where(active, bonus_pos, anchor_pos)
    return next_anchor, next_pos


def verify_tree(target, drafter, anchor, anchor_pos, active, tree: sampling.Tree, *, temperature,
                filters, u, bonus_noise, attention):
    """Steps 3-5 for draft trees. 3: one target pass scores every node, each seeing the context and its
    own ancestors, at the position of its depth. 4: the target's token at every node (its argmax, or
    multi-draft rejection sampling over the node's sampled children); from the root, the walk follows
    the child holding it. 5: the accepted path's K/V move to consecutive positions. u [B, N+1, N] and
    bonus_noise Exp(1) [B, V]: `choose_at_nodes`' (None at T=0)."""
    B = tree.tokens.shape[0]
    max_depth = drafter.cfg.num_drafts
    device = anchor.device
    batch = torch.arange(B, device=device)
    capture = drafter.cfg.target_layer_ids
    # 3. Verify: every node, in slots a .. a+N of the cache, at RoPE positions a + its depth.
    ancestry = sampling.ancestors(tree, max_depth)  # [B, N+1, N+1] each node's ancestors and itself
    tree_slots = TreeSlots(anchor_pos, ancestry)
    positions = anchor_pos[:, None] + tree.depths
    logits, features = target(tree.tokens, positions, capture=capture, attention=attention,
                              tree_slots=tree_slots)
    # 4. Accept: the token each node's acceptance gives; the walk stops where no child holds it.
    if temperature == 0:
        chosen = torch.argmax(logits, dim=-1)  # [B, N+1] the target's own
    else:
        p = sampling.probs(logits, temperature, filters)  # [B, N+1, V]
        chosen = sampling.choose_at_nodes(tree, p, u, bonus_noise)
    path, accepted, next_token = sampling.walk_tree(tree, chosen, max_depth)  # path [B, max_depth+1]
    # 5. Commit: the path's K/V to positions a .. a+max_depth, its features to the drafter's context.
    steps = torch.arange(max_depth + 1, device=device)
    path_positions = anchor_pos[:, None] + steps  # where the path's tokens belong
    path_slots = anchor_pos[:, None] + path  # where the tree pass wrote the path's K/V
    target.move_cache(path_slots, path_positions)
    path_tokens = tree.tokens.gather(1, path)  # [B, max_depth+1], from the anchor
    path_features = features[batch[:, None], path]
    commit_drafter(drafter, path_features, path_positions, path_tokens[:, 1:], accepted, next_token)
    finite = finite_rows(logits).gather(1, path).all(dim=1)  # the accepted nodes', the last one's again
    if tree.q is not None:  # ... and the q each node's children were drawn from
        finite = finite & finite_rows(tree.q).all(dim=1)
    nodes = tree.tokens[:, 1:]
    parents = tree.parents[:, 1:]
    reached = (parents >= 0).sum(dim=1)  # the nodes the search found (at most N)
    packed = pack_record(drafts=nodes, verified=reached, accepted=accepted, bonus=next_token,
                         finite=finite, parents=parents, path=path[:, 1:])
    next_anchor, next_pos = advance(active, anchor, anchor_pos, accepted, next_token)
    return packed, next_anchor, next_pos


class RoundRecord(NamedTuple):
    """One row of a round's record (`record_widths`)."""
    drafts: list[int]                  # a chain's drafts, or a tree's nodes after the root
    verified: int                      # drafts sent to the target (a tree: the nodes its search reached)
    accepted: int
    bonus: int                         # the next token: the bonus, or the correction after a rejection
    finite: bool                       # the logits, q and confidences the round read were finite
    confidence: Optional[list[float]]
    parents: Optional[list[int]] = None  # a tree's nodes' parents (0: the root; -1: unreached)
    path: Optional[list[int]] = None     # a tree's accepted nodes, the first `accepted` of these


def record_widths(draft_width: int, confidence: bool, path_width: int = 0) -> dict:
    """The round record's columns and their widths: the one place its layout is written, the
    columns in RoundRecord's field order. `pack_record` fills it on the device (the round's one
    transfer to the host), `unpack` reads it. path_width: a tree's deepest path (0: a chain,
    without parents and path)."""
    widths = {"drafts": draft_width, "verified": 1, "accepted": 1, "bonus": 1, "finite": 1}
    widths["confidence"] = 0
    if confidence:
        widths["confidence"] = draft_width
    if path_width:
        widths["parents"] = draft_width
        widths["path"] = path_width
    return widths


def pack_record(**columns) -> torch.Tensor:
    """float64 [B, Σ widths]: the given columns ([B] or [B, width]) in `record_widths`' order, the
    order of RoundRecord's fields."""
    parts = []
    for name in RoundRecord._fields:
        column = columns.get(name)
        if column is not None:
            B = column.shape[0]
            parts.append(column.reshape(B, -1).double())
    return torch.cat(parts, dim=1)


def unpack(packed: torch.Tensor, widths: dict) -> list[RoundRecord]:
    """`pack_record`'s rows, read on the host."""
    rows = []
    for r in packed.tolist():
        values = {}
        at = 0
        for name in RoundRecord._fields:  # pack_record's order
            if name in widths:
                values[name] = r[at:at + widths[name]]
                at += widths[name]
        for name in ("drafts", "parents", "path"):  # token and node columns (a tree's: the last two)
            if name in values:
                values[name] = [int(x) for x in values[name]]
        for name in ("verified", "accepted", "bonus"):
            values[name] = int(values[name][0])
        values["finite"] = bool(values["finite"][0])
        # width 0: no confidence head, or a tree round
        values["confidence"] = values["confidence"] or None
        rows.append(RoundRecord(**values))
    return rows


def prefill(target, drafter, prompts: list[list[int]], temperature, noise, device, rows=None,
            filters=NO_FILTERS):
    """Prompts (right-padded) into cache rows 0..len-1, or `rows`, with the drafter's context. Returns
    each one's first token (-1: its logits are not finite) and its position."""
    B = len(prompts)
    lengths = [len(p) for p in prompts]
    lens = torch.tensor(lengths, device=device)
    P = max(lengths)
    padded = []
    for p in prompts:  # each right-padded with its last token
        padding = [p[-1]] * (P - len(p))
        padded.append(p + padding)
    tokens = torch.tensor(padded, device=device)  # [B, P]
    positions = torch.arange(P, device=device).expand(B, P)
    capture = captured(drafter)
    last = lens - 1
    logits, features = target(tokens, positions, capture=capture, logits_index=last, rows=rows)
    first = sampling.sample(logits, temperature, noise=noise, filters=filters)
    finite = finite_rows(logits)
    first = torch.where(finite, first, -1)
    if drafter is not None:
        batch = torch.arange(B, device=device)
        following = torch.roll(tokens, -1, dims=1)  # the token after each prompt position ...
        following[batch, last] = first.clamp(min=0)  # ... the first new one after the last
        drafter.commit_context(features, positions, following, last, rows)
    return first, lens


# Compiling: one graph per half of a round (a ragged verify, one per bucket), static shapes; on a
# CPU frozen weights and a C++ wrapper, on CUDA reduce-overhead (CUDA graphs).
CUDA_RECIPE = "reduce-overhead"  # `compiled`'s CUDA mode, as `captures_cuda_graphs` reads it


def compiled(fn, device, mode: Optional[str] = None, verbose: bool = False):
    """`fn` compiled whole: the project's recipe for `device`, or `mode` (--compile-mode) instead, which
    on a CPU also leaves out freezing and the C++ wrapper."""
    import torch._inductor.select_algorithm as select

    on_cuda = str(device).startswith("cuda")
    cpu_recipe = not on_cuda and mode is None
    if cpu_recipe:
        options = {"max_autotune": True}
    else:
        options = torch._inductor.list_mode_options(mode or CUDA_RECIPE)
    options["max_autotune_report_choices_stats"] = False  # no JSON blob per autotuned op
    select.PRINT_AUTOTUNE = verbose  # the autotuning tables, on stderr
    graph = torch.compile(fn, fullgraph=True, dynamic=False, options=options)
    if not cpu_recipe:
        return graph

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with torch.no_grad(), torch._inductor.config.patch(freezing=True, cpp_wrapper=True):
            return graph(*args, **kwargs)
    return call


def captures_cuda_graphs(device, mode: Optional[str] = None) -> bool:
    """Whether `compiled(fn, device, mode)` captures CUDA graphs: only on CUDA, and there with the
    recipe (CUDA_RECIPE) or max-autotune, not default or max-autotune-no-cudagraphs."""
    on_cuda = str(device).startswith("cuda")
    if not on_cuda:
        return False
    options = torch._inductor.list_mode_options(mode or CUDA_RECIPE)
    return bool(options.get("triton.cudagraphs"))


def own_code(fn):
    """`fn` with a code object of its own: graphs are kept per code object, so the cut-down guards
    (`Engine.generate`) never mistake another engine's graph for this one's."""
    code = fn.__code__.replace()
    copy = FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


# The engine

class NonFinite(UserError):
    def __init__(self, request: int, where: str):
        super().__init__(f"request {request}, {where}: the logits are not finite (NaN or Inf), the "
                         f"target's or the drafter's: "
                         f"check the checkpoints' weights and config (rope_theta, rms_norm_eps) "
                         f"and --temperature")


@dataclass
class Request:
    index: int
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    rounds: list[dict] = field(default_factory=list)  # trace records
    finish_reason: Optional[str] = None
    started: Optional[float] = None   # perf_counter at admission ...
    finished: Optional[float] = None  # ... and at the last token
    prompt: int = 0
    sample: int = 0


def drafts_per_round(drafter, num_drafts: Optional[int] = None) -> int:
    """K: an Eagle3 chain's `num_drafts` (--draft-length), else the drafter's own (a block drafter drafts
    its block whatever is asked); 0 without a drafter."""
    if drafter is None:
        return 0
    if drafter.cfg.layout == "eagle3" and num_drafts:
        return num_drafts
    return drafter.cfg.num_drafts


def cache_length(longest_prompt: int, max_new_tokens: int, drafter,
                 num_drafts: Optional[int] = None, tree_budget: int = 0) -> int:
    """Cache positions: prompt + budget + two rounds' windows. A round can move a row's anchor up to a
    window past its budget (the host cuts the tokens, not the anchor), and a finished row's idle rounds
    still write a window from there."""
    width = 1
    if drafter is not None:
        K = drafts_per_round(drafter, num_drafts)
        width = max(drafter.cfg.block_size, K + 1, tree_budget + 1)
    return longest_prompt + max_new_tokens + 2 * width


class Caches(NamedTuple):
    """The tensors a model's compiled graphs hold (`caches`)."""
    rope: torch.Tensor
    kv: list                         # each layer's KVCache
    carried: Optional[torch.Tensor]  # an Eagle3 drafter's state at each row's last commit

    def same(self, other: "Caches") -> bool:
        """Whether both hold the very same tensors."""
        kv_pairs = list(zip(self.kv, other.kv))
        pairs = [(self.rope, other.rope), (self.carried, other.carried)] + kv_pairs
        return all(a is b for a, b in pairs)


def caches(model) -> Caches:
    kv = [layer.self_attn.kv_cache for layer in model.layers]
    carried = getattr(model, "carried", None)
    return Caches(model.rope, kv, carried)


# Each keeps its caches (`Engine.held`) while it lives, whatever a later engine sets up.
LIVE_ENGINES: "weakref.WeakSet[Engine]" = weakref.WeakSet()


def reclaimed_cache_bytes(models: list, batch: int, max_seq: int, dtype: torch.dtype) -> int:
    """Bytes of the caches `models` hold now that new caches of batch x max_seq positions take over:
    a model's are reused at that size and dtype, and freed unless a live engine keeps them."""
    total = 0
    for model in models:
        if model.layers[0].self_attn.kv_cache is None:  # no engine has set up caches on it
            continue
        now = caches(model)
        kept = any(now.same(held) for e in LIVE_ENGINES for held in e.held)
        reused = caches_fit(model, batch, max_seq, dtype)
        if reused or not kept:
            total += sum(c.k.nbytes + c.v.nbytes for c in now.kv)
    return total


def trace_record(req: Request, rec: RoundRecord) -> dict:
    """A request's round as the trace writes it (docs/trace-format.md); a tree's adds its shape and
    the nodes the walk took."""
    entry = {"request": req.index, "round": len(req.rounds), "anchor": req.output_ids[-1],
             "draft": rec.drafts, "confidence": rec.confidence, "verified": rec.verified,
             "accepted": rec.accepted, "bonus": rec.bonus}
    if rec.path is not None:
        entry["parents"] = rec.parents
        entry["path"] = rec.path[:rec.accepted]
        entry["depth"] = tree_depth(rec.parents)
    return entry


def tree_depth(parents: list[int]) -> int:
    """How deep a tree reaches, from its nodes' parents (0: the root; -1: a node not reached)."""
    depths = [0]  # the root's
    for parent in parents:
        if parent >= 0:
            depths.append(depths[parent] + 1)
        else:
            depths.append(0)
    return max(depths)


@dataclass
class Rows:
    """The engine's batch rows during a decode: the request each one holds (None: free), its sampling
    generator, and every row's anchor and its position on the device."""
    requests: list
    generators: list
    anchor: torch.Tensor      # [B] each row's last committed token
    anchor_pos: torch.Tensor  # [B] its position
    live: Optional[list] = None              # which rows held a request when `mask` was made
    mask: Optional[torch.Tensor] = None      # [B] bool, on the device

    @staticmethod
    def empty(batch: int, device) -> "Rows":
        zeros = torch.zeros(batch, dtype=torch.long, device=device)
        return Rows([None] * batch, [None] * batch, zeros, zeros.clone())

    def free(self) -> list[int]:
        return [i for i, r in enumerate(self.requests) if r is None]

    def busy(self) -> bool:
        return any(r is not None for r in self.requests)

    def active(self) -> torch.Tensor:
        """[B] bool: the rows holding a request (copied to the device only when that changes)."""
        live = [r is not None for r in self.requests]
        if live != self.live:
            self.live = live
            self.mask = torch.tensor(live, device=self.anchor.device)
        return self.mask


class Engine:
    """Requests through prefill and rounds in `batch_size` rows (continuous batching). A round
    is `draft` then `verify`, one graph each when compiled; ragged (by default when scheduled), the
    host reads the verify size between them (a bucket when compiled), except "async", planned before.
    `make_engine` builds it from checked settings (flags, `size_engine`, `generate`); its defaults are
    those of a resolved setting (greedy, no schedule, eager). Built by hand, it refuses only what
    would make a round wrong (a batch size, seed, temperature, filters, kernels, schedule or tree
    its flags would refuse, a cache length or stop ids that are no integers: an unknown backend or
    one that cannot run here, an unknown kind, a threshold outside (0, 1] or one its kind leaves
    unread, buckets below a full round, a schedule for a drafter without a confidence head; a tree
    budget or tree temperature outside its range, a tree under a schedule or for a drafter that
    drafts none (no drafter, Eagle3); a schedule without an SPS table, prompts past its cache, and
    those `check_prompts` refuses: empty, outside the vocabulary, past the models' context)."""

    def __init__(self, target: Transformer, drafter=None, *, batch_size: int, max_seq: int,
                 temperature: float = 0.0, filters: Filters = NO_FILTERS, seed: int = Settings.seed,
                 stop_ids=(), stop_strings=None, scheduler: str = "none",
                 threshold: float = Settings.confidence_threshold,
                 buckets=None, ragged: Optional[bool] = None, compile: bool = False,
                 compile_mode: Optional[str] = None, compile_verbose: bool = False,
                 backend: str = Settings.kernels, num_drafts: Optional[int] = None,
                 tree_budget: int = Settings.tree_budget,
                 tree_temperature: float = Settings.tree_temperature):
        flags.check_engine_size(batch_size, max_seq, seed, stop_ids)
        flags.check_temperature(temperature, "Engine temperature")
        flags.check_filters(filters)
        K = drafts_per_round(drafter, num_drafts)
        flags.check_schedule(scheduler, threshold, buckets, drafter, batch_size, K)
        flags.check_tree(tree_budget, tree_temperature, scheduler, drafter)
        flags.check_kernels(backend, target.embed_tokens.weight.device)
        self.target = target
        self.drafter = drafter
        self.stop_ids = set(stop_ids)
        self.stop_strings = stop_strings
        self.max_batch = batch_size
        self.max_seq = max_seq
        self.temperature = temperature
        self.filters = filters  # greedy: none (flags.sampling_for)
        self.seed = seed  # request i samples from its own generator, seeded seed + i
        self.backend = backend
        self.compile_mode = compile_mode
        self.is_compiled = compile
        self.device = target.embed_tokens.weight.device
        self.models = [m for m in (target, drafter) if m is not None]
        for m in self.models:
            m.setup_caches(batch_size, max_seq)
        self.held = [caches(m) for m in self.models]  # each model's, for `own_caches` to put back
        LIVE_ENGINES.add(self)
        self.K = K
        self.tree_budget = tree_budget
        self.tree_temperature = tree_temperature
        V = target.args.vocab_size
        self.noise_shape = sampling.noise_shape(self.K, V, tree_budget)  # a sampled round's, a row
        has_confidence = drafter is not None and drafter.confidence_head is not None
        if tree_budget:  # a record holds the tree's nodes, their parents and the accepted path
            self.widths = record_widths(draft_width=tree_budget, confidence=False, path_width=self.K)
        else:
            self.widths = record_widths(draft_width=self.K, confidence=has_confidence)
        self.scheduler = sched.Scheduler(scheduler, self.K, batch_size, threshold=threshold,
                                         buckets=buckets, compiled=compile, device=self.device)
        if scheduler == "async" and ragged is False:  # its plan sizes every round's verify itself
            raise UserError("ragged=False: the async schedule verifies each row's own drafts, ragged")
        self.ragged = ragged
        if ragged is None:  # by default, a scheduled engine sends each row's own number of drafts
            self.ragged = scheduler != "none"
        self.draft_fn = draft
        self.verify_fn = verify
        if compile:
            self.draft_fn = compiled(own_code(draft), self.device, compile_mode, compile_verbose)
            self.verify_fn = compiled(own_code(verify), self.device, compile_mode, compile_verbose)
        self.cuda_graphs = compile and captures_cuda_graphs(self.device, compile_mode)
        if compile and self.ragged:  # one verify graph per bucket, all expected
            graphs = len(self.scheduler.profile_points) + 1
            # the limit is the process's: each such engine raises it by its own graphs
            torch._dynamo.config.recompile_limit += graphs
        self.prefill_seconds = 0.0
        self.decode_seconds = 0.0
        self.compile_seconds = 0.0
        self.warmed = False
        self.skip_guards = True  # False: evaluate every guard (bench.py)

    def round(self, anchor, anchor_pos, active, noise: Optional[sampling.Noise], verify_len=None,
              plan=None):
        """The device half of a round for every row: draft, the host's read of the verify size where
        ragged, verify. verify_len [B] (profiling): exactly these drafts; plan: async's. Returns
        `verify`'s packed record, next anchors and positions."""
        if self.cuda_graphs:  # one CUDA-graph generation per round: verify reads draft's outputs
            torch.compiler.cudagraph_mark_step_begin()
        if noise is None:  # greedy
            noise = sampling.Noise(None, None, None)
        capacity = None
        num_tokens = None
        if plan is not None:
            capacity = plan.tensor
            num_tokens = plan.num_tokens
        carried = getattr(self.drafter, "carried", None)  # Eagle3's h at each row's last commit
        proposal = self.draft_fn(self.drafter, anchor, anchor_pos, active, noise=noise.draft,
                                 temperature=self.temperature, filters=self.filters,
                                 schedule=self.scheduler, backend=self.backend, num_drafts=self.K,
                                 tree_budget=self.tree_budget, tree_temperature=self.tree_temperature,
                                 capacity=capacity, carried=carried)
        if verify_len is not None:
            proposal = proposal._replace(verify_len=verify_len)
        if self.ragged and plan is None:  # the host read between the halves
            sent = int(tokens_sent(proposal.verify_len, active).sum())
            num_tokens = self.scheduler.bucket(sent)
            if verify_len is not None:  # profiling: exactly this size
                num_tokens = sent
        return self.verify_fn(self.target, self.drafter, anchor, anchor_pos, active, proposal,
                              temperature=self.temperature, filters=self.filters, u=noise.u,
                              bonus_noise=noise.bonus, backend=self.backend, num_tokens=num_tokens)

    def own_caches(self):
        """Put this engine's caches back (another engine may have replaced them; graphs hold these)."""
        for m, mine in zip(self.models, self.held):
            if caches(m).same(mine):
                continue
            m.register_buffer("rope", mine.rope, persistent=False)
            for layer, kv in zip(m.layers, mine.kv):
                layer.self_attn.kv_cache = kv
            if mine.carried is not None:
                m.carried = mine.carried

    def clear_caches(self):
        """Zero every cache slot. Eager attention multiplies a masked slot's value by a weight of 0, so
        a NaN a failed decode left there would spread to rows that never read it."""
        for m in self.models:
            for layer in m.layers:
                kv = layer.self_attn.kv_cache
                kv.k.zero_()
                kv.v.zero_()

    def generate(self, requests: list[Request], max_new_tokens: int, on_round=None, on_finish=None,
                 on_step=None):
        """Decode `requests`, a finished one's row taking the next at once. Every round runs every
        row (free rows inactive): static shapes. Warmed up, guards are cut to what tells the graphs
        apart. on_round(request, entry): the round's trace entry (`trace_record`); on_finish(request),
        on_step() after each batch round. It takes no turn on the models (`decode` does, with
        `Models.engine_turn`): called directly, keeping other work off them is the caller's."""
        if not flags.whole_number(max_new_tokens) or max_new_tokens < 1:  # the prefill's is the first
            raise UserError(f"Engine.generate: max_new_tokens={max_new_tokens!r}, an integer, at least 1")
        runs_rounds = max_new_tokens > 1  # a budget of 1 ends every request at the prefill's token
        kind = self.scheduler.kind
        if kind in sched.SPS_KINDS and not self.scheduler.measured and runs_rounds:  # built by hand
            fix = "engine.scheduler.set_sps(scheduler.load_or_profile(engine, path))"
            raise UserError(f"Engine(scheduler={kind!r}): no SPS table, so every draft would be "
                            f"verified; make_engine reads or profiles one, or call {fix} first")
        prompts = [r.prompt_ids for r in requests]
        names = [f"Engine.generate: request {r.index}" for r in requests]
        check_prompts(prompts, self.target, max_new_tokens, drafter=self.drafter, sources=names)
        longest = max((len(r.prompt_ids) for r in requests), default=0)
        need = cache_length(longest, max_new_tokens, self.drafter, self.K, self.tree_budget)
        if need > self.max_seq:  # longer prompts or a larger budget than the engine was sized for
            asked = f"a {longest}-token prompt and --max-new-tokens {max_new_tokens}"
            fix = f"make_engine for these prompts (or Engine(max_seq={need}))"
            raise UserError(f"{asked} need {need} cache positions a row, and the engine holds "
                            f"{self.max_seq}: {fix}")
        self.own_caches()
        self.clear_caches()
        for m in self.models:  # the CPU kernels' weight copies follow edits made since the last call
            cpu_kernels.refresh(m)
        if self.is_compiled and not self.warmed and runs_rounds:  # built by hand: compiled first
            self.warmup()
        self.scheduler.reset()
        rows = Rows.empty(self.max_batch, self.device)
        waiting = list(reversed(requests))  # pop() takes them in order
        with self.stance():
            self.admit(rows, waiting, max_new_tokens, on_finish)
            while rows.busy():
                t0 = time.perf_counter()
                rounds = self.step(rows, max_new_tokens)
                self.decode_seconds += time.perf_counter() - t0
                for req, entry in rounds:  # the callbacks' time (a trace's writes) is not decoding's
                    if on_round is not None:
                        on_round(req, entry)
                    if req.finish_reason is not None:
                        self.finish(req, on_finish)
                if on_step is not None:
                    on_step()
                self.admit(rows, waiting, max_new_tokens, on_finish)
        return requests

    def admit(self, rows: "Rows", waiting: list[Request], max_new_tokens: int, on_finish):
        """Prefill waiting requests into free rows (again, while one ends at its first token)."""
        V = self.target.args.vocab_size
        while waiting and rows.free():
            t0 = time.perf_counter()
            free = rows.free()[:len(waiting)]
            new = [waiting.pop() for _ in free]
            noise = None
            if self.temperature > 0:  # a request's draws depend only on the seed and its index
                draws = []
                for i, req in zip(free, new):
                    generator = torch.Generator(device=self.device)
                    seed = self.seed + req.index
                    rows.generators[i] = generator.manual_seed(seed)
                    first_race = sampling.exponential((V,), generator, self.device)
                    draws.append(first_race)
                noise = torch.stack(draws)
            index = torch.tensor(free, device=self.device)
            cache_rows = None  # rows 0 .. n-1: the prefill writes them without an index
            if free != list(range(len(free))):
                cache_rows = index
            prompts = [r.prompt_ids for r in new]
            first, lens = prefill(self.target, self.drafter, prompts, self.temperature, noise,
                                  self.device, rows=cache_rows, filters=self.filters)
            rows.anchor = rows.anchor.index_copy(0, index, first)
            rows.anchor_pos = rows.anchor_pos.index_copy(0, index, lens)
            ended = []
            for i, req, token in zip(free, new, first.tolist()):
                req.started = t0
                if token < 0:
                    raise NonFinite(req.index, "the prefill")
                self.append_output(req, [token], max_new_tokens)
                if req.finish_reason is None:
                    rows.requests[i] = req
                else:
                    ended.append(req)
            self.prefill_seconds += time.perf_counter() - t0
            for req in ended:
                self.finish(req, on_finish)

    def step(self, rows: "Rows", max_new_tokens: int) -> list:
        """One round of the engine: each row's noise, `round`, its packed record read once on the host,
        each request's new tokens appended to its output (a finished one's row freed). Returns each
        request's (request, trace entry) of the round."""
        active = rows.active()
        noise = None
        if self.temperature > 0:
            generators = list(rows.generators)  # a free row's noise is a placeholder
            for i in rows.free():
                generators[i] = None
            noise = sampling.rows_noise(generators, self.noise_shape, self.device)
        plan = None
        if self.scheduler.kind == "async":
            held = len(rows.requests) - len(rows.free())
            plan = self.scheduler.plan(held)
        packed, anchor, anchor_pos = self.round(rows.anchor, rows.anchor_pos, active, noise, plan=plan)
        if self.cuda_graphs:  # outlive the next graph replay
            anchor = anchor.clone()
            anchor_pos = anchor_pos.clone()
        rows.anchor = anchor
        rows.anchor_pos = anchor_pos
        records = unpack(packed, self.widths)  # the one host read
        if plan is not None:  # the history that sizes the round after next
            # the confidences of the rows holding a request
            confidences = [rec.confidence for rec, req in zip(records, rows.requests) if req is not None]
            self.scheduler.observe(confidences)
        rounds = []
        for i, (req, rec) in enumerate(zip(rows.requests, records)):
            if req is None:
                continue
            if not rec.finite:
                raise NonFinite(req.index, f"round {len(req.rounds)}")
            entry = trace_record(req, rec)
            if plan is not None:
                entry.update(plan.trace())
            req.rounds.append(entry)
            new_tokens = metrics.accepted_tokens(entry) + [rec.bonus]
            self.append_output(req, new_tokens, max_new_tokens)
            rounds.append((req, entry))
            if req.finish_reason is not None:
                rows.requests[i] = None
        return rounds

    @staticmethod
    def finish(req: Request, on_finish):
        req.finished = time.perf_counter()
        if on_finish is not None:
            on_finish(req)

    def append_output(self, req: Request, tokens: list[int], budget: int):
        """Append up to the budget and the first stop token; a stop string cuts after its last token."""
        before = len(req.output_ids)
        for t in tokens:
            if req.finish_reason is not None:
                break
            req.output_ids.append(t)
            if t in self.stop_ids:
                req.finish_reason = "stop"
            elif len(req.output_ids) >= budget:
                req.finish_reason = "length"
        if self.stop_strings is not None and len(req.output_ids) > before:
            keep = self.stop_strings.keep(req.output_ids, before)
            if keep is not None:
                del req.output_ids[keep:]
                req.finish_reason = "stop"

    def dummy_round(self, num_tokens: Optional[int] = None):
        """A round at position 0 filling `num_tokens` verify tokens (None: the engine's schedule), for
        compiling and profiling: throwaway noise, cache rows rewritten before they are read."""
        self.own_caches()
        B = self.max_batch
        dev = self.device
        W = self.K + 1  # a chain row's verify tokens at most (a tree's rows each verify all N + 1 nodes)
        zeros = torch.zeros(B, dtype=torch.long, device=dev)  # every row's anchor ...
        anchor_pos = zeros.clone()  # ... and its position
        noise = None
        if self.temperature > 0:
            generator = torch.Generator(device=dev).manual_seed(0)
            noise = sampling.round_noise(generator, B, self.noise_shape, dev)
        active = torch.zeros(B, dtype=torch.bool, device=dev)
        verify_len = None
        plan = None
        if num_tokens is not None:
            starts = W * torch.arange(B, device=dev)  # rows filled in order
            counts = (num_tokens - starts).clamp(0, W)
            active = counts > 0
            verify_len = (counts - 1).clamp(min=0)
            if self.scheduler.kind == "async":
                plan = self.scheduler.fixed(num_tokens)
        packed, _, _ = self.round(zeros, anchor_pos, active, noise, verify_len=verify_len, plan=plan)
        return packed.tolist()  # the host's read: waits for the round

    def stance(self):
        """How rounds find their graphs: warmed up, guards cut to what tells the graphs apart."""
        skip = self.is_compiled and self.warmed and self.skip_guards
        return torch.compiler.set_stance("default", skip_guard_eval_unsafe=skip)

    def warmup(self):
        """Compile every graph a round can call before anything is timed."""
        t0 = time.perf_counter()
        s = self.scheduler
        sizes = [None]
        if self.ragged:
            sizes = s.buckets or [s.profile_points[-1]]
        with warnings.catch_warnings():
            # Inductor's autotuner calls the deprecated tensor.storage(): torch's own, not the user's
            warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
            for n in sizes:
                self.dummy_round(n)
        self.compile_seconds += time.perf_counter() - t0
        self.warmed = True


# The Python API: load once, generate many times. Its arguments are the flags, checked once here.

def load(target: Optional[str] = None, drafter: Optional[str] = None, *, device: str = "cpu",
         dtype: Optional[str] = None, calibration: Optional[str] = None,
         cpu_kernels: bool = True) -> Models:
    """The models for `generate`: checkpoint directories or hub ids; with neither, the demo pair.
    cpu_kernels=False: the plain model on CPU float32 too, every module running as written (the
    kernels replace the linear layers' forwards, `Attention.project` and few-token attention)."""
    target = path_argument(target, "--target")
    drafter = path_argument(drafter, "--drafter")
    calibration = path_argument(calibration, "--calibration")
    if not isinstance(device, str) or not device:  # no default to fall back on: "cpu" is load's
        raise UserError(f"load(): device={device!r} (\"cpu\" or \"cuda\")")
    cpu_kernels = flags.python_bool(cpu_kernels)
    if not isinstance(cpu_kernels, bool):
        raise UserError(f"load(): cpu_kernels={cpu_kernels!r} (True or False)")
    if target is None and drafter is None:
        if not os.path.isdir(DEMO_DIR):
            raise UserError(f"load(): no target given, and the demo pair is not at {DEMO_DIR} (it stays in "
                            f"the checkout: install with pip install -e, or give a target)")
        target = os.path.join(DEMO_DIR, "target")
        drafter = os.path.join(DEMO_DIR, "drafter")
    return load_models(target, drafter, device=device, dtype=dtype, calibration=calibration,
                       cpu_kernels=cpu_kernels)


class EngineSize(NamedTuple):
    batch: int                       # cache rows: the batch size, at most the requests
    max_seq: int                     # positions a row
    buckets: Optional[list[int]]     # --verify-buckets, checked against the drafter


def size_engine(m: Models, drafter, prompts: list[list[int]], s: Settings,
                max_seq: Optional[int] = None) -> EngineSize:
    """What an engine for `drafter` (None: autoregressive) holds for the prompts (at least `max_seq`
    positions a row), after the settings that depend on the drafter are checked and the caches (and a
    sampled tree's round) are checked against free memory: a refusal comes before any decoding."""
    flags.check_drafter_settings(s, drafter)
    requests = len(prompts) * s.num_samples
    batch = min(s.batch_size, requests)
    longest = max(map(len, prompts))
    need = cache_length(longest, s.max_new_tokens, drafter, s.draft_length, s.tree_budget)
    max_seq = max(need, max_seq or 0)
    device = m.target.embed_tokens.weight.device
    tree_bytes = 0
    if s.tree_budget:
        sampled = flags.sampling_for(m, s).temperature > 0
        tree_bytes = flags.tree_round_bytes(m.target, drafter, s.tree_budget, sampled)
    models = [m.target]
    if drafter is not None:
        models.append(drafter)
    dtype = m.target.embed_tokens.weight.dtype
    reclaimed = reclaimed_cache_bytes(models, batch, max_seq, dtype)
    flags.check_cache_memory(m.target, drafter, batch, max_seq, device, tree_bytes,
                             reclaimed=reclaimed)
    buckets = None
    if drafter is not None:
        buckets = sched.parse_buckets(s.verify_buckets, batch, drafter)
    return EngineSize(batch, max_seq, buckets)


def make_engine(m: Models, drafter, prompts: list[list[int]], s: Settings, *,
                max_seq: Optional[int] = None, verbose: bool = True) -> Engine:
    """The engine for `drafter` (None: autoregressive) sized for the prompts (at least `max_seq`
    positions a row), compiled and warmed up when asked (eager: one untimed round), its SPS table
    read or profiled; none of this for --max-new-tokens 1, which runs no round, unless --sps-table
    asks for the table. One thread at a time sets up or runs an engine on `m`
    (`Models.engine_turn`)."""
    flags.check_engine_inputs(m, prompts, s, drafter)
    with m.engine_turn():  # the models' caches become this engine's
        size = size_engine(m, drafter, prompts, s, max_seq)
        kind = flags.scheduler_kind(s, drafter)
        threshold = 0.0  # read only under its own kind (an autoregressive engine schedules none)
        if kind == "threshold":
            threshold = s.confidence_threshold
        drawn = flags.sampling_for(m, s)
        stop_ids = m.stop_ids
        if s.ignore_eos:
            stop_ids = ()
        stop_strings = StopStrings.build(m.tokenizer, s.stop)
        engine = Engine(m.target, drafter, batch_size=size.batch, max_seq=size.max_seq,
                        temperature=drawn.temperature, filters=drawn.filters, seed=s.seed,
                        stop_ids=stop_ids, stop_strings=stop_strings, scheduler=kind,
                        threshold=threshold, buckets=size.buckets, compile=s.compile,
                        compile_mode=s.compile_mode, compile_verbose=s.verbose, backend=s.kernels,
                        num_drafts=s.draft_length, tree_budget=s.tree_budget,
                        tree_temperature=s.tree_temperature)
        table_asked = kind in sched.SPS_KINDS and s.sps_table is not None  # read or written all the same
        sps = None
        if table_asked:  # a table on disk is read, and refused where it does not fit, before any compile
            sps = sched.read_table(engine, s.sps_table, verbose=verbose)
        if s.max_new_tokens == 1 and not table_asked:  # every request ends at the prefill's token
            return engine
        if s.compile:
            engine.warmup()
            if verbose:
                what = "speculative"
                if drafter is None:
                    what = "autoregressive"
                print(f"compiled the {what} round in {engine.compile_seconds:.1f} s", file=sys.stderr)
        else:  # one untimed full round, so that first-call costs (a GPU library's set-up) time no decode
            full_round = engine.scheduler.profile_points[-1]  # every row sends every draft
            engine.dummy_round(full_round)
        if kind in sched.SPS_KINDS:
            if sps is None:  # profiled, warmed up, and written where --sps-table names a file
                sps = sched.load_or_profile(engine, s.sps_table, verbose=verbose)
            engine.scheduler.set_sps(sps)
        return engine


@dataclass
class Completion:
    """One request's result, as the API returns it and the output file records it."""
    request: int                 # prompts in order, each num_samples times
    prompt: int
    sample: int
    text: Optional[str]          # special tokens skipped, cut before a stop string
    output_ids: list[int]        # up to the stop token, or the one completing the stop string
    finish_reason: str           # "stop" or "length"
    num_rounds: int
    acceptance_length: Optional[float]  # τ
    prompt_ids: list[int]
    # trace records (not in the output file)
    rounds: list[dict] = field(default_factory=list, repr=False)

    def record(self) -> dict:
        names = [f.name for f in fields(self) if f.name != "rounds"]
        return {name: getattr(self, name) for name in names}


def completion(req: Request, m: Models, engine: Engine) -> Completion:
    text = None
    if m.tokenizer is not None:
        text = m.tokenizer.decode(req.output_ids, skip_special_tokens=True)
        if engine.stop_strings:
            text = engine.stop_strings.cut(text)
    counts = metrics.count([req], K=0, stop_ids=engine.stop_ids)  # K=0: no per-position counts
    tau = metrics.acceptance_length(counts)
    return Completion(request=req.index, prompt=req.prompt, sample=req.sample, text=text,
                      output_ids=list(req.output_ids), finish_reason=req.finish_reason,
                      num_rounds=len(req.rounds), acceptance_length=tau,
                      prompt_ids=list(req.prompt_ids), rounds=list(req.rounds))


def requests_for(prompts: list[list[int]], num_samples: int) -> list[Request]:
    """Request i = prompt i // num_samples, sample i % num_samples."""
    requests = []
    for i in range(len(prompts) * num_samples):
        prompt = i // num_samples
        sample = i % num_samples
        requests.append(Request(i, prompts[prompt], prompt=prompt, sample=sample))
    return requests


def decode(m: Models, prompts: list[list[int]], s: Settings, engine: Engine, *, on_round=None,
           on_finish=None, on_step=None) -> list[Completion]:
    """Every prompt num_samples times on `engine`: the driver of `generate` and of the command line.
    Of `s` it reads num_samples and max_new_tokens; everything else is the engine's, as it was built.
    on_round(request, entry) after each round of a request, with the round's trace entry (`trace_record`);
    on_finish(completion) as each ends; neither may call the API on `m` (`Models.engine_turn`)."""
    flags.check_models(m)
    if not isinstance(engine, Engine):
        raise UserError(f"engine: an Engine (speculate.make_engine(m, m.drafter, prompts, s)), got "
                        f"{type(engine).__name__} {repr(engine)[:60]}")
    if engine.target is not m.target:
        raise UserError("engine: built on other models; make_engine(m, ...) for these models")
    flags.check_engine_inputs(m, prompts, s, engine.drafter)
    requests = requests_for(prompts, s.num_samples)

    def finished(req):
        if on_finish is not None:
            on_finish(completion(req, m, engine))

    with m.engine_turn():  # another engine would put its caches in the models mid-decode
        engine.generate(requests, s.max_new_tokens, on_round, finished, on_step)
    return [completion(r, m, engine) for r in requests]


def generate(m: Models, prompts, *, chat: Optional[bool] = None, system_prompt: Optional[str] = None,
             thinking: bool = False, **settings) -> list[Completion]:
    """One Completion per prompt and sample, in order. `prompts`: one or a list of texts, token-id
    lists or conversations ([{"role", "content"}, ...]). Other arguments: `Settings` (the flags)."""
    flags.check_models(m)
    known = {f.name for f in fields(Settings)}
    unknown = set(settings) - known
    if unknown:
        raise TypeError(f"generate() got unexpected keyword argument {sorted(unknown)[0]!r}")
    device = m.target.embed_tokens.weight.device
    s = flags.check_settings(Settings(**settings), device)
    if m.drafter is None:
        flags.check_no_drafter(s)
    listed = flags.prompt_list(prompts)
    chat = flags.check_rendering(m.tokenizer, chat, system_prompt, thinking, listed)
    ids = []
    for i, p in enumerate(listed):
        prompt_ids = encode(m.tokenizer, p, f"prompt {i}", chat=chat, system_prompt=system_prompt,
                            thinking=thinking)
        ids.append(prompt_ids)
    drawn = flags.check_sampling_reads(m, s)
    # what the command line says at start, as warnings: generation_config.json's keys not applied
    # here, a calibration fitted elsewhere (where this call reads it)
    if drawn.unapplied:
        unapplied = ", ".join(drawn.unapplied)
        warnings.warn(f"{m.generation_source}: not applied here: {unapplied}", stacklevel=2)
    if m.calibration is not None and flags.reads_confidences(s, drawn.temperature):
        note = flags.calibration_note(m, drawn.temperature)
        if note:
            warnings.warn(note.removeprefix("note: "), stacklevel=2)
    engine = make_engine(m, m.drafter, ids, s, verbose=False)
    return decode(m, ids, s, engine)


# The command line: `python speculate.py --help` (its flags: support/flags.py)

def run(args: Args) -> dict:
    """Everything `python speculate.py` does; returns the summary (and every request's output ids)."""
    one_process("speculate.py", "eval.py is the program that runs data-parallel")
    args, demo, lead = flags.resolve_demo(args, DEMO_DIR)
    s = flags.check_command_line(args)
    if args.random_init is None:
        args.target = resolve_checkpoint(args.target, "--target")
        args.drafter = resolve_checkpoint(args.drafter, "--drafter")
        flags.check_files(args)  # not inside the snapshots hub ids resolved to
    with runlog.logged_run(args, "speculate", "speculate.py") as log:
        machine = args.machine
        threads = flags.start_machine(machine, s)
        m = load_models(args.target, args.drafter, device=machine.device, dtype=machine.dtype,
                        random_init=args.random_init, calibration=args.calibration, seed=s.seed)
        temperature = flags.check_sampling_reads(m, s).temperature
        flags.check_calibration_read(args.calibration, s, temperature)
        prompts, sources = flags.read_prompts(args.prompts, args.rendering, m, s, lead)
        check_prompts(prompts, m.target, s.max_new_tokens, drafter=m.drafter, sources=sources)
        report = Report(args, s, m, prompts, threads, log, demo=demo, lead=lead is not None)
        engine = make_engine(m, m.drafter, prompts, s)
        if temperature == 0 and s.num_samples > 1:  # said once nothing refuses the run
            print(f"note: --num-samples {s.num_samples} under greedy decoding: a prompt's samples are "
                  f"the same tokens (a sampling flag, e.g. --temperature 1, draws different ones)",
                  file=sys.stderr)
        if demo:  # the baseline first: the same engine without the drafter, as long cache rows
            report.show_prompt()
            # the drafter's settings off: size_engine refuses both for an engine without a drafter
            # (check_drafter_settings)
            no_drafter = flags.derived(s, tree_budget=0, draft_length=None)
            plain = make_engine(m, None, prompts, no_drafter, max_seq=engine.max_seq)
            with report.decoding(plain, "autoregressive", files=False) as baseline:
                decode(m, prompts, s, plain, on_round=baseline.on_round, on_finish=baseline.on_finish,
                       on_step=baseline.on_step)
        heading = None
        if demo:
            heading = "speculative"
        with report.decoding(engine, heading, announce=not demo) as speculative:
            decode(m, prompts, s, engine, on_round=speculative.on_round, on_finish=speculative.on_finish,
                   on_step=speculative.on_step)
        if demo:
            report.speed_up(baseline, speculative)
        return dict(speculative.summary, outputs=[c.output_ids for c in speculative.done])


def main(argv: Optional[list[str]] = None) -> int:
    one_drafter = {"--drafter": "speculate.py decodes with one (eval.py compares several)"}
    return cli_main(Args, run, argv, once=one_drafter)


if __name__ == "__main__":
    sys.exit(main())
