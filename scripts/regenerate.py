"""Regenerate training responses with the target itself, as the authors train (docs/algorithm.md, "Training data").

    python scripts/regenerate.py --target DIR [--drafter DIR] --prompts a.jsonl,b.jsonl --out train.jsonl \
        [--temperature 0.7 --max-new-tokens 4096 --batch-size 64]
    python train.py --target DIR --data train.jsonl ...

Each turn is answered from the conversation so far (answers regenerated, system turns kept), thinking
off, by speculate.py's engine; turn t of conversation i samples from its own stream, so the records do
not depend on batch, chunk or shard. They go to OUT.partial chunk by chunk (OUT.partial.json: what they
depend on, how far the run got, for --resume), renamed to OUT when complete.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Literal, NamedTuple, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from speculate import Request, make_engine  # noqa: E402
from support import flags, runlog  # noqa: E402
from support import metrics as mt  # noqa: E402
from support.checkpoint import load_models, resolve_checkpoint  # noqa: E402
from support.cli import (  # noqa: E402
    Interrupted,
    UserError,
    check_ranges,
    cli_main,
    dtype_name,
    flag,
    flat,
    flat_fields,
    one_process,
    resolve_device,
    resolve_dtype,
    signals_deferred,
)
from support.data import chatml_note, turns_problem  # noqa: E402
from support.files import (  # noqa: E402
    CHECKPOINT_FILES,
    check_input,
    check_outputs,
    check_writable,
    directory_problem,
    files_digest,
    read_json,
    read_jsonl,
    write_json,
)
from support.flags import Settings  # noqa: E402
from support.text import RECORD_SETTINGS, ROLES, check_record_keys, check_text, encode  # noqa: E402

TURN_STRIDE = 1024  # request index = conversation * TURN_STRIDE + turn


@dataclass
class Args:
    """Regenerate training responses with the target (thinking off)."""

    target: Optional[str] = None
    """The target's Hugging Face Qwen3 directory (with tokenizer.json), or a hub id ORG/NAME[@REVISION]."""
    drafter: Optional[str] = None
    """A drafter (directory or hub id): speculative decoding, faster, the same distribution."""
    prompts: Optional[str] = None
    """Comma-separated JSON-lines files: "turns" [str], "prompt" str, or "messages" / "conversations"."""
    out: Optional[str] = None
    """The records' JSON-lines file (OUT.partial until complete)."""
    # The decode settings, with the authors' Qwen3 sampling (temperature 0.7, top-k 20, top-p 0.8), their
    # 4096-token responses and 16 requests decoded together; request conversation * 1024 + turn draws from
    # the stream seeded --seed + its index. READ lists the settings regenerate.py reads.
    decode: flat(Settings) = field(default_factory=lambda: Settings(
        max_new_tokens=4096, temperature=0.7, top_k=20, top_p=0.8, min_p=0.0, batch_size=16))
    max_context: Optional[int] = None
    """Longest prompt + response of a turn (default: the models' context, at most 8192);
    a conversation with a prompt over it less --max-new-tokens is dropped
    (counted; every one dropped is an error)."""
    chunk_size: int = 256
    """Conversations generated, then written, at a time."""
    max_prompts: Optional[int] = None
    """Only the first this many conversations (before sharding)."""
    num_shards: int = 1
    """Split the conversations across this many processes (i to shard i mod N)."""
    shard_index: int = 0
    """This process's shard, 0 .. --num-shards - 1."""
    resume: bool = False
    """Continue an interrupted run's OUT.partial (refused if its flags, or its prompts' records or models'
    files by content, differ: a copy or a move of the same files resumes)."""
    device: Optional[Literal["cpu", "cuda"]] = None
    """Default: cuda when available."""
    dtype: Optional[Literal["float32", "bfloat16", "float16"]] = None
    """Weights and activations. Default: bfloat16 on cuda, float32 on cpu."""
    progress: bool = True
    """Progress on stderr (responses generated): a bar on a terminal, else a line at most once a minute
    with the rate and the time to go."""


def prompt_files(paths: str) -> list[str]:
    return [p.strip() for p in paths.split(",") if p.strip()]  # "a.jsonl, b.jsonl" as eval.py's --datasets


# the keys a record gives its prompt under, one of them a record
PROMPT_KEYS = ("turns", "prompt", "messages", "conversations")
# the records a prompts file holds, as an error names them
RECORD_SHAPES = ('{"turns": [str]}, {"prompt": str} or {"messages": [{"role": str, "content": str}, ...]} '
                 '(or "conversations" for "messages")')


