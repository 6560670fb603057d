"""Each setting declared once and checked once, at the edge: the decode settings (`Settings`), which the
Python API takes as keyword arguments and every program as flags; the flag groups programs share
(`Machine`, `Prompts`, `Rendering`); speculate.py's command line (`Args`); what the defaults resolve to
(sampling from generation_config.json, compiling on CUDA); the command line's own combinations."""

from __future__ import annotations

import numbers
import os
import sys
from dataclasses import dataclass, field, fields, replace
from typing import Literal, Optional

import numpy as np
import torch

import kernels
import scheduler as sched
from drafter import DrafterBase
from sampling import Filters, tree_parent_count
from support import runlog
from support.checkpoint import Models
from support.cli import (
    DTYPES,
    MAX_BLOCK,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    MIN_TEMPERATURE,
    SEED_RANGE,
    AutoBool,
    Repeated,
    UserError,
    check_ranges,
    fits,
    flag,
    flat,
    flat_fields,
    free_memory,
    in_range,
    path_argument,
    resolve_device,
    set_threads,
    use_compile_cache,
)
from support.files import check_input, check_outputs, check_read_apart
from support.runlog import WandbFlags
from support.text import (
    StopStrings,
    all_token_ids,
    auto_chat,
    check_chat_flags,
    check_chat_renders,
    check_prompts,
    encode,
    load_prompts,
)

MAX_REQUESTS = 10_000_000
MAX_TREE_BUDGET = 1024  # a draft tree's nodes at most
DEFAULT_BUDGET = 128  # new tokens per request when none is given (eval.py has the authors' own)

# The decode settings' ranges and choices (a value outside is one line naming the flag).
RANGES = {
    "max_new_tokens": (int, "[1, 10485760]"),
    "seed": (int, SEED_RANGE),
    "num_samples": (int, f"[1, {MAX_REQUESTS}]"),
    "batch_size": (int, "[1, 65536]"),
    "top_k": (int, f"[0, {MAX_TOP_K}]"),
    "temperature": (float, f"[0, {MAX_TEMPERATURE:g}]"),
    "top_p": (float, "(0, 1]"),
    "min_p": (float, "[0, 1]"),
    "confidence_threshold": (float, "[0, 1]"),
    "draft_length": (int, f"[1, {MAX_BLOCK}]"),
    "tree_budget": (int, f"[0, {MAX_TREE_BUDGET}]"),
    "tree_temperature": (float, f"[{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]"),
}
CHOICES = {
    "scheduler": sched.KINDS,
    "compile_mode": ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
    "kernels": ("torch", "triton"),
}


@dataclass
class Settings:
    """How to decode: the Python API's keyword arguments, and the flags of the same names."""

    max_new_tokens: Optional[int] = None
    """Token budget per request (exact). None: 128 (eval.py: the authors' 2048,
    or 128 in its demo mode, capped to what the context leaves the longest prompt)."""
    temperature: Optional[float] = None
    """0 = greedy, else lossless sampling at this temperature. None: with no other sampling setting,
    the target's generation_config.json (greedy without one; bench.py: greedy); 1.0 with only
    filters given."""
    top_k: Optional[int] = None
    """Sample from the K most likely tokens only (0: off), in the target's and the drafter's alike."""
    top_p: Optional[float] = None
    """Then from the most likely tokens that make up probability P (1: off)."""
    min_p: Optional[float] = None
    """Then only tokens at least M times as likely as the most likely one (0: off)."""
    stop: Repeated = ()
    """End a request at this text (repeatable); the text is cut before it."""
    ignore_eos: bool = False
    """Do not stop at the target's EOS tokens."""
    seed: int = 0
    """Request i samples from its own generator seeded seed + i: independent of the batch and
    repeatable under the none and threshold schedules (hardware and async: with the same --sps-table).
    Seeds closer than the number of requests share streams: repeat a run at seed + requests."""
    num_samples: int = 1
    """Run every prompt this many times (independent samples)."""
    batch_size: int = 1
    """Requests decoded together; a finished request's row takes the next at once (continuous batching)."""
    scheduler: Optional[Literal[CHOICES["scheduler"]]] = None
    """How many drafts a round verifies: none (all), threshold, hardware (the paper's Algorithm 1 over
    SPS(B)) or async (its production variant, sized two rounds ahead). Default: threshold if
    --confidence-threshold > 0, else none."""
    confidence_threshold: float = 0.0
    """Verify drafts only up to the first confidence below this; 0 = the whole block."""
    sps_table: Optional[str] = None
    """SPS(B) table for hardware/async: read if it exists (it must match this run), else profiled and
    written there. Without it, profiled at start and not kept."""
    verify_buckets: Optional[str] = None
    """Comma-separated token counts a scheduled round's verification is padded to (one compiled graph
    each), the largest at least a full round, batch x (drafts + 1), the ones past it cut to it. Default:
    compiled 1,2,3,4,6,8,12,... up to that; eager, exact."""
    compile: AutoBool = None
    """torch.compile the round. None: on for cuda, off for cpu (a first compile takes minutes)."""
    compile_mode: Optional[Literal[CHOICES["compile_mode"]]] = None
    """With --compile: this torch.compile mode instead of the recipe (cpu: max-autotune, frozen weights,
    C++ wrapper; cuda: reduce-overhead). "default" is cached across runs but slower (docs/performance.md)."""
    verbose: bool = False
    """With --compile: show what compiling prints (autotuning tables)."""
    kernels: Literal[CHOICES["kernels"]] = "torch"
    """Markov chain, sampled acceptance, cache attention: torch or kernels.py's Triton (cuda; cpu under
    TRITON_INTERPRET=1, which runs outside compiled graphs only: compiled on a cpu, the round runs the
    torch references)."""
    tree_budget: int = 0
    """Draft a tree of this many nodes a round instead of a chain (0: the chain): the block's most likely
    continuations, best first (with a Markov head each branch is conditioned on its own parent's token;
    sampled, a node's children are drawn and accepted by multi-draft rejection sampling), scored in
    one target pass. Block drafters (DSpark, DFlash) without a confidence scheduler. The tree
    is built a depth a step, each depth over up to this many nodes (with a Markov head, their
    log-probabilities over the whole vocabulary at once: batch x budget x vocabulary floats).
    Sampled, each node that draws children has a race over the vocabulary: 82 at 16 nodes with 7
    positions, 370 at 64 (batch x those x vocabulary floats a round). These, and the target's logits
    at the nodes, are counted with the KV caches against the memory free before decoding."""
    tree_temperature: float = 0.3
    """The temperature of the drafter's distributions a tree is ranked by (greedy: which tokens a node's
    children are; sampled, where they are drawn at --temperature: how many each node draws, unless
    the drafter has a confidence head, which then shapes the tree: an error there). Below 1 the tree
    goes deeper along what is likeliest to be the target's own token (a drafter distilled at T = 1
    spreads its mass thin); 1 is DDTree's choice. Measured on the demo: docs/performance.md."""
    draft_length: Optional[int] = None
    """An Eagle3 drafter's drafts per round (a chain of one-token steps). None: the checkpoint's
    ttt_length, the chain it was trained to unroll (a block drafter drafts its block)."""


