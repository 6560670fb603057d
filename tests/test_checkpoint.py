"""support/checkpoint.py: strict loading and its one-line errors (each names the file, key or tensor at
fault), sharded and bf16 checkpoints, a config's two RoPE spellings read into the same arguments, and
the target layers a drafter may read checked when it attaches; and support/text.py's tokenizer, chat
template and stop tokens as a checkpoint brings them."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import (
    CHAT_NO_THINK,
    ENDOFTEXT_ID,
    IM_END_ID,
    IM_START_ID,
    QWEN3_LIKE_TEMPLATE,
    arange_positions,
    copy_target,
    edit_config,
    edit_json,
    edit_tensors,
    hf_forward,
    import_model,
    max_err,
    random_tokens,
    render_chat,
    target_with_caches,
    write_json,
)
from test_model import QWEN3_8B_CONFIG

m = import_model()
from support import (
    checkpoint,  # noqa: E402
    configs,  # noqa: E402
    text,  # noqa: E402
)
from support.cli import UserError  # noqa: E402

ATOL = 1e-4


# ----------------------------------------------------------------------------------------
# Loading: errors name the culprit

def corrupt(tiny_target, tmp_path):
    return copy_target(tiny_target.path, tmp_path / "ckpt")


def test_missing_directory(tmp_path):
    missing = tmp_path / "no_such_dir"
    with pytest.raises(UserError, match="no_such_dir.*not found"):
        checkpoint.load_target(str(missing))


def test_models_need_a_target(tmp_path):
    with pytest.raises(UserError, match="^--target: no target directory given$"):
        checkpoint.load_models(None)


def test_missing_config(tiny_target, tmp_path):
    d = corrupt(tiny_target, tmp_path)
    (d / "config.json").unlink()
    with pytest.raises(UserError, match="config.json: file not found"):
        checkpoint.load_target(str(d))


def test_a_checkpoint_folder_one_level_too_high_names_the_flag_and_the_folder_to_give(tmp_path):
    """--target/--drafter DIR without a config.json: the flag named, and the folder meant where DIR holds
    it (demo for demo/target; a Hugging Face cache folder models--ORG--NAME and its snapshots)."""
    pair = tmp_path / "pair"
    for name in ("target", "drafter"):
        (pair / name).mkdir(parents=True)
        (pair / name / "config.json").write_text("{}")
    with pytest.raises(UserError) as e:
        checkpoint.resolve_checkpoint(str(pair), "--drafter")
    assert str(e.value) == (f"--drafter {pair}: no config.json there; give a folder in it that holds one: "
                            f"{pair / 'drafter'}, {pair / 'target'}")
    repo = tmp_path / "hub" / "models--Qwen--Qwen3-8B"
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    with pytest.raises(UserError) as e:
        checkpoint.resolve_checkpoint(str(repo), "--target")
    assert str(e.value) == (f"--target {repo}: no config.json there; a Hugging Face cache folder: give a "
                            f"snapshot in it, {repo / 'snapshots' / 'abc123'} (or the hub id Qwen/Qwen3-8B)")
    with pytest.raises(UserError, match=f"^--target {tmp_path / 'hub'}: no config.json there \\(not a "):
        checkpoint.resolve_checkpoint(str(tmp_path / "hub"), "--target")


def test_malformed_config_json(tiny_target, tmp_path):
    d = corrupt(tiny_target, tmp_path)
    (d / "config.json").write_text('{"vocab_size": 64,')
    with pytest.raises(UserError, match="config.json: malformed JSON"):
        checkpoint.load_target(str(d))


def test_config_not_an_object(tiny_target, tmp_path):
    d = corrupt(tiny_target, tmp_path)
    (d / "config.json").write_text("[1, 2]")
    with pytest.raises(UserError, match="config.json: expected a JSON object"):
        checkpoint.load_target(str(d))


@pytest.mark.parametrize("key", ["vocab_size", "hidden_size", "num_hidden_layers", "num_key_value_heads"])
def test_config_missing_required_key(tiny_target, tmp_path, key):
    d = corrupt(tiny_target, tmp_path)
    edit_config(d, lambda c: c.pop(key))
    with pytest.raises(UserError, match=f"config.json: missing key '{key}'"):
        checkpoint.load_target(str(d))


@pytest.mark.parametrize("value", ["32", 0, -4, True, 32.0])
def test_config_bad_integer(tiny_target, tmp_path, value):
    d = corrupt(tiny_target, tmp_path)
    edit_config(d, lambda c: c.update(hidden_size=value))
    with pytest.raises(UserError, match="'hidden_size' must be an integer from 1 to"):
        checkpoint.load_target(str(d))


def test_a_configs_bounds_are_printed_in_full(tiny_target, tmp_path):
    """A bound is written as a number a user can type (10485760, not 1.04858e+07)."""
    d = corrupt(tiny_target, tmp_path)
    edit_config(d, lambda c: c.update(max_position_embeddings=None))
    with pytest.raises(UserError, match="'max_position_embeddings' must be an integer from 1 to 10485760, got None"):
        checkpoint.load_target(str(d))


@pytest.mark.parametrize("archs", ["Qwen3ForCausalLM", [["Qwen3ForCausalLM"]], [3]])
def test_architectures_must_be_a_list_of_names(tiny_target, tmp_path, archs):
    """A string said "'Qwen3ForCausalLM' not supported (supported: Qwen3ForCausalLM)"; a nested list was a
    traceback."""
    d = corrupt(tiny_target, tmp_path)
    edit_config(d, lambda c: c.update(architectures=archs))
    with pytest.raises(UserError, match="config.json: 'architectures' must be a list of names"):
        checkpoint.load_target(str(d))


def test_a_checkpoint_path_may_start_with_a_tilde(tiny_target, monkeypatch):
    """`--target=~/models/x`: the shell leaves ~ alone after `=`, so the loader expands it."""
    monkeypatch.setenv("HOME", str(tiny_target.path.parent))
    spec = "~/" + tiny_target.path.name
    assert checkpoint.resolve_checkpoint(spec, "--target") == str(tiny_target.path)


def test_load_models_loads_on_the_device_it_resolves(tiny_target, monkeypatch):
    """No device given: the weights go where the dtype was chosen for (they went to the raw None, which
    on a CUDA machine meant bfloat16 weights on the CPU)."""
    seen = {}

    def load_target(path, device, dtype):
        seen.update(device=device, dtype=dtype)
        raise UserError("stop here")

    monkeypatch.setattr(checkpoint, "load_target", load_target)
    monkeypatch.setattr(checkpoint, "resolve_device", lambda device: "cpu")
    with pytest.raises(UserError, match="stop here"):
        checkpoint.load_models(str(tiny_target.path), device=None)
    assert seen == {"device": "cpu", "dtype": torch.float32}


def test_config_missing_rope_theta(tiny_target, tmp_path):
    d = corrupt(tiny_target, tmp_path)
    edit_config(d, lambda c: c.pop("rope_parameters"))
    with pytest.raises(UserError, match="rope_theta"):
        checkpoint.load_target(str(d))


def test_config_heads_not_multiple_of_kv_heads(tiny_target, tmp_path):
    d = corrupt(tiny_target, tmp_path)
    edit_config(d, lambda c: c.update(num_key_value_heads=3))
    with pytest.raises(UserError, match="num_key_value_heads 3"):
        checkpoint.load_target(str(d))


@pytest.mark.parametrize("edit,needle", [
    (lambda c: c.update(rope_parameters="fast"), "rope_parameters must be an object, got 'fast'"),
    (lambda c: c.update(head_dim=None), "'head_dim' must be an integer"),
], ids=["rope-not-an-object", "null-head-dim"])
def test_config_shapes_that_cannot_be_read(tiny_target, tmp_path, edit, needle):
    d = corrupt(tiny_target, tmp_path)
    edit_config(d, edit)
    with pytest.raises(UserError, match=re.escape(needle)):
        checkpoint.load_target(str(d))


@pytest.mark.parametrize("edit,culprit", [
    (lambda c: c.update(architectures=["LlamaForCausalLM"]), "LlamaForCausalLM"),
    (lambda c: c.update(architectures=["Qwen3ForCausalLM", "Qwen3MoeForCausalLM"]), "Qwen3MoeForCausalLM"),
    (lambda c: (c.pop("architectures"), c.update(model_type="llama")), "'llama'"),
], ids=["llama-arch", "moe-arch", "model_type"])
def test_unsupported_architecture(tiny_target, tmp_path, edit, culprit):
    d = corrupt(tiny_target, tmp_path)
    edit_config(d, edit)
    with pytest.raises(UserError, match="not supported") as e:
        checkpoint.load_target(str(d))
    assert culprit in str(e.value)
    assert "config.json" in str(e.value)


def test_a_config_without_max_position_embeddings_reads_as_transformers_reads_it(tiny_target, tmp_path):
    transformers = pytest.importorskip("transformers")
    d = corrupt(tiny_target, tmp_path)
    edit_config(d, lambda c: c.pop("max_position_embeddings"))
    cfg = json.loads((d / "config.json").read_text())
    assert configs.target_args(cfg, "c").max_position_embeddings == \
        transformers.Qwen3Config(**cfg).max_position_embeddings


def test_a_config_without_head_dim_reads_as_transformers_reads_it(tiny_target, tmp_path):
    """Qwen3's default head_dim is 128, not hidden_size / num_attention_heads (which this project took):
    the weights' shapes then disagree with the default, and the error says what the model expects."""
    transformers = pytest.importorskip("transformers")
    d = corrupt(tiny_target, tmp_path)
    edit_config(d, lambda c: c.pop("head_dim"))
    cfg = json.loads((d / "config.json").read_text())
    assert configs.target_args(cfg, "c").head_dim == transformers.Qwen3Config(**cfg).head_dim == 128
    with pytest.raises(UserError, match=r"has shape \[16\], the model expects \[128\]"):
        checkpoint.load_target(str(d))