def setting_instead(key: str) -> str:
    """Where a record's setting goes instead: a system message, or a flag regenerate.py reads."""
    if key in ("system", "system_prompt"):
        return 'give it as a system message in "messages"'
    run_flag = RECORD_SETTINGS[key]
    if run_flag in [flag(name) for name in READ]:
        return f"that is the run's {run_flag}"
    return "regenerate.py sets it for every record or not at all"


def conversation_messages(obj, where: str) -> Optional[list[dict]]:
    """A record's system and user messages (None: no form it takes is recognized); a record giving two
    prompts, or one of the wrong shape, is an error."""
    if not isinstance(obj, dict):
        return None
    check_record_keys(obj, where, setting_instead)
    obj = {key: value for key, value in obj.items() if value is not None}  # a table's empty column
    given = [key for key in PROMPT_KEYS if key in obj]
    if len(given) > 1:
        raise UserError(f"{where}: a record gives one prompt, and this one has {' and '.join(given)}")
    if "turns" in obj:
        turns = obj["turns"]
        if not (isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns)):
            raise UserError(f"{where}: 'turns' must be a non-empty list of strings")
        return [{"role": "user", "content": t} for t in turns]
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str):
            raise UserError(f"{where}: 'prompt' must be a string")
        return [{"role": "user", "content": obj["prompt"]}]
    key = "messages"
    if "conversations" in obj:
        key = "conversations"
    raw = obj.get(key)
    if not isinstance(raw, list):
        return None
    for m in raw:
        well_formed = isinstance(m, dict) and m.get("role") in ROLES
        well_formed = well_formed and isinstance(m.get("content"), str)
        if not well_formed:
            raise UserError(f"{where}: {turns_problem(key, raw)}")
    return [{"role": m["role"], "content": m["content"]} for m in raw if m["role"] != "assistant"]


def user_turns(msgs: list[dict]) -> int:
    return sum(m["role"] == "user" for m in msgs)


def check_messages(msgs: Optional[list[dict]], where: str):
    """A user turn at least, no empty one, and text the tokenizer takes."""
    if not msgs or not any(m["role"] == "user" for m in msgs):
        raise UserError(f"{where}: expected {{\"turns\": [str]}}, {{\"prompt\": str}} or "
                        "{\"messages\": [...]} with a user turn")
    for m in msgs:
        check_text(m["content"], where)
        if m["role"] == "user" and not m["content"].strip():
            raise UserError(f"{where}: empty user turn")


def read_conversations(paths: str) -> list[tuple[str, Optional[object], list[dict], int]]:
    """(source "file:line" by the real path, id, system and user messages, user turns) of each record."""
    out = []
    seen = {}  # each file's real path: the path that named it
    for path in prompt_files(paths):
        check_input(path, "--prompts")
        real = os.path.realpath(path)
        if real in seen:  # its conversations would be written twice
            raise UserError(f"--prompts {paths}: names {seen[real]} twice")
        seen[real] = path
        for where, obj in read_jsonl(path, records=RECORD_SHAPES):
            msgs = conversation_messages(obj, where)
            check_messages(msgs, where)
            source = real + where[len(path):]
            out.append((source, obj.get("id"), msgs, user_turns(msgs)))
    if not out:
        raise UserError(f"--prompts {paths}: no prompts")
    return out


def model_digest(directory: Optional[str], flag_name: str) -> Optional[str]:
    """The digest of the files a run reads from a checkpoint directory, by content: a copy or a move
    of the directory, or a `touch`, keeps it."""
    if directory is None:
        return None
    problem = directory_problem(directory, "checkpoint directory")
    if problem:
        raise UserError(f"{flag_name} {directory}: {problem}")
    files = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        read_by_a_run = name in CHECKPOINT_FILES or name.endswith(".safetensors")
        if read_by_a_run and os.path.isfile(path):
            files.append(path)
    return files_digest(files)


def real_path(directory: Optional[str]) -> Optional[str]:
    """./m and /abs/m agree."""
    if directory is None:
        return None
    return os.path.realpath(directory)


def source_place(source: str, files: list[str]) -> tuple[int, int]:
    """(the prompts file's position in --prompts, the line) of a record's source "real path:line"."""
    path, _, line = source.rpartition(":")
    return files.index(path), int(line)


