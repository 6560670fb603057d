"""What a run decodes: the models named by the flags, and the prompts — read, tokenized and checked.

Shared by speculate.py, eval.py and the scripts, so that every program reads a checkpoint, a
prompts file or a chat template the same way and refuses the same mistakes with the same line:
- `load_models`: a target directory (and drafter), or a random-weight preset; an STS calibration;
- `resolve_checkpoint`: --target/--drafter as a directory, or a Hugging Face hub id (ORG/NAME@REVISION)
  found in the Hugging Face cache or downloaded into it — only the files a run reads;
- `load_prompts`: --prompt (text through the chat template, after an optional system turn),
  --prompt-ids, or a JSON-lines file of {"prompt"}, {"prompt_ids"}, {"turns"} or {"messages"}
  records — one kind per record, valid Unicode, and a text too long for the context refused after
  tokenizing a bounded prefix of it;
- `check_prompts`: ids inside the vocabulary, prompt + budget inside the target's and the drafter's
  context;
- `resolve_sampling`: the sampling settings — the flags, or without any the target's
  generation_config.json.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import torch

from common import (UserError, check_ranges, optional_file, parse_ints, read_json, read_jsonl, resolve_device,
                    resolve_dtype)
from kernels import Filters
from model import Transformer, load_target, random_target
from text import MAX_TEMPERATURE, MAX_TOP_K, MIN_TEMPERATURE, ROLES, Tokenizer, generation_sampling, stop_token_ids


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
    directories: tuple = (None, None)  # where the target and the drafter were read

    @property
    def hub_snapshots(self) -> list[str]:
        """A line for each model read from a snapshot of the Hugging Face cache: its id, commit and directory."""
        return [f"{flag} {hub}: {path}" for flag, path in zip(("--target", "--drafter"), self.directories)
                if path is not None and (hub := hub_snapshot(path))]

    def describe(self) -> str:
        """The drafter in one line (printed to stderr once every input has been checked), after the
        `hub_snapshots` lines."""
        d = self.drafter
        return "\n".join(self.hub_snapshots + [d.cfg.describe() if d is not None else
                                                "no drafter: autoregressive decoding"])


def load_models(target: Optional[str], drafter: Optional[str] = None, *, device: str = "cpu",
                dtype: Optional[str] = None, random_init: Optional[str] = None, calibration: Optional[str] = None,
                seed: int = 0) -> Models:
    """The target (and drafter) from directories or Hugging Face hub ids (`resolve_checkpoint`), or a
    random-weight preset; with `calibration`, the drafter's confidence temperatures (eval.py
    --calibration-out)."""
    if random_init is None and target is None:
        raise UserError("--target: no target directory given")
    if random_init is not None and (target is not None or drafter is not None):
        raise UserError("--random-init builds its own target and drafter: drop --target/--drafter")
    target, drafter = resolve_checkpoint(target, "--target"), resolve_checkpoint(drafter, "--drafter")  # hub ids
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
        if optional_file(os.path.join(target, "tokenizer.json")):
            tokenizer = Tokenizer(target)
        if drafter is not None:
            from drafter import load_drafter
            d = load_drafter(drafter, t, device, dt)
    if calibration is not None:
        if d is None or d.confidence_head is None:
            raise UserError(f"--calibration {calibration}: needs a --drafter with a confidence head")
        temps, K = read_json(calibration).get("temperatures"), d.cfg.num_drafts
        lo, hi = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max  # applied in float32
        if not isinstance(temps, list) or len(temps) != K or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and lo <= x <= hi for x in temps):
            raise UserError(f"{calibration}: 'temperatures' must be a list of {K} positive numbers from {lo:.3g} to "
                            f"{hi:.3g} (one per draft position), got {repr(temps)[:200]}")
        d.calibrate(temps)
    return Models(t, d, tokenizer, stop_ids, dt, generation, generation_source, (target, drafter))



# ----------------------------------------------------------------------------------------
# Checkpoints named by a Hugging Face hub id

HUB_META_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
                  "tokenizer_config.json", "chat_template.jinja")
"""What a run reads from a checkpoint besides its weights (model.py, drafter.py, text.py); the weights are
model.safetensors or the shards the index names, and nothing else of a repository is downloaded."""
_HUB_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"  # the hub's own rule for an owner or a name
HUB_ID = re.compile(rf"(?P<repo>{_HUB_PART}/{_HUB_PART})(?:@(?P<revision>[^@]*))?")
_REVISION = re.compile(r"[A-Za-z0-9_+-][A-Za-z0-9_.+-]*(?:/[A-Za-z0-9_+-][A-Za-z0-9_.+-]*)*")  # a git ref or a hash


def calibration_note(calibration: Optional[str], drafter: Optional[str], temperature: float) -> Optional[str]:
    """A note when an STS file (eval.py --calibration-out) was fitted on another drafter or at another
    sampling temperature than this run's: c_k's calibration depends on both, so its temperatures may not
    fit. `drafter`: the directory this run read its drafter from. Files without those records (written
    before they were) are taken as they are."""
    if calibration is None:
        return None
    cal, other = read_json(calibration), []
    fitted = cal.get("drafter_dir")
    if isinstance(fitted, str) and drafter is not None and fitted != os.path.realpath(drafter):
        other.append(f"on drafter {fitted} (this run: {os.path.realpath(drafter)})")
    fitted_t = cal.get("temperature")
    if isinstance(fitted_t, (int, float)) and not isinstance(fitted_t, bool) and fitted_t != temperature:
        other.append(f"at temperature {fitted_t:g} (this run: {temperature:g})")
    if not other:
        return None
    return (f"note: --calibration {calibration} was fitted {' and '.join(other)}; its temperatures may not fit "
            f"this run (eval.py --calibration-out refits them)")


def resolve_checkpoint(spec: Optional[str], flag: str) -> Optional[str]:
    """A --target/--drafter value as a local checkpoint directory. An existing path is used as it is (a
    local directory always wins over a hub id of the same spelling); otherwise `spec` must be a Hugging
    Face hub id ORG/NAME or ORG/NAME@REVISION (a branch, tag or commit), resolved as huggingface_hub
    resolves it: from its cache (HF_HUB_CACHE, or HF_HOME/hub) when the snapshot there holds config.json
    and the weights, else downloaded into that cache (only the files a run reads) unless offline mode
    (HF_HUB_OFFLINE) forbids it. Every failure is one UserError naming the flag and the id; what was
    resolved is said once every input has been checked (`Models.describe`, `hub_snapshot`)."""
    if spec is None or os.path.exists(spec):
        return spec
    if not spec.strip():
        raise UserError(f"{flag}: empty (a checkpoint directory, or a Hugging Face hub id ORG/NAME)")
    if os.path.isabs(spec) or spec.startswith((".", "~")):
        return spec  # spelled as a path: the loader says it is not found
    m = HUB_ID.fullmatch(spec)
    repo, revision = (m["repo"], m["revision"]) if m else (None, None)
    if m is None or ".." in repo or "--" in repo or (revision is not None and (
            not _REVISION.fullmatch(revision) or ".." in revision or len(revision) > 255)):
        raise UserError(f"{flag} {spec}: not found as a directory, and not a Hugging Face hub id (ORG/NAME or "
                        f"ORG/NAME@REVISION)")
    import huggingface_hub
    from huggingface_hub import constants

    cache, where = constants.HF_HUB_CACHE, f"{flag} {spec}"
    path, incomplete = _cached_snapshot(repo, revision, cache, where)
    missing = _missing_weights(path) if path else None
    loadable = path and not missing and not incomplete  # the config and the weights there
    # Used without asking the hub when it also holds the metadata every Qwen3 repository has (a cache another
    # program filled may hold the weights alone), or offline. A cached branch is not refreshed: give a commit.
    if loadable and (constants.HF_HUB_OFFLINE
                     or all(os.path.isfile(os.path.join(path, f)) for f in snapshot_expected(flag))):
        return path
    if constants.HF_HUB_OFFLINE:
        lacks = (f"lacks files the repository has ({incomplete})" if incomplete else f"has no {missing}")
        raise UserError(f"{where}: " + (f"the cached snapshot {path} {lacks}" if path else
                                        f"no such local directory, and not in the Hugging Face cache ({cache})")
                        + "; offline mode (HF_HUB_OFFLINE) forbids downloading it")

    def download(revision, files):
        try:
            return huggingface_hub.snapshot_download(repo, revision=revision, cache_dir=cache, allow_patterns=files)
        except Exception as e:  # network, authorization, disk: every way a download fails is one line
            raise UserError(f"{where}: {_download_error(e, repo, revision, cache)}") from None

    try:
        path_now = download(revision, list(HUB_META_FILES))  # the index says which weight files there are ...
    except UserError as e:
        if not (path and not missing):
            raise
        print(f"note: {e}; using the cached snapshot {path} as it is (HF_HUB_OFFLINE=1 skips this check)",
              file=sys.stderr)  # the hub out of reach: the snapshot with its weights as it is, said
        return path
    path = path_now
    if _missing_weights(path):  # (the weights of this very commit already there: nothing to ask)
        index = os.path.join(path, "model.safetensors.index.json")
        shards = _index_shards(index) if os.path.isfile(index) else ["model.safetensors"]
        path = download(os.path.basename(path), shards)  # ... fetched at the very commit the metadata came from
    missing = _missing_weights(path)
    if missing:
        raise UserError(f"{where}: {path} has no {missing} after the download: the repository lacks it (checkpoints "
                        f"are read as config.json and safetensors weights), or the hub could not be reached")
    lacking = [f for f in snapshot_expected(flag) if not os.path.isfile(os.path.join(path, f))]
    if lacking:  # huggingface_hub returns the cached snapshot itself when the hub is out of reach
        print(f"note: {where}: the snapshot {path} still has no {', '.join(lacking)} after asking the hub (out of "
              f"reach, or the repository lacks them); using it as it is", file=sys.stderr)
    return path


#: What a target's cached snapshot must hold, besides config.json and its weights, to be used without
#: asking the hub (every Qwen3 repository has them). A drafter's repository holds its weights alone.
SNAPSHOT_EXPECTED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def snapshot_expected(flag: str) -> tuple:
    return () if flag == "--drafter" else SNAPSHOT_EXPECTED


def hub_snapshot(path: str) -> Optional[str]:
    """ORG/NAME@COMMIT when `path` is a snapshot directory of a Hugging Face cache, else None."""
    *_, folder, snapshots, commit = ["", ""] + os.path.normpath(path).split(os.sep)
    repo = folder.removeprefix("models--")
    if snapshots == "snapshots" and repo != folder and "--" in repo:  # models--ORG--NAME (no "--" inside a part)
        return repo.replace("--", "/", 1) + "@" + commit
    return None


def _cached_snapshot(repo: str, revision: Optional[str], cache: str, where: str) -> tuple[Optional[str], Optional[str]]:
    """(the snapshot directory of repo@revision in the Hugging Face cache, or None; what it lacks by the cache's
    own listing of the repository, or None). Nothing is downloaded."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import LocalEntryNotFoundError

    try:
        return snapshot_download(repo, revision=revision, cache_dir=cache, local_files_only=True,
                                 allow_patterns=list(HUB_META_FILES)), None
    except LocalEntryNotFoundError as e:  # not there, or there in part (huggingface_hub >= 2: IncompleteSnapshotError)
        path = getattr(e, "snapshot_path", None)
        if path is None or not os.path.isdir(path):
            return None, None
        lacking = [f for f in HUB_META_FILES if f in str(e) and not os.path.exists(os.path.join(path, f))]
        return path, ", ".join(lacking) or "some of its metadata files"
    except Exception as e:
        raise UserError(f"{where}: cannot read the Hugging Face cache {cache} ({type(e).__name__}: "
                        f"{_first_line(e)})") from None


