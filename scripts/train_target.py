"""Pre-train a small Qwen3 target from scratch (next-token cross-entropy): the demo pair's target.

    python scripts/train_target.py --data DIR --tokenizer-from-corpus --out DIR [--layers 4 --hidden-size 256 ...]

`--tokenizer-from-corpus` first trains a byte-level BPE tokenizer on --data, with <|endoftext|> (EOS)
and <|mask|> (the drafter's mask) as special tokens. The output is a Hugging Face Qwen3 directory that
checkpoint.load_target and transformers both read. The data and the loop are data.py's and trainer.py's.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from model import ModelArgs, Transformer  # noqa: E402
from support import runlog  # noqa: E402
from support.checkpoint import init_random_, load_target, published  # noqa: E402
from support.cli import UserError, device_name, dtype_name, resolve_device, resolve_dtype
from support.configs import LAYER_KEYS  # noqa: E402
from support.data import (  # noqa: E402
    EOS_TOKEN,
    MASK_TOKEN,
    Batches,
    Corpus,
    digest,
    micro_slices,
    read_texts,
    read_windows,
)
from support.distributed import dist_init, from_rank0, rank0  # noqa: E402
from support.files import atomic_write, read_json, write_json  # noqa: E402
from support.text import Tokenizer, read_tokenizer_file  # noqa: E402
from support.trainer import (  # noqa: E402
    STATE_JSON,
    Run,
    TrainArgs,
    causal_flops,
    check_identity,
    check_resume_progress,
    check_train_args,
    checkpoint_dir,
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
    """Pre-train a small Qwen3 target from scratch (next-token cross-entropy)."""

    tokenizer: Optional[str] = None
    """A tokenizer.json (or a directory holding one) to copy into --out and use."""
    tokenizer_from_corpus: bool = False
    """Train a byte-level BPE tokenizer on --data first (specials <|endoftext|>, <|mask|>)."""
    vocab_size: int = 8192
    """Vocabulary of --tokenizer-from-corpus."""
    hidden_size: int = 256
    """Width of the residual stream."""
    layers: int = 4
    """Decoder layers."""
    heads: int = 4
    """Attention (query) heads."""
    kv_heads: int = 2
    """Key/value heads (grouped-query attention; --heads must be a multiple)."""
    head_dim: int = 64
    """Width of one head (explicit in Qwen3, not hidden / heads)."""
    intermediate_size: int = 768
    """Width of the SwiGLU MLP."""
    rope_theta: float = 1_000_000.0
    """RoPE base (Qwen3's)."""
    max_position_embeddings: int = 4096
    """Longest context the config declares; at least --seq-len, the rows it is trained on."""
    tie_word_embeddings: bool = True
    """The lm_head is the embedding matrix (saves V x hidden parameters in a small model)."""

    resume_keys: ClassVar[tuple[str, ...]] = TrainArgs.resume_keys + (
        "hidden_size", "layers", "heads", "kv_heads", "head_dim", "intermediate_size",
        "rope_theta", "max_position_embeddings", "tie_word_embeddings")
    kind: ClassVar[str] = "target"


def train_bpe(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer (GPT-2 pre-tokenization: round-trips any text)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN, MASK_TOKEN],
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def next_token_loss(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    h, _ = model.hidden(tokens)  # cache-free, causal
    logits = model.lm_head(h[:, :-1]).float()  # [B, T-1, V]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


class TargetStep(torch.nn.Module):
    """A micro-batch's mean cross-entropy x its share of the global batch's rows (they sum to its mean)."""

    def __init__(self, model: Transformer, share: float, compile: bool):
        super().__init__()
        self.model = model
        self.share = share
        self.loss_fn = next_token_loss
        if compile:
            self.loss_fn = torch.compile(next_token_loss, dynamic=False)

    def forward(self, tokens):
        loss = self.loss_fn(self.model, tokens) * self.share
        return loss, loss.detach().float()[None]


def target_flops(a: ModelArgs, G: int, T: int) -> float:
    """A step's matmul FLOPs (an estimate): 3 x the forward with its lm_head."""
    return float(3 * G * (causal_flops(a, T) + 2 * T * a.hidden_size * a.vocab_size))


def save_target(out: str, model: Transformer, eos_id: Optional[int], step: Optional[int] = None):
    """A Hugging Face Qwen3 directory: config.json, model.safetensors, generation_config.json."""
    os.makedirs(out, exist_ok=True)
    a = model.args
    # Hugging Face's names: the decoder under "model.", the lm_head (unless tied) beside it
    tensors = {}
    for k, v in published(model.state_dict()).items():
        if k == "lm_head.weight":
            if not a.tie_word_embeddings:
                tensors[k] = v.float()
        else:
            tensors["model." + k] = v.float()
    save_tensors(os.path.join(out, "model.safetensors"), tensors, step=step)
    write_json(os.path.join(out, "config.json"), config_json(a, eos_id))
    write_json(os.path.join(out, "generation_config.json"),
               {"eos_token_id": [eos_id] if eos_id is not None else [], "do_sample": False})


def config_json(a, eos_id: Optional[int]) -> dict:
    """The config.json of a target of shape `a` (ModelArgs), as Hugging Face's Qwen3 writes it."""
    cfg = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
           "vocab_size": a.vocab_size, "hidden_size": a.hidden_size,
           "intermediate_size": a.intermediate_size,
           "num_hidden_layers": a.num_hidden_layers, "num_attention_heads": a.num_attention_heads,
           "num_key_value_heads": a.num_key_value_heads, "head_dim": a.head_dim,
           "hidden_act": "silu",
           "max_position_embeddings": a.max_position_embeddings, "rms_norm_eps": a.rms_norm_eps,
           "rope_theta": a.rope_theta, "attention_bias": False, "attention_dropout": 0.0,
           "tie_word_embeddings": a.tie_word_embeddings, "use_sliding_window": False,
           "initializer_range": 0.02, "use_cache": True, "torch_dtype": "float32"}
    if eos_id is not None:
        cfg["eos_token_id"] = eos_id
    return cfg


def tokenizer_source(args: Args) -> Optional[str]:
    """The tokenizer.json the run copies into --out (None: one trained on --data): the resumed run's (at the
    top of its --out), or --tokenizer's."""
    if args.resume:
        here = os.path.realpath(args.resume)
        folders = [args.resume]
        if os.path.basename(here).startswith("checkpoint-"):
            folders.append(os.path.dirname(here))
        for folder in folders:
            kept = os.path.join(folder, "tokenizer.json")
            if os.path.isfile(kept):
                check_same_tokenizer(args, kept)
                return kept
        raise UserError(f"--resume {args.resume}: no tokenizer.json in {' or '.join(folders)} "
                        f"(the run's tokenizer, written at the top of its --out)")
    if args.tokenizer_from_corpus:
        if args.data is None:
            raise UserError("--tokenizer-from-corpus needs --data (text)")
        return None
    if args.tokenizer is not None:
        src = given_tokenizer(args)
        read_tokenizer_file(src)  # before it is copied into --out: an error names the file given
        return src
    raise UserError("a target needs --tokenizer PATH or --tokenizer-from-corpus")


def given_tokenizer(args: Args) -> str:
    """--tokenizer's tokenizer.json: the path, or the one in the folder it names."""
    src = args.tokenizer
    if os.path.isdir(src):
        src = os.path.join(src, "tokenizer.json")
    if not os.path.isfile(src):
        raise UserError(f"--tokenizer {args.tokenizer}: no tokenizer.json")
    return src


def check_same_tokenizer(args: Args, kept: str):
    """A resumed run goes on with its own tokenizer: a --tokenizer given must be that one, and a
    --tokenizer-from-corpus must ask for the vocabulary it was trained to."""
    if args.tokenizer_from_corpus:
        state = os.path.join(checkpoint_dir(args.resume), STATE_JSON)
        trained = read_json(state).get("args", {}).get("vocab_size")
        if trained is not None and trained != args.vocab_size:
            raise UserError(f"--vocab-size {args.vocab_size}: the resumed run's tokenizer {kept} was trained "
                            f"to --vocab-size {trained} (a resumed run goes on with its own tokenizer)")
    if args.tokenizer is None:
        return
    src = given_tokenizer(args)
    with open(src, "rb") as given, open(kept, "rb") as run:
        same = given.read() == run.read()
    if not same:
        raise UserError(f"--tokenizer {args.tokenizer}: differs from the resumed run's {kept}")


def tokenizer_into(args: Args, src: Optional[str], texts: Optional[list[str]]) -> Tokenizer:
    """The run's tokenizer in --out: `src` copied, or trained on the corpus."""
    tok_path = os.path.join(args.out, "tokenizer.json")
    if src is None:
        bpe = train_bpe(texts, args.vocab_size)
        atomic_write(tok_path, lambda p: bpe.save(p))
    elif os.path.realpath(src) != os.path.realpath(tok_path):
        atomic_write(tok_path, lambda p: shutil.copyfile(src, p))
    return Tokenizer(args.out)


# The shape flags and the config keys they write: each flag is held to the range the loader
# allows that key, so that what this writes loads.
SHAPE_KEYS = {"hidden_size": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads",
              "kv_heads": "num_key_value_heads", "head_dim": "head_dim",
              "intermediate_size": "intermediate_size", "rope_theta": "rope_theta",
              "max_position_embeddings": "max_position_embeddings"}
# a byte-level BPE's alphabet (256 bytes) and the two special tokens
SMALLEST_VOCAB = 258


def shape_ranges() -> dict:
    ranges = {"vocab_size": f"[{SMALLEST_VOCAB}, {LAYER_KEYS['vocab_size'][2]}]"}
    for name, key in SHAPE_KEYS.items():
        _, lo, hi, _ = LAYER_KEYS[key]
        ranges[name] = f"[{lo}, {hi}]"
    return ranges


def run(args: Args) -> dict:
    check_train_args(args, **shape_ranges())
    if args.tokenizer is not None and args.tokenizer_from_corpus:
        raise UserError("give --tokenizer or --tokenizer-from-corpus, not both")
    refuse_unused(args, [(("vocab_size",), not args.tokenizer_from_corpus, "no --tokenizer-from-corpus")])
    if args.heads % args.kv_heads:
        raise UserError(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    if args.head_dim % 2:
        raise UserError(f"--head-dim {args.head_dim}: must be even (RoPE rotates its two halves)")
    if args.max_position_embeddings < args.seq_len:
        raise UserError(f"--max-position-embeddings {args.max_position_embeddings}: below --seq-len "
                        f"{args.seq_len}, the length of the rows the target is trained on")
    tokenizer_source(args)
    # before the lock and W&B: every rank stops
    _, world, _ = dist_init(resolve_device(args.device), args.dist_timeout)
    check_resume_progress(args, world)
    with out_held(args.out, rank0(), from_rank0):
        return train(args)


def train(args: Args) -> dict:
    """The tokenizer, the data and the model, read and checked against a resumed state; then the run, in
    its W&B run (a resumed one's only once those checks pass: a refusal leaves it as it was)."""
    rank, world, device = dist_init(resolve_device(args.device), args.dist_timeout)
    dtype = resolve_dtype(args.dtype, device)
    src = tokenizer_source(args)
    texts = None
    if args.data is not None:
        texts = read_texts(args.data)
    os.makedirs(args.out, exist_ok=True)  # rank 0's `out_held` made it; a missing one it removes if left empty
    fresh = not os.listdir(args.out)
    try:
        tok = tokenizer_into(args, src, texts)
        V = tok.tok.get_vocab_size(with_added_tokens=True)
        eos = tok.tok.token_to_id(EOS_TOKEN)
        windows = read_windows(args, tok, V, eos, texts)
    except BaseException:  # e.g. too little text: --out as it was, for the same command next time
        if fresh and os.path.isfile(os.path.join(args.out, "tokenizer.json")):
            os.remove(os.path.join(args.out, "tokenizer.json"))
        raise
    eos_ids = ()
    if eos is not None:
        eos_ids = (eos,)
    margs = ModelArgs(vocab_size=V, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, head_dim=args.head_dim, rope_theta=args.rope_theta,
                      tie_word_embeddings=args.tie_word_embeddings,
                      max_position_embeddings=args.max_position_embeddings, eos_token_ids=eos_ids)
    identity = {"data": digest(Corpus(windows))}  # --resume refuses other data
    if args.resume:
        check_identity(checkpoint_dir(args.resume), identity, {"data": f"--data {args.data}"})
        model = load_target(checkpoint_dir(args.resume), device, torch.float32)
        model.requires_grad_(True)
        if model.args.vocab_size != V or model.args.num_hidden_layers != args.layers:
            raise UserError(f"--resume {args.resume}: "
                            "the saved target's shape differs from the flags")
        resumed = read_state(checkpoint_dir(args.resume), model, len(windows))
    else:
        resumed = None
        with torch.device(device):
            model = Transformer(margs)
        init_random_(model, args.seed, args.init_std)
    run_id = resumed_wandb_run(args)  # a resumed run goes on in its W&B run
    with runlog.logged_run(args, "train", "scripts/train_target.py", enabled=rank0(),
                           from_rank0=from_rank0, run_id=run_id) as log:
        return train_loaded(args, model, windows, identity, eos, dtype, log, resumed)


def train_loaded(args: Args, model: Transformer, windows: torch.Tensor, identity: dict, eos: Optional[int],
                 dtype, log: Optional[runlog.Log], resumed: Optional[tuple[int, dict]]) -> dict:
    """train's run, its inputs read and checked (`resumed`: the optimizer state resumed)."""
    rank, world, device = dist_init(resolve_device(args.device), args.dist_timeout)
    margs = model.args
    V = margs.vocab_size
    G = args.batch_size * args.grad_accum * world
    parameters = sum(p.numel() for p in model.parameters())
    banner = (f"target: {parameters:,} parameters, vocab {V}, "
              f"{len(windows)} sequences of {args.seq_len} tokens, global batch {G}")
    if log is not None:
        log.config(world_size=world, global_batch=G, hardware=device_name(device),
                   dtype_resolved=dtype_name(dtype), num_sequences=len(windows),
                   target_config=config_json(model.args, eos))  # the config.json its checkpoints hold
    batches = Batches(len(windows), G, args.seed)
    mine = micro_slices(args.batch_size, args.grad_accum, rank)

    def micro_batches(step):
        tokens = windows[batches(step)]
        return [{"tokens": tokens[sl].to(device)} for sl in mine]

    def summarize(sums):
        loss = float(sums[0])
        return {"loss": loss, "ppl": math.exp(min(loss, 50.0))}

    def save(directory, step, opt):
        save_target(directory, model, eos, step=step)
        # a checkpoint (and its --wandb-artifacts copy) is a target that reads text
        shutil.copyfile(os.path.join(args.out, "tokenizer.json"), os.path.join(directory, "tokenizer.json"))
        save_state(directory, step, model, opt, args, len(windows), world, identity, log)

    step_module = TargetStep(model, args.batch_size / G, args.compile)
    run_state = Run(rank, world, device, log)
    flops = target_flops(margs, G, args.seq_len)
    return optimize(args, step_module, micro_batches, summarize, save, run_state, dtype, resumed, flops,
                    banner)


def main(argv: Optional[list[str]] = None) -> int:
    return train_main(Args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