def records_digest(args: Args, convs: list) -> str:
    """The prompts' records with their places (file's position, line), not the files' paths: a copy or a
    move of the files keeps it."""
    files = [real_path(p) for p in prompt_files(args.prompts)]
    digest = hashlib.sha256()
    for where, cid, msgs, _ in convs:
        digest.update(json.dumps([source_place(where, files), cid, msgs]).encode() + b"\n")
    return digest.hexdigest()


def resume_key(args: Args, convs: list, target_dir: Optional[str],
               drafter_dir: Optional[str], device: str) -> dict:
    """What OUT.partial's records depend on, by flag: a resume must agree (--dtype as it resolves on
    `device`: not given is bfloat16 on a GPU, float32 on a CPU; the models and prompts by content)."""
    return {
        "--dtype": dtype_name(resolve_dtype(args.dtype, device)),
        "--max-prompts": args.max_prompts,
        "--num-shards": args.num_shards,
        "--shard-index": args.shard_index,
        "--max-context": args.max_context,
        "--max-new-tokens": args.decode.max_new_tokens,
        "--temperature": args.decode.temperature,
        "--top-k": args.decode.top_k,
        "--top-p": args.decode.top_p,
        "--min-p": args.decode.min_p,
        "--seed": args.decode.seed,
        # last: a flag that changes which records are read is named, not the records
        "--target": model_digest(target_dir, "--target"),
        "--drafter": model_digest(drafter_dir, "--drafter"),
        "--prompts": records_digest(args, convs),
    }


def started_with(args: Args, target_dir: Optional[str], drafter_dir: Optional[str]) -> dict:
    """The real paths a run was started with: for its messages, and as its records' sources."""
    return {
        "--target": real_path(target_dir),
        "--drafter": real_path(drafter_dir),
        "--prompts": [real_path(p) for p in prompt_files(args.prompts)],
    }


def shown(value) -> str:
    """A flag's value in a message; None as "(not given)", a list of paths as --prompts takes it."""
    if value is None:
        return "(not given)"
    if isinstance(value, list):
        return ",".join(value)
    return f"{value}"


def check_resume_file(saved: dict, partial: str, done_path: str):
    """The resume file is regenerate.py's: a resume key, the paths the run was started with, and its
    counts, conversations consumed and, of them, dropped, and the user turns those dropped left
    unanswered (an older run's file lacks these)."""
    key = saved.get("resume_key")
    if isinstance(key, dict) and "--target files" in key:  # the models keyed by their files' dates
        raise UserError(f"{done_path}: written by an older regenerate.py, which keyed the models by their "
                        f"files' dates; finish {partial} with that version, or remove both to start over")
    consumed = saved.get("consumed")
    dropped = saved.get("dropped")
    turns = saved.get("dropped_turns", 0)
    paths = saved.get("started_with")
    files = None
    if isinstance(paths, dict):
        files = paths.get("--prompts")
    well_formed = isinstance(key, dict) and isinstance(files, list) and all(isinstance(f, str) for f in files)
    for count in (consumed, dropped, turns):
        well_formed = well_formed and isinstance(count, int) and not isinstance(count, bool) and count >= 0
    well_formed = well_formed and dropped <= consumed
    if not well_formed:
        raise UserError(f"{done_path}: not a resume file of regenerate.py; "
                        f"remove it and {partial} to start over")


# the flags a resume compares by content, and what of theirs it compares
BY_CONTENT = {"--target": "files", "--drafter": "files", "--prompts": "records"}


def check_same_flags(saved: dict, key: dict, partial: str, args: Args):
    """Every flag (the models and prompts by content) the records depend on is as when OUT.partial was
    started."""
    saved_key = saved["resume_key"]
    for name, value in key.items():
        if name in saved_key and saved_key[name] == value:
            continue
        then = saved_key.get(name)
        if name in BY_CONTENT:  # named as given now, and as the run was started
            value = flat_fields(args)[name[2:]]
            then = saved["started_with"].get(name)
        if name in BY_CONTENT and value is not None and then is not None:
            raise UserError(f"{name} {value}: its {BY_CONTENT[name]} differ from those {partial} was started "
                            f"with ({shown(then)}); restore them, or remove {partial} to start over")
        raise UserError(f"{name} {shown(value)}: {partial} was started with {name} {shown(then)}; "
                        f"resume with the same {name}, or remove {partial} to start over")


