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
- Output: JSON lines {"messages": [...], "source": "file:line", "id"?, "regenerated": {settings, finish
  reasons, response tokens}}, in input order, appended chunk by chunk to OUT.partial (flushed to disk) and
  renamed to OUT when complete; --resume continues a .partial. --num-shards/--shard-index split the
  prompts across processes (one per GPU); concatenate their outputs.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Literal, Optional


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import metrics as mt  # noqa: E402
from common import (AutoBool, UserError, check_outputs, check_ranges, check_writable, cli_main,  # noqa: E402
                    read_jsonl, resolve_device)
from data import ROLES  # noqa: E402
from inputs import check_sampling  # noqa: E402
from kernels import Filters  # noqa: E402
from inputs import resolve_checkpoint  # noqa: E402
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
    """Longest prompt + response of one turn, the engine's cache length (default: the target's context, at most
    8192); a conversation whose prompt leaves less than --max-new-tokens is dropped (counted)."""
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
    """Continue OUT.partial (its complete lines are kept and their conversations skipped)."""
    device: Optional[Literal["cpu", "cuda"]] = None
    """Default: cuda when available."""
    dtype: Optional[Literal["float32", "bfloat16", "float16"]] = None
    """Weights and activations. Default: bfloat16 on cuda, float32 on cpu."""
    compile: AutoBool = None
    """torch.compile the round. Default: on for cuda, off for cpu."""
    progress: bool = True
    """A progress bar on stderr (responses generated)."""


def read_conversations(paths: str) -> list[tuple[str, Optional[object], list[dict], int]]:
    """(where, id, the messages kept (system and user), number of user turns) per prompt record."""
    out = []
    for path in [p for p in paths.split(",") if p.strip()]:
        if not os.path.isfile(path):
            raise UserError(f"--prompts {path}: file not found")
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
            out.append((where, obj.get("id"), msgs, sum(m["role"] == "user" for m in msgs)))
    if not out:
        raise UserError(f"--prompts {paths}: no prompts")
    return out


def complete_lines(path: str) -> list[str]:
    """The whole lines of an earlier OUT.partial (a torn last line dropped)."""
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [line for line in f if line.endswith("\n")]


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
    check_outputs({"--out": args.out}, inputs=[target_dir, drafter_dir])  # not a file of a model it reads
    device = resolve_device(args.device)
    m = load_models(target_dir, drafter_dir, device=device, dtype=args.dtype, seed=args.seed)
    if m.tokenizer is None:
        raise UserError(f"--target {args.target}: regenerating text needs its tokenizer.json")
    context = args.max_context or min(m.target.args.max_position_embeddings, 8192)
    if context > m.target.args.max_position_embeddings or context <= args.max_new_tokens:
        raise UserError(f"--max-context {context}: must exceed --max-new-tokens {args.max_new_tokens} and fit the "
                        f"target's context of {m.target.args.max_position_embeddings}")
    longest = context - args.max_new_tokens
    engine = Engine(m.target, m.drafter, batch_size=args.batch_size, max_seq=cache_length(longest, args.max_new_tokens,
                    m.drafter), temperature=args.temperature, filters=Filters(args.top_k, args.top_p, args.min_p),
                    seed=args.seed, device=device, stop_ids=m.stop_ids,
                    compile=auto_compile(args.compile, device))
    setting = {"tool": "scripts/regenerate.py", "target": args.target, "drafter": args.drafter,
               "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p,
               "max_new_tokens": args.max_new_tokens,
               "seed": args.seed, "enable_thinking": False}
    partial = args.out + ".partial"
    done = complete_lines(partial) if args.resume else []
    with open(partial, "w") as f:
        f.writelines(done)
    from tqdm import tqdm

    bar = tqdm(total=sum(n for _, (*_, n) in mine), file=sys.stderr, disable=not args.progress, unit="response",
               dynamic_ncols=True)
    bar.update(sum(c[3] for _, c in mine[:len(done)]))
    stats = {"conversations": len(done), "dropped": 0, "responses": 0, "tokens": 0, "rounds": 0, "committed": 0}
    t0 = time.perf_counter()
    todo = mine[len(done):]
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
    bar.close()
    os.replace(partial, args.out)
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
