"""What a run decodes: the models named by the flags, and the prompts — read, tokenized and checked.

Shared by speculate.py, eval.py and the scripts, so that every program reads a checkpoint, a
prompts file or a chat template the same way and refuses the same mistakes with the same line:
- `load_models`: a target directory (and drafter), or a random-weight preset; an STS calibration;
- `load_prompts`: --prompt (text through the chat template), --prompt-ids, or a JSON-lines file of
  {"prompt"}, {"prompt_ids"} or {"turns"} records — one kind per record, valid Unicode, and a text
  too long for the context refused after tokenizing a bounded prefix of it;
- `check_prompts`: ids inside the vocabulary, prompt + budget inside the target's and the drafter's
  context;
- `resolve_sampling`: the sampling settings — the flags, or without any the target's
  generation_config.json.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import torch

from common import UserError, check_ranges, parse_ints, read_json, read_jsonl, resolve_device, resolve_dtype
from kernels import Filters
from model import Transformer, load_target, random_target
from text import Tokenizer, generation_sampling, stop_token_ids


@dataclass
class Models:
    """What `load_models` resolves: the models, the tokenizer, the stop ids and the dtype."""
    target: Transformer
    drafter: object  # drafter.Drafter or None
    tokenizer: Optional[Tokenizer]
    stop_ids: tuple
    dtype: torch.dtype
    generation: Optional[dict] = None         # the target's recommended sampling (None: greedy), and
    generation_source: Optional[str] = None   # the generation_config.json it came from (None: no file)

    def describe(self) -> str:
        """The drafter in one line (printed to stderr once every input has been checked)."""
        d = self.drafter
        return d.cfg.describe() if d is not None else "no drafter: autoregressive decoding"


def load_models(target: Optional[str], drafter: Optional[str] = None, *, device: str = "cpu",
                dtype: Optional[str] = None, random_init: Optional[str] = None, calibration: Optional[str] = None,
                seed: int = 0) -> Models:
    """The target (and drafter) from directories, or a random-weight preset; with `calibration`, the
    drafter's confidence temperatures (eval.py --calibration-out)."""
    if random_init is None and target is None:
        raise UserError("--target: no target directory given")
    if random_init is not None and (target is not None or drafter is not None):
        raise UserError("--random-init builds its own target and drafter: drop --target/--drafter")
    dt = resolve_dtype(dtype, resolve_device(device))
    d = tokenizer = generation = generation_source = None
    if random_init is not None:
        from drafter import random_drafter
        t = random_target(random_init, device, dt, seed)
        d = random_drafter(t)
        stop_ids = ()
    else:
        t = load_target(target, device, dt)
        stop_ids = stop_token_ids(target, t.args)
        generation, generation_source = generation_sampling(target)
        if os.path.isfile(os.path.join(target, "tokenizer.json")):
            tokenizer = Tokenizer(target)
        if drafter is not None:
            from drafter import load_drafter
            d = load_drafter(drafter, t, device, dt)
    if calibration is not None:
        if d is None or d.confidence_head is None:
            raise UserError(f"--calibration {calibration}: needs a --drafter with a confidence head")
        temps, K = read_json(calibration).get("temperatures"), d.cfg.num_drafts
        if not isinstance(temps, list) or len(temps) != K or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < float("inf") for x in temps):
            raise UserError(f"{calibration}: 'temperatures' must be a list of {K} positive numbers "
                            f"(one per draft position), got {temps!r}")
        d.calibrate(temps)
    return Models(t, d, tokenizer, stop_ids, dt, generation, generation_source)



PROMPT_KINDS = ("prompt", "prompt_ids", "turns")
CHARS_PER_TOKEN = 64  # a text this many characters per allowed token is tokenized only that far before refusing