def kept_records(partial: str, mine: list, consumed: int) -> tuple[int, int]:
    """(whole records of the first `consumed` conversations of `mine`, their bytes). Records past them,
    a chunk written before the resume file counted it, are cut off with a torn last line and generated
    again, the same: the resume file's counts of dropped conversations do not include that chunk's."""
    position = {}
    for k, (_, (where, *_)) in enumerate(mine):
        position[where] = k
    kept = 0
    size = 0
    last = -1
    with open(partial, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.endswith(b"\n"):  # torn by the kill: cut off
                break
            try:
                source = json.loads(line).get("source")
            except (ValueError, AttributeError, RecursionError):
                source = None
            if not isinstance(source, str) or position.get(source, -1) <= last:
                raise UserError(f"{partial}:{lineno}: "
                                "not a record of this run's next conversation "
                                f"(source {source!r}); remove {partial} to start over")
            last = position[source]
            if last >= consumed:
                break
            kept += 1
            size += len(line)
    return kept, size


class ResumePoint(NamedTuple):
    kept: int           # whole records in OUT.partial
    size: int           # their bytes (a torn last line cut off)
    consumed: int       # conversations done, dropped ones included
    dropped: int        # conversations dropped
    dropped_turns: int  # the user turns those left unanswered


def resume_file(partial: str, done_path: str, key: dict, args: Args) -> dict:
    """OUT.partial's resume file, checked against this run's flags, models and prompts."""
    saved = read_json(done_path)
    check_resume_file(saved, partial, done_path)
    check_same_flags(saved, key, partial, args)
    return saved


def sources_as_started(args: Args, mine: list, started: list[str]) -> list:
    """`mine` with each source naming its prompts file by the path the run was started with (the same
    records, a copy or a move of them now): the records written name it, and the rest will too."""
    files = [real_path(p) for p in prompt_files(args.prompts)]
    out = []
    for i, (source, cid, msgs, n) in mine:
        place, line = source_place(source, files)
        out.append((i, (f"{started[place]}:{line}", cid, msgs, n)))
    return out


def resume_point(partial: str, done_path: str, saved: dict, mine: list) -> ResumePoint:
    consumed = saved["consumed"]
    if not 0 <= consumed <= len(mine):
        raise UserError(f"{done_path}: counts {consumed} conversations done "
                        f"of this run's {len(mine)}; "
                        f"remove it and {partial} to start over")
    kept, size = kept_records(partial, mine, consumed)
    return ResumePoint(kept, size, consumed, saved["dropped"], saved.get("dropped_turns", 0))


# run()'s steps, in order

# The decode settings regenerate.py reads; another would change what a record means (--stop,
# --num-samples) or is not offered here.
READ = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "batch_size",
        "compile")
Args.__doc__ = flags.reads_only(Args.__doc__, "regenerate.py", READ)


def checked_settings(args: Args, device) -> Settings:
    """The decoding settings and the flags' ranges, checked; the required flags given."""
    default = Args().decode
    for f in fields(Settings):
        value = getattr(args.decode, f.name)
        given = value != getattr(default, f.name)
        if given and f.name not in READ:
            read = ", ".join(flag(name) for name in READ)
            raise UserError(f"{flag(f.name)}: regenerate.py decodes with {read} only; "
                            "it does not offer this one")
        # None means "the default" only where regenerate.py's default is None: the records and
        # the resume key write these settings as given
        if given and value is None:
            raise UserError(f"{flag(f.name)}: invalid value None")
    if args.decode.temperature == 0:  # greedy: the authors' filters, where left as they are, do not apply
        for name in ("top_k", "top_p", "min_p"):
            if getattr(args.decode, name) == getattr(default, name):
                setattr(args.decode, name, None)
    settings = flags.check_settings(args.decode, device)
    check_ranges(args, max_context="[2, inf)", chunk_size="[1, inf)", max_prompts="[1, inf)",
                 num_shards="[1, inf)", shard_index=f"[0, {args.num_shards - 1}]")
    for name in ("target", "prompts", "out"):
        if getattr(args, name) is None:
            raise UserError(f"--{name}: not given")
    check_writable(args.out, "--out")
    return settings


def this_shards_conversations(args: Args) -> tuple[list, list]:
    """(the conversations of every shard, (index, conversation) of this shard's)."""
    convs = read_conversations(args.prompts)[:args.max_prompts]
    mine = []
    for i, c in enumerate(convs):
        if i % args.num_shards == args.shard_index:
            mine.append((i, c))
    for where, _, _, n in convs:
        if n > TURN_STRIDE:
            raise UserError(f"{where}: the conversation has {n} user turns; "
                            f"regenerate.py takes at most {TURN_STRIDE}")
    return convs, mine