def check_temperature(t, name: str = "--temperature"):
    """A temperature: 0 (greedy) or inside the range a sampled one keeps finite (never NaN)."""
    greedy = isinstance(t, numbers.Real) and not isinstance(t, bool) and t == 0
    if not greedy and not in_range(t, MIN_TEMPERATURE, MAX_TEMPERATURE, True, True):
        raise UserError(f"{name}: invalid value {t!r} (valid: 0 for greedy, or "
                        f"{MIN_TEMPERATURE:g} to {MAX_TEMPERATURE:g})")


def check_filters(f):
    """An engine's resolved filters: a `Filters`, each value in its flag's range."""
    if not isinstance(f, Filters):
        raise UserError(f"filters: a sampling.Filters, got {type(f).__name__} {repr(f)[:60]}")
    check_ranges(f, **{name: RANGES[name][1] for name in Filters._fields})


def check_requests(num_prompts: int, num_samples: int):
    """Prompts x samples, each a request, at most MAX_REQUESTS."""
    if num_prompts * num_samples > MAX_REQUESTS:
        raise UserError(f"--num-samples {num_samples}: "
                        f"{num_prompts} prompts x {num_samples} samples "
                        f"is more than {MAX_REQUESTS:,} requests")


def check_choice(name: str, value):
    """A setting of fixed choices (CHOICES) given one of them."""
    choices = CHOICES[name]
    if value not in choices:
        raise UserError(f"{flag(name)} {value!r}: one of {', '.join(choices)}")


def check_kernels(name, device):
    """--kernels (an engine's `backend`): one of its choices, and Triton's kernels built where they can run
    on `device`."""
    check_choice("kernels", name)
    try:
        kernels.check_backend(name, device)
    except RuntimeError as e:
        raise UserError(f"--kernels {name}: {e}") from None


def check_schedule(kind, threshold, buckets, drafter, batch: int, K: int):
    """An engine's resolved schedule (`Engine`'s arguments, built by hand or by `make_engine`), checked
    as its flags are: a known kind; θ in [0, 1], above 0 under threshold and 0 under another kind
    (which leaves it unread); a drafter with a confidence head for a scheduled round; the largest
    bucket holding a full round of `batch` rows of K drafts and their anchor."""
    check_choice("scheduler", kind)
    check_values(confidence_threshold=threshold)
    sched.resolve(kind, threshold, None, None)
    if drafter is not None:
        check_scheduled_drafter(kind, threshold, drafter)
    if buckets:
        sched.check_full_round(buckets, batch, K + 1)


def setting_number(name: str, value):
    """A numeric setting's value (RANGES) as its kind, refused where it is no number of that kind (a bool,
    a fraction for an integer); numpy numbers are taken as Python's. Its range is checked apart."""
    kind = RANGES[name][0]
    want = numbers.Real
    expected = "a number"
    if kind is int:
        want = numbers.Integral
        expected = "an integer"
    if isinstance(value, bool) or not isinstance(value, want):
        raise UserError(f"{flag(name)}: invalid value {value!r} (expected {expected})")
    try:
        return kind(value)
    except OverflowError:  # an integer too large for a float
        raise UserError(f"{flag(name)}: invalid value {value!r} (expected {expected} in range)") from None


def check_values(**values) -> Settings:
    """An engine's arguments named as settings, each checked as its flag's value (a number of its kind,
    in its range); returns them as a `Settings`."""
    chosen = Settings(**{name: setting_number(name, v) for name, v in values.items()})
    check_ranges(chosen, **{name: RANGES[name][1] for name in values})
    return chosen


def check_tree_schedule(tree_budget: int, kind: str):
    """A draft tree is verified whole: refused beside a scheduler, which sizes a chain's verification."""
    if tree_budget and kind != "none":
        raise UserError(f"--tree-budget {tree_budget}: a draft tree is verified whole, "
                        f"and --scheduler {kind} chooses how much of a chain to verify "
                        f"(its confidences score a chain's prefixes, not a tree's branches): "
                        f"use one or the other")


