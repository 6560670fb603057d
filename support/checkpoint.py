"""Where models come from: checkpoint directories or hub ids, loaded strictly (the config read by
support/configs.py, every weight assigned), or random weights in a published shape. Files split k/v,
gate/up; models fuse them."""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys
import threading
from dataclasses import dataclass, field, replace
from typing import Optional

import torch
import torch.nn as nn

from drafter import Drafter, DrafterBase, DrafterConfig, Eagle3Drafter
from model import ModelArgs, RMSNorm, Transformer
from support.cli import (
    MAX_TEMPERATURE,
    MAX_TOP_K,
    MIN_TEMPERATURE,
    UserError,
    dtype_name,
    first_line,
    fits,
    free_memory,
    resolve_device,
    resolve_dtype,
)
from support.configs import HEAD_RENAMES, checked, drafter_config, number, target_args, token_ids
from support.files import CHECKPOINT_FILES, check_input, directory_problem, optional_file, read_json

# Weights

WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX = "model.safetensors.index.json"
# A calibration file's largest STS temperature (the fit's grid stops at 20): past about 1e6, σ(logit / T)
# rounds to 0.5 in float32, so every confidence would be 0.5, its logit 0, the head's output lost.
MAX_STS_TEMPERATURE = 1000.0
# rows [first; second]
FUSED = {"kv_proj": ("k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def fused(tensors: dict) -> dict:
    """A checkpoint's names -> the models': k/v_proj -> kv_proj, gate/up_proj -> gate_up_proj."""
    out = dict(tensors)
    for whole, (a, b) in FUSED.items():
        for name in list(out):
            partner = name.replace(f".{a}.", f".{b}.")
            if f".{a}." not in name or partner not in out:
                continue
            rows = torch.cat([out.pop(name), out.pop(partner)])
            out[name.replace(f".{a}.", f".{whole}.")] = rows
    return out


def published(state: dict) -> dict:
    """The models' names and tensors -> a checkpoint's: fused rows split back."""
    out = {}
    for name, t in state.items():
        module, _, kind = name.rpartition(".")
        head, _, leaf = module.rpartition(".")
        if leaf in FUSED:
            for part, rows in zip(FUSED[leaf], t.chunk(2, 0)):
                out[f"{head}.{part}.{kind}"] = rows
        else:
            out[name] = t
    return out


def absent(directory: str, names) -> list[str]:
    return [f for f in names if not os.path.isfile(os.path.join(directory, f))]


def read_index(index: str) -> dict:
    """model.safetensors.index.json's weight_map: each tensor's shard, a file beside the index."""
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise UserError(f"{index}: missing or empty 'weight_map'")
    for k, f in weight_map.items():
        if not isinstance(f, str) or not f or os.path.basename(f) != f:
            raise UserError(f"{index}: weight_map[{k!r}] must be a shard file name "
                            f"in the directory, got {f!r}")
    return weight_map


def weight_files(directory: str) -> list[str]:
    """model.safetensors, or the shards the index names, with no unnamed shard beside them."""
    single = os.path.join(directory, "model.safetensors")
    index = os.path.join(directory, INDEX)
    if not optional_file(index):
        if optional_file(single):  # (a broken link is named so)
            return [single]
        raise UserError(f"{directory}: no model.safetensors or model.safetensors.index.json")
    shards = sorted(set(read_index(index).values()))
    if os.path.lexists(single) and shards != ["model.safetensors"]:  # an index of that one file is its index
        raise UserError(f"{directory}: both model.safetensors and model.safetensors.index.json "
                        "are there; which is the checkpoint is ambiguous (remove one)")
    lacking = absent(directory, shards)
    if lacking:
        raise UserError(f"{index}: shard {lacking[0]!r} not found in {directory}")
    stray = []  # shard-named files the index leaves out
    for f in sorted(os.listdir(directory)):
        if re.fullmatch(r"model-\d+-of-\d+\.safetensors", f) and f not in shards:
            stray.append(f)
    if stray:
        stray_path = os.path.join(directory, stray[0])
        raise UserError(f"{stray_path}: a weight file that {index} does not name "
                        "(its tensors would be left out; remove it or list them in the index)")
    return [os.path.join(directory, f) for f in shards]


def read_weights(files, dtype, device, rename=lambda k: k, index: Optional[str] = None) -> dict:
    """Every tensor of `files` in `dtype` on `device`, renamed, finite plain floats; shards match `index` if given."""
    from safetensors import SafetensorError, safe_open
    weight_map = {}
    if index:
        weight_map = read_index(index)
    out = {}
    spelled = {}  # each tensor's name as renamed -> as stored
    for path in files:
        shard = os.path.basename(path)
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                mapped_here = {k for k, v in weight_map.items() if v == shard}
                unheld = sorted(mapped_here - set(f.keys()))
                if unheld:
                    raise UserError(f"{index}: maps tensor {unheld[0]!r} to {shard!r}, "
                                    "which does not hold it")
                for key in f.keys():
                    if index and weight_map.get(key) != shard:
                        where = "does not list it"
                        if key in weight_map:
                            where = f"maps it to {weight_map[key]!r}"
                        raise UserError(f"{path}: holds tensor {key!r}, but {index} {where}")
                    name = rename(key)
                    if name in spelled:
                        raise UserError(f"{path}: tensors {spelled[name]!r} and {key!r} are two "
                                        f"spellings of one weight (keep one)")
                    spelled[name] = key
                    t = f.get_tensor(key)
                    if t.dtype not in WEIGHT_DTYPES:
                        what = "not a floating-point weight"
                        if key in ("d2t", "t2d"):
                            what = ("an EAGLE-3 draft vocabulary map, not implemented: drafters here draft "
                                    "over the target's whole vocabulary")
                        if t.is_floating_point():
                            what = ("a quantized format "
                                    "(not supported: use the unquantized checkpoint)")
                        stored = dtype_name(t.dtype)
                        raise UserError(f"{path}: tensor {key!r} is {stored}, {what}")
                    v = t.to(device, dtype)
                    if not torch.isfinite(v).all():
                        if not torch.isfinite(t).all():
                            raise UserError(f"{path}: tensor {key!r} holds NaN or infinite values")
                        wanted = dtype_name(dtype)
                        largest = t.abs().max().item()
                        raise UserError(f"{path}: tensor {key!r} overflows {wanted} "
                                        f"(largest magnitude {largest:.4g}): "
                                        "load it in a wider dtype")
                    out[name] = v
        except (SafetensorError, OSError) as e:
            raise UserError(f"{path}: cannot read safetensors ({e})") from None
    return out


def assign(module: nn.Module, tensors: dict, source: str):
    """A checkpoint's tensors into `module` (on meta): each matches a parameter, every parameter is loaded."""
    want = published(dict(module.named_parameters()))
    for name in sorted(tensors):
        if name not in want:
            raise UserError(f"{source}: tensor {name!r} in the checkpoint "
                            "matches no parameter of the model")
        if tensors[name].shape != want[name].shape:
            raise UserError(f"{source}: tensor {name!r} has shape {list(tensors[name].shape)}, "
                            f"the model expects {list(want[name].shape)}")
    missing = [name for name in want if name not in tensors]
    if missing:
        raise UserError(f"{source}: parameter {missing[0]!r} is missing from the checkpoint")
    module.load_state_dict(fused(tensors), strict=False, assign=True)


def checkpoint_weights(directory: str, dtype, device, rename) -> tuple[dict, str]:
    """A directory's tensors (read_weights), and the file their errors name: the weights, or the shards' index."""
    files = weight_files(directory)
    index = os.path.join(directory, INDEX)
    shards_index = None
    if os.path.isfile(index):
        shards_index = index
    tensors = read_weights(files, dtype, device, rename, shards_index)
    source = index  # the file errors name: the weights themselves when they are one file
    if len(files) == 1:
        source = files[0]
    return tensors, source


def read_target_args(directory: str) -> ModelArgs:
    """The target's shape, from the config.json of `directory` (checked to be one)."""
    problem = directory_problem(directory, "target directory")
    if problem:
        raise UserError(f"--target {directory}: {problem}")
    path = os.path.join(directory, "config.json")
    return target_args(read_json(path), path)


def load_target(directory: str, device="cpu", dtype=torch.float32) -> Transformer:
    args = read_target_args(directory)
    tensors, source = checkpoint_weights(directory, dtype, device,
                                         lambda k: k.removeprefix("model."))
    # some exports write the tied head too
    if args.tie_word_embeddings and "lm_head.weight" in tensors:
        head = tensors.pop("lm_head.weight")
        emb = tensors.get("embed_tokens.weight")
        if emb is None:
            raise UserError(f"{source}: parameter 'embed_tokens.weight' is missing "
                            "from the checkpoint (it holds 'lm_head.weight', "
                            "and tie_word_embeddings is true)")
        if head.shape != emb.shape or not torch.equal(head, emb):
            raise UserError(f"{source}: tie_word_embeddings is true "
                            "but 'lm_head.weight' differs from the embedding")
    with torch.device("meta"):
        model = Transformer(args)
    assign(model, tensors, source)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval().requires_grad_(False)


def attach(drafter: DrafterBase, target: Transformer, where: str = "the drafter"):
    """Give the drafter the target's embedding and lm_head, once the two are seen to fit (a refusal
    names `where`: the drafter's config file, when it has one)."""
    t = target.args
    a = drafter.cfg.layers
    c = drafter.cfg
    L = t.num_hidden_layers
    for key in ("vocab_size", "hidden_size"):
        drafter_has = getattr(a, key)
        target_has = getattr(t, key)
        if drafter_has != target_has:
            raise UserError(f"{where}: {key} {drafter_has} differs from the target's {target_has}")
    if c.num_target_layers is not None and c.num_target_layers != L:
        raise UserError(f"{where}: num_target_layers {c.num_target_layers} "
                        f"differs from the target's num_hidden_layers {L}: "
                        "it was built for another target")
    for i in c.target_layer_ids:
        if not -1 <= i < L:
            raise UserError(f"{where}: target_layer_ids: layer id {i!r} is outside "
                            f"the capturable layers -1..{L - 2}")
        if i == L - 1:
            raise UserError(f"{where}: target_layer_ids: layer id {i} "
                            "is the target's last layer; drafters read layers before it")
    drafter.attach(target)


def same_copy(copy: torch.Tensor, param: torch.Tensor) -> bool:
    """A drafter's copy of a target weight is the same weight: equal, or within the rounding of a half
    precision (a copy exported in bfloat16 beside a float32 target, both then read in any dtype): at most
    one bfloat16 step apart, relative to the value, or 2^-14 near zero. Another target's weight is not."""
    if copy.shape != param.shape:
        return False
    copy = copy.to(param.device, param.dtype)
    if torch.equal(copy, param):
        return True
    for rows in range(0, param.shape[0], 4096):  # in float32, a slice at a time: no float32 copy of it all
        a = copy[rows:rows + 4096].float()
        b = param[rows:rows + 4096].float()
        if not torch.all((a - b).abs() <= 2**-7 * b.abs() + 2**-14):
            return False
    return True


def load_drafter(directory: str, target: Transformer, device="cpu",
                 dtype=torch.float32) -> DrafterBase:
    problem = directory_problem(directory, "drafter directory")
    if problem:
        raise UserError(f"--drafter {directory}: {problem}")
    path = os.path.join(directory, "config.json")
    spelled = {}  # the models' names -> the file's
    raw = read_json(path)  # malformed JSON fails before the weights are read; its keys are checked with them
    vocab = target.args.vocab_size
    draft_vocab = raw.get("draft_vocab_size", vocab)
    if draft_vocab != vocab:  # before the weights, whose int64 vocabulary maps are no weights
        raise UserError(f"{path}: 'draft_vocab_size' {draft_vocab!r}: a reduced draft vocabulary (EAGLE-3's "
                        f"d2t/t2d maps) is not implemented; drafters here draft over the target's {vocab} tokens")

    def rename(key):
        name = drafter_name(key)
        spelled[name] = key
        return name

    tensors, source = checkpoint_weights(directory, dtype, device, rename)
    cfg = drafter_config(raw, tensors, path, source, spelled)
    shared = (("embed_tokens.weight", target.embed_tokens.weight),
              ("lm_head.weight", target.lm_head.weight))
    for name, param in shared:
        t = tensors.pop(name, None)  # a copy of the target's, which is used: it must be the same
        if t is None:
            continue
        if not same_copy(t, param):
            raise UserError(f"{source}: drafter tensor {name!r} differs from the target's; "
                            "drafters share the target's embedding and lm_head")
    drafter = drafter_shape(cfg)
    assign(drafter, tensors, source)
    attach(drafter, target, path)
    return drafter.eval().requires_grad_(False)


def drafter_name(key: str) -> str:
    """A drafter tensor's name in the models, from its name in the file."""
    name = key.removeprefix("model.")
    return HEAD_RENAMES.get(name, name)


def drafter_shape(cfg: DrafterConfig) -> DrafterBase:
    """The drafter `cfg` describes, on the meta device."""
    with torch.device("meta"):
        if cfg.layout == "eagle3":
            return Eagle3Drafter(cfg)
        return Drafter(cfg)


# Random weights in a published shape

# Hugging Face Qwen/Qwen3-*/config.json; qwen3-tiny: Qwen3's vocabulary with toy layers
PRESETS = {
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128),
    "qwen3-14b": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                      num_attention_heads=40, num_key_value_heads=8, head_dim=128),
    "qwen3-tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8)}


def init_random_(module: nn.Module, seed: int = 0, std: float = 0.02) -> nn.Module:
    """N(0, std) matrices and embeddings, 1 norm weights, 0 biases; then each submodule's own `init_()`."""
    device = next(module.parameters()).device
    if device.type == "meta":
        return module
    g = torch.Generator(device=device).manual_seed(seed)
    norms = set()  # the norm layers' weights, by identity
    for m in module.modules():
        is_norm = isinstance(m, (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, RMSNorm))
        if is_norm and getattr(m, "weight", None) is not None:
            norms.add(id(m.weight))
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight") or id(p) in norms:
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=g)
        for m in module.modules():
            if callable(getattr(m, "init_", None)):
                m.init_()
    return module