def check_earlier_output(args: Args, partial: str, done_path: str, mine: list):
    """A non-empty OUT.partial is continued only with --resume and its resume file; a finished OUT is not
    generated again under --resume."""
    if os.path.getsize(partial) == 0:  # made by this run's `claim`, or left empty
        finished = args.resume and os.path.exists(args.out)
        if finished and os.path.exists(done_path):
            # a run killed between publishing OUT and removing its resume file left that file counting
            # every conversation; one counting fewer is a later run's, killed before its first record
            saved = read_json(done_path)
            check_resume_file(saved, partial, done_path)
            finished = saved["consumed"] == len(mine)
            if finished:
                os.remove(done_path)  # as the run that published OUT would have
        if finished:
            raise UserError(f"--resume: {args.out} is a finished run's output, and there is no {partial} "
                            "to continue; leave out --resume to generate it again")
        return
    if not args.resume:
        raise UserError(f"{partial}: holds an earlier run's output; "
                        "pass --resume to continue it, or remove it to start over")
    if not os.path.exists(done_path):
        raise UserError(f"{done_path}: not found, so what {partial} was made with is unknown; "
                        f"remove {partial} to start over")


def models_context(m) -> int:
    """The longest context the target (and the drafter) take: their max_position_embeddings."""
    limit = m.target.args.max_position_embeddings
    if m.drafter is not None:
        limit = min(limit, m.drafter.cfg.layers.max_position_embeddings)
    return limit


def context_length(args: Args, m) -> int:
    """Longest prompt + response of a turn: --max-context, or the models' context up to 8192."""
    limit = models_context(m)
    models = "the target"
    if m.drafter is not None:
        models = "the target and the drafter"
    context = args.max_context or min(limit, 8192)
    budget = args.decode.max_new_tokens
    if args.max_context is None and context <= budget:
        default = ""
        if budget == Args().decode.max_new_tokens:
            default = " (regenerate.py's default)"
        where = f"the context of {context} tokens (max_position_embeddings of {models})"
        hint = f"give --max-new-tokens below {context}"
        if context < limit:  # the 8192 cap, not the models'
            where = f"regenerate.py's default context of {context} tokens"
            hint += f", or --max-context up to {limit}"
        raise UserError(f"--max-new-tokens {budget}{default}: leaves no room for a prompt in {where}; {hint}")
    if context > limit or context <= budget:
        raise UserError(f"--max-context {context}: must exceed --max-new-tokens {budget} "
                        f"and fit the models' context of {limit} "
                        f"(max_position_embeddings of {models})")
    return context


def drop_reason(args: Args, context: int, budget: int) -> str:
    """Why a conversation is dropped, as the summary and the error say it."""
    limit = f"--max-context {context}"
    if args.max_context is None:
        limit = f"the context of {context}"
    return f"a prompt over {context - budget} tokens: {limit} less --max-new-tokens {budget}"


def all_dropped(dropped: int, why: str, room: bool) -> str:
    """The error of a run that dropped every conversation; `room`: a longer --max-context would fit the
    models."""
    what = f"all {dropped} conversations dropped"
    if dropped == 1:
        what = "its one conversation dropped"
    fix = "give a smaller --max-new-tokens"
    if room:
        fix += " or a larger --max-context"
    return f"--prompts: {what} ({why}); {fix}"


def record_setting(args: Args) -> dict:
    """How every record was regenerated (each record's "regenerated", with its own finish reasons and lengths)."""
    return {
        "tool": "scripts/regenerate.py",
        "target": args.target,
        "drafter": args.drafter,
        "temperature": args.decode.temperature,
        "top_p": args.decode.top_p,
        "top_k": args.decode.top_k,
        "min_p": args.decode.min_p,
        "max_new_tokens": args.decode.max_new_tokens,
        "seed": args.decode.seed,
        "enable_thinking": False,
    }


def new_conversation(index: int, where: str, cid, msgs: list[dict]) -> dict:
    """A conversation being regenerated: its messages so far, those to come, each answer's finish and length."""
    return dict(index=index, where=where, id=cid, history=[], pending=list(msgs),
                finish=[], ntok=[], alive=True)


