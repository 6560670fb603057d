"""Speculative decoding with a DSpark / DFlash drafter — or, without `--drafter`, plain
autoregressive decoding by the same engine (the baseline).

One round (DSPARK.md §5), all in `speculative_round` below:
  draft (drafter block forward -> Markov chain -> confidence) -> schedule (threshold)
  -> verify (target forward on [anchor, drafts] with capture) -> accept (rejection sampling)
  -> commit (the drafter's context gains the verified rows; rollback is the anchor position).

Without a drafter a round is the same with zero drafts: the target runs on the anchor and
the "bonus" is the next token, so baseline and speculative numbers come from one code path.

    python speculate.py --target DIR [--drafter DIR] --prompt "..." --max-new-tokens 128
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Literal, Optional

import torch

import kernels
from model import CheckpointError, Tokenizer, Transformer, load_target, random_target, read_json, read_jsonl, stop_token_ids


@dataclass
class Args:
    """Speculative decoding with DSpark / DFlash drafters (baseline decoding without --drafter)."""

    target: Optional[str] = None
    """Hugging Face Qwen3 directory (config.json, safetensors, tokenizer.json)."""
    drafter: Optional[str] = None
    """Drafter directory (any DSpark / DFlash spelling); omitted: plain autoregressive decoding."""
    prompt: Optional[str] = None
    """One prompt as text (rendered with the chat template unless --no-chat)."""
    prompt_ids: Optional[str] = None
    """One prompt as comma-separated token ids, e.g. 1,2,3 (no tokenizer needed)."""
    prompts_file: Optional[str] = None
    """JSON lines, each {"prompt": str}, {"prompt_ids": [int]} or {"turns": [str]} (first turn used)."""
    chat: bool = True
    """Render text prompts with the target's chat template, thinking off (default: on when the
    tokenizer has a template; --chat without one uses Qwen3's non-thinking format)."""
    num_samples: int = 1
    """Run every prompt this many times (independent samples)."""
    batch_size: int = 1
    """Requests decoded together."""
    max_new_tokens: int = 128
    """Token budget per request (exact)."""
    temperature: float = 0.0
    """0 = greedy; otherwise lossless rejection sampling at this temperature."""
    seed: int = 0
    """Seed of the sampling generator: a sampled run repeats exactly with the same seed."""
    confidence_threshold: float = 0.0
    """Verify drafts only up to the first confidence below this; 0 = the whole block."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where to run."""
    dtype: Optional[Literal["float32", "bfloat16", "float16"]] = None
    """Weights and activations (default: bfloat16 on cuda, float32 on cpu)."""
    compile: bool = False
    """torch.compile the round (default: on for cuda, off for cpu)."""
    trace_file: Optional[str] = None
    """Write a JSON-lines record of every round, request and a summary here."""
    wandb: bool = False
    """Log the run to Weights & Biases (WANDB_MODE=offline works without network)."""
    calibration: Optional[str] = None
    """Confidence temperatures from `eval.py --calibration-out` (Sequential Temperature Scaling):
    c_k = σ(logit_k / T_k), applied before the threshold."""
    random_init: Optional[Literal["qwen3-4b", "qwen3-8b", "qwen3-14b"]] = None
    """Instead of --target/--drafter: a real-shaped target and a block-7, 5-layer DSpark drafter with
    random weights, to measure speed without downloads (prompts as ids; use bench.py for tables)."""


# ----------------------------------------------------------------------------------------
# One round