def random_target(preset: str, device="cpu", dtype=torch.bfloat16, seed: int = 0) -> Transformer:
    """A preset's target with random weights (on the meta device, its shapes alone)."""
    with torch.device("meta"):
        model = Transformer(ModelArgs(**PRESETS[preset]))
    model = model.to(dtype).to_empty(device=device)
    if model.args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return init_random_(model, seed).eval().requires_grad_(False)


def random_pair(preset: str, device="cpu", dtype=torch.bfloat16, seed: int = 0, *, eagle3: bool = False,
                flag: str = "--random-init") -> tuple[Transformer, DrafterBase]:
    """A preset's target and a drafter shaped like the published ones (`random_drafter`, or `random_eagle3`),
    with random weights. Counted on the meta device first, their weights and the copy the CPU kernels make
    of them must fit in what is free on `device` (`check_memory`; `flag` names the preset: --random-init,
    or bench.py's --model)."""
    make_drafter = random_drafter
    if eagle3:
        make_drafter = random_eagle3
    shapes = [random_target(preset, "meta", dtype)]
    shapes.append(make_drafter(shapes[0]))
    check_memory(shapes, device, dtype, f"{flag} {preset}: its target's and drafter's weights",
                 "choose a smaller preset or a narrower --dtype")
    target = random_target(preset, device, dtype, seed)
    return target, make_drafter(target)