class Progress:
    """Responses done, and apart the turns of dropped conversations: a tqdm bar on a terminal, else
    a line at most once a minute with this run's rate and the time to go; nothing without --progress."""

    def __init__(self, how: Optional[str], total: int, before: int, dropped_before: int = 0):
        from tqdm import tqdm

        self.total = total
        self.before = before  # a resumed run's responses, done before this one: not in the rate
        self.done = before
        self.dropped = dropped_before  # the turns of dropped conversations, never answered
        self.t0 = time.perf_counter()
        self.bar = tqdm(total=total, initial=before + dropped_before, file=sys.stderr,
                        disable=how != "bar",
                        unit="response", dynamic_ncols=True)
        self.lines = None
        if how == "lines":
            self.lines = runlog.Lines()

    def update(self, n: int, final: bool = False, dropped: int = 0):
        self.done += n
        self.dropped += dropped
        self.bar.update(n + dropped)
        if dropped:
            self.bar.set_postfix(dropped=self.dropped)
        if self.lines is None:
            return
        seconds = max(time.perf_counter() - self.t0, 1e-9)
        rate = (self.done - self.before) / seconds
        left = ""
        if rate > 0:
            left = f", {(self.total - self.done - self.dropped) / rate / 60:.1f} min to go"
        text = f"regenerate.py: {self.done}/{self.total} responses"
        if self.dropped:
            text += f", {self.dropped} dropped"
        self.lines.say(f"{text}, {rate:.2f}/s{left}", final=final)

    def close(self):
        self.bar.close()


def turn_requests(chunk: list[dict], turn: int, m, longest: int, progress: Progress
                  ) -> tuple[list, list]:
    """(requests, their conversations) of a turn: each live conversation's next user turn with what precedes it;
    a conversation whose prompt exceeds `longest` is dropped (its remaining turns counted as dropped)."""
    requests = []
    owners = []
    for c in chunk:
        while c["alive"] and c["pending"] and c["pending"][0]["role"] != "user":  # system turns
            c["history"].append(c["pending"].pop(0))
        if not c["alive"] or not c["pending"]:
            continue
        c["history"].append(c["pending"].pop(0))
        ids = encode(m.tokenizer, c["history"], c["where"], chat=True)
        if len(ids) > longest:
            c["alive"] = False
            progress.update(0, dropped=1 + user_turns(c["pending"]))
            continue
        requests.append(Request(c["index"] * TURN_STRIDE + turn, ids))
        owners.append(c)
    return requests, owners


def response_text(tokenizer, ids: list[int], cut: bool) -> str:
    """A response's text; cut at its budget inside a character, less the U+FFFD its first bytes decode
    as (the target never wrote it). Those bytes end the last 3 tokens at most: a U+FFFD that stays
    without them is bytes that are not UTF-8, kept as they decode."""
    text = tokenizer.decode(ids)
    if not cut or not text.endswith("\ufffd"):
        return text
    for n in range(1, min(3, len(ids)) + 1):
        if not tokenizer.decode(ids[:-n]).endswith("\ufffd"):
            return text[:-1]  # a token's text before the cut character stays
    return text


def add_answers(owners: list[dict], requests: list, m, stats: dict):
    """Each request's response as its conversation's assistant turn (the stop token left out, and a
    character cut by the budget)."""
    for c, req in zip(owners, requests):
        out = req.output_ids
        if req.finish_reason == "stop":
            out = out[:-1]
        cut = req.finish_reason == "length"
        c["history"].append({"role": "assistant", "content": response_text(m.tokenizer, out, cut)})
        c["finish"].append(req.finish_reason)
        c["ntok"].append(len(out))
        stats["responses"] += 1
        stats["tokens"] += len(req.output_ids)


def regenerate_chunk(chunk: list[dict], engine, m, longest: int, max_new_tokens: int,
                     progress: Progress, stats: dict):
    """Every turn of a chunk's conversations, a turn of all of them at a time."""
    turns = max(user_turns(c["pending"]) for c in chunk)
    for turn in range(turns):
        requests, owners = turn_requests(chunk, turn, m, longest, progress)
        engine.generate(requests, max_new_tokens, on_finish=lambda req: progress.update(1))
        counts = mt.count(requests, engine.K, m.stop_ids)
        stats["num_rounds"] += counts["num_rounds"]
        stats["committed"] += counts["committed"]
        add_answers(owners, requests, m, stats)