def speculative_round(target: Transformer, drafter, anchor: torch.Tensor, anchor_pos: torch.Tensor,
                      active: torch.Tensor, temperature: float, threshold: float, noise):
    """Draft, schedule, verify, accept and commit once for every row; static shapes throughout.

    anchor [B]: the last committed token, at positions anchor_pos [B]; the target's cache and
    the drafter's context hold rows < anchor_pos. active [B] (bool): rows still decoding; the
    others keep their anchor. noise: `kernels.round_noise(...)` when sampling, None at T=0.
    Returns (record, anchor', anchor_pos'): record [B, 2K+3] (float64, the one tensor the host
    reads) holds drafts [K], verified ℓ, accepted n, next token, confidence [K] (0 without a
    head). Moving the anchor to anchor_pos + n + 1 is the whole KV rollback.
    """
    B = anchor.shape[0]
    chain_noise, u, bonus_noise = noise if noise is not None else (None, None, None)
    capture = drafter.cfg.target_layer_ids if drafter is not None else ()
    # 1. Draft: the block forward, then the sequential Markov chain, then confidence.
    if drafter is not None:
        hidden, base_logits = drafter(anchor, anchor_pos)
        drafts, q = kernels.markov_chain(base_logits, hidden, anchor, drafter.markov_head, temperature, None,
                                         chain_noise)
        confidence = drafter.confidence(hidden, torch.cat([anchor[:, None], drafts[:, :-1]], dim=1))
    else:
        drafts, q, confidence = anchor.new_zeros((B, 0)), None, None
    K = drafts.shape[1]
    # 2. Schedule: verify the drafts before the first confidence below the threshold.
    if confidence is not None and threshold > 0:
        verify_len = torch.cumprod((confidence >= threshold).long(), dim=1).sum(1)
    else:
        verify_len = torch.full((B,), K, dtype=torch.long, device=anchor.device)
    # 3. Verify: one target pass over [x_0, x_1 .. x_K] (fixed width; unscheduled drafts are
    #    masked out of acceptance, their cache rows are never read), capturing features.
    tokens = torch.cat([anchor[:, None], drafts], dim=1)
    positions = anchor_pos[:, None] + torch.arange(K + 1, device=anchor.device)
    logits, features = target(tokens, positions, capture=capture)
    # 4. Accept.
    if temperature == 0:
        accepted, next_token = kernels.verify_greedy(drafts, logits, verify_len)
    else:
        accepted, next_token = kernels.verify_sampled(drafts, q, logits, verify_len, temperature, None,
                                                      u, bonus_noise)
    # 5. Commit: the drafter's context gains rows a .. a+K; rows past a+n are masked out next
    #    round (context is < the new anchor position) and overwritten later.
    if drafter is not None:
        drafter.commit_context(features, positions)
    if confidence is None:
        confidence = torch.zeros((B, K), device=anchor.device)
    record = torch.cat([drafts, verify_len[:, None], accepted[:, None], next_token[:, None]], dim=1).double()
    record = torch.cat([record, confidence.double()], dim=1)
    return (record, torch.where(active, next_token, anchor),
            torch.where(active, anchor_pos + accepted + 1, anchor_pos))


