"""Shared helpers for the tests: tiny random Qwen3 checkpoints built offline.

Nothing here downloads anything. A checkpoint directory is made by building a
`transformers.Qwen3ForCausalLM` with random weights and saving it, plus a word-level
`tokenizer.json`, a `tokenizer_config.json` with a small Qwen3-like chat template and a
`generation_config.json` with a list of EOS ids.

Main entry points
-----------------
- `make_target_dir(path, **options)` -> `TinyTarget(path, hf_model)`: write one checkpoint.
- `tiny_target` (session fixture): the default checkpoint, built once per session.
- `target_factory` (session fixture): `target_factory(**options)` builds a checkpoint once per
  distinct set of options and returns the cached `TinyTarget` on later calls.
- `copy_target(src, dst)`: a private copy to corrupt (never modify the cached directories).
- `edit_config(dir, fn)` / `edit_json(path, fn)`, `edit_tensors(dir, fn)`: rewrite files in place.
- `hf_forward(hf_model, tokens)`: HF logits and hidden states for reference comparisons.
- `import_model()`: the repository's `model.py` module.
- `chi2_pvalue(samples, probs)`: the goodness-of-fit test of the distribution tests.
- `run_captured(args)`: `speculate.main(args)` in-process: (exit status, stdout, stderr).

Conventions: all tiny models are float32 on CPU; `max_position_embeddings` is small (128)
so caches stay small; ids of the special tokens are fixed (see `SPECIAL_TOKENS`).
Torch runs single-threaded in the test session (set below): the models are far too small to
gain from threads, and spinning worker threads slow the suite badly on a shared, loaded CPU.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable, NamedTuple, Optional, Sequence, Union

import pytest
import torch

torch.set_num_threads(1)

# No test reaches the Hugging Face hub or reads the user's cache: the session (and every process it
# starts) sees an empty cache of its own, offline. Tests of hub ids build their own cache (test_hub.py).
_HF_HOME = tempfile.mkdtemp(prefix="dspark-tests-hf-")
atexit.register(shutil.rmtree, _HF_HOME, ignore_errors=True)
os.environ.update(HF_HOME=_HF_HOME, HF_HUB_CACHE=os.path.join(_HF_HOME, "hub"), HF_HUB_OFFLINE="1")
if "huggingface_hub.constants" in sys.modules:  # read at its import: imported already (by a plugin), set it too
    sys.modules["huggingface_hub.constants"].HF_HUB_CACHE = os.environ["HF_HUB_CACHE"]
    sys.modules["huggingface_hub.constants"].HF_HUB_OFFLINE = True

# Compiled tests keep Inductor's own cache directory (per user, under the temp dir), not the programs'
# default ~/.cache/dspark-fast/inductor: the tests never write the user's cache, and reruns stay warm.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    import getpass
    try:
        _USER = getpass.getuser()
    except (KeyError, OSError):
        _USER = f"uid_{os.getuid()}"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"torchinductor_{_USER}")

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
if str(REPO_ROOT / "scripts") not in sys.path:
    sys.path.insert(1, str(REPO_ROOT / "scripts"))  # the programs there (bench.py, loc.py, ...) import by name


def import_model():
    """The repository's `model` module (imported lazily so collection stays cheap)."""
    import model  # noqa: WPS433

    return model


# ----------------------------------------------------------------------------------------
# Vocabulary and tokenizer