def load_prompts(*, tokenizer: Optional[Tokenizer], chat: bool, prompt: Optional[str] = None,
                 prompt_ids: Optional[str] = None, prompts_file: Optional[str] = None,
                 max_len: Optional[int] = None) -> list[list[int]]:
    """Token ids of every prompt given by exactly one of prompt, prompt_ids or prompts_file. A text
    that cannot fit `max_len` tokens is refused after tokenizing a bounded prefix of it."""
    given = [f for f, v in (("prompt", prompt), ("prompt_ids", prompt_ids), ("prompts_file", prompts_file))
             if v is not None]
    if len(given) != 1:
        raise UserError("give exactly one of --prompt, --prompt-ids, --prompts-file"
                        + (f" (got {', '.join('--' + g.replace('_', '-') for g in given)})" if given else ""))

    def encode(text: str, where: str) -> list[int]:
        if tokenizer is None:
            raise UserError(f"{where}: a text prompt needs the target's tokenizer.json")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise UserError(f"{where}: the text is not valid Unicode (a lone surrogate)") from None
        if max_len is not None and len(text) > CHARS_PER_TOKEN * max_len:  # e.g. a 100 MB prompt
            head = tokenizer.encode(text[:CHARS_PER_TOKEN * max_len])
            if len(head) > max_len:
                raise UserError(f"{where}: the prompt is longer than the {max_len} tokens the context leaves it")
        return tokenizer.encode(tokenizer.render_chat(text) if chat else text)

    if prompt is not None:
        return [encode(prompt, "--prompt")]
    if prompt_ids is not None:
        return [parse_ints(prompt_ids, "--prompt-ids")]
    if not os.path.isfile(prompts_file):
        raise UserError(f"{prompts_file}: prompts file not found")
    prompts = []
    for where, row in read_jsonl(prompts_file):
        kinds = [k for k in PROMPT_KINDS if isinstance(row, dict) and k in row]
        if len(kinds) > 1:
            raise UserError(f"{where}: a record gives one prompt, as one of {', '.join(PROMPT_KINDS)}; this one has "
                            f"{' and '.join(kinds)}")
        if kinds == ["prompt"] and isinstance(row["prompt"], str):
            prompts.append(encode(row["prompt"], where))
        elif kinds == ["prompt_ids"] and isinstance(row["prompt_ids"], list):
            ids = row["prompt_ids"]
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise UserError(f"{where}: 'prompt_ids' must be a list of integers")
            prompts.append(ids)
        elif kinds == ["turns"] and isinstance(row["turns"], list) and row["turns"] and isinstance(row["turns"][0], str):
            prompts.append(encode(row["turns"][0], where))
        else:
            raise UserError(f"{where}: expected {{\"prompt\": str}}, {{\"prompt_ids\": [int]}} or {{\"turns\": [str]}}")
    if not prompts:
        raise UserError(f"{prompts_file}: no prompts")
    return prompts


def check_prompts(prompts: list[list[int]], target: Transformer, max_new_tokens: int, where: str = "", drafter=None):
    """Every prompt non-empty, inside the vocabulary, and fitting the context (the target's, and the
    drafter's positions too) with its budget."""
    V, context = target.args.vocab_size, target.args.max_position_embeddings
    if drafter is not None:
        context = min(context, drafter.cfg.layers.max_position_embeddings)
    for i, p in enumerate(prompts):
        if not p:
            raise UserError(f"{where}prompt {i}: empty prompt")
        bad = [t for t in p if not 0 <= t < V]
        if bad:
            raise UserError(f"{where}prompt {i}: token id {bad[0]} is outside the vocabulary (0..{V - 1})")
        if len(p) + max_new_tokens > context:
            raise UserError(f"{where}prompt {i}: {len(p)} tokens + --max-new-tokens {max_new_tokens} exceed "
                            f"the {'target' if context == target.args.max_position_embeddings else 'drafter'}'s "
                            f"context of {context} (max_position_embeddings)")



def auto_chat(chat: Optional[bool], tokenizer: Optional[Tokenizer]) -> bool:
    """--chat's default: on when the tokenizer has a chat template."""
    return chat if chat is not None else (tokenizer is not None and tokenizer.chat_template is not None)