def check_engine_size(batch_size, max_seq, seed, stop_ids):
    """A hand-built engine's rows and seed in their flags' ranges, its cache length a positive integer
    and its stop ids a list, tuple or set of integers (a string's characters never match a token)."""
    check_values(batch_size=batch_size, seed=seed)
    if not whole_number(max_seq) or max_seq < 1:
        raise UserError(f"Engine max_seq: invalid value {max_seq!r} (a positive integer)")
    listed = isinstance(stop_ids, (list, tuple, set, frozenset))  # a generator would be used up here
    if not listed or not all(whole_number(i) for i in stop_ids):
        raise UserError(f"Engine stop_ids: invalid value {stop_ids!r} (token ids, integers)")


def whole_number(value) -> bool:
    """An integer, numpy's included, and not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_tree(tree_budget, tree_temperature, kind: str, drafter):
    """An engine's resolved tree (`Engine`'s arguments, built by hand or by `make_engine`), checked as its
    flags are: each a number in its flag's range; a budget only under the "none" schedule (which verifies
    it whole) and for a drafter that grows trees (a block drafter)."""
    chosen = check_values(tree_budget=tree_budget, tree_temperature=tree_temperature)
    check_tree_schedule(chosen.tree_budget, kind)
    check_tree_drafter(chosen.tree_budget, drafter)


def check_settings(s, device, budget: Optional[int] = DEFAULT_BUDGET, trees: Optional[bool] = None):
    """A `Settings` for a run on `device`, checked: types, ranges, spellings, then combinations
    (numpy numbers are taken as Python's). Returns it with the scheduler and `compile` resolved, `stop`
    a tuple, and no budget given the default `budget` (None: left for the caller). trees: whether the
    run drafts trees (None: a --tree-budget was given; bench.py's --tree-budgets say it too). The result
    is marked checked for `device` (`check_engine_inputs` reads the mark; `replace` drops it, and an
    edit in place shows)."""
    if not isinstance(s, Settings):
        raise UserError(f"settings: a support.flags.Settings, got {type(s).__name__} {repr(s)[:60]}")
    if isinstance(device, torch.device):  # the models' own, as generate passes it
        device = str(device)
    device = resolve_device(device)
    s = replace(s)  # the caller's settings stay as given
    if s.max_new_tokens is None:
        s.max_new_tokens = budget
    for name in RANGES:
        value = getattr(s, name)
        if value is None:
            # None only where it is the default (resolved later)
            if getattr(Settings, name) is not None:
                raise UserError(f"{flag(name)}: invalid value None")
            continue
        setattr(s, name, setting_number(name, value))
    for name in ("ignore_eos", "verbose", "compile"):
        setattr(s, name, python_bool(getattr(s, name)))
    for name in ("ignore_eos", "verbose"):
        value = getattr(s, name)
        if not isinstance(value, bool):
            raise UserError(f"{flag(name)}: invalid value {value!r} (True or False)")
    # a str or an os.PathLike, as load's paths take; held as a str
    s.sps_table = path_argument(s.sps_table, flag("sps_table"), "a file")
    if s.verify_buckets is not None and not isinstance(s.verify_buckets, str):
        raise UserError(f"{flag('verify_buckets')}: invalid value {s.verify_buckets!r} (a string, or None)")
    if s.temperature is not None:
        check_temperature(s.temperature)
    check_ranges(s, **{name: interval for name, (_, interval) in RANGES.items()})
    for name in CHOICES:
        value = getattr(s, name)
        if value is None and getattr(Settings, name) is None:  # the default, resolved later
            continue
        check_choice(name, value)
    check_kernels(s.kernels, device)
    filters = [name for name in ("top_k", "top_p", "min_p") if getattr(s, name) is not None]
    if s.temperature == 0 and filters:  # greedy: the most likely token, whatever a filter keeps
        raise UserError(f"{flag(filters[0])} {getattr(s, filters[0]):g}: a sampling filter, "
                        f"and --temperature 0 decodes greedily "
                        f"(the most likely token, filtered or not), so it would change nothing")
    if isinstance(s.stop, str):
        s.stop = (s.stop,)
    elif s.stop is None:
        s.stop = ()
    if not isinstance(s.stop, (list, tuple)):
        raise UserError(f"--stop {s.stop!r}: a stop string or a list of them")
    s.stop = tuple(s.stop)
    StopStrings.check(s.stop)
    s.scheduler = sched.resolve(s.scheduler, s.confidence_threshold, s.sps_table, s.verify_buckets)
    check_tree_schedule(s.tree_budget, s.scheduler)
    if trees is None:
        trees = s.tree_budget > 0
    if not trees and s.tree_temperature != Settings.tree_temperature:
        raise UserError(f"--tree-temperature {s.tree_temperature:g}: ranks the branches of a draft "
                        f"tree, and no --tree-budget is given (a chain is drafted): it would change "
                        f"nothing")
    if s.compile is not None and not isinstance(s.compile, bool):
        raise UserError(f"--compile: invalid value {s.compile!r} "
                        f"(True, False, or None for the default)")
    if s.compile is None:  # on for cuda, off for cpu (a first compile on a CPU takes minutes)
        s.compile = torch.device(device).type == "cuda"
    if not s.compile:
        if s.compile_mode is not None:
            raise UserError(f"--compile-mode {s.compile_mode}: only used with --compile "
                            f"(the run is eager)")
        if s.verbose:
            raise UserError("--verbose: only used with --compile (the run is eager)")
    mark_checked(s, device)
    return s


def setting_values(s: Settings) -> tuple:
    return tuple(getattr(s, f.name) for f in fields(s))


def mark_checked(s: Settings, device: str):
    """`s` marked checked for `device`, with the values checked, so that an edit afterwards shows (the
    marks are not fields: neither flags nor API arguments)."""
    s._checked_for = device
    s._checked_values = setting_values(s)


def derived(s: Settings, **changes) -> Settings:
    """Checked settings with a program's own changes for one engine (its drafter's tree budget and
    drafts), still marked checked: `replace` alone drops the mark, as a caller's edit must."""
    d = replace(s, **changes)
    mark_checked(d, s._checked_for)
    return d


@dataclass
class Sampling:
    """How tokens are drawn, and where that came from (printed at start)."""
    temperature: float
    filters: Filters
    source: str
    unapplied: tuple = ()  # read from generation_config.json, not applied here ("key value" each)

    def record(self) -> dict:
        """As a run's config records it (`sampling`): the temperature, the filters, where they came from."""
        return {"temperature": self.temperature, **self.filters._asdict(), "source": self.source}

    def describe(self) -> str:
        if self.temperature == 0:
            return f"sampling: greedy ({self.source})"
        f = self.filters
        parts = [f"temperature {self.temperature:g}"]
        if f.top_k:
            parts.append(f"top-k {f.top_k}")
        if f.top_p < 1:
            parts.append(f"top-p {f.top_p:g}")
        if f.min_p > 0:
            parts.append(f"min-p {f.min_p:g}")
        return f"sampling: {', '.join(parts)} ({self.source})"


def sampling_for(m, s) -> Sampling:
    """The settings' sampling if any is given (a filter alone: T = 1), else the target's
    generation_config.json, else greedy."""
    names = ("temperature", "top_k", "top_p", "min_p")
    given = {name: getattr(s, name) for name in names if getattr(s, name) is not None}
    unapplied = ()
    if given:
        source = "from " + ", ".join(flag(name) for name in given)
    elif m.generation_problem is not None:
        raise UserError(f"{m.generation_problem} (or give --temperature, --top-k, --top-p or --min-p, "
                        f"which replace the file)")
    elif m.generation is not None:
        given = m.generation
        source = f"from {m.generation_source}"
        unapplied = m.generation_unapplied
        if unapplied:
            source += f"; not applied here: {', '.join(unapplied)}"
    else:
        given = {"temperature": 0.0}
        source = "no sampling flag, and no generation_config.json"
        if m.generation_source is not None:
            source = f"no sampling flag, and {m.generation_source} does not set do_sample true"
        unapplied = m.generation_unapplied
        if unapplied:
            source += f"; not applied here: {', '.join(unapplied)}"
    temperature = float(given.get("temperature", 1.0))
    filters = Filters()
    if temperature != 0:
        filters = Filters(int(given.get("top_k") or 0), float(given.get("top_p", 1.0)),
                          float(given.get("min_p", 0.0)))
    return Sampling(temperature, filters, source, unapplied)


def tree_round_bytes(target, drafter, tree_budget: int, sampled: bool) -> int:
    """What a tree's round holds a row, at least, in float32 rows of the vocabulary: the target's
    logits at the tree's budget + 1 nodes; sampled, also the tree's q there and the races and
    distributions of the nodes it draws children for (`sampling.tree_parent_count`); greedy with a
    Markov head, a depth's bias, logits and log-probabilities for the children of up to `budget` nodes."""
    V = target.args.vocab_size
    rows = tree_budget + 1
    if sampled:
        parents = tree_parent_count(tree_budget, drafter.cfg.num_drafts, V)
        rows += 2 * parents + tree_budget + 1
    elif drafter.markov_head is not None:
        rows += 3 * tree_budget
    return 4 * rows * V


def check_cache_memory(target, drafter, batch: int, max_seq: int, device, tree_bytes: int = 0,
                       rows: str = "--batch-size", reclaimed: int = 0):
    """The KV caches, and a tree's round (`tree_bytes` a row), must fit in what is free on
    the device (where that is known) and `reclaimed`, the bytes of the caches the models hold now
    that the new ones take over; `rows`: the flag that sets `batch`."""
    configs = [target.args]
    if drafter is not None:
        configs.append(drafter.cfg.layers)
    per_token = sum(2 * a.num_hidden_layers * a.num_key_value_heads * a.head_dim for a in configs)
    itemsize = target.embed_tokens.weight.element_size()  # the caches are the model's dtype
    need = per_token * batch * max_seq * itemsize
    trees = tree_bytes * batch
    free = free_memory(device)
    if free:
        free += reclaimed
    if fits(need + trees, free):
        return
    what = f"the KV caches for {rows} {batch} x {max_seq} positions need {need / 2**30:.1f} GiB"
    fix = f"lower {rows} or --max-new-tokens"
    if trees:
        what += f", and a tree's logits and distributions over the vocabulary {trees / 2**30:.1f} GiB a round"
        fix = f"lower {rows}, --max-new-tokens or --tree-budget"
    raise UserError(f"{what}; {free / 2**30:.1f} GiB are free on {device}: {fix}")


def python_bool(value):
    """A numpy boolean as Python's (numpy numbers are taken as Python's too); anything else as given."""
    if isinstance(value, np.bool_):
        return bool(value)
    return value


def check_rendering(tokenizer, chat, system_prompt, thinking, prompts: list) -> bool:
    """`generate`'s chat, system_prompt and thinking, checked as --chat, --system-prompt and
    --enable-thinking are: their types, then what the command line refuses of them (chat with `prompts`
    all token ids, as --prompt-ids). Returns chat resolved for `tokenizer` (`auto_chat`)."""
    chat = python_bool(chat)
    thinking = python_bool(thinking)
    if chat is not None and not isinstance(chat, bool):
        raise UserError(f"--chat: invalid value {chat!r} (True, False or None)")
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise UserError(f"--system-prompt: invalid value {system_prompt!r} (a string, or None)")
    if not isinstance(thinking, bool):
        raise UserError(f"--enable-thinking: invalid value {thinking!r} (True or False)")
    check_chat_renders(chat, prompts, "every prompt")
    ids = None
    if all_token_ids(prompts):
        ids = "every prompt is"
    chat = auto_chat(chat, tokenizer)
    check_chat_flags(chat=chat, ids=ids, system_prompt=system_prompt, thinking=thinking)
    return chat


def prompt_list(prompts) -> list:
    """The Python API's `prompts` as a list of prompts (one text, id list or conversation, or a list)."""
    if not isinstance(prompts, (str, list, tuple)):
        raise UserError(f"prompts: expected a text, a list of token ids, "
                        f"a conversation (a list of messages) or a list of these, "
                        f"got {type(prompts).__name__}")
    if isinstance(prompts, str):
        return [prompts]
    if not prompts:
        raise UserError("generate: no prompts")
    is_id = [isinstance(x, numbers.Integral) for x in prompts]  # numpy's integers too
    is_turn = [isinstance(x, dict) for x in prompts]
    if all(is_id) or all(is_turn):  # one list of token ids, or one conversation
        return [prompts]
    if any(is_id):
        raise UserError("prompts: a list mixing token ids and other prompts "
                        "(each prompt's token ids are a list of their own)")
    return list(prompts)


def check_models(m):
    """The API's models argument: what `speculate.load` returns."""
    if not isinstance(m, Models):
        raise UserError(f"models: speculate.load()'s result, got {type(m).__name__} {repr(m)[:60]}")


def check_engine_inputs(m, prompts, s, drafter):
    """`make_engine`'s and `decode`'s models, drafter (None or a loaded one), their token-id prompts,
    checked as `generate` checks what it encodes (with the samples, at most MAX_REQUESTS requests),
    and their settings checked (`check_settings` resolves the scheduler)."""
    check_models(m)
    if drafter is not None and not isinstance(drafter, DrafterBase):
        raise UserError(f"drafter: None or a loaded drafter (the models' m.drafter), got "
                        f"{type(drafter).__name__} {repr(drafter)[:60]}")
    device = m.target.embed_tokens.weight.device
    checked_for = getattr(s, "_checked_for", None)
    if not isinstance(s, Settings) or checked_for is None:
        raise UserError("settings: not checked; pass support.flags.check_settings(Settings(...), device)")
    if torch.device(checked_for).type != device.type:  # compile and --kernels were resolved for it
        raise UserError(f"settings: checked for device {checked_for!r}, and the models are on "
                        f"{device.type}; pass support.flags.check_settings(Settings(...), "
                        f"{device.type!r})")
    edited = [f.name for f, value in zip(fields(s), s._checked_values) if getattr(s, f.name) != value]
    if edited:
        raise UserError(f"settings: {edited[0]} was changed after they were checked; pass "
                        f"support.flags.check_settings(Settings(...), device) again")
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise UserError(f"prompts: a non-empty list of token-id lists, got {repr(prompts)[:80]}")
    for i, p in enumerate(prompts):
        ids = isinstance(p, (list, tuple))
        if ids:
            ids = all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in p)
        if not ids:
            raise UserError(f"prompt {i}: a list of token ids, got {repr(p)[:80]} "
                            f"(generate encodes text and conversations)")
    check_requests(len(prompts), s.num_samples)
    check_prompts(prompts, m.target, s.max_new_tokens, drafter=drafter)