#: Special tokens, always the first ids of the vocabulary, in this order.
SPECIAL_TOKENS = ("<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
UNK_ID, ENDOFTEXT_ID, IM_START_ID, IM_END_ID, THINK_ID, END_THINK_ID = range(len(SPECIAL_TOKENS))

#: Ordinary words after the special tokens; padded with `tok<N>` up to `vocab_size`.
WORDS = (
    "user", "assistant", "system", "def", "return", "if", "else", "for", "in", "while",
    "import", "print", "hello", "world", "the", "a", "is", "x", "y", "z",
    "(", ")", ":", "=", "+", "-", ",", ".",
    "0", "1", "2", "3", "4", "5", "6", "7", "8", "9",
)

#: A small Qwen3-like chat template: ChatML turns; with `enable_thinking` false the generation
#: prompt closes an empty think block, exactly like Qwen3's own template does.
QWEN3_LIKE_TEMPLATE = (
    "{%- for message in messages %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
)
#: What Qwen3's template renders for one user prompt without thinking (`{p}`: the prompt).
CHAT_NO_THINK = "<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def vocabulary(vocab_size: int) -> list[str]:
    """Exactly `vocab_size` distinct tokens: `SPECIAL_TOKENS`, then `WORDS`, then `tok<N>`."""
    if vocab_size < len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be at least {len(SPECIAL_TOKENS)}")
    vocab = list(SPECIAL_TOKENS) + list(WORDS)
    i = 0
    while len(vocab) < vocab_size:
        vocab.append(f"tok{i}")
        i += 1
    return vocab[:vocab_size]


def build_tokenizer(vocab_size: int):
    """A `tokenizers.Tokenizer`: WordLevel over `vocabulary(vocab_size)`, whitespace pre-tokenizer.

    The special tokens are registered as special added tokens so that `<|im_start|>` etc. are
    matched whole inside text (the chat template's output encodes to single ids).
    """
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel

    vocab = vocabulary(vocab_size)
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    return tok


# ----------------------------------------------------------------------------------------
# Checkpoint directories

class TinyTarget(NamedTuple):
    """A checkpoint directory and the HF model whose weights it holds (eval mode, float32)."""

    path: Path
    hf_model: "torch.nn.Module"



def make_target_dir(
    path: Union[str, os.PathLike],
    *,
    vocab_size: int = 64,
    hidden_size: int = 32,
    intermediate_size: int = 64,
    num_hidden_layers: int = 3,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    tie_word_embeddings: bool = False,
    attention_bias: bool = False,
    rope_theta: float = 10000.0,
    rope_spelling: str = "nested",
    rms_norm_eps: float = 1e-6,
    max_position_embeddings: int = 128,
    eos_token_id: Optional[Union[int, Sequence[int]]] = IM_END_ID,
    generation_eos_token_id: Optional[Sequence[int]] = (IM_END_ID, ENDOFTEXT_ID),
    seed: int = 0,
    initializer_range: float = 0.2,
    randomize_norms: bool = True,
    with_tokenizer: bool = True,
    chat_template: Union[bool, str, None] = True,
    chat_template_file: bool = False,
    max_shard_size: Optional[Union[int, str]] = None,
) -> TinyTarget:
    """Write a tiny random Qwen3 checkpoint into `path` (created if needed) and return it.

    - Weights: `Qwen3ForCausalLM` initialised under `torch.manual_seed(seed)` with
      `initializer_range` (0.2 keeps logits far from flat). With `randomize_norms` the RMSNorm
      weights (and attention biases, if any) are perturbed away from their constant init so
      that a swapped or skipped norm shows up in comparisons.
    - `rope_spelling`: "nested" keeps transformers' `rope_parameters: {rope_theta, rope_type}`;
      "top" rewrites config.json to the older spelling, a top-level `rope_theta` and no
      `rope_parameters`.
    - `eos_token_id` goes into config.json (None: the key is removed);
      `generation_eos_token_id` is written as generation_config.json's `eos_token_id` list
      (None: no generation_config.json at all).
    - `with_tokenizer`: write tokenizer.json (see `build_tokenizer`) and tokenizer_config.json.
      `chat_template`: True for `QWEN3_LIKE_TEMPLATE`, a string for that template, False/None
      for none. `chat_template_file` puts it in `chat_template.jinja` instead of
      tokenizer_config.json.
    - `max_shard_size`: passed to `save_pretrained` to produce a sharded checkpoint.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if rope_spelling not in ("nested", "top"):
        raise ValueError(f"rope_spelling must be 'nested' or 'top', not {rope_spelling!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads, head_dim=head_dim,
        tie_word_embeddings=tie_word_embeddings, attention_bias=attention_bias,
        rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta)},
        rms_norm_eps=rms_norm_eps, max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range, eos_token_id=eos_token_id,
    )
    hf = Qwen3ForCausalLM(config)
    if randomize_norms or attention_bias:
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if randomize_norms and name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.2 * torch.randn_like(p))
                elif name.endswith(".bias"):
                    p.copy_(0.2 * torch.randn_like(p))
    hf.eval()

    save_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    hf.save_pretrained(path, **save_kwargs)

    def fix_config(cfg):
        if rope_spelling == "top":
            cfg["rope_theta"] = cfg["rope_parameters"]["rope_theta"]
            del cfg["rope_parameters"]
        if eos_token_id is None:
            cfg.pop("eos_token_id", None)
    edit_config(path, fix_config)

    gen = path / "generation_config.json"
    if generation_eos_token_id is None:
        gen.unlink(missing_ok=True)
    else:
        write_json(gen, {"eos_token_id": list(generation_eos_token_id), "do_sample": False})

    if with_tokenizer:
        build_tokenizer(vocab_size).save(str(path / "tokenizer.json"))
        template = QWEN3_LIKE_TEMPLATE if chat_template is True else (chat_template or None)
        tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
                   "unk_token": "<unk>"}
        if template is not None and chat_template_file:
            (path / "chat_template.jinja").write_text(template)
        elif template is not None:
            tok_cfg["chat_template"] = template
        write_json(path / "tokenizer_config.json", tok_cfg)
    return TinyTarget(path, hf)


def copy_target(src: Union[str, os.PathLike], dst: Union[str, os.PathLike]) -> Path:
    """Copy a checkpoint directory to `dst` (which must not exist yet, or be empty) and return it."""
    dst = Path(dst)
    shutil.copytree(src, dst, dirs_exist_ok=True)
    return dst


def write_json(path: Union[str, os.PathLike], obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)


def edit_json(path: Union[str, os.PathLike], fn: Callable[[dict], object]) -> None:
    """Rewrite a JSON file: `fn` edits the parsed object in place (its return value is ignored,
    so `lambda c: c.pop("key")` works). To replace the whole file use `write_json`."""
    with open(path) as f:
        obj = json.load(f)
    fn(obj)
    write_json(path, obj)


def edit_config(directory: Union[str, os.PathLike], fn: Callable[[dict], object]) -> None:
    """`edit_json` on `directory/config.json`."""
    edit_json(Path(directory) / "config.json", fn)


def edit_tensors(directory: Union[str, os.PathLike], fn: Callable[[dict], object],
                 filename: str = "model.safetensors") -> None:
    """Rewrite a safetensors file: `fn` edits the {key: tensor} dict in place (return ignored).

    Keys are the file's own (HF spelling, e.g. "model.layers.0.mlp.up_proj.weight").
    """
    from safetensors.torch import load_file, save_file

    p = Path(directory) / filename
    tensors = load_file(str(p))
    fn(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(p), metadata={"format": "pt"})


@torch.no_grad()
def hf_forward(hf_model, tokens: torch.Tensor):
    """HF reference on `tokens` [B, T] (positions 0..T-1, no padding): (logits, hidden_states).

    `hidden_states[0]` is the embedding output, `hidden_states[i + 1]` the output of layer i.
    """
    out = hf_model(input_ids=tokens, output_hidden_states=True, use_cache=False)
    return out.logits, out.hidden_states


def gen(seed: int = 0) -> torch.Generator:
    """A CPU generator seeded with `seed`."""
    return torch.Generator().manual_seed(seed)


def random_tokens(batch: int, length: int, vocab_size: int = 64, seed: int = 0) -> torch.Tensor:
    """Deterministic random token ids [batch, length] (int64)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, length), generator=g)


