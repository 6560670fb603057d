"""Builders of tiny target/drafter checkpoint pairs for the tests, in every published spelling.

`make_target(path)` writes a Hugging Face Qwen3 directory with `transformers`' own
`save_pretrained`, with a small attention output projection so that the target is *near-bigram*:
its next token depends mostly on the current token, a little on the context.
`bigram_logits(target_dir)` reads that table back (the target's logits for each single token).

`make_drafter(path, target_dir, ...)` writes a drafter. With `oracle=True` its Markov head
carries the bigram table, so the drafter is often right (and, with `norm_scale` small, its
draft distribution q is close to the target's p): rounds accept several tokens. With
`oracle=False` every weight is random: the drafter is mostly wrong.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

from drafter import MARKOV_HEADS

SPELLINGS = ("deepspec", "dspark_config", "dspark_prefix", "specforge", "zlab")


def make_target(path, *, vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                attn_scale=0.002, eos_token_id=None, max_position_embeddings=512, seed=0):
    """A near-bigram Qwen3 target saved by transformers. Returns the path."""
    import transformers

    cfg = transformers.Qwen3Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads, head_dim=head_dim, tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=max_position_embeddings, initializer_range=0.3, eos_token_id=eos_token_id)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(attn_scale)
    model.save_pretrained(path)
    return str(path)


def bigram_logits(target_dir) -> torch.Tensor:
    """[V, V]: row t = the target's logits after the single token t (float32)."""
    import sys
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from support.checkpoint import load_target

    target = load_target(str(target_dir))
    V = target.args.vocab_size
    target.setup_caches(V, 4)
    with torch.no_grad():
        logits, _ = target(torch.arange(V)[:, None], torch.zeros(V, 1, dtype=torch.long))
    return logits[:, 0].float()