def _index_shards(index: str) -> list[str]:
    """The weight files a sharded checkpoint's index names (model.py checks the index in full when loading)."""
    weight_map = read_json(index).get("weight_map")
    shards = sorted({f for f in weight_map.values() if isinstance(f, str)}) if isinstance(weight_map, dict) else []
    if not shards or any(os.path.basename(f) != f or not f.endswith(".safetensors") for f in shards):
        raise UserError(f"{index}: 'weight_map' must map tensor names to .safetensors files beside it")
    return shards


def _missing_weights(directory: str) -> Optional[str]:
    """What a checkpoint directory lacks before it can be loaded (config.json, the weights), or None."""
    if not os.path.isfile(os.path.join(directory, "config.json")):
        return "config.json"
    index = os.path.join(directory, "model.safetensors.index.json")
    if not os.path.isfile(index):
        return None if os.path.isfile(os.path.join(directory, "model.safetensors")) else \
            "model.safetensors (or model.safetensors.index.json)"
    return next((f for f in _index_shards(index) if not os.path.isfile(os.path.join(directory, f))), None)


def _download_error(e: Exception, repo: str, revision: Optional[str], cache: str) -> str:
    """A failed download in one line, for the people who can act on it."""
    from huggingface_hub.utils import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                       RevisionNotFoundError)

    if isinstance(e, GatedRepoError):
        return (f"{repo} is gated on the Hugging Face hub: accept its conditions on huggingface.co/{repo}, then log "
                f"in (hf auth login, or HF_TOKEN)")
    if isinstance(e, RepositoryNotFoundError):
        return (f"no repository {repo} on the Hugging Face hub (or it is private: log in with hf auth login, or "
                f"set HF_TOKEN)")
    if isinstance(e, RevisionNotFoundError):
        return f"{repo} has no revision {revision!r} on the Hugging Face hub"
    if isinstance(e, LocalEntryNotFoundError):  # the hub could not be reached, and the cache has no copy
        return f"not in the Hugging Face cache ({cache}), and the hub cannot be reached ({_first_line(e)})"
    return f"downloading from the Hugging Face hub failed ({type(e).__name__}: {_first_line(e)})"


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]