def prefill(target: Transformer, drafter, prompts: list[list[int]], temperature: float,
            generator: Optional[torch.Generator], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the prompts (right-padded) through the target, capturing features for the drafter.

    Returns the first token of every row (the first anchor) and its position (the prompt length).
    Pad rows are written past each prompt's end, where they are masked and later overwritten.
    """
    lens = torch.tensor([len(p) for p in prompts], device=device)
    P = int(lens.max())
    tokens = torch.tensor([p + [p[-1]] * (P - len(p)) for p in prompts], device=device)
    positions = torch.arange(P, device=device).expand(len(prompts), P)
    capture = drafter.cfg.target_layer_ids if drafter is not None else ()
    logits, features = target(tokens, positions, capture=capture, logits_index=lens - 1)
    if drafter is not None:
        drafter.commit_context(features, positions)
    return kernels.sample(logits, temperature, generator), lens


# ----------------------------------------------------------------------------------------
# Requests

@dataclass
class Request:
    index: int
    prompt_ids: list[int]
    output_ids: list[int]
    rounds: list[dict]
    finish_reason: Optional[str] = None

    @property
    def acceptance_length(self) -> Optional[float]:
        """τ: tokens per round the drafter and the target produced, bonus included (None: no round)."""
        return sum(r["accepted"] + 1 for r in self.rounds) / len(self.rounds) if self.rounds else None


def default_compile_mode(device) -> Optional[str]:
    """max-autotune (with CUDA graphs) on GPU; Inductor's default on CPU, where autotuning buys little."""
    return "max-autotune" if str(device).startswith("cuda") else None


class Engine:
    """Static batches of requests through prefill and rounds, with stop and budget handling."""

    def __init__(self, target: Transformer, drafter, stop_ids, batch_size: int, max_seq: int, temperature: float,
                 threshold: float, seed: int, device, compile: bool = False, compile_mode: Optional[str] = None):
        self.target, self.drafter, self.stop_ids = target, drafter, set(stop_ids)
        self.temperature, self.threshold, self.device = temperature, threshold, device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.max_batch = batch_size
        target.setup_caches(batch_size, max_seq)
        if drafter is not None:
            drafter.setup_caches(batch_size, max_seq)
        self.round_fn = speculative_round
        if compile:
            self.round_fn = torch.compile(speculative_round, fullgraph=True, dynamic=False,
                                          mode=compile_mode or default_compile_mode(device))
        self.prefill_seconds = self.decode_seconds = self.compile_seconds = 0.0

    def warmup(self):
        """Compile the round before anything is timed: one round on inactive rows at position 0.

        It draws its noise from a throwaway generator, so the run's own random stream (and with
        it every sampled token) is the same as in an eager run. The cache rows it writes are
        rewritten by the next prefill before they are read.
        """
        K = self.drafter.cfg.num_drafts if self.drafter is not None else 0
        B, dev = self.max_batch, self.device
        zeros = lambda dtype=torch.long: torch.zeros(B, dtype=dtype, device=dev)  # distinct tensors: no aliasing guard
        noise = (kernels.round_noise(torch.Generator(device=dev).manual_seed(0), B, K, self.target.args.vocab_size, dev)
                 if self.temperature > 0 else None)
        t0 = time.perf_counter()
        record, _, _ = self.round_fn(self.target, self.drafter, zeros(), zeros(), zeros(torch.bool),
                                     self.temperature, self.threshold, noise)
        record.tolist()
        self.compile_seconds += time.perf_counter() - t0

    def _sync(self):
        if str(self.device).startswith("cuda"):
            torch.cuda.synchronize()

    def _commit(self, req: Request, tokens: list[int], budget: int) -> int:
        """Append tokens up to the budget and the first stop token; returns how many went in."""
        n = 0
        for t in tokens:
            if req.finish_reason is not None:
                break
            req.output_ids.append(t)
            n += 1
            if t in self.stop_ids:
                req.finish_reason = "stop"
            elif len(req.output_ids) >= budget:
                req.finish_reason = "length"
        return n

    def generate(self, requests: list[Request], max_new_tokens: int, on_round=None):
        """Decode a batch of requests to completion; `on_round(request, record)` sees every round.

        The batch always has `max_batch` rows (missing requests are inactive padding rows), so
        every round has the same shapes and a compiled round never recompiles.
        """
        rows = requests + [None] * (self.max_batch - len(requests))
        prompts = [(r or requests[0]).prompt_ids for r in rows]
        t0 = time.perf_counter()
        first, anchor_pos = prefill(self.target, self.drafter, prompts, self.temperature, self.generator, self.device)
        self._sync()
        self.prefill_seconds += time.perf_counter() - t0
        for req, t in zip(requests, first.tolist()):
            self._commit(req, [t], max_new_tokens)
        anchor = first
        live = [r is not None and r.finish_reason is None for r in rows]
        active = torch.tensor(live, device=self.device)
        K = self.drafter.cfg.num_drafts if self.drafter is not None else 0
        V = self.target.args.vocab_size
        t0 = time.perf_counter()
        while any(live):
            noise = (kernels.round_noise(self.generator, len(rows), K, V, self.device)
                     if self.temperature > 0 else None)
            record, anchor, anchor_pos = self.round_fn(self.target, self.drafter, anchor, anchor_pos, active,
                                                       self.temperature, self.threshold, noise)
            anchor, anchor_pos = anchor.clone(), anchor_pos.clone()  # outlive the next graph replay
            record = record.tolist()  # the one host read of the round
            for i, req in enumerate(rows):
                if not live[i]:
                    continue
                rec = record[i]
                n = int(rec[K + 1])
                entry = {"request": req.index, "round": len(req.rounds), "anchor": req.output_ids[-1],
                         "draft": [int(x) for x in rec[:K]],
                         "confidence": rec[K + 3:] if self.drafter is not None and self.drafter.confidence_head is not None else None,
                         "verified": int(rec[K]), "accepted": n, "bonus": int(rec[K + 2])}
                req.rounds.append(entry)
                self._commit(req, entry["draft"][:n] + [entry["bonus"]], max_new_tokens)
                if on_round is not None:
                    on_round(req, entry)
            now_live = [r is not None and r.finish_reason is None for r in rows]
            if now_live != live:
                live = now_live
                active = torch.tensor(live, device=self.device)
        self._sync()
        self.decode_seconds += time.perf_counter() - t0
        return requests


def accept_rate_by_position(requests: list[Request], K: int) -> list[float]:
    """Rate of accepting draft k given drafts 1..k-1 were accepted and draft k was verified."""
    rates = []
    for k in range(1, K + 1):
        tried = sum(1 for r in requests for rd in r.rounds if rd["accepted"] >= k - 1 and rd["verified"] >= k)
        ok = sum(1 for r in requests for rd in r.rounds if rd["accepted"] >= k)
        rates.append(ok / tried if tried else 0.0)
    return rates


# ----------------------------------------------------------------------------------------
# Prompts

def parse_ids(text: str, what: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CheckpointError(f"{what}: {text!r} is not a comma-separated list of token ids") from None
    return ids


def load_prompts(args: Args, tokenizer: Optional[Tokenizer], chat: bool) -> list[list[int]]:
    """Token ids of every prompt given by --prompt, --prompt-ids or --prompts-file."""
    given = [f for f in ("prompt", "prompt_ids", "prompts_file") if getattr(args, f) is not None]
    if len(given) != 1:
        raise CheckpointError("give exactly one of --prompt, --prompt-ids, --prompts-file"
                              + (f" (got {', '.join('--' + g.replace('_', '-') for g in given)})" if given else ""))

    def encode(text: str, where: str) -> list[int]:
        if tokenizer is None:
            raise CheckpointError(f"{where}: a text prompt needs the target's tokenizer.json")
        return tokenizer.encode(tokenizer.render_chat(text) if chat else text)

    if args.prompt is not None:
        return [encode(args.prompt, "--prompt")]
    if args.prompt_ids is not None:
        return [parse_ids(args.prompt_ids, "--prompt-ids")]
    path = args.prompts_file
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: prompts file not found")
    prompts = []
    for where, row in read_jsonl(path):
        if isinstance(row, dict) and isinstance(row.get("prompt"), str):
            prompts.append(encode(row["prompt"], where))
        elif isinstance(row, dict) and isinstance(row.get("prompt_ids"), list):
            ids = row["prompt_ids"]
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise CheckpointError(f"{where}: 'prompt_ids' must be a list of integers")
            prompts.append(ids)
        elif isinstance(row, dict) and isinstance(row.get("turns"), list) and row["turns"] \
                and isinstance(row["turns"][0], str):
            prompts.append(encode(row["turns"][0], where))
        else:
            raise CheckpointError(f"{where}: expected {{\"prompt\": str}}, {{\"prompt_ids\": [int]}} "
                                  "or {\"turns\": [str]}")
    if not prompts:
        raise CheckpointError(f"{path}: no prompts")
    return prompts


# ----------------------------------------------------------------------------------------
# CLI

def _explicit(argv: list[str], flag: str) -> bool:
    return any(a in (f"--{flag}", f"--no-{flag}") for a in argv)


@dataclass
class Models:
    """What `load_models` resolves from the flags shared by speculate.py and eval.py."""
    target: Transformer
    drafter: object  # drafter.Drafter or None
    tokenizer: Optional[Tokenizer]
    stop_ids: tuple
    chat: bool  # render text prompts with the chat template
    compile: bool
    dtype: torch.dtype


def load_models(args, argv: list[str], device: Optional[str] = None, verbose: bool = True) -> Models:
    """Load the target (and drafter) named by `args` — speculate's `Args` or anything with the same
    fields — and check the flags that depend on them. `device` overrides args.device (a rank's GPU)."""
    device = device or args.device
    if getattr(args, "random_init", None) is None and args.target is None:
        raise CheckpointError("--target: no target directory given")
    if getattr(args, "random_init", None) is not None and (args.target is not None or args.drafter is not None):
        raise CheckpointError("--random-init builds its own target and drafter: drop --target/--drafter")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise CheckpointError("--device cuda: no CUDA device is available")
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    compile = args.compile if _explicit(argv, "compile") else args.device == "cuda"
    drafter = tokenizer = None
    if getattr(args, "random_init", None) is not None:
        from drafter import random_drafter
        target = random_target(args.random_init, device, dtype, args.seed)
        drafter = random_drafter(target)
        stop_ids = ()
    else:
        target = load_target(args.target, device, dtype)
        stop_ids = stop_token_ids(args.target, target.args)
        if os.path.isfile(os.path.join(args.target, "tokenizer.json")):
            tokenizer = Tokenizer(args.target)
        if args.drafter is not None:
            from drafter import load_drafter
            drafter = load_drafter(args.drafter, target, device, dtype)
    has_confidence = drafter is not None and drafter.cfg.confidence_head
    if args.confidence_threshold > 0 and not has_confidence:
        raise CheckpointError("--confidence-threshold needs a --drafter with a confidence head")
    if getattr(args, "calibration", None) is not None:
        if not has_confidence:
            raise CheckpointError(f"--calibration {args.calibration}: needs a --drafter with a confidence head")
        temps = read_json(args.calibration).get("temperatures")
        K = drafter.cfg.num_drafts
        if not isinstance(temps, list) or len(temps) != K or not all(
                isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t < float("inf") for t in temps):
            raise CheckpointError(f"{args.calibration}: 'temperatures' must be a list of {K} positive numbers "
                                  f"(one per draft position), got {temps!r}")
        drafter.calibrate(temps)
    if drafter is not None and verbose:  # once every check has passed
        print(drafter.cfg.describe() + (" (random weights)" if args.drafter is None else ""), file=sys.stderr)
    chat = args.chat if _explicit(argv, "chat") else (tokenizer is not None and tokenizer.chat_template is not None)
    return Models(target, drafter, tokenizer, stop_ids, chat, compile, dtype)


def check_prompts(prompts: list[list[int]], target: Transformer, max_new_tokens: int, where: str = ""):
    """Every prompt non-empty, inside the vocabulary, and fitting the context with its budget."""
    V, context = target.args.vocab_size, target.args.max_position_embeddings
    for i, p in enumerate(prompts):
        if not p:
            raise CheckpointError(f"{where}prompt {i}: empty prompt")
        bad = [t for t in p if not 0 <= t < V]
        if bad:
            raise CheckpointError(f"{where}prompt {i}: token id {bad[0]} is outside the vocabulary (0..{V - 1})")
        if len(p) + max_new_tokens > context:
            raise CheckpointError(f"{where}prompt {i}: {len(p)} tokens + --max-new-tokens {max_new_tokens} exceed "
                                  f"the target's context of {context} (max_position_embeddings)")


def cache_length(longest_prompt: int, max_new_tokens: int, drafter) -> int:
    """Cache rows for a batch: prompt + budget, plus room for a round's block / verify window from a
    finished row's last anchor (which may sit up to K+1 past its budget while other rows go on)."""
    width = max(drafter.cfg.num_slots, drafter.cfg.num_drafts + 1) if drafter is not None else 1
    return longest_prompt + max_new_tokens + 2 * width


DEMO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo")
# From shutil.py, one of the standard-library files held out of the demo pair's training (demo/heldout.txt).
DEMO_PROMPT = 'def copyfileobj(fsrc, fdst, length=0):\n    """copy data from file-like object fsrc to file-like object fdst"""\n'


def demo_defaults(args: Args) -> bool:
    """With no --target, --drafter or --random-init: the committed demo pair (demo/target, demo/drafter; made by
    scripts/train_demo.sh) and, without a prompt flag, a raw code prompt. Returns whether demo mode is on."""
    if args.target is not None or args.drafter is not None or args.random_init is not None:
        return False
    args.target, args.drafter = os.path.join(DEMO_DIR, "target"), os.path.join(DEMO_DIR, "drafter")
    if args.prompt is None and args.prompt_ids is None and args.prompts_file is None:
        args.prompt = DEMO_PROMPT  # the demo tokenizer has no chat template: sent raw
    return True


def run(args: Args, argv: list[str]) -> dict:
    """Everything `python speculate.py` does; returns the summary. Raises CheckpointError on bad input."""
    demo = demo_defaults(args)
    for name, ok in (("num_samples", args.num_samples >= 1), ("batch_size", args.batch_size >= 1),
                     ("max_new_tokens", args.max_new_tokens >= 1), ("temperature", args.temperature >= 0),
                     ("confidence_threshold", 0 <= args.confidence_threshold <= 1)):
        if not ok:
            raise CheckpointError(f"--{name.replace('_', '-')}: invalid value {getattr(args, name)!r}")
    m = load_models(args, argv)
    target, drafter, tokenizer = m.target, m.drafter, m.tokenizer
    prompts = load_prompts(args, tokenizer, m.chat)
    check_prompts(prompts, target, args.max_new_tokens)
    if demo:  # the baseline first, by the same engine without the drafter, for the side-by-side figures
        baseline = decode(args, m, None, prompts, None)
    summary = decode(args, m, drafter, prompts, args.trace_file)
    if demo and baseline["tokens_per_second"] > 0:
        print(f"speed-up: {summary['tokens_per_second'] / baseline['tokens_per_second']:.2f}x "
              f"(speculative vs autoregressive tokens/s, same prompts, greedy outputs identical: "
              f"{baseline['outputs'] == summary['outputs']})")
    if args.wandb:
        import wandb
        wandb.init(project="dspark-fast", config=asdict(args))
        wandb.log({k: v for k, v in summary.items() if k != "summary" and not isinstance(v, list)})
        wandb.finish()
    return summary


def decode(args: Args, m: Models, drafter, prompts: list[list[int]], trace_file: Optional[str]) -> dict:
    """Decode every prompt with `drafter` (None: autoregressive), print the texts and one figures line."""
    target, tokenizer = m.target, m.tokenizer
    requests = [Request(i, p, [], []) for i, p in enumerate(pp for pp in prompts for _ in range(args.num_samples))]
    max_seq = cache_length(max(len(r.prompt_ids) for r in requests), args.max_new_tokens, drafter)
    batch = min(args.batch_size, len(requests))
    engine = Engine(target, drafter, m.stop_ids, batch, max_seq, args.temperature, args.confidence_threshold,
                    args.seed, args.device, m.compile)
    if m.compile:
        engine.warmup()

    trace = open(trace_file, "w") if trace_file else None
    on_round = (lambda req, rec: trace.write(json.dumps(rec) + "\n")) if trace else None
    for start in range(0, len(requests), batch):
        chunk = engine.generate(requests[start:start + batch], args.max_new_tokens, on_round)
        for req in chunk:
            if trace:
                trace.write(json.dumps({"request": req.index, "output_ids": req.output_ids,
                                        "num_rounds": len(req.rounds), "acceptance_length": req.acceptance_length,
                                        "finish_reason": req.finish_reason}) + "\n")
            print(tokenizer.decode(req.output_ids) if tokenizer is not None else ",".join(map(str, req.output_ids)))

    n_tokens = sum(len(r.output_ids) for r in requests)
    n_rounds = sum(len(r.rounds) for r in requests)
    seconds = engine.prefill_seconds + engine.decode_seconds
    summary = {
        "summary": True,
        "tokens_per_second": n_tokens / seconds if seconds > 0 else 0.0,
        "acceptance_length": sum(rd["accepted"] + 1 for r in requests for rd in r.rounds) / max(n_rounds, 1),
        "accept_rate_by_position": accept_rate_by_position(requests, drafter.cfg.num_drafts if drafter else 0),
        "prefill_seconds": engine.prefill_seconds,
        "decode_seconds": engine.decode_seconds,
        "compile_seconds": engine.compile_seconds,
    }
    if trace:
        trace.write(json.dumps(summary) + "\n")
        trace.close()
    rates = " ".join(f"{x:.2f}" for x in summary["accept_rate_by_position"])
    print(f"{'speculative' if drafter else 'autoregressive'}: {n_tokens} tokens in {seconds:.2f} s, "
          f"{summary['tokens_per_second']:.1f} tokens/s, τ={summary['acceptance_length']:.2f}"
          + (f", accept by position [{rates}]" if drafter else "")
          + f" (prefill {engine.prefill_seconds:.2f} s, decode {engine.decode_seconds:.2f} s)")
    return dict(summary, outputs=[r.output_ids for r in requests])


def main(argv: Optional[list[str]] = None) -> int:
    import tyro

    argv = sys.argv[1:] if argv is None else argv
    args = tyro.cli(Args, args=argv)
    try:
        with torch.inference_mode():
            run(args, argv)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