def encode_prompt(tokenizer: Optional[Tokenizer], prompt, *, chat: Optional[bool] = None,
                  system_prompt: Optional[str] = None) -> list[int]:
    """One prompt of the Python API as ids: token ids as given; a text through the chat template
    (unless chat=False), after the system prompt if one is given; a conversation ([{"role",
    "content"}, ...]) through the template."""
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    if tokenizer is None:
        raise UserError("a text or conversation prompt needs the target's tokenizer.json; give token ids")
    system = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    if isinstance(prompt, str):
        if not auto_chat(chat, tokenizer):
            if system:
                raise UserError("system_prompt: needs the chat template (chat=False sends the text raw)")
            return tokenizer.encode(prompt)
        return tokenizer.encode(tokenizer.render_messages(system + [{"role": "user", "content": prompt}],
                                                          add_generation_prompt=True))
    if isinstance(prompt, (list, tuple)) and prompt and all(
            isinstance(x, dict) and isinstance(x.get("role"), str) and isinstance(x.get("content"), str) for x in prompt):
        return tokenizer.encode(tokenizer.render_messages(system + list(prompt), add_generation_prompt=True))
    raise UserError(f"prompt {str(prompt)[:60]!r}: expected a text, a list of token ids or a list of "
                    f"{{\"role\", \"content\"}} messages")


@dataclass
class Sampling:
    """How tokens are drawn: greedy at temperature 0; else the temperature and the filters. `source`
    says where the settings came from (printed at start)."""
    temperature: float
    filters: Filters
    source: str

    def describe(self) -> str:
        if self.temperature == 0:
            return f"sampling: greedy ({self.source})"
        f = self.filters
        parts = [f"temperature {self.temperature:g}"] + ([f"top-k {f.top_k}"] if f.top_k else []) + (
            [f"top-p {f.top_p:g}"] if f.top_p < 1 else []) + ([f"min-p {f.min_p:g}"] if f.min_p > 0 else [])
        return f"sampling: {', '.join(parts)} ({self.source})"


MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-4, 1e4  # beyond these, logits / T overflow float32 or sampling is uniform noise


def check_sampling(temperature: Optional[float] = None, top_k: Optional[int] = None, top_p: Optional[float] = None,
                   min_p: Optional[float] = None):
    """The sampling flags' values (None: not given), each a one-line error when out of range."""
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)):
        raise UserError(f"--top-k: invalid value {top_k!r} (valid: an integer, 0 for off)")
    check_ranges(SimpleNamespace(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p),
                 temperature=f"[0, {MAX_TEMPERATURE:g}]", top_k="[0, 1073741824]", top_p="(0, 1]", min_p="[0, 1]")
    if temperature is not None and 0 < temperature < MIN_TEMPERATURE:
        raise UserError(f"--temperature: invalid value {temperature!r} (valid: 0 for greedy, or "
                        f"{MIN_TEMPERATURE:g} to {MAX_TEMPERATURE:g})")


def resolve_sampling(models: Models, temperature: Optional[float] = None, top_k: Optional[int] = None,
                     top_p: Optional[float] = None, min_p: Optional[float] = None) -> Sampling:
    """The flags when any is given (a filter flag alone samples at temperature 1.0; a filter not given
    is off); with none, the target's generation_config.json (greedy without one or with do_sample
    false). Temperature 0 is greedy whatever the filters say (the most likely token survives all)."""
    check_sampling(temperature, top_k, top_p, min_p)
    flags = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    if any(v is not None for v in flags.values()):
        named = ", ".join(f"--{k.replace('_', '-')}" for k, v in flags.items() if v is not None)
        s, source = {k: v for k, v in flags.items() if v is not None}, f"from {named}"
    elif models.generation is not None:
        s, source = models.generation, f"from {models.generation_source}"
    else:
        s = {"temperature": 0.0}
        source = ("no sampling flag, and no generation_config.json" if models.generation_source is None else
                  f"no sampling flag, and {models.generation_source} has do_sample false")
    T = s.get("temperature", 1.0)
    filters = Filters(int(s.get("top_k") or 0), float(s.get("top_p", 1.0)), float(s.get("min_p", 0.0)))
    return Sampling(float(T), filters if T > 0 else Filters(), source)