def weight_sampler(seed):
    """rnd(*shape, s=0.2): a tensor of that shape drawn from N(0, s^2), every call from one generator
    seeded with `seed` (the same calls in the same order give the same weights)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, s=0.2):
        return torch.randn(*shape, generator=g) * s
    return rnd


def make_drafter(path, target_dir, *, spelling="deepspec", markov="vanilla", confidence=True,
                 confidence_with_markov=True, block_size=4, num_layers=2, rank=None, target_layer_ids=(0, 1),
                 oracle=True, oracle_scale=1.0, norm_scale=1.0, seed=1, extra_config=None, drop_config=(),
                 with_embeddings=None):
    """Write a drafter directory in one of SPELLINGS. Returns the path.

    oracle: the Markov head adds `oracle_scale` x the target's bigram logits of the previous
    token (rank = vocab_size, W1 = identity). norm_scale scales the final norm, and with it
    the block's own logits U.
    """
    tcfg = json.load(open(os.path.join(target_dir, "config.json")))
    tw = load_file(os.path.join(target_dir, "model.safetensors"))
    H, V, I = tcfg["hidden_size"], tcfg["vocab_size"], tcfg["intermediate_size"]
    hd, nh, nkv = tcfg["head_dim"], tcfg["num_attention_heads"], tcfg["num_key_value_heads"]
    r = rank or (V if oracle else 8)
    rnd = weight_sampler(seed)

    w = {}
    for i in range(num_layers):
        p = f"layers.{i}."
        w[p + "self_attn.q_proj.weight"] = rnd(nh * hd, H)
        w[p + "self_attn.k_proj.weight"] = rnd(nkv * hd, H)
        w[p + "self_attn.v_proj.weight"] = rnd(nkv * hd, H)
        w[p + "self_attn.o_proj.weight"] = rnd(H, nh * hd)
        w[p + "self_attn.q_norm.weight"] = 1 + rnd(hd, s=0.1)
        w[p + "self_attn.k_norm.weight"] = 1 + rnd(hd, s=0.1)
        w[p + "mlp.gate_proj.weight"] = rnd(I, H)
        w[p + "mlp.up_proj.weight"] = rnd(I, H)
        w[p + "mlp.down_proj.weight"] = rnd(H, I)
        w[p + "input_layernorm.weight"] = 1 + rnd(H, s=0.1)
        w[p + "post_attention_layernorm.weight"] = 1 + rnd(H, s=0.1)
    w["fc.weight"] = rnd(H, len(target_layer_ids) * H)
    w["hidden_norm.weight"] = 1 + rnd(H, s=0.1)
    w["norm.weight"] = norm_scale * (1 + rnd(H, s=0.1))

    if markov:
        if oracle:
            w1, w2 = torch.eye(V, r), oracle_scale * bigram_logits(target_dir).T[:, :r].contiguous()
        else:
            w1, w2 = rnd(V, r, s=1.0), rnd(V, r, s=1.0)
        w["markov_head.markov_w1.weight"], w["markov_head.markov_w2.weight"] = w1, w2
        if markov == "gated":
            w["markov_head.gate_proj.weight"] = rnd(r, H + r)
            w["markov_head.gate_proj.bias"] = torch.full((r,), 8.0) if oracle else rnd(r)  # g ~ 1
        elif markov == "rnn":
            jw = rnd(3 * r, 2 * r + H, s=0.05)
            if oracle:  # the output gate reads 6 * W1[x]: tanh(out) ~ one-hot of the previous token
                jw[2 * r:, r:2 * r] = 6 * torch.eye(r)
            w["markov_head.joint_proj.weight"] = jw
            w["markov_head.joint_proj.bias"] = torch.zeros(3 * r)
        # a head of another kind: its own further parameters, drawn at random
        head = MARKOV_HEADS[markov](H, V, r)
        for name, value in head.state_dict().items():
            if f"markov_head.{name}" not in w:
                w[f"markov_head.{name}"] = rnd(*value.shape)
    if confidence:
        w["confidence_head.proj.weight"] = rnd(1, H + (r if confidence_with_markov else 0), s=0.5)
        w["confidence_head.proj.bias"] = torch.tensor([1.0])

    keys = {"block_size": block_size, "target_layer_ids": list(target_layer_ids), "mask_token_id": V - 1,
            "markov_rank": r if markov else 0, "markov_head_type": markov, "enable_confidence_head": confidence,
            "confidence_head_with_markov": confidence_with_markov}
    cfg = {k: v for k, v in tcfg.items() if k not in ("architectures", "auto_map", "dtype", "torch_dtype")}
    cfg["num_hidden_layers"] = num_layers
    cfg["num_target_layers"] = tcfg["num_hidden_layers"]
    embeddings = spelling != "zlab" if with_embeddings is None else with_embeddings
    if spelling == "deepspec":
        cfg.update(architectures=["Qwen3DSparkModel"], num_anchors=64, **keys)
    elif spelling == "dspark_config":
        cfg.update(architectures=["Qwen3DSparkModel"], dspark_config=keys)
    elif spelling == "dspark_prefix":
        cfg.update(architectures=["Qwen3DSparkModel"], **{f"dspark_{k}": v for k, v in keys.items()})
    elif spelling == "specforge":
        cfg.update(architectures=["DFlashDraftModel"], block_size=block_size, dflash_config={
            "mask_token_id": V - 1, "target_layer_ids": list(target_layer_ids), "projector_type": "dspark",
            "markov_rank": keys["markov_rank"], "markov_head_type": markov, "use_confidence_head": confidence,
            "shift_label": True})
        rename = {"markov_head.markov_w1.weight": "markov_w1.weight", "markov_head.markov_w2.weight": "markov_w2.weight",
                  "confidence_head.proj.weight": "confidence_proj.weight",
                  "confidence_head.proj.bias": "confidence_proj.bias"}
        w = {rename.get(k, k): v for k, v in w.items()}
    elif spelling == "zlab":
        assert not markov and not confidence, "the z-lab DFlash layout has no heads"
        cfg.update(architectures=["DFlashDraftModel"], block_size=block_size,
                   dflash_config={"mask_token_id": V - 1, "target_layer_ids": list(target_layer_ids)})
    else:
        raise ValueError(spelling)
    if embeddings:
        w["embed_tokens.weight"] = tw["model.embed_tokens.weight"].clone()
        w["lm_head.weight"] = tw.get("lm_head.weight", tw["model.embed_tokens.weight"]).clone()
    for k in drop_config:
        cfg.pop(k, None)
    cfg.update(extra_config or {})
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    save_file({k: v.contiguous() for k, v in w.items()}, os.path.join(path, "model.safetensors"))
    return str(path)


def make_eagle3(path, target_dir, *, ttt_length=4, target_layer_ids=(0, 1), norm_scale=1.0, seed=2,
                extra_config=None, drop=(), extra_tensors=None):
    """Write an Eagle3 drafter as DeepSpec saves one (config.json: the target's, one layer, the Eagle3
    keys; model.safetensors: separate q/k/v, the target's embedding and lm_head). Random weights;
    norm_scale scales the final norm (small: a flat draft distribution). Returns the path."""
    tcfg = json.load(open(os.path.join(target_dir, "config.json")))
    tw = load_file(os.path.join(target_dir, "model.safetensors"))
    H, I = tcfg["hidden_size"], tcfg["intermediate_size"]
    hd, nh, nkv = tcfg["head_dim"], tcfg["num_attention_heads"], tcfg["num_key_value_heads"]
    rnd = weight_sampler(seed)

    p = "layers.0."
    w = {"fc.weight": rnd(H, len(target_layer_ids) * H), "norm.weight": norm_scale * (1 + rnd(H, s=0.1)),
         p + "hidden_norm.weight": 1 + rnd(H, s=0.1), p + "input_layernorm.weight": 1 + rnd(H, s=0.1),
         p + "post_attention_layernorm.weight": 1 + rnd(H, s=0.1),
         p + "self_attn.q_proj.weight": rnd(nh * hd, 2 * H), p + "self_attn.k_proj.weight": rnd(nkv * hd, 2 * H),
         p + "self_attn.v_proj.weight": rnd(nkv * hd, 2 * H), p + "self_attn.o_proj.weight": rnd(H, nh * hd),
         p + "self_attn.q_norm.weight": 1 + rnd(hd, s=0.1), p + "self_attn.k_norm.weight": 1 + rnd(hd, s=0.1),
         p + "mlp.gate_proj.weight": rnd(I, H), p + "mlp.up_proj.weight": rnd(I, H),
         p + "mlp.down_proj.weight": rnd(H, I),
         "embed_tokens.weight": tw["model.embed_tokens.weight"].clone(),
         "lm_head.weight": tw.get("lm_head.weight", tw["model.embed_tokens.weight"]).clone()}
    for name in drop:
        w.pop(name)
    w.update(extra_tensors or {})
    cfg = {k: v for k, v in tcfg.items() if k not in ("architectures", "auto_map", "dtype", "torch_dtype")}
    cfg.update(architectures=["Qwen3Eagle3Model"], num_target_layers=tcfg["num_hidden_layers"], num_hidden_layers=1,
               draft_num_hidden_layers=1, layer_types=["full_attention"], target_layer_ids=list(target_layer_ids),
               ttt_length=ttt_length, step_loss_decay=0.8, tie_word_embeddings=False)
    cfg.update(extra_config or {})
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    save_file({k: v.contiguous() for k, v in w.items()}, os.path.join(path, "model.safetensors"))
    return str(path)


def make_any(path, target_dir, **opts):
    """make_eagle3 where the options say eagle3=True, else make_drafter."""
    if opts.pop("eagle3", False):
        return make_eagle3(path, target_dir, **opts)
    return make_drafter(path, target_dir, **opts)