def stored_numbers(directory: str) -> int:
    """How many numbers a checkpoint directory's weight files hold, read from their headers; 0 where they
    cannot be read (loading them then says why)."""
    from safetensors import SafetensorError, safe_open

    total = 0
    try:
        for path in weight_files(directory):
            with safe_open(path, framework="pt", device="cpu") as f:
                for key in f.keys():
                    total += math.prod(f.get_slice(key).get_shape())
    except (UserError, SafetensorError, OSError, ValueError):
        return 0
    return total


def drafter_copied_bytes(directory: str, device, dtype: torch.dtype) -> int:
    """What the CPU kernels would copy of the drafter in `directory`, built on the meta device from its
    config.json and its weights' headers; 0 where they cannot be read (loading them then says why)."""
    from safetensors import SafetensorError, safe_open

    from support import cpu_kernels

    if not cpu_kernels.copies(device, dtype):
        return 0
    path = os.path.join(directory, "config.json")
    shapes = {}  # each weight as the models name it, on the meta device
    spelled = {}
    try:
        raw = read_json(path)
        for file in weight_files(directory):
            with safe_open(file, framework="pt", device="cpu") as f:
                for key in f.keys():
                    name = drafter_name(key)
                    spelled[name] = key
                    shapes[name] = torch.empty(f.get_slice(key).get_shape(), device="meta")
        cfg = drafter_config(raw, shapes, path, directory, spelled)
    except (UserError, SafetensorError, OSError, ValueError):
        return 0
    return cpu_kernels.copied_bytes(drafter_shape(cfg), device, dtype)