PROMPT_KINDS = ("prompt", "prompt_ids", "turns", "messages")
#: Keys a prompt record might be meant to set per prompt, which only flags set (the flag named); a record's
#: other keys beside its prompt (an id, a category, a reference answer) are metadata and ignored.
RECORD_SETTINGS = {"system": "--system-prompt", "system_prompt": "--system-prompt",
                   "enable_thinking": "--enable-thinking", "max_new_tokens": "--max-new-tokens",
                   "max_tokens": "--max-new-tokens", "temperature": "--temperature", "top_k": "--top-k",
                   "top_p": "--top-p", "min_p": "--min-p", "stop": "--stop", "seed": "--seed",
                   "num_samples": "--num-samples"}
CHARS_PER_TOKEN = 64  # a text this many characters per allowed token is tokenized only that far before refusing


def load_prompts(*, tokenizer: Optional[Tokenizer], chat: bool, prompt: Optional[str] = None,
                 prompt_ids: Optional[str] = None, prompts_file: Optional[str] = None,
                 max_len: Optional[int] = None, system_prompt: Optional[str] = None,
                 thinking: bool = False, sources: Optional[list] = None) -> list[list[int]]:
    """Token ids of every prompt given by exactly one of prompt, prompt_ids or prompts_file. With `chat`,
    a text is one user turn rendered with the chat template (after a `system_prompt` turn, and with the
    template's `enable_thinking` set to `thinking`); a {"messages"} record is a whole conversation,
    rendered the same way. A text that cannot fit `max_len` tokens is refused after tokenizing a
    bounded prefix of it; an empty text is refused before rendering. `sources`, when given, gets where
    each prompt came from (`--prompt`, `--prompt-ids`, `FILE:LINE`), for `check_prompts`' messages."""
    given = [f for f, v in (("prompt", prompt), ("prompt_ids", prompt_ids), ("prompts_file", prompts_file))
             if v is not None]
    if len(given) != 1:
        raise UserError("give exactly one of --prompt, --prompt-ids, --prompts-file"
                        + (f" (got {', '.join('--' + g.replace('_', '-') for g in given)})" if given else ""))
    chat_flags = check_chat_flags(chat=chat, prompt_ids=prompt_ids, system_prompt=system_prompt, thinking=thinking)
    if thinking and tokenizer is not None and not tokenizer.thinking_switch:
        raise UserError(f"--enable-thinking: the chat template ({tokenizer.template_source}) has no thinking switch "
                        f"(it never reads enable_thinking)")
    system = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []

    def encode(messages: list[dict], where: str) -> list[int]:
        """A conversation ending in the user's turn, as ids: rendered with the template, or (no chat) the one
        text as it is."""
        if tokenizer is None:
            raise UserError(f"{where}: a text prompt needs the target's tokenizer.json")
        for m in messages:
            check_text(m["content"], where)
        texts = [m["content"] for m in messages]
        if not texts[-1].strip():  # before rendering: a template would dress an empty question up
            raise UserError(f"{where}: empty prompt")
        if max_len is not None and sum(map(len, texts)) > CHARS_PER_TOKEN * max_len:  # e.g. a 100 MB prompt
            head = tokenizer.encode("\n".join(texts)[:CHARS_PER_TOKEN * max_len])
            if len(head) > max_len:
                raise UserError(f"{where}: the prompt is longer than the {max_len} tokens the context leaves it")
        if not chat:
            return tokenizer.encode(texts[-1])
        return tokenizer.encode(tokenizer.render_messages(messages, add_generation_prompt=True, thinking=thinking))

    def user(text: str) -> list[dict]:
        return system + [{"role": "user", "content": text}]

    sources = [] if sources is None else sources
    if prompt is not None:
        sources.append("--prompt")
        return [encode(user(prompt), "--prompt")]
    if prompt_ids is not None:
        sources.append("--prompt-ids")
        return [parse_ints(prompt_ids, "--prompt-ids")]
    if not os.path.isfile(prompts_file):
        raise UserError(f"{prompts_file}: " + ("not a regular file (a pipe or a device): give a file"
                                               if os.path.exists(prompts_file) else "prompts file not found"))
    prompts = []
    for where, row in read_jsonl(prompts_file):
        sources.append(where)
        setting = sorted(set(row) & set(RECORD_SETTINGS)) if isinstance(row, dict) else []
        if setting:  # e.g. {"prompt": ..., "system": ...}: what the user meant would be dropped
            raise UserError(f"{where}: a record cannot set {setting[0]!r}; that is the run's "
                            f"{RECORD_SETTINGS[setting[0]]} (other keys are metadata, ignored)")
        kinds = [k for k in PROMPT_KINDS if isinstance(row, dict) and k in row]
        if len(kinds) > 1:
            raise UserError(f"{where}: a record gives one prompt, as one of {', '.join(PROMPT_KINDS)}; this one has "
                            f"{' and '.join(kinds)}")
        if kinds == ["prompt"] and isinstance(row["prompt"], str):
            prompts.append(encode(user(row["prompt"]), where))
        elif kinds == ["prompt_ids"] and isinstance(row["prompt_ids"], list):
            ids = row["prompt_ids"]
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise UserError(f"{where}: 'prompt_ids' must be a list of integers")
            if chat_flags:
                raise UserError(f"{where}: a prompt_ids record is token ids, not a rendered chat; {chat_flags[0]} "
                                f"would change nothing for it")
            prompts.append(ids)
        elif kinds == ["turns"] and isinstance(row["turns"], list) and row["turns"] and all(
                isinstance(t, str) for t in row["turns"]):  # the first turn is the prompt (the authors' protocol)
            prompts.append(encode(user(row["turns"][0]), where))
        elif kinds == ["messages"]:
            if tokenizer is not None and not chat:
                raise UserError(f"{where}: a messages record is a conversation, rendered only with a chat template, "
                                f"and prompts are not rendered as chat here (--no-chat, or a tokenizer without a chat "
                                f"template: --chat renders Qwen3's format)")
            messages = _read_messages(row["messages"], where)
            if system and any(m["role"] == "system" for m in messages):
                raise UserError(f"{where}: the conversation has its own system turn, and --system-prompt gives "
                                f"another; drop one")
            prompts.append(encode(system + messages, where))
        else:
            raise UserError(f"{where}: expected {{\"prompt\": str}}, {{\"prompt_ids\": [int]}}, {{\"turns\": [str]}} "
                            f"or {{\"messages\": [{{\"role\": str, \"content\": str}}, ...]}}")
    if not prompts:
        raise UserError(f"{prompts_file}: no prompts")
    return prompts