# Flag groups shared by the programs

@dataclass
class Machine:
    """Where and how a program runs."""

    device: Literal["cpu", "cuda"] = "cpu"
    """Where to run."""
    dtype: Optional[Literal[DTYPES]] = None
    """Weights and activations. Default: bfloat16 on cuda, float32 on cpu."""
    threads: Optional[int] = None
    """CPU threads. Default: OMP_NUM_THREADS, else half the CPUs (docs/performance.md)."""
    compile_cache: Optional[str] = None
    """With --compile: its cache directory. Default: $TORCHINDUCTOR_CACHE_DIR, else
    ~/.cache/dspark-fast/inductor ($XDG_CACHE_HOME for ~/.cache)."""


@dataclass
class Prompts:
    """What speculate.py decodes."""

    prompt: Optional[str] = None
    """One prompt as text, rendered as a chat if --chat is on (its default: on when the tokenizer has a
    template)."""
    prompt_ids: Optional[str] = None
    """One prompt as comma-separated token ids, e.g. 1,2,3."""
    prompts_file: Optional[str] = None
    """JSON lines of {"prompt": str}, {"prompt_ids": [int]}, {"turns": [str]} (the first)
    or {"messages": [{"role", "content"}, ...]} (ending with the user's turn).
    The demo's default: its 20 held-out prompts, after a lead prompt whose completion it prints."""


