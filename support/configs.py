"""What a checkpoint's config.json says, checked once as it loads: a target's against tables of keys, types
and ranges, the unimplemented refused by name; a drafter's in any published spelling, its weights settling
what it leaves open. And the config.json a trained drafter is written with, in DeepSpec's spelling."""

from __future__ import annotations

import os
from dataclasses import replace

from drafter import MARKOV_HEADS, DrafterConfig
from model import ModelArgs
from support.cli import MAX_BLOCK, UserError, bound_text
from support.files import read_json

REQUIRED = object()  # a key without a default
# key: (type, smallest, largest, default) — far beyond any published Qwen3, short of what would hang.
LAYER_KEYS = {"vocab_size": (int, 1, 10_000_000, REQUIRED),
              "hidden_size": (int, 1, 65_536, REQUIRED),
              "intermediate_size": (int, 1, 1_048_576, REQUIRED),
              "num_hidden_layers": (int, 1, 1024, REQUIRED),
              "num_attention_heads": (int, 1, 1024, REQUIRED),
              "num_key_value_heads": (int, 1, 1024, REQUIRED),
              "head_dim": (int, 1, 4096, 128),  # transformers' Qwen3Config default, not hidden / heads
              "max_position_embeddings": (int, 1, 10_485_760, 32768),
              "rms_norm_eps": (float, 1e-12, 0.1, 1e-6),
              "rope_theta": (float, 1.0, 1e12, REQUIRED),
              "attention_bias": (bool, 0, 0, False),
              "tie_word_embeddings": (bool, 0, 0, False)}
LAYOUT_NAMES = {"dspark": "DSpark", "dflash": "DFlash"}
# DeepSpec's name, and its evaluator's alias
EAGLE3_ARCHITECTURES = ("Qwen3Eagle3Model", "Eagle3DraftModel")