def target_with_caches(path, max_batch=4, max_seq=32, **kwargs):
    """support/checkpoint.load_target, its caches set up for `max_batch` rows of `max_seq`."""
    from support import checkpoint

    model = checkpoint.load_target(str(path), **kwargs)
    model.setup_caches(max_batch, max_seq)
    return model


def arange_positions(batch: int, start: int, length: int) -> torch.Tensor:
    return torch.arange(start, start + length).expand(batch, length).contiguous()


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


# ----------------------------------------------------------------------------------------
# Running the programs in-process

def run_captured(args) -> tuple[int, str, str]:
    """speculate.main in-process on `args` (str() of each), its output captured: (exit status, stdout, stderr)."""
    import speculate

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = speculate.main([str(a) for a in args])
    return rc, out.getvalue(), err.getvalue()


# ----------------------------------------------------------------------------------------
# Fixtures

@pytest.fixture(scope="session")
def target_factory(tmp_path_factory):
    """`target_factory(**make_target_dir_options) -> TinyTarget`, memoised per option set.

    The directories are shared by the whole session: treat them as read-only (use
    `copy_target` into `tmp_path` before corrupting anything). The returned HF model is shared
    too; do not modify its weights.
    """
    cache: dict = {}

    def factory(**options) -> TinyTarget:
        key = tuple(sorted((k, repr(v)) for k, v in options.items()))
        if key not in cache:
            d = tmp_path_factory.mktemp("target")
            cache[key] = make_target_dir(d, **options)
        return cache[key]

    return factory