def chunk_lines(chunk: list[dict], setting: dict, stats: dict) -> list[str]:
    """The JSON lines of a chunk's conversations not dropped."""
    lines = []
    for c in chunk:
        if not c["alive"]:
            stats["dropped"] += 1
            continue
        rec = {"messages": c["history"], "source": c["where"]}
        if c["id"] is not None:
            rec["id"] = c["id"]
        rec["regenerated"] = dict(setting, finish_reasons=c["finish"], response_tokens=c["ntok"])
        lines.append(json.dumps(rec, ensure_ascii=False) + "\n")
        stats["conversations"] += 1
    return lines


def claim(partial: str, out: str) -> tuple[int, bool]:
    """OUT.partial opened (made if missing: the bool) and locked for the rest of the run, before anything
    reads it: a second run writing the same --out at the same time (a job submitted twice, one --out for
    two shards) is refused, not interleaved with this one."""
    try:
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        created = True
    except FileExistsError:
        fd = os.open(partial, os.O_WRONLY)
        created = False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # published (renamed) by the run that held it, between the open and the lock
        elsewhere = os.fstat(fd).st_ino != os.stat(partial).st_ino
    except (BlockingIOError, FileNotFoundError):  # held by another run, or published by it meanwhile
        elsewhere = True
    except OSError as e:  # a filesystem without locks (NFS mounted nolock): unguarded, said once
        print(f"warning: --out {out}: {partial} cannot be locked ({e.strerror}); a second run writing "
              f"it at the same time would not be refused", file=sys.stderr)
        elsewhere = False
    if elsewhere:  # another run has it
        os.close(fd)
        raise UserError(f"--out {out}: another run is writing it now ({partial} is locked); "
                        "give each run its own --out")
    return fd, created


def append_durably(path: str, lines: list[str]):
    """The lines on disk before the resume file counts them."""
    with open(path, "a", encoding="utf-8") as f:
        f.writelines(lines)
        f.flush()
        os.fsync(f.fileno())


def publish(partial: str, out_file: str, done_path: str):
    with signals_deferred():  # OUT published and its resume file gone together
        os.replace(partial, out_file)
        os.remove(done_path)


def print_summary(stats: dict, seconds: float, tau: Optional[float], why: str, out: str, resumed: int):
    """The counts of the file written; the responses, tokens, time and rate of this run alone (a resumed
    run's earlier conversations were generated by the run it resumes)."""
    rate = stats["tokens"] / max(seconds, 1e-9)
    text = f"{stats['conversations']} conversations "
    # generated: a conversation dropped after its first turns was generated in part, and is not written
    if resumed:
        text += f"({resumed} from the run resumed; this run generated {stats['responses']} responses, "
    else:
        text += f"(generated {stats['responses']} responses, "
    text += f"{stats['tokens']} tokens) in {seconds:.1f} s, {rate:.1f} tokens/s"
    if tau is not None:
        text += f", τ={tau:.2f}"
    text += f"; {stats['dropped']} dropped ({why}); written to {out}"
    print(text)


def kept_files(out: str, out_file: str, partial: str) -> list[str]:
    """What an interrupted run kept: OUT.partial's finished records (and how to continue them), or OUT once
    published (OUT.partial, made at the start, is gone only then)."""
    if not os.path.exists(partial) and os.path.exists(out_file):
        return [out]
    if os.path.isfile(partial) and os.path.getsize(partial) > 0:
        return [f"{partial} (rerun with --resume to continue it)"]
    return []


def out_paths(out: str) -> tuple[str, str, str]:
    """OUT, OUT.partial and its resume file; a link: the two go beside the file it names."""
    out_file = os.path.realpath(out)
    return out_file, out_file + ".partial", out_file + ".partial.json"


def run(args: Args) -> dict:
    """Everything `python scripts/regenerate.py` does; returns counts."""
    one_process("regenerate.py", "run one a GPU with --num-shards N --shard-index i, each with its own "
                "--out (docs/training.md)")
    device = resolve_device(args.device)
    settings = checked_settings(args, device)
    convs, mine = this_shards_conversations(args)
    target_dir = resolve_checkpoint(args.target, "--target")
    drafter_dir = resolve_checkpoint(args.drafter, "--drafter")
    out_file, partial, done_path = out_paths(args.out)
    outputs = {"--out": args.out, "--out (its partial file)": partial,
               "--out (its resume file)": done_path}
    check_outputs(outputs, inputs=[target_dir, drafter_dir, *prompt_files(args.prompts)])
    key = resume_key(args, convs, target_dir, drafter_dir, device)
    fd, created = claim(partial, args.out)
    try:
        return regenerate(args, device, settings, mine, key, target_dir, drafter_dir, fd)
    except Interrupted as e:  # its line names what is kept, and how to go on
        e.written = kept_files(args.out, out_file, partial)
        raise
    finally:
        if created and os.path.isfile(partial) and os.path.getsize(partial) == 0:
            os.remove(partial)  # made by this run, which stopped before writing a record
        os.close(fd)  # and the lock with it