def integer(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON's true is no count


def number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def checked(v, key: str, source: str, kind=int, lo=None, hi=None):
    """`key`'s value `v`: true or false for a bool, else of `kind` inside [lo, hi]; else one line naming the key."""
    if kind is bool:
        if not isinstance(v, bool):
            raise UserError(f"{source}: key {key!r} must be true or false, got {v!r}")
        return v
    ok = number(v)
    what = "a number"
    if kind is int:
        ok = integer(v)
        what = "an integer"
    if not (ok and lo <= v <= hi):
        valid = f"from {bound_text(float(lo))} to {bound_text(float(hi))}"
        raise UserError(f"{source}: key {key!r} must be {what} {valid}, got {v!r}")
    return kind(v)


def layer_args(cfg: dict, source: str) -> ModelArgs:
    """The decoder-layer shape of a Qwen3 config (target or drafter), as read_json reads it."""
    cfg = dict(cfg)
    thetas = {}  # where the file gives rope_theta: transformers reads rope_scaling as rope_parameters
    if "rope_theta" in cfg:
        thetas["top-level"] = cfg["rope_theta"]
    for key in ("rope_parameters", "rope_scaling"):
        r = cfg.get(key)
        if r is not None and not isinstance(r, dict):
            raise UserError(f"{source}: {key} must be an object, got {r!r}")
        r = r or {}
        nested = [k for k, v in r.items() if isinstance(v, dict)]
        if nested:  # transformers' per-layer-type form, which its Qwen3 refuses too
            names = ", ".join(repr(k) for k in nested)
            raise UserError(f"{source}: {key} keyed by layer type ({names}) is not supported "
                            "(one default RoPE for every layer)")
        if "rope_theta" in r:
            thetas[key] = r["rope_theta"]
        for spelling in ("rope_type", "type"):
            if r.get(spelling) not in ("default", None):
                raise UserError(f"{source}: {key} {spelling} {r[spelling]!r} is not supported "
                                "(only default RoPE)")
        kind = r.get("rope_type") or r.get("type")
        factor = r.get("factor", 1)
        if kind is None and factor != 1:  # a scaling without its kind: not default RoPE, nor any one
            raise UserError(f"{source}: {key} has a 'factor' of {factor!r} and no 'rope_type' "
                            "(only default RoPE is supported)")
    spellings = list(thetas.items())
    for where, theta in spellings[1:]:
        first, first_theta = spellings[0]
        if theta != first_theta:
            raise UserError(f"{source}: conflicting values for 'rope_theta': "
                            f"{first} {first_theta!r}, {where} {theta!r}")
    if spellings:
        cfg["rope_theta"] = spellings[0][1]
    out = {}
    for key, (kind, lo, hi, default) in LAYER_KEYS.items():
        if key in cfg:
            out[key] = checked(cfg[key], key, source, kind, lo, hi)
        elif default is REQUIRED:
            where = ""
            if key == "rope_theta":
                where = " (top-level, or in rope_parameters or rope_scaling)"
            raise UserError(f"{source}: missing key {key!r}{where}")
        else:
            out[key] = default
    if out["head_dim"] % 2:
        raise UserError(f"{source}: head_dim must be even (RoPE rotates its two halves), "
                        f"got {out['head_dim']}")
    if out["num_attention_heads"] % out["num_key_value_heads"]:
        raise UserError(f"{source}: num_attention_heads {out['num_attention_heads']} "
                        f"is not a multiple of num_key_value_heads {out['num_key_value_heads']}")
    quant = cfg.get("quantization_config")
    if quant is not None:
        method = quant
        if isinstance(quant, dict):
            method = quant.get("quant_method")
        raise UserError(f"{source}: quantization_config ({method!r}): "
                        "quantized checkpoints are not supported (use the unquantized one)")
    types = cfg.get("layer_types")
    if types is not None:
        full = isinstance(types, list) and all(t == "full_attention" for t in types)
        if not full:
            raise UserError(f"{source}: layer_types other than full_attention are not supported")
    sliding = cfg.get("use_sliding_window")
    if sliding is not None and checked(sliding, "use_sliding_window", source, bool):
        raise UserError(f"{source}: use_sliding_window=true is not supported")
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):  # transformers' two names of one function
        raise UserError(f"{source}: hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
    return ModelArgs(**out)


def token_ids(v, source: str, vocab_size: int) -> tuple[int, ...]:
    """eos_token_id: an id or a list of ids, each inside the vocabulary."""
    if v is None:
        vals = []
    elif isinstance(v, list):
        vals = v
    else:
        vals = [v]
    if not all(integer(x) and 0 <= x < vocab_size for x in vals):
        bad = next(x for x in vals if not (integer(x) and 0 <= x < vocab_size))
        raise UserError(f"{source}: key 'eos_token_id' must be a token id below vocab_size {vocab_size} "
                        f"or a list of them, got {repr(v)[:80]} (holding {repr(bad)[:40]})")
    return tuple(vals)


def target_args(cfg: dict, source: str) -> ModelArgs:
    args = layer_args(cfg, source)
    archs = cfg.get("architectures")
    names = isinstance(archs, list) and all(isinstance(a, str) for a in archs)
    if archs is not None:
        if not names:
            raise UserError(f"{source}: 'architectures' must be a list of names, got {archs!r}")
        if set(archs) != {"Qwen3ForCausalLM"}:
            raise UserError(f"{source}: architectures {archs!r} not supported "
                            "(supported: Qwen3ForCausalLM)")
    if cfg.get("model_type") not in (None, "qwen3"):
        raise UserError(f"{source}: model_type {cfg['model_type']!r} not supported "
                        "(supported: qwen3)")
    return replace(args, eos_token_ids=token_ids(cfg.get("eos_token_id"), source, args.vocab_size))


# Drafter configs, in every spelling

HEAD_RENAMES = {"markov_w1.weight": "markov_head.markov_w1.weight",
                "markov_w2.weight": "markov_head.markov_w2.weight",
                "confidence_proj.weight": "confidence_head.proj.weight",
                "confidence_proj.bias": "confidence_head.proj.bias"}


def lookup(cfg: dict, key: str, source: str, kind=None, aliases: tuple = ()):
    """`key` wherever a spelling puts it (`kind` bool: checked as one); spellings that disagree are an error."""
    for nested in ("dspark_config", "dflash_config"):
        if nested in cfg and not isinstance(cfg[nested], dict):
            raise UserError(f"{source}: {nested!r} must be an object, got {cfg[nested]!r}")
    found = {}  # "where 'spelling'": its value
    for name in (key, *aliases):
        places = (("dspark_config", cfg.get("dspark_config"), name),
                  ("dflash_config", cfg.get("dflash_config"), name),
                  ("top-level", cfg, f"dspark_{name}"),
                  ("top-level", cfg, name))
        for where, d, k in places:
            if isinstance(d, dict) and k in d:
                found[f"{where} {k!r}"] = d[k]
    values = list(found.values())
    for v in values[1:]:
        if type(v) is not type(values[0]) or v != values[0]:  # 4 and 4.0 disagree
            spellings = ", ".join(f"{w}={v!r}" for w, v in found.items())
            raise UserError(f"{source}: conflicting values for {key!r}: {spellings}")
    if not values:
        return None
    if kind is bool and values[0] is not None:
        return checked(values[0], key, source, bool)
    return values[0]


def check_layer_ids(ids, num_target_layers, source: str):
    """target_layer_ids (each layer once) and num_target_layers (None: not given), as every drafter names them."""
    if not (isinstance(ids, list) and ids and all(map(integer, ids))):
        raise UserError(f"{source}: 'target_layer_ids' must be a non-empty list of layer ids, "
                        f"got {ids!r}")
    if len(set(ids)) != len(ids):
        raise UserError(f"{source}: 'target_layer_ids' {ids} names a layer twice")
    if num_target_layers is not None:
        most_layers = LAYER_KEYS["num_hidden_layers"][2]
        checked(num_target_layers, "num_target_layers", source, int, 1, most_layers)


def drafter_config(cfg: dict, tensors: dict, source: str, weights: str,
                   spelled: dict) -> DrafterConfig:
    """The drafter config from config.json and the weights (`tensors`, renamed; `spelled`: the file's names)."""
    layers = layer_args(cfg, source)
    archs = cfg.get("architectures")
    if not isinstance(archs, list):
        raise UserError(f"{source}: 'architectures' must be a list naming the drafter "
                        f"(e.g. [\"Qwen3DSparkModel\"]), got {archs!r}")
    arch = None
    if len(archs) == 1:
        arch = archs[0]
    if arch in EAGLE3_ARCHITECTURES:
        return eagle3_config(cfg, layers, source)
    if arch not in ("Qwen3DSparkModel", "DFlashDraftModel"):
        raise UserError(f"{source}: architectures {archs!r} is not a known drafter "
                        "(Qwen3DSparkModel, DFlashDraftModel or Qwen3Eagle3Model)")
    block = lookup(cfg, "block_size", source)
    ids = lookup(cfg, "target_layer_ids", source)
    mask_id = lookup(cfg, "mask_token_id", source)
    num_target_layers = lookup(cfg, "num_target_layers", source)
    for key, value in (("block_size", block), ("target_layer_ids", ids), ("mask_token_id", mask_id)):
        if value is None:
            raise UserError(f"{source}: missing key {key!r} (or null; top-level, or in dspark_config or "
                            f"dflash_config)")
    block = checked(block, "block_size", source, int, 1, MAX_BLOCK)
    check_layer_ids(ids, num_target_layers, source)
    if not (integer(mask_id) and 0 <= mask_id < layers.vocab_size):
        raise UserError(f"{source}: 'mask_token_id' must be an id below vocab_size "
                        f"{layers.vocab_size}, got {mask_id!r}")

    # Layout: Qwen3DSparkModel is DSpark's; a DFlashDraftModel z-lab's DFlash unless its config says DSpark.
    shift = lookup(cfg, "shift_label", source, bool)
    projector = lookup(cfg, "projector_type", source)
    if projector not in (None, "dspark", "dflash"):
        raise UserError(f"{source}: unknown projector_type {projector!r}")
    said = []  # (what said it, the layout it says), in this order
    if shift is not None:
        shift_layout = {True: "dspark", False: "dflash"}[shift]
        said.append((f"shift_label={str(shift).lower()}", shift_layout))
    if projector is not None:
        said.append((f"projector_type {projector!r}", projector))
    if arch == "Qwen3DSparkModel":
        said.append(("architecture Qwen3DSparkModel", "dspark"))
    for (who, lay), (other, its) in zip(said, said[1:]):
        if lay != its:
            raise UserError(f"{source}: {who} contradicts {other} "
                            f"(the {LAYOUT_NAMES[its]} layout)")
    layout = "dflash"
    if said:
        layout = said[0][1]
    if layout == "dflash" and block < 2:
        raise UserError(f"{source}: the DFlash layout needs block_size >= 2, got {block}")

    # Markov head: declared by markov_head_type, its weights exactly that type's; the rank is W1's.
    mtype = lookup(cfg, "markov_head_type", source)
    if isinstance(mtype, str):  # DeepSpec lowercases it
        mtype = mtype.lower()
    if mtype in ("none", ""):
        mtype = None
    if mtype not in (None, *MARKOV_HEADS):
        raise UserError(f"{source}: unknown markov_head_type {mtype!r} "
                        f"(known: {', '.join(MARKOV_HEADS)})")
    declared = lookup(cfg, "markov_rank", source)
    w1 = tensors.get("markov_head.markov_w1.weight")
    rank = 0
    if mtype is None:
        heads = sorted(k for k in tensors if k.startswith("markov_head."))
        if heads:
            head_name = spelled[heads[0]]
            raise UserError(f"{weights}: tensor {head_name!r} belongs to a Markov head, "
                            f"but {source} declares none (markov_head_type)")
        if isinstance(declared, bool) or declared not in (None, 0):
            raise UserError(f"{source}: markov_rank is {declared!r} but markov_head_type "
                            "declares no Markov head (and the weights have none)")
    else:
        if w1 is None:
            raise UserError(f"{weights}: markov_head_type is {mtype!r} "
                            "but the weights have no markov_w1 "
                            "(markov_head.markov_w1.weight or markov_w1.weight)")
        if w1.ndim != 2 or w1.shape[1] < 1:
            w1_name = spelled["markov_head.markov_w1.weight"]
            raise UserError(f"{weights}: tensor {w1_name!r} has shape {list(w1.shape)}, "
                            "the Markov head expects [vocab_size, rank >= 1]")
        rank = w1.shape[1]
        if declared is not None and (not integer(declared) or declared != rank):
            raise UserError(f"{source}: markov_rank is {declared!r} but markov_w1 has rank {rank}")
    norm = tensors.get("norm.weight")
    if norm is not None and list(norm.shape) != [layers.hidden_size]:
        norm_name = spelled["norm.weight"]
        raise UserError(f"{source}: hidden_size is {layers.hidden_size} but tensor "
                        f"{norm_name!r} has shape {list(norm.shape)}")

    # Confidence head; whether it reads W1[x] is settled by its width.
    conf = lookup(cfg, "enable_confidence_head", source, bool, aliases=("use_confidence_head",))
    with_markov = lookup(cfg, "confidence_head_with_markov", source, bool)
    proj = tensors.get("confidence_head.proj.weight")
    name = spelled.get("confidence_head.proj.weight")
    if proj is not None and not conf:
        raise UserError(f"{weights}: tensor {name!r} belongs to a confidence head, "
                        f"but {source} does not enable one "
                        "(enable_confidence_head / use_confidence_head)")
    by_weights = False
    if conf:
        if proj is None:
            raise UserError(f"{weights}: the confidence head is enabled in {source} "
                            "but the weights have no confidence_head.proj.weight "
                            "(or confidence_proj.weight)")
        if proj.ndim != 2:
            raise UserError(f"{weights}: tensor {name!r} has shape {list(proj.shape)}, "
                            "the confidence head expects [1, features]")
        by_weights = rank > 0 and proj.shape[-1] == layers.hidden_size + rank
        if with_markov and mtype is None:
            raise UserError(f"{source}: confidence_head_with_markov is true "
                            "but there is no Markov head")
        if with_markov is not None and with_markov != by_weights:
            raise UserError(f"{source}: confidence_head_with_markov is {with_markov} "
                            f"but confidence_head.proj reads {proj.shape[-1]} features "
                            f"(hidden {layers.hidden_size}, markov rank {rank})")
    if layout == "dflash" and (mtype or conf):
        why = "the DFlash layout"
        if not said:  # taken for the architecture's default: say which key makes it DSpark
            why = ("no key names the layout, so a DFlashDraftModel is read as z-lab's DFlash (set "
                   "projector_type \"dspark\" or shift_label true for the DSpark layout), and that layout")
        raise UserError(f"{source}: {why} has no Markov or confidence head")
    return DrafterConfig(layers, block, tuple(ids), mask_id, layout, mtype, rank, bool(conf),
                         by_weights, num_target_layers)


def eagle3_config(cfg: dict, layers: ModelArgs, source: str) -> DrafterConfig:
    """DeepSpec's Eagle3 drafter: the target's config with one draft layer, the captured layers and the
    chain length it was trained to unroll (ttt_length, the drafts a round proposes by default)."""
    for key in ("target_layer_ids", "ttt_length"):
        if key not in cfg:
            raise UserError(f"{source}: missing key {key!r} (an Eagle3 drafter's config names it)")
    ids = cfg["target_layer_ids"]
    num_target_layers = cfg.get("num_target_layers")
    check_layer_ids(ids, num_target_layers, source)
    if ids != sorted(ids):
        raise UserError(f"{source}: 'target_layer_ids' {ids} must be strictly increasing")
    gamma = checked(cfg["ttt_length"], "ttt_length", source, int, 1, MAX_BLOCK)
    depth = cfg.get("draft_num_hidden_layers", layers.num_hidden_layers)
    if not integer(depth) or depth != 1:
        raise UserError(f"{source}: an Eagle3 drafter has one layer "
                        f"(draft_num_hidden_layers / num_hidden_layers), got {depth!r}")
    one_layer = replace(layers, num_hidden_layers=1)
    return DrafterConfig(one_layer, gamma, tuple(ids), 0, "eagle3", None, 0, False, False, num_target_layers)


# Written: a trained drafter's config.json, in DeepSpec's spelling

TARGET_ONLY_KEYS = ("architectures", "auto_map", "dtype", "torch_dtype")


def target_keys(tcfg: dict) -> dict:
    """The target's config.json less the keys a drafter's config sets or drops."""
    return {k: v for k, v in tcfg.items() if k not in TARGET_ONLY_KEYS}


def drafter_keys(target_dir: str, cfg: DrafterConfig, architecture: str) -> dict:
    """What every DeepSpec drafter config.json holds: the target's keys, the drafter's depth and the
    target layers it reads."""
    tcfg = read_json(os.path.join(target_dir, "config.json"))
    out = target_keys(tcfg)
    D = cfg.layers.num_hidden_layers
    out.update(
        architectures=[architecture],
        num_target_layers=tcfg["num_hidden_layers"],
        num_hidden_layers=D,
        layer_types=["full_attention"] * D,
        tie_word_embeddings=False,
        torch_dtype="float32",
        target_layer_ids=list(cfg.target_layer_ids),
    )
    return out


def config_json(target_dir: str, cfg: DrafterConfig, num_anchors: int) -> dict:
    """DeepSpec's drafter config.json: the target's, with the drafter's depth and keys."""
    out = drafter_keys(target_dir, cfg, "Qwen3DSparkModel")
    out.update(
        block_size=cfg.block_size,
        mask_token_id=cfg.mask_token_id,
        num_anchors=num_anchors,
        markov_rank=cfg.markov_rank,
        markov_head_type=cfg.markov_head_type,
        enable_confidence_head=cfg.confidence_head,
        confidence_head_with_markov=cfg.confidence_with_markov,
    )
    return out


def eagle3_config_json(target_dir: str, cfg: DrafterConfig, step_loss_decay: float) -> dict:
    """DeepSpec's Eagle3 config.json (build_draft_config): the target's, one layer, the Eagle3 keys."""
    out = drafter_keys(target_dir, cfg, "Qwen3Eagle3Model")
    out.update(
        draft_num_hidden_layers=1,
        ttt_length=cfg.block_size,
        step_loss_decay=step_loss_decay,
    )
    return out