@pytest.fixture(scope="session")
def tiny_target(target_factory) -> TinyTarget:
    """The default tiny checkpoint (untied, nested rope spelling, 3 layers, vocab 64)."""
    return target_factory()


@pytest.fixture
def model_module():
    """The repository's `model` module."""
    return import_model()


@pytest.fixture(autouse=True)
def _keep_the_compile_cache(monkeypatch):
    """A program run with --compile-cache points Inductor at it for the rest of the process: put the
    suite's cache back after every test, or every later compile in the worker would start cold."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.environ["TORCHINDUCTOR_CACHE_DIR"])


@pytest.fixture(autouse=True)
def _fresh_wandb():
    """wandb keeps process-wide settings (its run directory among them) from its first run:
    tear it down after every test so that each test's WANDB_DIR is the one it uses."""
    yield
    if "wandb" in sys.modules:
        sys.modules["wandb"].teardown()


# ----------------------------------------------------------------------------------------
# Distribution tests

def chi2_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of integer `samples` (any shape) to `probs` [V]; cells with an expected
    count below 5 are pooled into one; a sample in a zero-probability cell gives p = 0."""
    samples = samples.reshape(-1)
    N = samples.numel()
    probs = probs.double() / probs.double().sum()
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    if bool((counts[probs == 0] > 0).any()):
        return 0.0
    expected = probs * N
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    df = obs.numel() - 1
    if df < 1:
        return 1.0
    stat = ((obs - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def make_read_only(monkeypatch, *folders):
    """Simulate read-only filesystems at `folders` (the tests run as root, whom chmod does not stop):
    os.statvfs reports them mounted read-only, which is what `trainer.folder_write_problem` reads."""
    from types import SimpleNamespace
    real, targets = os.statvfs, {os.path.realpath(f) for f in folders}

    def statvfs(path):
        st = real(path)
        return SimpleNamespace(f_flag=st.f_flag | os.ST_RDONLY) if os.path.realpath(path) in targets else st
    monkeypatch.setattr(os, "statvfs", statvfs)


def render_chat(tok, prompt, thinking=False, system=None):
    """A one-question chat through Tokenizer.render_messages (with the system turn, if any)."""
    turns = [{"role": "user", "content": prompt}]
    if system is not None:
        turns.insert(0, {"role": "system", "content": system})
    return tok.render_messages(turns, add_generation_prompt=True, thinking=thinking)


# ----------------------------------------------------------------------------------------
# Tests write into temporary folders only: the checkout must look the same after the run.

_SKIPPED_IN_CHECKOUT = {".git", "__pycache__", ".pytest_cache"}


def _checkout_files() -> set[str]:
    """Every file under the checkout, by relative path, less git's folder and Python's caches."""
    found = set()
    for folder, subfolders, files in os.walk(REPO_ROOT):
        subfolders[:] = [s for s in subfolders if s not in _SKIPPED_IN_CHECKOUT and not s.endswith(".egg-info")]
        for name in files:
            found.add(os.path.relpath(os.path.join(folder, name), REPO_ROOT))
    return found


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):  # the controlling process only, not xdist's workers
        session.config._checkout_before = _checkout_files()


def pytest_sessionfinish(session, exitstatus):
    before = getattr(session.config, "_checkout_before", None)
    if before is None:
        return
    added = sorted(_checkout_files() - before)
    if added:
        print(f"\nthe tests wrote into the checkout: {', '.join(added[:10])}", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