def check_chat_flags(*, chat: Optional[bool], prompt_ids: Optional[str], system_prompt: Optional[str],
                     thinking: bool) -> list[str]:
    """--system-prompt and --enable-thinking against the prompt flags, before anything is loaded (`chat`
    None: not known yet). They shape chat rendering only, so with token ids or without chat they
    would be dropped: an error. Returns the ones given."""
    flags = [f for f, on in (("--system-prompt", system_prompt is not None), ("--enable-thinking", thinking)) if on]
    if flags and prompt_ids is not None:  # said once here, and per record for a file's prompt_ids
        raise UserError(f"{flags[0]}: --prompt-ids are token ids, not a rendered chat; it would change nothing")
    if flags and chat is False:
        raise UserError(f"{flags[0]}: prompts are not rendered as chat here (--no-chat, or a tokenizer without "
                        f"a chat template: --chat renders Qwen3's format); it would change nothing")
    if system_prompt is not None:
        check_text(system_prompt, "--system-prompt")
        if not system_prompt.strip():
            raise UserError("--system-prompt: empty (leave the flag out for no system turn)")
    return flags


def check_text(text: str, where: str):
    """A text that can be encoded (tokenizers refuse a lone surrogate with a TypeError)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise UserError(f"{where}: the text is not valid Unicode (a lone surrogate)") from None


def _read_messages(messages, where: str) -> list[dict]:
    """A {"messages"} record's conversation, checked: {"role", "content"} objects, roles system / user /
    assistant, text content, the user's turn last (the one the model answers)."""
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: 'messages' must be a non-empty list of {{\"role\": str, \"content\": str}}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            got = f"keys {', '.join(map(repr, m))}" if isinstance(m, dict) else f"a {type(m).__name__}"
            raise UserError(f"{where}: messages[{i}] must be {{\"role\": str, \"content\": str}}, got {got}")
        if m["role"] not in ROLES:
            raise UserError(f"{where}: messages[{i}]: role {repr(m['role'])[:60]} is not one of {', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise UserError(f"{where}: messages[{i}]: 'content' must be a string, got {type(m['content']).__name__}")
    if messages[-1]["role"] != "user":
        raise UserError(f"{where}: the last message must be the user's (the turn the model answers), not the "
                        f"{messages[-1]['role']}'s")
    return [dict(m) for m in messages]


def check_prompts(prompts: list[list[int]], target: Transformer, max_new_tokens: int, where: str = "", drafter=None,
                  sources: Optional[list] = None):
    """Every prompt non-empty, inside the vocabulary, and fitting the context (the target's, and the
    drafter's positions too) with its budget. A prompt is named by `sources[i]` (from `load_prompts`),
    else as `{where}prompt {i}`."""
    V, context = target.args.vocab_size, target.args.max_position_embeddings
    if drafter is not None:
        context = min(context, drafter.cfg.layers.max_position_embeddings)
    for i, p in enumerate(prompts):
        name = sources[i] if sources is not None else f"{where}prompt {i}"
        if not p:
            raise UserError(f"{name}: empty prompt")
        bad = [t for t in p if not 0 <= t < V]
        if bad:
            raise UserError(f"{name}: token id {bad[0]} is outside the vocabulary (0..{V - 1})")
        if len(p) + max_new_tokens > context:
            raise UserError(f"{name}: {len(p)} tokens + --max-new-tokens {max_new_tokens} exceed "
                            f"the {'target' if context == target.args.max_position_embeddings else 'drafter'}'s "
                            f"context of {context} (max_position_embeddings)")



def auto_chat(chat: Optional[bool], tokenizer: Optional[Tokenizer]) -> bool:
    """--chat's default: on when the tokenizer has a chat template (or names templates it cannot use: then
    rendering a text says why, rather than sending it raw)."""
    return chat if chat is not None else (tokenizer is not None and (
        tokenizer.chat_template is not None or tokenizer.template_problem is not None))


def encode_prompt(tokenizer: Optional[Tokenizer], prompt, *, chat: Optional[bool] = None,
                  system_prompt: Optional[str] = None, thinking: bool = False, where: str = "prompt") -> list[int]:
    """One prompt of the Python API as ids: token ids as given; a text through the chat template
    (unless chat=False), after the system prompt if one is given; a conversation ([{"role",
    "content"}, ...], the user's turn last) through the template. Checked as prompts files are."""
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if system_prompt is not None or thinking:
            raise UserError(f"{where}: token ids are not a rendered chat; system_prompt or thinking would change nothing")
        return list(prompt)
    if tokenizer is None:
        raise UserError(f"{where}: a text or a conversation needs the target's tokenizer.json; give token ids")
    chat = auto_chat(chat, tokenizer)
    check_chat_flags(chat=chat, prompt_ids=None, system_prompt=system_prompt, thinking=thinking)
    if thinking and not tokenizer.thinking_switch:
        raise UserError(f"thinking: the chat template ({tokenizer.template_source}) has no thinking switch")
    if isinstance(prompt, str):
        check_text(prompt, where)
        if not chat:
            return tokenizer.encode(prompt)
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, (list, tuple)) and chat:
        messages = _read_messages(list(prompt), where)
    else:
        raise UserError(f"{where}: expected a text, a list of token ids or a list of {{\"role\", \"content\"}} "
                        f"messages (rendered with the chat template: chat must not be False)")
    if system_prompt is not None:
        if any(m["role"] == "system" for m in messages):
            raise UserError(f"{where}: the conversation has its own system turn, and system_prompt gives another")
        messages = [{"role": "system", "content": system_prompt}] + messages
    for m in messages:
        check_text(m["content"], where)
    return tokenizer.encode(tokenizer.render_messages(messages, add_generation_prompt=True, thinking=thinking))


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


def check_sampling(temperature: Optional[float] = None, top_k: Optional[int] = None, top_p: Optional[float] = None,
                   min_p: Optional[float] = None):
    """The sampling flags' values (None: not given), each a one-line error when out of range."""
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)):
        raise UserError(f"--top-k: invalid value {top_k!r} (valid: an integer, 0 for off)")
    check_ranges(SimpleNamespace(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p),
                 temperature=f"[0, {MAX_TEMPERATURE:g}]", top_k=f"[0, {MAX_TOP_K}]", top_p="(0, 1]", min_p="[0, 1]")
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