@dataclass
class Rendering:
    """How text prompts become token ids."""

    chat: AutoBool = None
    """Render text prompts with the chat template, thinking off unless --enable-thinking.
    Default: on when the tokenizer has a template; --chat without one uses Qwen3's format."""
    system_prompt: Optional[str] = None
    """A system turn before every text prompt (chat rendering only)."""
    enable_thinking: bool = False
    """Render with the template's thinking on (the published drafters were trained with it off)."""



@dataclass
class Args(WandbFlags):
    """Speculative decoding with DSpark / DFlash / Eagle3 drafters (autoregressive decoding without --drafter)."""

    target: Optional[str] = None
    """Qwen3 checkpoint directory, or a Hugging Face hub id ORG/NAME[@REVISION] (from the HF cache or
    downloaded; HF_HUB_OFFLINE=1: the cache only). Default, with no --drafter or --random-init: demo/."""
    drafter: Optional[str] = None
    """Drafter directory or hub id (any DSpark / DFlash / Eagle3 spelling); omitted: autoregressive decoding."""
    decode: flat(Settings) = field(default_factory=Settings)
    prompts: flat(Prompts) = field(default_factory=Prompts)
    rendering: flat(Rendering) = field(default_factory=Rendering)
    machine: flat(Machine) = field(default_factory=Machine)
    calibration: Optional[str] = None
    """Confidence temperatures from `eval.py --calibration-out`: c_k = σ(logit_k / T_k)."""
    random_init: Optional[Literal["qwen3-4b", "qwen3-8b", "qwen3-14b"]] = None
    """Instead of --target/--drafter: a real-shaped pair with random weights (speed without downloads)."""
    trace_file: Optional[str] = None
    """Write every round, request and a summary here as JSON lines (docs/trace-format.md)."""
    output_file: Optional[str] = None
    """Write one JSON record per request as it finishes (text, ids, finish reason, rounds, τ)."""
    progress: bool = True
    """Progress on stderr while several requests decode: a bar on a terminal, else a line at most once
    a minute."""
    log_every: int = 10
    """With --wandb: log the figures so far every this many steps (one step verifies a round of each
    request in the batch)."""