@pytest.mark.parametrize("edit", [
    lambda c: c["rope_parameters"].update(rope_type="yarn", factor=4.0,
                                          original_max_position_embeddings=32),
    lambda c: (c.pop("rope_parameters"),
               c.update(rope_theta=10000.0, rope_scaling={"type": "yarn", "factor": 4.0})),
], ids=["rope_parameters", "legacy-rope_scaling"])
def test_unsupported_rope_type(tiny_target, tmp_path, edit):
    d = corrupt(tiny_target, tmp_path)
    edit_config(d, edit)
    with pytest.raises(UserError, match="(rope_type|type) 'yarn' is not supported"):
        checkpoint.load_target(str(d))


@pytest.mark.parametrize("edit,culprit", [
    (lambda c: c.update(use_sliding_window=True, sliding_window=8), "use_sliding_window"),
    (lambda c: c.update(layer_types=["full_attention", "sliding_attention", "full_attention"]), "layer_types"),
    (lambda c: c.update(hidden_act="gelu"), "'gelu'"),
    (lambda c: c.update(tie_word_embeddings="yes"), "tie_word_embeddings"),
])
def test_unsupported_features_are_refused(tiny_target, tmp_path, edit, culprit):
    d = corrupt(tiny_target, tmp_path)
    edit_config(d, edit)
    with pytest.raises(UserError, match=culprit):
        checkpoint.load_target(str(d))