def check_target_memory(directory: str, device, dtype: torch.dtype, drafter: Optional[str] = None,
                        kernels: bool = True):
    """Before a weight is read, what loading will hold must fit in what is free on `device`: the target's
    weights in `dtype` (counted from its config.json on the meta device), the copy the CPU kernels make of
    them (with `kernels`), and the `drafter` directory's tensors as its files hold them (DeepSpec's copies of
    the target's embedding and lm_head included: they are read, then dropped)."""
    args = read_target_args(directory)
    with torch.device("meta"):
        shape = Transformer(args)
    whose = f"--target {directory}: its weights"
    drafter_bytes = 0
    drafter_copy = 0
    if drafter is not None:
        whose = f"--target {directory} and --drafter {drafter}: their weights"
        drafter_bytes = stored_numbers(drafter) * dtype.itemsize
        if kernels:
            drafter_copy = drafter_copied_bytes(drafter, device, dtype)
    check_memory([shape], device, dtype, whose, "a narrower --dtype, or a smaller model",
                 extra=drafter_bytes, kernels=kernels, extra_copies=drafter_copy)


def check_memory(shapes: list, device, dtype: torch.dtype, whose: str, fix: str, extra: int = 0,
                 kernels: bool = True, extra_copies: int = 0):
    """Models (`shapes`, on the meta device) in `dtype`, `extra` bytes beside them and, with `kernels`, the
    copy the CPU kernels would make of the models (and `extra_copies` bytes of others') must fit in what is
    free on `device` (where that is known); `whose` and `fix` begin and end the refusal."""
    from support import cpu_kernels

    weights = extra
    copies = extra_copies
    for m in shapes:
        weights += sum(p.numel() for p in m.parameters()) * dtype.itemsize
        if kernels:
            copies += cpu_kernels.copied_bytes(m, device, dtype)
    need = weights + copies
    free = free_memory(device)
    if fits(need, free):
        return
    what = f"{whose} need {need / 2**30:.1f} GiB in {dtype_name(dtype)}"
    if copies:
        what += f" (the CPU kernels' copy of them {copies / 2**30:.1f} GiB)"
    raise UserError(f"{what}; {free / 2**30:.1f} GiB are free on {device}: {fix}")


def random_drafter(target: Transformer, block_size: int = 7, num_layers: int = 5,
                   rank: int = 256) -> Drafter:
    """A DSpark drafter shaped like the published ones (block 7, 5 layers, r 256, a vanilla Markov head and a
    confidence head reading W1[x]) on the target's device."""
    t = target.args
    layers = replace(t, num_hidden_layers=num_layers)
    mask_id = t.vocab_size - 1
    cfg = DrafterConfig(layers, block_size, five_layers(t), mask_id, "dspark", "vanilla", rank, True, True)
    return random_weights(Drafter, cfg, target)


def random_eagle3(target: Transformer) -> Eagle3Drafter:
    """An Eagle3 drafter shaped like DeepSpec's (one layer, five captured layers, a chain of 7)."""
    t = target.args
    one_layer = replace(t, num_hidden_layers=1)
    cfg = DrafterConfig(one_layer, 7, five_layers(t), 0, "eagle3", None, 0, False, False)
    return random_weights(Eagle3Drafter, cfg, target)