def check_machine(machine: Machine, compile: bool):
    check_ranges(machine, threads="[1, 4096]")
    if machine.compile_cache is not None and not compile:
        raise UserError("--compile-cache: only used with --compile (the run is eager)")


def start_machine(machine: Machine, s) -> str:
    """Threads set and the compile cache chosen; returns the line that says how many threads."""
    threads = set_threads(machine.threads)
    if s.compile:
        cache = use_compile_cache(machine.compile_cache)
        print(compiling_line(cache, s.max_new_tokens), file=sys.stderr)
    return threads


def compiling_line(cache: str, max_new_tokens: Optional[int]) -> str:
    """What a run that compiles says before its models load (a budget of 1 runs no round to compile)."""
    if max_new_tokens == 1:
        return ("--compile: --max-new-tokens 1 ends every request at its first token, before any round: "
                "nothing is compiled")
    return ("loading the models; compiling the round next "
            f"(a first compile takes minutes on a CPU, then it is cached in {cache})")


# speculate.py's command line

# The demo's printed prompt, from the held-out shutil.py; demo/heldout.jsonl's 20 follow (figures over 21).
DEMO_PROMPT = ('def copyfileobj(fsrc, fdst, length=0):\n'
               '    """copy data from file-like object fsrc to file-like object fdst"""\n')


def resolve_demo(args, demo_dir: str):
    """(args, demo, lead): no --target, --drafter or --random-init is the demo pair on its held-out
    prompts, led by DEMO_PROMPT (`lead`) unless a prompt is given."""
    p = args.prompts
    demo = args.target is None and args.drafter is None and args.random_init is None
    no_prompt = p.prompt is None and p.prompt_ids is None and p.prompts_file is None
    lead = None
    if demo:
        args = replace(args, target=os.path.join(demo_dir, "target"),
                       drafter=os.path.join(demo_dir, "drafter"))
        if no_prompt:
            args.prompts = replace(p, prompts_file=os.path.join(demo_dir, "heldout.jsonl"))
            lead = DEMO_PROMPT
    return args, demo, lead


def scheduler_kind(s, drafter) -> str:
    """The scheduler a run uses: --scheduler's, or "none" without a drafter (nothing to schedule)."""
    if drafter is None:
        return "none"
    return s.scheduler


def check_drafter_settings(s, drafter):
    """The settings that need a drafter of some kind, against the one loaded (None: autoregressive, whose
    settings `check_no_drafter` refused where the run has none; an engine built without one, beside a
    drafter's, keeps the drafter's schedule unread)."""
    check_tree_drafter(s.tree_budget, drafter)
    if drafter is None:
        if s.draft_length is not None:
            raise UserError(f"--draft-length {s.draft_length}: sets how many drafts an Eagle3 drafter "
                            f"proposes, and this engine has none")
        return
    check_scheduled_drafter(s.scheduler, s.confidence_threshold, drafter)
    eagle3 = drafter.cfg.layout == "eagle3"
    if s.draft_length is not None and not eagle3:
        raise UserError(f"--draft-length {s.draft_length}: only an Eagle3 drafter's chain length "
                        f"is chosen; a block drafter drafts its block")


def check_tree_drafter(tree_budget: int, drafter):
    """A tree grows from a block drafter's distributions: a budget is refused for no drafter (None) and
    for an Eagle3 drafter, whose chain is drafted a step at a time."""
    if not tree_budget:
        return
    if drafter is None:
        raise UserError(f"--tree-budget {tree_budget}: a tree is drafted by a drafter, "
                        f"and this engine has none")
    if drafter.cfg.layout == "eagle3":
        raise UserError(f"--tree-budget {tree_budget}: "
                        f"an Eagle3 drafter drafts a chain of one-token steps; "
                        f"trees grow from a block drafter's distributions (DSpark or DFlash)")


