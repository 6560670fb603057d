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

import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Literal, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from speculate import Request, make_engine  # noqa: E402
from support import flags  # noqa: E402
from support import metrics as mt  # noqa: E402
from support.checkpoint import HUB_META_FILES, load_models, resolve_checkpoint  # noqa: E402
from support.cli import AutoBool, UserError, check_ranges, cli_main, resolve_device, signals_deferred
from support.files import atomic_write, check_outputs, check_writable, read_json, read_jsonl, write_json  # noqa: E402
from support.flags import Settings  # noqa: E402
from support.text import ROLES, check_text, encode  # noqa: E402

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
    temperature: float = 0.7
    """Sampling temperature (the authors' Qwen3 setting); 0 = greedy."""
    top_k: int = 20
    """Sample from the K most likely tokens (the authors' 20; 0: off)."""
    top_p: float = 0.8
    """Then from the most likely tokens of probability P (the authors' 0.8; 1: off)."""
    min_p: float = 0.0
    """Then only tokens at least M times as likely as the likeliest (0: off)."""
    max_new_tokens: int = 4096
    """Token budget of one response (the authors': 4096)."""
    max_context: Optional[int] = None
    """Longest prompt + response of a turn (default: the models' context, at most 8192); longer prompts are
    dropped (counted)."""
    batch_size: int = 16
    """Requests decoded together (continuous batching)."""
    chunk_size: int = 256
    """Conversations generated, then written, at a time."""
    max_prompts: Optional[int] = None
    """Only the first this many conversations (before sharding)."""
    num_shards: int = 1
    """Split the conversations across this many processes (i to shard i mod N)."""
    shard_index: int = 0
    """This process's shard, 0 .. --num-shards - 1."""
    seed: int = 0
    """Turn t of conversation i samples from a stream seeded seed + i*1024 + t."""
    resume: bool = False
    """Continue an interrupted run's OUT.partial (refused if its flags, prompts or models differ)."""
    device: Optional[Literal["cpu", "cuda"]] = None
    """Default: cuda when available."""
    dtype: Optional[Literal["float32", "bfloat16", "float16"]] = None
    """Weights and activations. Default: bfloat16 on cuda, float32 on cpu."""
    compile: AutoBool = None
    """torch.compile the round. Default: on for cuda, off for cpu."""
    progress: bool = True
    """A progress bar on stderr (responses generated)."""


def prompt_files(paths: str) -> list[str]:
    return [p for p in paths.split(",") if p.strip()]


def read_conversations(paths: str) -> list[tuple[str, Optional[object], list[dict], int]]:
    """(source "file:line" by the real path, id, system and user messages, user turns) of each record."""
    out = []
    for path in prompt_files(paths):
        if not os.path.isfile(path):
            raise UserError(f"--prompts {path}: file not found")
        real = os.path.realpath(path)
        for where, obj in read_jsonl(path):
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
            for m in msgs:
                check_text(m["content"], where)
                if m["role"] == "user" and not m["content"].strip():
                    raise UserError(f"{where}: empty user turn")
            out.append((real + where[len(path):], obj.get("id"), msgs, sum(m["role"] == "user" for m in msgs)))
    if not out:
        raise UserError(f"--prompts {paths}: no prompts")
    return out


def model_files(directory: Optional[str], flag: str) -> Optional[dict]:
    """[size, mtime] of each file a run reads from a checkpoint directory."""
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
    """What OUT.partial's records depend on, by flag: a resume must agree."""
    digest = hashlib.sha256()
    for where, cid, msgs, _ in convs:
        digest.update(json.dumps([where, cid, msgs]).encode() + b"\n")
    real = lambda d: os.path.realpath(d) if d is not None else None  # noqa: E731  (./m and /abs/m agree)
    return {"--target": real(target_dir), "--drafter": real(drafter_dir),
            "--prompts": ",".join(map(real, prompt_files(args.prompts))),
            "--dtype": args.dtype,
            "--max-prompts": args.max_prompts, "--num-shards": args.num_shards, "--shard-index": args.shard_index,
            "--max-context": args.max_context, "--max-new-tokens": args.max_new_tokens,
            "--temperature": args.temperature, "--top-k": args.top_k, "--top-p": args.top_p, "--min-p": args.min_p,
            "--seed": args.seed, "--target files": model_files(target_dir, "--target"),
            "--drafter files": model_files(drafter_dir, "--drafter"), "--prompts records": digest.hexdigest()}


def resume_point(partial: str, done_path: str, key: dict, args: Args, mine: list) -> tuple[int, int, int, int]:
    """(records kept, their bytes (a torn last line cut off), conversations done, dropped)."""
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
            then, now = saved["resume_key"].get(name), value
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
    """Everything `python scripts/regenerate.py` does; returns counts."""
    device = resolve_device(args.device)
    settings = Settings(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                        top_p=args.top_p, min_p=args.min_p, seed=args.seed, batch_size=args.batch_size,
                        compile=args.compile)
    settings = flags.check_settings(settings, device)
    check_ranges(args, max_context="[2, inf)", chunk_size="[1, inf)", max_prompts="[1, inf)", num_shards="[1, inf)",
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
    out_file = os.path.realpath(args.out)  # a link: OUT.partial(.json) go beside the file it names
    partial, done_path = out_file + ".partial", out_file + ".partial.json"
    check_outputs({"--out": args.out, "--out (its partial file)": partial, "--out (its resume file)": done_path},
                  inputs=[target_dir, drafter_dir, *prompt_files(args.prompts)])
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
    m = load_models(target_dir, drafter_dir, device=device, dtype=args.dtype)
    if m.tokenizer is None:
        raise UserError(f"--target {args.target}: regenerating text needs its tokenizer.json")
    limit = m.target.args.max_position_embeddings
    if m.drafter is not None:
        limit = min(limit, m.drafter.cfg.layers.max_position_embeddings)
    context = args.max_context or min(limit, 8192)
    if context > limit or context <= args.max_new_tokens:
        raise UserError(f"--max-context {context}: must exceed --max-new-tokens {args.max_new_tokens} and fit the "
                        f"models' context of {limit} (max_position_embeddings of the target and the drafter)")
    longest = context - args.max_new_tokens
    engine = make_engine(m, m.drafter, [[0] * longest] * args.batch_size, settings)  # sized for the longest
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
                ids = encode(m.tokenizer, c["history"], c["where"], chat=True)
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
        write_json(done_path, dict(resume, consumed=cut + c0 + len(chunk), dropped=stats["dropped"]))
    bar.close()
    with signals_deferred():  # OUT published and its resume file gone together
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