def five_layers(t: ModelArgs) -> tuple[int, ...]:
    """The target layers the published drafters capture: five, spread out (1, 9, .., 33 at 36 layers)."""
    spread = t.num_hidden_layers - 4
    layers = {1 + spread * i // 4 for i in range(5)}
    return tuple(sorted(layers))


def random_weights(drafter_class, cfg: DrafterConfig, target: Transformer) -> DrafterBase:
    """A drafter of `cfg` with random weights, in the target's dtype on its device, attached to it."""
    w = target.embed_tokens.weight
    with torch.device("meta"):
        drafter = drafter_class(cfg)
    drafter = drafter.to(w.dtype).to_empty(device=w.device)
    drafter = init_random_(drafter, 1)
    attach(drafter, target)
    return drafter.eval().requires_grad_(False)


# What a run loads: models, tokenizer, stop ids, sampling defaults

@dataclass
class Models:
    target: Transformer
    drafter: Optional[DrafterBase]  # a Drafter or an Eagle3Drafter
    tokenizer: Optional[object]  # text.Tokenizer
    stop_ids: tuple
    dtype: torch.dtype
    generation: Optional[dict] = None        # generation_config.json's sampling (None: greedy) ...
    generation_source: Optional[str] = None  # ... and that file (None: none)
    directories: tuple = (None, None)        # where the target and the drafter were read
    generation_problem: Optional[str] = None  # why that file is unusable, said only where it is used
    generation_unapplied: tuple = ()  # what that file asks for that is not applied here ("key value" each)
    calibration: Optional[str] = None  # the STS temperatures file the drafter's head applies ...
    # ... as read at load, with "applied_to", the drafter's real path then (`flags.calibration_note`)
    calibration_fit: Optional[dict] = None
    # held by whatever sets up or runs an engine on these models (their caches are the engine's)
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)
    busy: bool = field(default=False, repr=False, compare=False)  # an engine is being built or decodes

    @contextlib.contextmanager
    def engine_turn(self):
        """Hold the models' caches for one engine: another thread waits for its turn; a call on this
        thread while it holds them (from a decode callback) is refused, as it would replace the caches
        the running decode reads."""
        with self.lock:
            if self.busy:
                raise UserError("generate, make_engine or decode called from a decode callback on the "
                                "same models, whose caches the running decode uses: load a second copy "
                                "(speculate.load) for the nested work, or queue it until decode returns")
            self.busy = True
            try:
                yield
            finally:
                self.busy = False

    @property
    def hub_snapshots(self) -> list[str]:
        """A line per model read from a hub snapshot: the flag, ORG/NAME@COMMIT and the directory."""
        lines = []
        for flag, path in zip(("--target", "--drafter"), self.directories):
            if path is None:
                continue
            hub = hub_snapshot(path)
            if hub:
                lines.append(f"{flag} {hub}: {path}")
        return lines

    def describe(self, num_drafts: Optional[int] = None) -> str:
        drafter = "no drafter: autoregressive decoding"
        if self.drafter:
            drafter = self.drafter.cfg.describe(num_drafts)
        return "\n".join(self.hub_snapshots + [drafter])