def check_scheduled_drafter(kind: str, threshold: float, drafter):
    """A scheduled round reads the drafter's confidences: refused for a drafter without a confidence
    head."""
    if kind == "none" or drafter.confidence_head is not None:
        return
    name = f"--scheduler {kind}"
    if kind == "threshold":
        name = f"--confidence-threshold {threshold:g}"
    raise UserError(f"{name}: the --drafter has no confidence head, whose confidences a scheduled "
                    f"round reads")


def check_tree_temperature(s, drafters: list, temperature: float):
    """--tree-temperature ranks the branches of greedy trees and of sampled trees whose drafter has no
    confidence head (with one, the head shapes a sampled tree): refused where it would rank none of
    the trees that `drafters` (those that grow one; None: no drafter) draft at `temperature`. Checked
    at the edge (speculate.py, `generate`, eval.py, bench.py) over every drafter a run decodes with,
    after `check_settings` (which refuses it where no tree is drafted)."""
    drafters = [d for d in drafters if d is not None]
    if s.tree_temperature == Settings.tree_temperature or not drafters:
        return
    if all(temperature > 0 and d.confidence_head is not None for d in drafters):
        raise UserError(f"--tree-temperature {s.tree_temperature:g}: a sampled tree from a drafter "
                        f"with a confidence head is shaped by the head (each node's chance that a "
                        f"draft after it survives), so it would change nothing; it ranks the "
                        f"branches of greedy trees and of drafters without one")


def check_no_drafter(s: Settings, calibration: Optional[str] = None):
    """Without a drafter a setting only a drafter reads would change nothing: refused, not ignored in
    silence (speculate.py: no --drafter and no --random-init, the demo having one; eval.py: no --drafter;
    bench.py: a --target without one; `generate` with models that have none). Those that need another
    (--sps-table a --scheduler, --calibration a scheduled round) come first, so each is named for itself."""
    settings = [  # (given, flag and value, what it does)
        (calibration is not None, f"--calibration {calibration}",
         "calibrates a drafter's confidence head"),
        (s.sps_table is not None, f"--sps-table {s.sps_table}",
         "sizes the rounds of a drafter's scheduler"),
        (s.verify_buckets is not None, f"--verify-buckets {s.verify_buckets}",
         "pads the verification of a drafter's drafts"),
        (s.confidence_threshold > 0, f"--confidence-threshold {s.confidence_threshold:g}",
         "thresholds a drafter's confidences"),
        (s.scheduler not in (None, "none"), f"--scheduler {s.scheduler}",
         "chooses how many of a drafter's drafts a round verifies"),
        (s.tree_budget > 0, f"--tree-budget {s.tree_budget}", "a tree is drafted by a --drafter"),
        (s.draft_length is not None, f"--draft-length {s.draft_length}",
         "sets how many drafts an Eagle3 drafter proposes"),
    ]
    for given, flag_value, what in settings:
        if given:
            raise UserError(f"{flag_value}: {what}; "
                            f"without a --drafter the decoding is autoregressive, "
                            f"so it would change nothing (give a --drafter, or drop the flag)")


def check_command_line(args):
    """speculate.py's flags alone, before anything is loaded or downloaded; returns the settings."""
    s = check_settings(args.decode, args.machine.device)
    check_machine(args.machine, s.compile)
    check_ranges(args, log_every="[1, inf)")
    runlog.check(args)
    if args.drafter is None and args.random_init is None:
        check_no_drafter(args.decode, args.calibration)
    p = args.prompts
    r = args.rendering
    text_flags = (("--prompt", p.prompt is not None), ("--stop", bool(s.stop)),
                  ("--system-prompt", r.system_prompt is not None))
    text = [name for name, given in text_flags if given]
    if args.random_init is not None and text:  # no tokenizer: say so before building the model
        raise UserError(f"{text[0]}: text needs a tokenizer, "
                        f"and --random-init {args.random_init} has none (use --prompt-ids)")
    if r.chat and p.prompt_ids is not None:
        raise UserError("--chat: --prompt-ids are token ids, never rendered; "
                        "it would change nothing")
    ids = None
    if p.prompt_ids is not None:
        ids = "--prompt-ids are"
    check_chat_flags(chat=r.chat, ids=ids, system_prompt=r.system_prompt, thinking=r.enable_thinking)
    check_calibration_read(args.calibration, s)
    check_files(args)
    resolve_device(args.machine.device)
    note = StopStrings.escape_note(s.stop)
    if note:
        print(note, file=sys.stderr)
    return s


def sps_paths(sps_table: Optional[str]) -> tuple[Optional[str], Optional[str]]:
    """(read, written): an --sps-table is read if it exists, else written."""
    if sps_table is not None and os.path.isfile(sps_table):
        return sps_table, None
    return None, sps_table


def check_files(args):
    """The outputs writable, none an input."""
    sps_read, sps_written = sps_paths(args.decode.sps_table)
    outputs = {"--trace-file": args.trace_file, "--output-file": args.output_file,
               "--sps-table": sps_written}
    given = [args.target, args.drafter, args.prompts.prompts_file, args.calibration]
    # the compile cache is read and written as the run goes: no output may take its name
    inputs = given + [sps_read, args.machine.compile_cache]
    check_outputs(outputs, inputs=inputs)
    check_read_apart(sps_read, "--sps-table", inputs=given)
    check_calibration_file(args.calibration)


