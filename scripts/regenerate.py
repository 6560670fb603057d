"""Regenerate training responses with the target itself, as the authors train (docs/algorithm.md, "Training data").

    python scripts/regenerate.py --target DIR [--drafter DIR] --prompts a.jsonl,b.jsonl --out train.jsonl \
        [--temperature 0.7 --max-new-tokens 4096 --batch-size 64]
    python train.py --target DIR --data train.jsonl ...

What is notable here:
- Prompts are JSON lines with "turns" (user turns), "prompt" (one user turn) or "messages" /
  "conversations" (system messages kept, assistant messages dropped and regenerated). Turn t of every
  conversation is generated from the conversation so far — the regenerated earlier answers included, as
  the authors' script does — through the target's chat template with thinking off.
- Generation is speculate.py's `Engine`: batched with continuous batching, speculative when --drafter is
  given (lossless: the responses are the target's own distribution either way), one engine with static
  cache shapes for the whole run (--max-context), so a compiled round compiles once.
- Sampling is reproducible whatever the batch, chunk or shard: turn t of conversation i samples from its
  own generator seeded --seed + i·1024 + t (the engine's per-request streams). Sampling is the authors':
  temperature 0.7, top-p 0.8, top-k 20 by default, exact under speculation; each record says so.
- Output: JSON lines {"messages": [...], "source": "file:line" (the prompts file's real path), "id"?,
  "regenerated": {settings, finish reasons, response tokens}}, in input order, appended chunk by chunk to
  OUT.partial (flushed to disk) and renamed to OUT when complete (an OUT that is a symbolic link: to the file
  it names, beside which OUT.partial and OUT.partial.json go). --num-shards/--shard-index split the prompts
  across processes (one per GPU); concatenate their outputs.
- --resume continues an interrupted run's OUT.partial. OUT.partial.json beside it (written atomically after
  each chunk) holds what its records depend on (the model files, the prompts, the sampling and length flags)
  and how many conversations are done, the dropped ones included; a resume that differs in any of them is
  refused, and one skips exactly the conversations done. Without --resume an OUT.partial with records in it
  is refused rather than overwritten.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Literal, Optional


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import metrics as mt  # noqa: E402
from common import (AutoBool, UserError, atomic_write, check_outputs, check_ranges, check_writable,  # noqa: E402
                    cli_main, read_json, read_jsonl, resolve_device, signals_deferred, write_json)
from data import ROLES  # noqa: E402
from inputs import check_sampling, check_text  # noqa: E402
from kernels import Filters  # noqa: E402
from inputs import HUB_META_FILES, resolve_checkpoint  # noqa: E402
from compiling import auto_compile  # noqa: E402
from speculate import Engine, Request, cache_length, load_models  # noqa: E402

TURN_STRIDE = 1024  # request index = conversation index * TURN_STRIDE + turn (per-request random streams)


@dataclass
class Args:
    """Regenerate training responses with the target (thinking off), speculatively with --drafter."""

    target: Optional[str] = None
    """Hugging Face Qwen3 directory of the target (with tokenizer.json), or a hub id ORG/NAME[@REVISION]."""
    drafter: Optional[str] = None
    """A drafter (directory or hub id) to decode speculatively (faster, the same distribution); omitted:
    autoregressive."""
    prompts: Optional[str] = None
    """Comma-separated JSON-lines files of prompts: "turns" [str], "prompt" str, or "messages" / "conversations"."""
    out: Optional[str] = None
    """Output JSON lines of training records (written to OUT.partial, renamed when complete)."""
    temperature: float = 0.7
    """Sampling temperature (the authors' Qwen3 setting); 0 = greedy."""
    top_k: int = 20
    """Sample from the K most likely tokens (the authors' 20; 0: off)."""
    top_p: float = 0.8
    """Then from the most likely tokens making up probability P (the authors' 0.8; 1: off)."""
    min_p: float = 0.0
    """Then only tokens at least M times as likely as the most likely one (0: off)."""
    max_new_tokens: int = 4096
    """Token budget of one response (the authors': 4096)."""
    max_context: Optional[int] = None
    """Longest prompt + response of one turn, the engine's cache length (default: the models' context — the
    target's, and the drafter's positions — at most 8192); a conversation whose prompt leaves less than
    --max-new-tokens is dropped (counted)."""
    batch_size: int = 16
    """Requests decoded together (continuous batching)."""
    chunk_size: int = 256
    """Conversations generated, then written and flushed, at a time."""
    max_prompts: Optional[int] = None
    """Only the first this many conversations of the files (before sharding)."""
    num_shards: int = 1
    """Split the conversations across this many processes (conversation i goes to shard i mod N)."""
    shard_index: int = 0
    """This process's shard, 0 .. --num-shards - 1."""
    seed: int = 0
    """Turn t of conversation i samples from its own stream seeded seed + i*1024 + t."""
    resume: bool = False
    """Continue an interrupted run's OUT.partial (its complete lines are kept and the conversations done skipped);
    refused if a flag its records depend on, the prompts or the model differ."""
    device: Optional[Literal["cpu", "cuda"]] = None
    """Default: cuda when available."""
    dtype: Optional[Literal["float32", "bfloat16", "float16"]] = None
    """Weights and activations. Default: bfloat16 on cuda, float32 on cpu."""
    compile: AutoBool = None
    """torch.compile the round. Default: on for cuda, off for cpu."""
    progress: bool = True
    """A progress bar on stderr (responses generated)."""


def prompt_files(paths: str) -> list[str]:
    """The files of --prompts (comma-separated)."""
    return [p for p in paths.split(",") if p.strip()]


def read_conversations(paths: str) -> list[tuple[str, Optional[object], list[dict], int]]:
    """(source: "file:line" by the file's real path, id, the messages kept (system and user), number of user
    turns) per prompt record. The source is the same whichever way --prompts names the file (./p, /abs/p)."""
    out = []
    for path in prompt_files(paths):
        if not os.path.isfile(path):
            raise UserError(f"--prompts {path}: file not found")
        real = os.path.realpath(path)
        for where, obj in read_jsonl(path):  # `where` names the file as given: for messages
            msgs = None
            if isinstance(obj, dict) and isinstance(obj.get("turns"), list) and obj["turns"] \
                    and all(isinstance(t, str) for t in obj["turns"]):
                msgs = [{"role": "user", "content": t} for t in obj["turns"]]
            elif isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
                msgs = [{"role": "user", "content": obj["prompt"]}]
            elif isinstance(obj, dict) and isinstance(obj.get("messages", obj.get("conversations")), list):
                raw = obj.get("messages", obj.get("conversations"))
                if not all(isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
                           for m in raw):
                    raise UserError(f"{where}: messages must be {{\"role\": system/user/assistant, \"content\": str}}")
                msgs = [{"role": m["role"], "content": m["content"]} for m in raw if m["role"] != "assistant"]
            if not msgs or not any(m["role"] == "user" for m in msgs):
                raise UserError(f"{where}: expected {{\"turns\": [str]}}, {{\"prompt\": str}} or {{\"messages\": [...]}} "
                                "with a user turn")
            for m in msgs:  # as speculate.py's prompts: valid Unicode, and no empty question to answer
                check_text(m["content"], where)
                if m["role"] == "user" and not m["content"].strip():
                    raise UserError(f"{where}: empty user turn")
            out.append((real + where[len(path):], obj.get("id"), msgs, sum(m["role"] == "user" for m in msgs)))
    if not out:
        raise UserError(f"--prompts {paths}: no prompts")
    return out


def model_files(directory: Optional[str], flag: str) -> Optional[dict]:
    """[size, modification time] of each file a run reads from a checkpoint directory, links followed: a
    model replaced or retrained in place shows here."""
    if directory is None:
        return None
    if not os.path.isdir(directory):
        raise UserError(f"{flag} {directory}: checkpoint directory not found")
    files = {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if (name in HUB_META_FILES or name.endswith(".safetensors")) and os.path.isfile(path):
            st = os.stat(path)
            files[name] = [st.st_size, st.st_mtime_ns]
    return files


def resume_key(args: Args, convs: list, target_dir: Optional[str], drafter_dir: Optional[str]) -> dict:
    """What the records of OUT.partial depend on, by the flag that sets it (the flags, then "FLAG what": the
    contents of what the flag names): a --resume must agree on every one."""
    digest = hashlib.sha256()
    for where, cid, msgs, _ in convs:
        digest.update(json.dumps([where, cid, msgs]).encode() + b"\n")
    real = lambda d: os.path.realpath(d) if d is not None else None  # noqa: E731  (./m and /abs/m agree)
    return {"--target": real(target_dir), "--drafter": real(drafter_dir),
            "--prompts": ",".join(map(real, prompt_files(args.prompts))),
            "--dtype": args.dtype,  # another dtype rounds, and samples, otherwise
            "--max-prompts": args.max_prompts, "--num-shards": args.num_shards, "--shard-index": args.shard_index,
            "--max-context": args.max_context, "--max-new-tokens": args.max_new_tokens,
            "--temperature": args.temperature, "--top-k": args.top_k, "--top-p": args.top_p, "--min-p": args.min_p,
            "--seed": args.seed, "--target files": model_files(target_dir, "--target"),
            "--drafter files": model_files(drafter_dir, "--drafter"), "--prompts records": digest.hexdigest()}


def resume_point(partial: str, done_path: str, key: dict, args: Args, mine: list) -> tuple[int, int, int, int]:
    """Where --resume continues an interrupted run: (records kept in OUT.partial, the bytes they take (a torn
    last line, from a run killed mid-write, is cut off), conversations of this shard done, those dropped).
    Conversations are done in order: the done ones are those before the last record kept and the ones
    OUT.partial.json counts (the dropped ones included). A resume file whose `key` differs from this run's, or a
    record that is not this run's next conversation, is a UserError."""
    saved = read_json(done_path)
    if not (isinstance(saved.get("resume_key"), dict) and isinstance(saved.get("consumed"), int)
            and isinstance(saved.get("dropped"), int)):
        raise UserError(f"{done_path}: not a resume file of regenerate.py; remove it and {partial} to start over")
    for name, value in key.items():
        if name not in saved["resume_key"] or saved["resume_key"][name] != value:
            flag, _, what = name.partition(" ")
            now = getattr(args, flag[2:].replace("-", "_"))
            if what:
                raise UserError(f"{flag} {now}: its {what} changed since {partial} was started; restore them, or "
                                f"remove {partial} to start over")
            then, now = saved["resume_key"].get(name), value  # as the key holds them (paths resolved)
            raise UserError(f"{flag} {'(not given)' if now is None else now}: {partial} was started with {flag} "
                            f"{'(not given)' if then is None else then}; resume with the same {flag}, or remove "
                            f"{partial} to start over")
    if not 0 <= saved["consumed"] <= len(mine):
        raise UserError(f"{done_path}: counts {saved['consumed']} conversations done of this run's {len(mine)}; "
                        f"remove it and {partial} to start over")
    position = {where: k for k, (_, (where, *_)) in enumerate(mine)}
    kept, size, last = 0, 0, -1
    with open(partial, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.endswith(b"\n"):
                break
            try:
                source = json.loads(line).get("source")
            except (ValueError, AttributeError, RecursionError):
                source = None
            if not isinstance(source, str) or position.get(source, -1) <= last:
                raise UserError(f"{partial}:{lineno}: not a record of this run's next conversation (source "
                                f"{source!r}); remove {partial} to start over")
            kept, size, last = kept + 1, size + len(line), position[source]
    return kept, size, max(saved["consumed"], last + 1), saved["dropped"]


def run(args: Args) -> dict:
    """Everything `python scripts/regenerate.py` does; returns counts. Raises UserError on bad input."""
    check_sampling(args.temperature, args.top_k, args.top_p, args.min_p)
    check_ranges(args, max_new_tokens="[1, inf)", max_context="[2, inf)",
                 batch_size="[1, inf)", chunk_size="[1, inf)", max_prompts="[1, inf)", num_shards="[1, inf)",
                 shard_index=f"[0, {args.num_shards - 1}]")
    for flag in ("target", "prompts", "out"):
        if getattr(args, flag) is None:
            raise UserError(f"--{flag}: not given")
    check_writable(args.out, "--out")
    convs = read_conversations(args.prompts)[:args.max_prompts]
    mine = [(i, c) for i, c in enumerate(convs) if i % args.num_shards == args.shard_index]
    if any(n > TURN_STRIDE for *_, n in convs):
        raise UserError(f"--prompts: a conversation has more than {TURN_STRIDE} user turns")
    target_dir, drafter_dir = resolve_checkpoint(args.target, "--target"), resolve_checkpoint(args.drafter, "--drafter")
    out_file = os.path.realpath(args.out)  # a link: the file it names is written (as atomic_write does), and
    partial, done_path = out_file + ".partial", out_file + ".partial.json"  # OUT.partial(.json) go beside it
    check_outputs({"--out": args.out, "--out (its partial file)": partial, "--out (its resume file)": done_path},
                  inputs=[target_dir, drafter_dir, *prompt_files(args.prompts)])  # not a prompts file nor a model's
    key = resume_key(args, convs, target_dir, drafter_dir)
    if os.path.isfile(partial) and os.path.getsize(partial) > 0:
        if not args.resume:
            raise UserError(f"{partial}: holds an earlier run's output; pass --resume to continue it, or remove it "
                            "to start over")
        if not os.path.exists(done_path):
            raise UserError(f"{done_path}: not found, so what {partial} was made with is unknown; remove {partial} "
                            "to start over")
    resuming = args.resume and os.path.isfile(partial) and os.path.exists(done_path)
    kept, size, cut, dropped = resume_point(partial, done_path, key, args, mine) if resuming else (0, 0, 0, 0)
    device = resolve_device(args.device)
    m = load_models(target_dir, drafter_dir, device=device, dtype=args.dtype, seed=args.seed)
    if m.tokenizer is None:
        raise UserError(f"--target {args.target}: regenerating text needs its tokenizer.json")
    limit = m.target.args.max_position_embeddings  # the drafter's positions too, as speculate.py checks them
    if m.drafter is not None:
        limit = min(limit, m.drafter.cfg.layers.max_position_embeddings)
    context = args.max_context or min(limit, 8192)
    if context > limit or context <= args.max_new_tokens:
        raise UserError(f"--max-context {context}: must exceed --max-new-tokens {args.max_new_tokens} and fit the "
                        f"models' context of {limit} (max_position_embeddings of the target and the drafter)")
    longest = context - args.max_new_tokens
    engine = Engine(m.target, m.drafter, batch_size=args.batch_size, max_seq=cache_length(longest, args.max_new_tokens,
                    m.drafter), temperature=args.temperature, filters=Filters(args.top_k, args.top_p, args.min_p),
                    seed=args.seed, device=device, stop_ids=m.stop_ids,
                    compile=auto_compile(args.compile, device))
    setting = {"tool": "scripts/regenerate.py", "target": args.target, "drafter": args.drafter,
               "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p,
               "max_new_tokens": args.max_new_tokens,
               "seed": args.seed, "enable_thinking": False}
    if resuming:
        os.truncate(partial, size)
    else:
        atomic_write(partial, "")
    resume = {"tool": "scripts/regenerate.py", "resume_key": key, "consumed": cut, "dropped": dropped}
    write_json(done_path, resume)
    from tqdm import tqdm

    bar = tqdm(total=sum(n for _, (*_, n) in mine), file=sys.stderr, disable=not args.progress, unit="response",
               dynamic_ncols=True)
    bar.update(sum(c[3] for _, c in mine[:cut]))
    stats = {"conversations": kept, "dropped": dropped, "responses": 0, "tokens": 0, "rounds": 0, "committed": 0}
    t0 = time.perf_counter()
    todo = mine[cut:]
    for c0 in range(0, len(todo), args.chunk_size):
        chunk = [dict(index=i, where=w, id=cid, history=[], pending=list(msgs), finish=[], ntok=[], alive=True)
                 for i, (w, cid, msgs, _) in todo[c0:c0 + args.chunk_size]]
        for turn in range(max(sum(x["role"] == "user" for x in c["pending"]) for c in chunk)):
            requests, owners = [], []
            for c in chunk:
                while c["alive"] and c["pending"] and c["pending"][0]["role"] != "user":  # system turns
                    c["history"].append(c["pending"].pop(0))
                if not c["alive"] or not c["pending"]:
                    continue
                c["history"].append(c["pending"].pop(0))
                text = m.tokenizer.render_messages(c["history"], add_generation_prompt=True, thinking=False)
                ids = m.tokenizer.encode(text)
                if len(ids) > longest:
                    c["alive"] = False
                    bar.update(1 + sum(x["role"] == "user" for x in c["pending"]))
                    continue
                requests.append(Request(c["index"] * TURN_STRIDE + turn, ids))
                owners.append(c)
            engine.generate(requests, args.max_new_tokens, on_finish=lambda req: bar.update(1))
            c_ = mt.count(requests, engine.K, m.stop_ids)
            stats["rounds"] += c_["num_rounds"]
            stats["committed"] += c_["committed"]
            for c, req in zip(owners, requests):
                out = req.output_ids[:-1] if req.finish_reason == "stop" else req.output_ids
                c["history"].append({"role": "assistant", "content": m.tokenizer.decode(out)})
                c["finish"].append(req.finish_reason)
                c["ntok"].append(len(out))
                stats["responses"] += 1
                stats["tokens"] += len(req.output_ids)
        lines = []
        for c in chunk:
            if not c["alive"]:
                stats["dropped"] += 1
                continue
            rec = {"messages": c["history"], "source": c["where"], **({"id": c["id"]} if c["id"] is not None else {}),
                   "regenerated": dict(setting, finish_reasons=c["finish"], response_tokens=c["ntok"])}
            lines.append(json.dumps(rec, ensure_ascii=False) + "\n")
            stats["conversations"] += 1
        with open(partial, "a") as f:
            f.writelines(lines)
            f.flush()
            os.fsync(f.fileno())
        # After the lines: a run killed in between leaves at most this chunk's last drops to be retried.
        write_json(done_path, dict(resume, consumed=cut + c0 + len(chunk), dropped=stats["dropped"]))
    bar.close()
    with signals_deferred():  # OUT published and its resume file gone together: never one without the other
        os.replace(partial, out_file)
        os.remove(done_path)
    seconds = time.perf_counter() - t0
    tau = stats["committed"] / stats["rounds"] if args.drafter and stats["rounds"] else None
    print(f"{stats['conversations']} conversations ({stats['responses']} responses, {stats['tokens']} tokens) in "
          f"{seconds:.1f} s, {stats['tokens'] / max(seconds, 1e-9):.1f} tokens/s"
          + (f", τ={tau:.2f}" if tau is not None else "") + f"; {stats['dropped']} dropped (prompt over "
          f"--max-context {context} - --max-new-tokens); written to {args.out}")
    return dict(stats, seconds=seconds, acceptance_length=tau, settings=setting, args=asdict(args))


def main(argv: Optional[list[str]] = None) -> int:
    return cli_main(Args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