def load_models(target: Optional[str], drafter: Optional[str] = None, *, device: str = "cpu",
                dtype: Optional[str] = None, random_init: Optional[str] = None,
                calibration: Optional[str] = None, seed: int = 0,
                cpu_kernels: bool = True) -> Models:
    """The target (and drafter) from directories, hub ids or a random preset; `calibration`: STS temperatures.
    CPU float32 models get the CPU kernels (not with cpu_kernels=False or DSPARK_CPU_KERNELS=0)."""
    from support.text import Tokenizer

    # drafters are trained on one target
    if random_init is None and target is None:
        if drafter is not None:
            raise UserError(f"--drafter {drafter}: needs --target, the target it was trained for")
        raise UserError("--target: no target directory given")
    if random_init is not None and (target is not None or drafter is not None):
        raise UserError("--random-init builds its own target and drafter: drop --target/--drafter")
    target = resolve_checkpoint(target, "--target")
    drafter = resolve_checkpoint(drafter, "--drafter")
    device = resolve_device(device)
    dt = resolve_dtype(dtype, device)
    tokenizer = None
    d = None
    generation = None
    generation_source = None
    generation_problem = None
    unapplied = ()
    if random_init is not None:
        t, d = random_pair(random_init, device, dt, seed)
        stop_ids = ()
    else:
        check_target_memory(target, device, dt, drafter, kernels=cpu_kernels)
        t = load_target(target, device, dt)
        stop_ids = stop_token_ids(target, t.args)
        try:
            generation, generation_source, unapplied = generation_sampling(target)
        except UserError as e:  # a sampling flag replaces the file: refused only where it is read
            generation_source = os.path.join(target, "generation_config.json")
            generation_problem = str(e)
        if optional_file(os.path.join(target, "tokenizer.json")):
            tokenizer = Tokenizer(target)
        if drafter is not None:
            d = load_drafter(drafter, t, device, dt)
    calibration_fit = None
    if calibration is not None:
        check_input(calibration, "--calibration", "calibration file")
        if d is None or d.confidence_head is None:
            raise UserError(f"--calibration {calibration}: needs a --drafter "
                            "with a confidence head")
        cal = read_json(calibration)
        temps = cal.get("temperatures")
        K = d.cfg.num_drafts
        lo = torch.finfo(torch.float32).tiny  # the temperatures are applied in float32
        hi = MAX_STS_TEMPERATURE
        # what it was fitted on, which a note compares with the run (eval.py writes these)
        fitted_dir = cal.get("drafter_dir")
        if fitted_dir is not None and not isinstance(fitted_dir, str):
            raise UserError(f"{calibration}: 'drafter_dir' (the drafter it was fitted on) must be a path, "
                            f"got {repr(fitted_dir)[:200]}")
        whose = ""
        if isinstance(temps, list) and len(temps) != K and fitted_dir is not None:
            whose = f"; it was fitted on drafter {fitted_dir}, which drafts {len(temps)}"
        well_formed = isinstance(temps, list) and len(temps) == K
        if well_formed:
            well_formed = all(number(x) and lo <= x <= hi for x in temps)
        if not well_formed:
            raise UserError(f"{calibration}: 'temperatures' must be a list "
                            f"of {K} positive numbers from {lo:.3g} to {hi:g} "
                            f"(one per draft position), got {repr(temps)[:200]}{whose}")
        fitted_t = cal.get("temperature")
        if fitted_t is not None and not (number(fitted_t) and 0 <= fitted_t <= MAX_TEMPERATURE):
            raise UserError(f"{calibration}: 'temperature' (the sampling temperature it was fitted at) "
                            f"must be a number from 0 to {MAX_TEMPERATURE:g}, got {repr(fitted_t)[:200]}")
        fitted_under = cal.get("scheduler")
        if fitted_under is not None and not isinstance(fitted_under, str):
            raise UserError(f"{calibration}: 'scheduler' (the --scheduler it was fitted under) must be a "
                            f"name, got {repr(fitted_under)[:200]}")
        counts = cal.get("fit_rounds_by_position")
        counted = isinstance(counts, list) and len(counts) == K
        if counted:
            counted = all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts)
        if counts is not None and not counted:
            raise UserError(f"{calibration}: 'fit_rounds_by_position' must be a list of {K} counts "
                            f"(the rounds each position was fitted on), got {repr(counts)[:200]}")
        d.calibrate(temps)
        calibration_fit = dict(cal, applied_to=os.path.realpath(drafter))
    if cpu_kernels:
        from support import cpu_kernels as backend
        for m in (t, d):
            if m is not None:
                backend.install(m)
    return Models(t, d, tokenizer, stop_ids, dt, generation, generation_source, (target, drafter),
                  generation_problem, unapplied, calibration, calibration_fit)


def stop_token_ids(directory: str, args: ModelArgs) -> tuple[int, ...]:
    """EOS ids from generation_config.json and config.json, in that order, deduplicated."""
    gen = os.path.join(directory, "generation_config.json")
    ids = ()
    if optional_file(gen):
        ids = token_ids(read_json(gen).get("eos_token_id"), gen, args.vocab_size)
    return tuple(dict.fromkeys(ids + args.eos_token_ids))


GENERATION_KEYS = {  # generation_config.json's sampling keys: (what is valid, the test)
    "temperature": (f"a number in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]",
                    lambda x: MIN_TEMPERATURE <= x <= MAX_TEMPERATURE),
    "top_k": (f"an integer from -1 to {MAX_TOP_K} (0 or -1: off)",
              lambda x: x == int(x) and -1 <= x <= MAX_TOP_K),
    "top_p": ("a number in (0, 1]", lambda x: 0 < x <= 1),
    "min_p": ("a number in [0, 1]", lambda x: 0 <= x <= 1),
}


# generation_config.json's keys this decoding does not apply, each with its value that changes nothing:
# those that change greedy decoding too, then those that change sampling only
UNAPPLIED_KEYS = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                  "no_repeat_ngram_size": 0, "num_beams": 1, "min_new_tokens": 0, "min_length": 0,
                  "bad_words_ids": [], "suppress_tokens": [], "begin_suppress_tokens": [],
                  "forced_eos_token_id": None, "max_new_tokens": None, "max_length": None}