def reads_only(description: str, program: str, names) -> str:
    """A program's --help description, saying which decode flags it reads of those it lists (it refuses
    the others); their help is written for speculate.py, their defaults shown are the program's."""
    read = ", ".join(flag(name) for name in names)
    return (f"{description}\n\nOf the decode flags below, {program} reads {read}; any other is refused. "
            f"Their help says what they do in speculate.py; the defaults shown are {program}'s.")


def recorded_flags(args, read) -> dict:
    """A program's flags as given, one key each (its --out file's config), less the decode settings it does
    not `read`: a --batch-size or --scheduler there would misdescribe the run."""
    config = flat_fields(args)
    for f in fields(Settings):
        if f.name not in read:
            del config[f.name]
    return config


def reads_confidences(s, temperature: Optional[float]) -> bool:
    """Whether a run reads the drafter's confidences: a schedule does, and so does a sampled draft tree (the
    head ranks each node's children). temperature: the run's, None before the models load (a tree may
    then be sampled)."""
    if s.scheduler != "none":
        return True
    sampled = temperature is None or temperature > 0
    return bool(s.tree_budget) and sampled


def check_calibration_read(calibration: Optional[str], s, temperature: Optional[float] = None):
    """--calibration scales the confidences (`reads_confidences`): refused where nothing reads them."""
    if calibration is None or reads_confidences(s, temperature):
        return
    if not calibration.strip():  # said by the file check: an empty path
        return
    if s.tree_budget:
        raise UserError(f"--calibration {calibration}: a greedy draft tree ranks its branches by the "
                        f"drafter's probabilities (--tree-temperature), not by the confidences; "
                        f"it would change nothing")
    raise UserError(f"--calibration {calibration}: "
                    f"only a scheduled round (--scheduler {sched.SCHEDULED}) or a sampled draft tree "
                    f"reads the confidences, each of a --drafter with a confidence head (an Eagle3 or "
                    f"DFlash drafter has none); without either it changes nothing")


def check_sampling_reads(m, s) -> Sampling:
    """The run's sampling (`sampling_for`), once --tree-temperature, which depends on its temperature,
    is checked against the models' drafter (`check_tree_temperature`)."""
    drawn = sampling_for(m, s)
    check_tree_temperature(s, [m.drafter], drawn.temperature)
    return drawn


def check_calibration_file(path: Optional[str]):
    """--calibration names a file that is there (its contents are checked where the drafter loads)."""
    if path is not None:
        check_input(path, "--calibration", "calibration file")


def read_prompts(p: Prompts, r: Rendering, m, s,
                 lead: Optional[str]) -> tuple[list[list[int]], list[str]]:
    """The prompts as ids and where each came from; the demo's lead prompt first."""
    chat = auto_chat(r.chat, m.tokenizer)
    context = m.target.args.max_position_embeddings
    max_len = max(context - s.max_new_tokens, 1)
    sources, prompts = [], []
    chat_given = r.chat
    if lead is not None:  # the demo's first prompt, whose completion is printed
        # the held-out prompts after it are token ids: --chat renders the lead (taken), a system
        # prompt or thinking would reach the lead alone (refused)
        flags_given = check_chat_flags(chat=chat, ids=None, system_prompt=r.system_prompt,
                                       thinking=r.enable_thinking)
        if flags_given:
            raise UserError(f"{flags_given[0]}: the demo's held-out prompts ({p.prompts_file}) are "
                            f"token ids, not a rendered chat, so it would reach the demo prompt alone "
                            f"(--prompt or --prompts-file gives prompts of your own)")
        chat_given = None
        sources.append("the demo prompt")
        prompts.append(encode(m.tokenizer, lead, "the demo prompt", chat=chat))
    prompts += load_prompts(tokenizer=m.tokenizer, chat=chat, prompt=p.prompt,
                            prompt_ids=p.prompt_ids, prompts_file=p.prompts_file, max_len=max_len,
                            system_prompt=r.system_prompt, thinking=r.enable_thinking,
                            sources=sources, chat_given=chat_given)
    check_requests(len(prompts), s.num_samples)
    return prompts, sources


def calibration_note(m, temperature: float) -> Optional[str]:
    """A note when the models' STS file was fitted on another drafter or at another temperature than this
    run, under a scheduler, or with positions no round verified: from the file as read at load
    (`Models.calibration_fit`, its keys checked there), whatever the file or the directory since."""
    calibration = m.calibration
    cal = m.calibration_fit
    fitted = cal.get("drafter_dir")
    fitted_t = cal.get("temperature")
    applied_to = cal["applied_to"]
    other = []
    if fitted is not None and fitted != applied_to:
        other.append(f"on drafter {fitted} (this run: {applied_to})")
    if fitted_t is not None and fitted_t != temperature:
        other.append(f"at temperature {fitted_t:g} (this run: {temperature:g})")
    scheduler = cal.get("scheduler")
    if scheduler not in (None, "none"):  # the schedule chose which drafts the fit saw
        other.append(f"under --scheduler {scheduler}, whose records bias it")
    counts = cal.get("fit_rounds_by_position")
    unfitted = []
    if isinstance(counts, list):
        unfitted = [str(k + 1) for k, n in enumerate(counts) if n == 0]
    if unfitted:
        other.append(f"with no round for position {', '.join(unfitted)} (kept at 1)")
    if not other:
        return None
    return (f"note: --calibration {calibration} was fitted {' and '.join(other)}; "
            f"its temperatures may not fit this run (eval.py --calibration-out refits them)")