def test_swish_is_silu_by_another_name(tiny_target, tmp_path):
    """transformers maps hidden_act "swish" to the same SiLU as "silu": taken, not refused."""
    d = corrupt(tiny_target, tmp_path)
    edit_config(d, lambda c: c.update(hidden_act="swish"))
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(checkpoint.load_target(str(d))(ids)[0], checkpoint.load_target(tiny_target.path)(ids)[0])


def test_missing_tensor(tiny_target, tmp_path):
    d = corrupt(tiny_target, tmp_path)
    edit_tensors(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(UserError, match=r"parameter 'layers\.1\.mlp\.up_proj\.weight' is missing"):
        checkpoint.load_target(str(d))


def test_extra_tensor(tiny_target, tmp_path):
    d = corrupt(tiny_target, tmp_path)
    edit_tensors(d, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    with pytest.raises(UserError,
                       match=r"'layers\.0\.self_attn\.rotary_emb\.inv_freq' in the checkpoint matches no parameter"):
        checkpoint.load_target(str(d))


def test_tensor_shape_mismatch(tiny_target, tmp_path):
    d = corrupt(tiny_target, tmp_path)
    edit_tensors(d, lambda t: t.update({"model.layers.2.self_attn.k_norm.weight": torch.ones(17)}))
    with pytest.raises(UserError, match=r"'layers\.2\.self_attn\.k_norm\.weight' has shape \[17\], "
                                              r"the model expects \[16\]"):
        checkpoint.load_target(str(d))


def test_config_disagrees_with_tensors(tiny_target, tmp_path):
    d = corrupt(tiny_target, tmp_path)
    edit_config(d, lambda c: c.update(intermediate_size=48))
    with pytest.raises(UserError, match=r"mlp\.\w+_proj\.weight' has shape"):
        checkpoint.load_target(str(d))


def test_no_weight_file(tiny_target, tmp_path):
    d = corrupt(tiny_target, tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(UserError, match="no model.safetensors or model.safetensors.index.json"):
        checkpoint.load_target(str(d))


def test_unreadable_weight_file(tiny_target, tmp_path):
    d = corrupt(tiny_target, tmp_path)
    (d / "model.safetensors").write_bytes(b"\x00" * 5)
    with pytest.raises(UserError, match="model.safetensors: cannot read safetensors"):
        checkpoint.load_target(str(d))


def test_tied_checkpoint_with_explicit_head(target_factory, tmp_path):
    target = target_factory(tie_word_embeddings=True)
    d = copy_target(target.path, tmp_path / "ok")
    edit_tensors(d, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    model = target_with_caches(d)
    assert model.lm_head.weight is model.embed_tokens.weight
    tokens = random_tokens(1, 5, seed=13)
    ref, _ = hf_forward(target.hf_model, tokens)
    with torch.no_grad():
        logits, _ = model(tokens, arange_positions(1, 0, 5))
    assert max_err(logits, ref) <= ATOL

    bad = copy_target(target.path, tmp_path / "bad")
    edit_tensors(bad, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"] + 1}))
    with pytest.raises(UserError, match="'lm_head.weight' differs from the embedding"):
        checkpoint.load_target(str(bad))


def test_untied_config_without_head(tiny_target, tmp_path):
    d = corrupt(tiny_target, tmp_path)
    edit_tensors(d, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(UserError, match="'lm_head.weight' is missing"):
        checkpoint.load_target(str(d))


def test_sharded_checkpoint(target_factory, tiny_target, tmp_path):
    sharded = target_factory(max_shard_size="20KB")  # same seed and shapes as tiny_target
    index = sharded.path / "model.safetensors.index.json"
    assert index.is_file()
    assert not (sharded.path / "model.safetensors").exists()
    shards = set(json.loads(index.read_text())["weight_map"].values())
    assert len(shards) > 1
    tokens = random_tokens(1, 9, seed=14)
    with torch.no_grad():
        a, _ = target_with_caches(sharded.path)(tokens, arange_positions(1, 0, 9))
        b, _ = target_with_caches(tiny_target.path)(tokens, arange_positions(1, 0, 9))
    ref, _ = hf_forward(sharded.hf_model, tokens)
    assert torch.equal(a, b)
    assert max_err(a, ref) <= ATOL

    # A shard named by the index but absent is named in the error.
    d = copy_target(sharded.path, tmp_path / "ckpt")
    victim = sorted(shards)[1]
    (d / victim).unlink()
    with pytest.raises(UserError, match=f"shard '{victim}' not found"):
        checkpoint.load_target(str(d))


def test_an_index_of_the_one_weight_file_beside_it_is_its_index(tiny_target, tmp_path):
    """model.safetensors with an index naming it alone (some exporters write one) is one checkpoint, as
    transformers reads it: it was refused as ambiguous. An index naming other shards beside it still is."""
    from safetensors import safe_open

    d = corrupt(tiny_target, tmp_path)
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    index = d / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {k: "model.safetensors" for k in keys}}))
    tokens = random_tokens(1, 9, seed=14)
    with torch.no_grad():
        a, _ = target_with_caches(d)(tokens, arange_positions(1, 0, 9))
        b, _ = target_with_caches(tiny_target.path)(tokens, arange_positions(1, 0, 9))
    assert torch.equal(a, b)
    edit_json(index, lambda i: i["weight_map"].update({keys[0]: "model-00001-of-00002.safetensors"}))
    with pytest.raises(UserError, match="both model.safetensors and model.safetensors.index.json are there"):
        checkpoint.load_target(str(d))


def test_a_broken_link_for_the_weights_is_named_so(tiny_target, tmp_path):
    """A snapshot whose blob is gone leaves a dangling model.safetensors link: said so, not "no weights"."""
    d = corrupt(tiny_target, tmp_path)
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").symlink_to(tmp_path / "gone-blob")
    with pytest.raises(UserError, match=r"model\.safetensors: is a broken link"):
        checkpoint.load_target(str(d))


def test_an_index_without_a_weight_map(target_factory, tmp_path):
    d = copy_target(target_factory(max_shard_size="20KB").path, tmp_path / "ckpt")
    edit_json(d / "model.safetensors.index.json", lambda index: index.update(weight_map={}))
    with pytest.raises(UserError, match="model.safetensors.index.json: missing or empty 'weight_map'"):
        checkpoint.load_target(str(d))


def test_sharded_duplicate_tensor(target_factory, tmp_path):
    """A tensor in two shards: the index maps it to one, so the other holds a tensor it does not list."""
    d = copy_target(target_factory(max_shard_size="20KB").path, tmp_path / "ckpt")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    from safetensors.torch import load_file
    first = load_file(str(d / shards[0]))
    key = next(iter(first))
    edit_tensors(d, lambda t: t.update({key: first[key]}), filename=shards[1])
    with pytest.raises(UserError, match=f"{shards[1]}: holds tensor {key!r}, but .* maps it to '{shards[0]}'"):
        checkpoint.load_target(str(d))


def test_a_tensor_spelled_twice(tiny_target, tmp_path):
    """'model.norm.weight' and 'norm.weight' name one parameter: the second is refused, not a silent overwrite."""
    d = corrupt(tiny_target, tmp_path)
    edit_tensors(d, lambda t: t.update({"norm.weight": t["model.norm.weight"] * 2}))
    with pytest.raises(UserError, match="tensors 'model.norm.weight' and 'norm.weight' are two spellings of one weight"):
        checkpoint.load_target(str(d))


def test_load_bfloat16(tiny_target):
    model = target_with_caches(tiny_target.path, dtype=torch.bfloat16)
    params = dict(model.named_parameters())
    assert params and all(p.dtype == torch.bfloat16 for p in params.values())
    assert not any(p.requires_grad for p in params.values())
    assert model.layers[0].self_attn.kv_cache.k.dtype == torch.bfloat16
    tokens = random_tokens(1, 8, seed=15)
    ref, _ = hf_forward(tiny_target.hf_model, tokens)
    with torch.no_grad():
        logits, feats = model(tokens, arange_positions(1, 0, 8), capture=(0,))
    assert logits.dtype == torch.bfloat16 and feats.dtype == torch.bfloat16
    assert torch.isfinite(logits.float()).all()
    # bf16 rounding only: close to the float32 reference relative to the logits' scale
    assert max_err(logits, ref) <= 0.1 * ref.abs().max().item()


# ----------------------------------------------------------------------------------------
# A config read into the model's arguments; a drafter attached to its target

def test_config_spellings_give_same_args(target_factory):
    nested = target_factory(rope_spelling="nested")
    top = target_factory(rope_spelling="top")
    cfg_nested = json.loads((nested.path / "config.json").read_text())
    cfg_top = json.loads((top.path / "config.json").read_text())
    assert "rope_parameters" in cfg_nested and "rope_theta" not in cfg_nested
    assert "rope_parameters" not in cfg_top and cfg_top["rope_theta"] == 10000.0
    a, b = configs.target_args(cfg_nested, 'c'), configs.target_args(cfg_top, 'c')
    assert a == b
    assert a.rope_theta == 10000.0  # not the dataclass default of 1e6
    assert (a.vocab_size, a.hidden_size, a.intermediate_size, a.num_hidden_layers) == (64, 32, 64, 3)
    assert (a.num_attention_heads, a.num_key_value_heads, a.head_dim) == (4, 2, 16)
    assert a.eos_token_ids == (IM_END_ID,)


def test_qwen3_8b_nested_rope_spelling():
    cfg = dict(QWEN3_8B_CONFIG)
    del cfg["rope_theta"], cfg["rope_scaling"]
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}
    assert configs.target_args(cfg, "c") == configs.target_args(QWEN3_8B_CONFIG, "c")


def test_capture_is_checked_when_a_drafter_is_attached(tiny_target):
    """A drafter may read layers -1 (the embeddings) .. L-2 of its target, never the last."""
    import dataclasses
    model = checkpoint.load_target(str(tiny_target.path))  # 3 layers: -1, 0, 1 allowed
    drafter = checkpoint.random_drafter(model, block_size=2, num_layers=1, rank=4)
    for ok in ([-1, 0, 1], [0]):
        drafter.cfg = dataclasses.replace(drafter.cfg, target_layer_ids=tuple(ok))
        checkpoint.attach(drafter, model)
    for bad, needle in ((2, "last layer"), (3, "outside"), (-2, "outside")):
        drafter.cfg = dataclasses.replace(drafter.cfg, target_layer_ids=(0, bad))
        with pytest.raises(UserError, match=f"^the drafter: target_layer_ids: .*{needle}"):
            checkpoint.attach(drafter, model)


# ----------------------------------------------------------------------------------------
# Tokenizer, chat template, stop tokens

def test_encode_decode_round_trip(tiny_target):
    tok = text.Tokenizer(str(tiny_target.path))
    sentence = "def x ( y ) : return x + 1"
    ids = tok.encode(sentence)
    assert len(ids) == 10 and text.Tokenizer(str(tiny_target.path)).encode("def") == [ids[0]]
    assert tok.decode(ids) == sentence
    assert tok.encode("hello world") == [tok.tok.token_to_id("hello"), tok.tok.token_to_id("world")]
    assert tok.encode("<|im_start|>user") == [IM_START_ID, tok.tok.token_to_id("user")]
    assert tok.decode([IM_END_ID]) == "<|im_end|>"  # special tokens are kept


def test_render_chat_with_template(tiny_target):
    tok = text.Tokenizer(str(tiny_target.path))
    assert tok.chat_template == QWEN3_LIKE_TEMPLATE
    out = render_chat(tok, "hello world")
    assert out == CHAT_NO_THINK.format(p="hello world")
    assert render_chat(tok, "hello world", thinking=True) == (
        "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(out)
    assert ids[0] == IM_START_ID and IM_END_ID in ids


def test_render_chat_fallback_without_template(target_factory):
    tok = text.Tokenizer(str(target_factory(chat_template=False).path))
    assert tok.chat_template is None
    assert render_chat(tok, "hello") == CHAT_NO_THINK.format(p="hello")


def test_render_chat_from_jinja_file(target_factory):
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}" \
               "{% if add_generation_prompt %} [assistant]{% endif %}"
    tok = text.Tokenizer(str(target_factory(chat_template=template, chat_template_file=True).path))
    assert render_chat(tok, "hi") == "[user] hi [assistant]"


def test_render_chat_template_error(target_factory, tmp_path):
    d = copy_target(target_factory().path, tmp_path / "ckpt")
    edit_json(d / "tokenizer_config.json",
              lambda c: c.update(chat_template="{{ raise_exception('no system role') }}"))
    with pytest.raises(UserError, match="no system role"):
        render_chat(text.Tokenizer(str(d)), "hi")


def test_missing_tokenizer(target_factory):
    d = target_factory(with_tokenizer=False).path
    with pytest.raises(UserError, match="tokenizer.json: file not found"):
        text.Tokenizer(str(d))


def _stop_ids(path):
    args = configs.target_args(json.loads((path / "config.json").read_text()), "config.json")
    return checkpoint.stop_token_ids(str(path), args)


def test_stop_token_ids_merge(target_factory):
    # generation_config [im_end, endoftext] + config im_end: deduplicated, generation order first
    assert _stop_ids(target_factory().path) == (IM_END_ID, ENDOFTEXT_ID)
    assert _stop_ids(target_factory(generation_eos_token_id=[ENDOFTEXT_ID]).path) == (ENDOFTEXT_ID, IM_END_ID)
    assert _stop_ids(target_factory(generation_eos_token_id=None).path) == (IM_END_ID,)
    assert _stop_ids(target_factory(eos_token_id=None, generation_eos_token_id=None).path) == ()
    assert _stop_ids(target_factory(eos_token_id=[IM_END_ID, ENDOFTEXT_ID],
                                    generation_eos_token_id=[ENDOFTEXT_ID, ENDOFTEXT_ID]).path) == (
        ENDOFTEXT_ID, IM_END_ID)


def test_stop_token_ids_bad_value(target_factory, tmp_path):
    d = copy_target(target_factory().path, tmp_path / "ckpt")
    write_json(d / "generation_config.json", {"eos_token_id": ["<|im_end|>"]})
    with pytest.raises(UserError, match="generation_config.json: key 'eos_token_id'"):
        _stop_ids(d)
    # a long list is cut in the line, which names the value at fault (it printed all of it: 600 KB)
    write_json(d / "generation_config.json", {"eos_token_id": [0] * 200_000 + [-1]})
    with pytest.raises(UserError, match=r"got \[0, 0, .*\(holding -1\)$") as e:
        _stop_ids(d)
    assert len(str(e.value)) < 400


# ----------------------------------------------------------------------------------------
# A JSON file that parses but is not an object is a user error too, not an AttributeError.

@pytest.mark.parametrize("filename", ["tokenizer_config.json", "generation_config.json",
                                      "model.safetensors.index.json"])
def test_non_object_json_is_a_checkpoint_error(target_factory, tmp_path, filename):
    src = target_factory(max_shard_size="20KB") if filename.startswith("model") else target_factory()
    d = copy_target(src.path, tmp_path / "ckpt")
    write_json(d / filename, [])
    with pytest.raises(UserError, match=filename):
        if filename == "tokenizer_config.json":
            text.Tokenizer(str(d))
        elif filename == "generation_config.json":
            _stop_ids(d)
        else:
            checkpoint.load_target(str(d))


def test_rope_theta_in_rope_scaling_is_read_as_transformers_reads_it(tmp_path):
    """transformers reads rope_scaling as rope_parameters, so a rope_theta there is the model's: it was left
    unread (the top-level value decoded instead, logits a few units off; without one, 'missing key'). Two
    spellings that disagree are one line, whichever they are."""
    from conftest import make_target_dir

    from support.checkpoint import load_target

    d = tmp_path / "t"
    make_target_dir(d, with_tokenizer=False, rope_theta=10000.0)

    def only_in_scaling(c):
        c["rope_scaling"] = {"rope_type": "default", "rope_theta": 5000.0}
        c.pop("rope_parameters", None)
        c.pop("rope_theta", None)

    edit_config(d, only_in_scaling)
    assert load_target(str(d)).args.rope_theta == 5000.0
    edit_config(d, lambda c: c.update(rope_theta=1e6))
    with pytest.raises(UserError, match=re.escape("conflicting values for 'rope_theta': top-level 1000000.0, "
                                                  "rope_scaling 5000.0")):
        load_target(str(d))