UNAPPLIED_SAMPLING_KEYS = {"typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0}


def generation_sampling(directory: str) -> tuple[Optional[dict], Optional[str], tuple]:
    """generation_config.json's (sampling, path, what it asks for that is not applied here, "key value"
    each): sampling None for greedy (no do_sample), temperature 1.0 if unset."""
    path = os.path.join(directory, "generation_config.json")
    if not optional_file(path):
        return None, None, ()
    cfg = read_json(path)
    do_sample = checked(cfg.get("do_sample", False), "do_sample", path, bool)
    unapplied_keys = dict(UNAPPLIED_KEYS)
    if do_sample:
        unapplied_keys.update(UNAPPLIED_SAMPLING_KEYS)
    unapplied = []
    for key, neutral in unapplied_keys.items():
        v = cfg.get(key)
        if v is not None and v != neutral:
            shown = repr(v)
            if len(shown) > 60:  # a long list of token ids
                shown = shown[:57] + "..."
            unapplied.append(f"{key} {shown}")
    if not do_sample:
        return None, path, tuple(unapplied)
    out = {}  # no temperature: 1.0 (flags.sampling_for)
    for key, (valid, ok) in GENERATION_KEYS.items():
        v = cfg.get(key)
        if v is None:
            continue
        if not (number(v) and abs(v) < float("inf") and ok(v)):
            raise UserError(f"{path}: key {key!r} must be {valid}, got {v!r}")
        if key == "top_k":
            out[key] = max(int(v), 0)  # -1 is transformers' "off", as 0 is ours
        else:
            out[key] = float(v)
    return out, path, tuple(unapplied)


# Hugging Face hub ids, ORG/NAME[@REVISION]: from the cache, or downloaded into it

# every Qwen3 repo has them
SNAPSHOT_EXPECTED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
# the hub's rule for an owner or a name
_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
# a branch, tag or commit
_REVISION = r"[A-Za-z0-9_+-][A-Za-z0-9_.+-]*(?:/[A-Za-z0-9_+-][A-Za-z0-9_.+-]*)*"
HUB_ID = re.compile(rf"(?P<repo>{_PART}/{_PART})(?:@(?P<revision>{_REVISION}))?")


def resolve_checkpoint(spec: Optional[str], flag: str) -> Optional[str]:
    """--target/--drafter: a path as it is (~ expanded, as a shell does not after --target=); a hub id's
    complete cached snapshot, else its download (unless offline)."""
    if spec is None:
        return None
    spec = os.path.expanduser(spec)
    if os.path.exists(spec):
        check_holds_config(spec, flag)
        return spec
    if not spec.strip():
        raise UserError(f"{flag}: empty (a checkpoint directory, "
                        "or a Hugging Face hub id ORG/NAME)")
    if os.path.isabs(spec) or spec.startswith((".", "~")):
        return spec  # spelled as a path: the loader says it is not found
    m = HUB_ID.fullmatch(spec)
    # a mistyped path shows where it was looked for
    looked = f"; checked the local path {os.path.abspath(spec)}"
    if m is None or ".." in spec or "--" in m["repo"] or len(m["revision"] or "") > 255:
        raise UserError(f"{flag} {spec}: not found as a directory, "
                        f"and not a Hugging Face hub id (ORG/NAME or ORG/NAME@REVISION){looked}")
    from huggingface_hub import constants, snapshot_download, utils

    repo = m["repo"]
    revision = m["revision"]
    cache = constants.HF_HUB_CACHE
    where = f"{flag} {spec}"
    path = None        # the cached snapshot ...
    incomplete = None  # ... and the metadata files it lacks
    try:  # the cached snapshot, if any
        path = snapshot_download(repo, revision=revision, cache_dir=cache, local_files_only=True,
                                 allow_patterns=list(CHECKPOINT_FILES))
    # absent, or present in part (huggingface_hub >= 2 names what it lacks)
    except utils.LocalEntryNotFoundError as e:
        snapshot = getattr(e, "snapshot_path", None)
        if snapshot is not None and os.path.isdir(snapshot):
            lacking = []
            for f in CHECKPOINT_FILES:
                if f in str(e) and not os.path.exists(os.path.join(snapshot, f)):
                    lacking.append(f)
            path = snapshot
            incomplete = ", ".join(lacking) or "some of its metadata files"
    except Exception as e:
        raise UserError(f"{where}: cannot read the Hugging Face cache {cache} "
                        f"({type(e).__name__}: {first_line(e)})") from None
    expected = SNAPSHOT_EXPECTED
    if flag == "--drafter":
        expected = ()
    missing = None
    if path:
        missing = missing_file(path)
    whole = path and not missing and not incomplete
    if whole and (constants.HF_HUB_OFFLINE or not absent(path, expected)):
        return path
    if constants.HF_HUB_OFFLINE:
        if path and not missing:  # the config and the weights: used as the hub out of reach uses it
            print(f"note: {where}: the cached snapshot {path} lacks files the repository has ({incomplete}); "
                  "offline (HF_HUB_OFFLINE) it is used as it is", file=sys.stderr)
            return path
        if path:
            why = (f"the cached snapshot {path} has no {missing}; "
                   "offline mode (HF_HUB_OFFLINE) forbids downloading it")
        else:
            why = (f"no such local directory, and not in the Hugging Face cache ({cache}); "
                   f"offline mode (HF_HUB_OFFLINE) forbids downloading it{looked}")
        raise UserError(f"{where}: {why}")

    def download(revision, files, either=False):
        """The snapshot; `either`: nothing cached, so a failure that leaves the repository's existence open
        says that neither a directory nor the hub has `spec` (it may be a mistyped path)."""
        try:
            return snapshot_download(repo, revision=revision, cache_dir=cache,
                                     allow_patterns=files)
        # network, authorization, disk: one line each (GatedRepoError before its base class)
        except Exception as e:
            gated = (f"{repo} is gated on the Hugging Face hub: "
                     f"accept its conditions on huggingface.co/{repo}, "
                     "then log in (hf auth login, or HF_TOKEN)")
            not_found = (f"no repository {repo} on the Hugging Face hub "
                         "(or it is private: log in with hf auth login, or set HF_TOKEN)")
            no_revision = f"{repo} has no revision {revision!r} on the Hugging Face hub"
            unreachable = f"the hub cannot be reached ({first_line(e)})"
            if either:  # (a snapshot in part is in the cache otherwise)
                unreachable = f"not in the Hugging Face cache ({cache}), and {unreachable}"
            said = {utils.GatedRepoError: gated,
                    utils.RepositoryNotFoundError: not_found,
                    utils.RevisionNotFoundError: no_revision,
                    utils.LocalEntryNotFoundError: unreachable}
            why = (f"downloading from the Hugging Face hub failed "
                   f"({type(e).__name__}: {first_line(e)})")
            for kind, text in said.items():  # the first that matches
                if isinstance(e, kind):
                    why = text
                    break
            # the repository exists
            on_hub = isinstance(e, (utils.GatedRepoError, utils.RevisionNotFoundError))
            if either and not on_hub:
                why = f"no such local directory, and {why}{looked}"
            raise UserError(f"{where}: {why}") from None

    try:
        # the index names the weight files ...
        now = download(revision, list(CHECKPOINT_FILES), either=path is None)
    except UserError as e:
        if not (path and not missing):
            raise
        print(f"note: {e}; using the cached snapshot {path} as it is "
              "(HF_HUB_OFFLINE=1 skips this check)", file=sys.stderr)
        return path
    if missing_file(now):  # ... fetched at the very commit the metadata came from
        now = download(os.path.basename(now), weight_names(now))
    missing = missing_file(now)
    if missing:
        raise UserError(f"{where}: {now} has no {missing} after the download: "
                        "the repository lacks it (checkpoints are read as config.json "
                        "and safetensors weights), or the hub could not be reached")
    lacking = absent(now, expected)
    if lacking:
        print(f"note: {where}: the snapshot {now} still has no {', '.join(lacking)} "
              "after asking the hub (out of reach, or the repository lacks them); "
              "using it as it is", file=sys.stderr)
    return now


def check_holds_config(path: str, flag: str):
    """--target/--drafter: a directory without a config.json, one folder too high, says which to give: a
    subfolder holding one (demo for demo/target), or a Hugging Face cache folder's snapshot."""
    if not os.path.isdir(path) or os.path.lexists(os.path.join(path, "config.json")):
        return  # a file, or a config.json the loader checks
    where = f"{flag} {path}: no config.json there"
    snapshots = os.path.join(path, "snapshots")
    if os.path.isdir(snapshots):
        found = [os.path.join(snapshots, commit) for commit in sorted(os.listdir(snapshots))]
        if not found:
            raise UserError(f"{where}; a Hugging Face cache folder with no snapshot in {snapshots}")
        hub = ""
        repo = hub_snapshot(found[0])
        if repo is not None:
            hub = f" (or the hub id {repo.split('@')[0]})"
        raise UserError(f"{where}; a Hugging Face cache folder: give a snapshot in it, "
                        f"{', '.join(found)}{hub}")
    inner = []
    for name in sorted(os.listdir(path)):
        if os.path.isfile(os.path.join(path, name, "config.json")):
            inner.append(os.path.join(path, name))
    if inner:
        raise UserError(f"{where}; give a folder in it that holds one: {', '.join(inner)}")
    raise UserError(f"{where} (not a checkpoint directory)")


def hub_snapshot(path: str) -> Optional[str]:
    """ORG/NAME@COMMIT when `path` is a snapshot directory of a Hugging Face cache."""
    *_, folder, snapshots, commit = ["", ""] + os.path.normpath(path).split(os.sep)
    repo = folder.removeprefix("models--")
    if snapshots == "snapshots" and repo != folder and "--" in repo:
        return repo.replace("--", "/", 1) + "@" + commit
    return None


def weight_names(directory: str) -> list[str]:
    """The weight files a snapshot names: its index's shards, else model.safetensors."""
    index = os.path.join(directory, INDEX)
    names = ["model.safetensors"]
    if os.path.isfile(index):
        names = sorted(set(read_index(index).values()))
    if any(not f.endswith(".safetensors") for f in names):  # only weights are asked for
        raise UserError(f"{index}: 'weight_map' must map tensor names "
                        "to .safetensors files beside it")
    return names


def missing_file(directory: str) -> Optional[str]:
    """What a checkpoint directory lacks before it can be loaded (config.json, the weights), or None."""
    lacking = absent(directory, ["config.json"]) or absent(directory, weight_names(directory))
    if lacking == ["model.safetensors"] and not os.path.isfile(os.path.join(directory, INDEX)):
        return "model.safetensors (or model.safetensors.index.json)"
    if not lacking:
        return None
    return lacking[0]