def regenerate(args: Args, device: str, settings: Settings, mine: list, key: dict, target_dir: str,
               drafter_dir: Optional[str], fd: int) -> dict:
    """`run`'s work, OUT.partial held (`fd`): from its resume point, if any, to OUT published."""
    out_file, partial, done_path = out_paths(args.out)
    check_earlier_output(args, partial, done_path, mine)
    resuming = args.resume and os.path.getsize(partial) > 0 and os.path.exists(done_path)
    start = ResumePoint(0, 0, 0, 0, 0)
    started = started_with(args, target_dir, drafter_dir)
    if resuming:
        saved = resume_file(partial, done_path, key, args)
        started = saved["started_with"]
        mine = sources_as_started(args, mine, started["--prompts"])
        start = resume_point(partial, done_path, saved, mine)
    cut = start.consumed

    m = load_models(target_dir, drafter_dir, device=device, dtype=args.dtype)
    if m.tokenizer is None:
        raise UserError(f"--target {args.target}: regenerating text needs its tokenizer.json")
    context = context_length(args, m)
    longest = context - settings.max_new_tokens
    why = drop_reason(args, context, settings.max_new_tokens)
    # sized for the longest
    engine = make_engine(m, m.drafter, [[0] * longest] * settings.batch_size, settings)
    note = chatml_note(m.tokenizer)
    if note is not None:  # as train.py says it of the records
        print(f"note: --prompts: {note}", file=sys.stderr)
    setting = record_setting(args)

    total = sum(n for _, (*_, n) in mine)
    # the run resumed: its responses, and apart the turns its dropped conversations left
    before = sum(c[3] for _, c in mine[:cut]) - start.dropped_turns
    how = runlog.show(args.progress)  # off a terminal, a line now and then: no bar frames in a log
    stats = {"conversations": start.kept, "dropped": start.dropped, "responses": 0, "tokens": 0,
             "num_rounds": 0, "committed": 0}
    progress = Progress(how, total, before, start.dropped_turns)
    t0 = time.perf_counter()
    try:
        os.ftruncate(fd, start.size)  # a resumed run's whole records; a fresh run's: none
        resume = {"tool": "scripts/regenerate.py", "resume_key": key, "started_with": started, "consumed": cut,
                  "dropped": start.dropped, "dropped_turns": start.dropped_turns}
        write_json(done_path, resume)
        todo = mine[cut:]
        for c0 in range(0, len(todo), args.chunk_size):
            chunk = []
            for i, (where, cid, msgs, _) in todo[c0:c0 + args.chunk_size]:
                chunk.append(new_conversation(i, where, cid, msgs))
            regenerate_chunk(chunk, engine, m, longest, settings.max_new_tokens, progress, stats)
            append_durably(partial, chunk_lines(chunk, setting, stats))
            consumed = cut + c0 + len(chunk)
            write_json(done_path, dict(resume, consumed=consumed, dropped=stats["dropped"],
                                       dropped_turns=progress.dropped))
        progress.update(0, final=True)
        if stats["conversations"] == 0 and stats["dropped"] > 0:  # an empty OUT would pass for a result
            os.remove(done_path)
            raise UserError(all_dropped(stats["dropped"], why, context < models_context(m)))
        publish(partial, out_file, done_path)
    finally:  # the bar closed before an interruption's line starts
        progress.close()
    seconds = time.perf_counter() - t0
    tau = None  # τ: tokens committed a round, with a drafter
    if args.drafter:
        tau = mt.acceptance_length(stats)
    print_summary(stats, seconds, tau, why, args.out, resumed=start.kept)
    return dict(stats, seconds=seconds, acceptance_length=tau, settings=setting, args=asdict(args))


def main(argv: Optional[list[str]] = None) -> int:
    one_drafter = {"--drafter": "regenerate.py decodes with one"}
    return cli_main(Args, run, argv, once=one_drafter)


if __name__ == "__main__":
    sys.exit(main())
