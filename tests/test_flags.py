"""support/flags.py: each decode setting is declared once (`speculate.Settings`), and the command line,
the Python API, eval.py and bench.py read it with the same defaults, departing only where a program
says why (eval.py: the authors' protocol; bench.py: it times compiled rounds)."""

from __future__ import annotations

import inspect
import os
import re
from dataclasses import fields, replace

import pytest
import torch
import tyro

import eval as ev
import model
import speculate
from support import flags
from support.cli import UserError, flat_fields, free_memory, from_flat


def test_the_command_line_and_the_api_agree_on_every_default():
    parsed = tyro.cli(speculate.Args, args=[])
    assert parsed.decode == speculate.Settings()
    # generate() takes Settings' fields as keyword arguments and has no decode default of its own.
    own = set(inspect.signature(speculate.generate).parameters) - {"m", "prompts", "settings"}
    assert own == {"chat", "system_prompt", "thinking"}
    assert not own & {f.name for f in fields(speculate.Settings)}


def test_the_engine_defaults_are_the_apis_resolved_on_a_cpu():
    # Engine takes resolved settings under the engine's names; a default it has is the API's,
    # resolved as check_settings and sampling_for resolve it for a target without a generation config.
    api = flags.check_settings(speculate.Settings(), "cpu")
    models = speculate.Models(target=None, drafter=None, tokenizer=None, stop_ids=(), dtype=None)
    no_generation_config = flags.sampling_for(models, api)
    expected = {"temperature": no_generation_config.temperature, "seed": api.seed,
                "scheduler": api.scheduler, "threshold": api.confidence_threshold,
                "compile": api.compile, "compile_mode": api.compile_mode,
                "compile_verbose": api.verbose, "backend": api.kernels, "num_drafts": api.draft_length,
                "tree_budget": api.tree_budget, "tree_temperature": api.tree_temperature}
    params = inspect.signature(speculate.Engine).parameters
    defaults = {name: params[name].default for name in expected}
    assert defaults == expected


def test_eval_and_bench_depart_only_where_they_say():
    default = speculate.Settings()
    protocol = tyro.cli(ev.EvalArgs, args=[]).decode
    differ = {f.name for f in fields(default) if getattr(protocol, f.name) != getattr(default, f.name)}
    assert differ == {"temperature", "seed"} and (protocol.temperature, protocol.seed) == (1.0, ev.AUTHORS_SEED)
    import bench
    timed = tyro.cli(bench.BenchArgs, args=[]).decode
    differ = {f.name for f in fields(default) if getattr(timed, f.name) != getattr(default, f.name)}
    assert differ == {"compile"} and timed.compile is True


def test_a_prompts_file_record_cannot_set_any_decode_setting():
    """text.py lists the decode settings a record may not set (it cannot import flags.py): every one
    of Settings' fields, so a new setting is refused in a record rather than ignored as metadata."""
    from support.text import DECODE_SETTINGS, RECORD_SETTINGS

    assert DECODE_SETTINGS == tuple(f.name for f in fields(speculate.Settings))
    assert RECORD_SETTINGS["tree_budget"] == "--tree-budget"


def test_every_decode_flag_reaches_the_settings():
    argv = ["--max-new-tokens", "7", "--temperature", "0.5", "--top-k", "3", "--top-p", "0.9", "--min-p", "0.1",
            "--stop", "a", "--stop", "b", "--ignore-eos", "--seed", "4", "--num-samples", "2", "--batch-size", "3",
            "--scheduler", "threshold", "--confidence-threshold", "0.4", "--no-compile", "--kernels", "triton"]
    s = tyro.cli(speculate.Args, args=argv).decode
    assert s == speculate.Settings(max_new_tokens=7, temperature=0.5, top_k=3, top_p=0.9, min_p=0.1, stop=("a", "b"),
                                   ignore_eos=True, seed=4, num_samples=2, batch_size=3, scheduler="threshold",
                                   confidence_threshold=0.4, compile=False, kernels="triton")


def test_check_settings_resolves_defaults_without_touching_the_callers(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # "cuda" is checked as --device is
    given = speculate.Settings(confidence_threshold=0.5)
    s = flags.check_settings(given, "cpu")
    assert (s.max_new_tokens, s.scheduler, s.compile, s.stop) == (flags.DEFAULT_BUDGET, "threshold", False, ())
    assert given == speculate.Settings(confidence_threshold=0.5)
    assert flags.check_settings(speculate.Settings(), "cuda").compile is True  # on for cuda
    assert flags.check_settings(speculate.Settings(), "cpu", budget=None).max_new_tokens is None


@pytest.mark.parametrize("settings,needle", [
    (dict(max_new_tokens=0), "--max-new-tokens: invalid value 0"),
    (dict(temperature="hot"), "--temperature: invalid value 'hot' (expected a number)"),
    (dict(compile=False, compile_mode="default"), "--compile-mode default: only used with --compile"),
    (dict(compile=False, verbose=True), "--verbose: only used with --compile"),
    (dict(kernels="cuda"), "--kernels 'cuda': one of torch, triton"),
    (dict(compile="yes"), "--compile: invalid value 'yes' (True, False, or None for the default)"),
])
def test_bad_settings_are_one_line_errors(settings, needle):
    with pytest.raises(UserError, match=None) as e:
        flags.check_settings(speculate.Settings(**settings), "cpu")
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("given", [None, {"max_new_tokens": 8}])
def test_check_settings_wants_settings(given):
    """Something other than a Settings is one line (it was a TypeError from dataclasses.replace)."""
    with pytest.raises(UserError, match=re.escape(f"settings: a support.flags.Settings, got {type(given).__name__}")):
        flags.check_settings(given, "cpu")


def test_flat_groups_round_trip():
    args = from_flat(speculate.Args, {"max_new_tokens": 5, "device": "cpu", "prompt": "hi", "chat": False})
    assert args.decode.max_new_tokens == 5 and args.prompts.prompt == "hi" and args.rendering.chat is False
    values = flat_fields(args)
    assert values["max_new_tokens"] == 5 and values["prompt"] == "hi" and "decode" not in values
    with pytest.raises(TypeError, match="no flag 'nope'"):
        from_flat(speculate.Args, {"nope": 1})


def test_the_api_refuses_what_only_the_api_can_give():
    with pytest.raises(UserError, match="^generate: no prompts$"):
        flags.prompt_list([])
    s = flags.check_settings(speculate.Settings(draft_length=3), "cpu")
    with pytest.raises(UserError, match="--draft-length 3: sets how many drafts an Eagle3 drafter proposes; without a --drafter"):
        flags.check_no_drafter(s)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
@pytest.mark.parametrize("device,needle", [("gpu", "--device 'gpu': cpu, cuda or cuda:N"),
                                           ("CPU", "--device 'CPU': cpu, cuda or cuda:N"),
                                           ("cuda", "--device cuda: no CUDA device is available")])
def test_check_settings_checks_its_device_as_load_does(device, needle):
    with pytest.raises(UserError, match=f"^{re.escape(needle)}$"):
        flags.check_settings(speculate.Settings(max_new_tokens=4), device)
    with pytest.raises(UserError, match=f"^{re.escape(needle)}$"):
        speculate.load(device=device)


def test_make_engine_and_decode_refuse_settings_not_checked_for_the_models_device(monkeypatch):
    """The mark of checked settings is check_settings' own, for the models' device: hand-built settings that
    name a scheduler (they were taken unchecked), an edit of checked ones, and settings checked for cuda
    (compile resolved on) given CPU models are each one line, before any work."""
    m = speculate.load()
    prompts = [[1, 2, 3]]
    s = flags.check_settings(speculate.Settings(max_new_tokens=8), "cpu")
    engine = speculate.make_engine(m, m.drafter, prompts, s, verbose=False)
    unchecked = "settings: not checked; pass support.flags.check_settings(Settings(...), device)"
    for bad in (speculate.Settings(scheduler="none", max_new_tokens=-3), speculate.Settings(scheduler="none"),
                speculate.Settings(scheduler="none", max_new_tokens=4, batch_size=0),
                replace(s, num_samples=0)):
        with pytest.raises(UserError, match=f"^{re.escape(unchecked)}$"):
            speculate.decode(m, prompts, bad, engine)
        with pytest.raises(UserError, match=f"^{re.escape(unchecked)}$"):
            speculate.make_engine(m, m.drafter, prompts, bad, verbose=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for_cuda = flags.check_settings(speculate.Settings(max_new_tokens=4), "cuda")
    assert for_cuda.compile is True
    other = ("settings: checked for device 'cuda', and the models are on cpu; "
             "pass support.flags.check_settings(Settings(...), 'cpu')")
    with pytest.raises(UserError, match=f"^{re.escape(other)}$"):
        speculate.make_engine(m, m.drafter, prompts, for_cuda, verbose=False)
    with pytest.raises(UserError, match=f"^{re.escape(other)}$"):
        speculate.decode(m, prompts, for_cuda, engine)
    assert len(speculate.decode(m, prompts, s, engine)[0].output_ids) == 8
    edited = flags.check_settings(speculate.Settings(max_new_tokens=8), "cpu")
    edited.num_samples = 0  # in place: the mark stays, the values it was given for do not
    changed = ("settings: num_samples was changed after they were checked; "
               "pass support.flags.check_settings(Settings(...), device) again")
    with pytest.raises(UserError, match=f"^{re.escape(changed)}$"):
        speculate.decode(m, prompts, edited, engine)
    with pytest.raises(UserError, match=f"^{re.escape(changed)}$"):
        speculate.make_engine(m, m.drafter, prompts, edited, verbose=False)


def test_decode_refuses_prompts_longer_than_its_engine_was_sized_for():
    """An engine built for short prompts and reused for a longer one: one line (it was an IndexError inside
    the round); prompts it was sized for decode on it."""
    m = speculate.load()
    s = flags.check_settings(speculate.Settings(max_new_tokens=8), "cpu")
    engine = speculate.make_engine(m, m.drafter, [[1, 2, 3]], s, verbose=False)
    assert len(speculate.decode(m, [[4, 5]], s, engine)[0].output_ids) == 8
    with pytest.raises(UserError, match=r"^a 200-token prompt and --max-new-tokens 8 need \d+ cache positions a "
                                        r"row, and the engine holds \d+: make_engine for these prompts "
                                        r"\(or Engine\(max_seq=\d+\)\)$"):
        speculate.decode(m, [list(range(5, 205))], s, engine)


def test_an_engine_refuses_requests_longer_than_it_was_sized_for():
    """Engine.generate, called by hand (api.md), checks as decode does, before any round: it was an
    IndexError in the drafter after rounds had run."""
    m = speculate.load()
    engine = speculate.Engine(m.target, m.drafter, batch_size=1, max_seq=24, temperature=0.0, seed=0)
    need = speculate.cache_length(3, 30, m.drafter)
    request = speculate.Request(0, [1, 2, 3])
    with pytest.raises(UserError, match=rf"^a 3-token prompt and --max-new-tokens 30 need {need} cache positions a "
                                        rf"row, and the engine holds 24: make_engine for these prompts "
                                        rf"\(or Engine\(max_seq={need}\)\)$"):
        engine.generate([request], 30)
    assert request.output_ids == [] and request.started is None
    engine.generate([request], 24 - need + 30)
    assert len(request.output_ids) == 24 - need + 30
    # a budget of 0 decoded a token, and an empty prompt was an IndexError in the prefill
    with pytest.raises(UserError, match=r"^Engine.generate: max_new_tokens=0, an integer, at least 1$"):
        engine.generate([speculate.Request(0, [1, 2, 3])], 0)
    with pytest.raises(UserError, match=r"^Engine.generate: max_new_tokens=2.5, an integer, at least 1$"):
        engine.generate([speculate.Request(0, [1, 2, 3])], 2.5)  # decoded 3 tokens
    with pytest.raises(UserError, match=r"^Engine.generate: request 1: empty prompt$"):
        engine.generate([speculate.Request(0, [1, 2]), speculate.Request(1, [])], 4)
    # an id outside the vocabulary was an IndexError in the embedding, as documented as checked
    V = m.target.args.vocab_size
    with pytest.raises(UserError, match=rf"^Engine.generate: request 2: token id 99999 is outside the vocabulary "
                                        rf"\(0..{V - 1}\)$"):
        engine.generate([speculate.Request(2, [99999])], 4)


def test_the_caches_a_model_holds_count_as_free_for_its_next_engine(monkeypatch):
    """Load once, generate many times: the caches the last engine left on the models are reused or freed by
    the next, so they count as free. Here the device has `budget` bytes and what the models hold is in use
    (as the allocator sees it): an engine of the same size again was refused, its own caches counted."""
    import gc

    m = speculate.load()
    s = flags.check_settings(speculate.Settings(max_new_tokens=64, batch_size=4, num_samples=4), "cpu")

    def held():
        layers = list(m.target.layers) + list(m.drafter.layers)
        return sum(l.self_attn.kv_cache.k.nbytes + l.self_attn.kv_cache.v.nbytes for l in layers)

    speculate.make_engine(m, m.drafter, [[1, 2, 3]], s, verbose=False)
    need = held()
    assert need > 0
    budget = int(need / 0.9) + 1024  # room for one engine's caches
    monkeypatch.setattr(flags, "free_memory", lambda device: budget - held())
    gc.collect()
    speculate.make_engine(m, m.drafter, [[1, 2, 3]], s, verbose=False)
    bigger = flags.check_settings(speculate.Settings(max_new_tokens=128, batch_size=4, num_samples=4), "cpu")
    with pytest.raises(UserError, match="the KV caches for --batch-size 4"):
        speculate.make_engine(m, m.drafter, [[1, 2, 3]], bigger, verbose=False)


def test_the_caches_of_an_engine_the_user_keeps_count_as_used(monkeypatch):
    """docs/api.md: build an engine yourself to reuse it. While it lives its caches stay allocated, so a next
    engine of another size must fit beside them; once it is gone they count as free again, and an engine of
    the kept one's size shares its caches."""
    m = speculate.load()

    def settings(max_new_tokens):
        given = speculate.Settings(max_new_tokens=max_new_tokens, batch_size=4, num_samples=4)
        return flags.check_settings(given, "cpu")

    def held():
        layers = list(m.target.layers) + list(m.drafter.layers)
        return sum(l.self_attn.kv_cache.k.nbytes + l.self_attn.kv_cache.v.nbytes for l in layers)

    kept = speculate.make_engine(m, m.drafter, [[1, 2, 3]], settings(64), verbose=False)
    small = held()
    in_use = small  # what the allocator holds for caches: the kept engine's, and later ones'
    budget = in_use + int(1.5 * small)  # room for one more engine of the kept one's size, not twice it
    monkeypatch.setattr(flags, "free_memory", lambda device: budget - in_use)
    speculate.make_engine(m, m.drafter, [[1, 2, 3]], settings(64), verbose=False)  # shares the kept caches
    with pytest.raises(UserError, match="the KV caches for --batch-size 4"):
        speculate.make_engine(m, m.drafter, [[1, 2, 3]], settings(128), verbose=False)
    del kept
    speculate.make_engine(m, m.drafter, [[1, 2, 3]], settings(128), verbose=False)  # replaces freed caches


def test_free_memory_on_cuda_counts_what_torchs_allocator_holds_unused(monkeypatch):
    """Freed tensors stay reserved by torch's caching allocator, which reuses them: free for the caches."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (5 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 12 << 30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 9 << 30)
    assert free_memory("cuda") == 8 << 30


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="Linux's /proc/meminfo")
def test_free_memory_on_a_cpu_is_what_linux_says_is_available():
    """The memory checks compare against MemAvailable (free pages and the page cache Linux can reclaim),
    not the free pages alone, which a large page cache shrinks far below what a run can take."""
    with open("/proc/meminfo") as f:
        lines = [line for line in f if line.startswith("MemAvailable:")]
    available = int(lines[0].split()[1]) * 1024
    assert abs(free_memory("cpu") - available) < 0.05 * available


def test_a_random_preset_larger_than_free_memory_is_refused(monkeypatch):
    """--random-init's weights are counted before they are allocated: one line, not an allocator traceback."""
    from support import checkpoint

    monkeypatch.setattr(checkpoint, "free_memory", lambda device: 2**30)
    with pytest.raises(UserError, match=r"^--random-init qwen3-4b: its target's and drafter's weights need [\d.]+ "
                                        r"GiB in float32.*; 1\.0 GiB are free on cpu"):
        checkpoint.load_models(None, random_init="qwen3-4b", device="cpu", dtype="float32")


def test_a_target_directory_larger_than_free_memory_is_refused_before_reading_it(monkeypatch):
    """A checkpoint's weights in the run's dtype, with the CPU kernels' copy, are counted from its config.json
    before a weight is read (a float32 Qwen3-4B on a 24 GB CPU was killed by the OOM killer, no message)."""
    from speculate import DEMO_DIR
    from support import checkpoint

    target = f"{DEMO_DIR}/target"
    monkeypatch.setattr(checkpoint, "free_memory", lambda device: 2**20)
    monkeypatch.setattr(checkpoint, "load_target", None)  # reading the weights would be a TypeError
    with pytest.raises(UserError, match=rf"^--target {target}: its weights need [\d.]+ GiB in float32"
                                        rf".*; 0\.0 GiB are free on cpu: a narrower --dtype, or a smaller model$"):
        checkpoint.load_models(target, device="cpu", dtype="float32")


def test_a_random_preset_counts_its_drafter_and_the_cpu_kernels_copy(monkeypatch):
    """The check counts what the run holds: a memory that the target's weights alone fit in (qwen3-4b in
    float32, with a tenth to spare) is refused for the drafter beside them (and, where the CPU kernels are
    built, their copy of both), before anything is allocated."""
    from support import checkpoint

    target = checkpoint.random_target("qwen3-4b", "meta", torch.float32)
    target_bytes = sum(p.numel() for p in target.parameters()) * 4
    monkeypatch.setattr(checkpoint, "free_memory", lambda device: int(target_bytes / 0.9) + 1)
    shapes_only = checkpoint.random_target

    def random_target(preset, device, dtype, seed=0):
        assert device == "meta", "weights allocated before the memory check"
        return shapes_only(preset, device, dtype, seed)

    monkeypatch.setattr(checkpoint, "random_target", random_target)
    with pytest.raises(UserError, match=r"^--random-init qwen3-4b: its target's and drafter's weights need"):
        checkpoint.load_models(None, random_init="qwen3-4b", device="cpu", dtype="float32")


def test_a_checkpoint_pair_counts_its_drafters_files(monkeypatch):
    """A memory that the target's weights and the CPU kernels' copy fit in (with a tenth to spare) is
    refused for the drafter's tensors beside them, counted from its files' headers before a weight is read
    (the drafter was left out as "a tenth of the target or less"; a published one holds a quarter)."""
    from speculate import DEMO_DIR
    from support import checkpoint, cpu_kernels

    target = f"{DEMO_DIR}/target"
    drafter = f"{DEMO_DIR}/drafter"
    with torch.device("meta"):
        shape = model.Transformer(checkpoint.read_target_args(target))
    need = sum(p.numel() for p in shape.parameters()) * 4 + cpu_kernels.copied_bytes(shape, "cpu", torch.float32)
    monkeypatch.setattr(checkpoint, "free_memory", lambda device: int(need / 0.9) + 1)
    monkeypatch.setattr(checkpoint, "load_target", None)  # reading the weights would be a TypeError
    with pytest.raises(UserError, match=rf"^--target {target} and --drafter {drafter}: their weights need"):
        checkpoint.load_models(target, drafter, device="cpu", dtype="float32")
    assert checkpoint.stored_numbers(drafter) > 0
    assert checkpoint.stored_numbers(f"{DEMO_DIR}/nowhere") == 0  # the load says why


@pytest.mark.parametrize("drafter", ["drafter", "eagle3"])
def test_the_drafters_cpu_kernels_copy_is_counted_before_loading(drafter, monkeypatch):
    """The CPU kernels copy the drafter's linear layers as they copy the target's. The check counts that
    copy from the drafter's config and headers, as the kernels would make it of the loaded drafter; a
    memory that everything else fits in (with a tenth to spare) is refused for it."""
    from speculate import DEMO_DIR
    from support import checkpoint, cpu_kernels

    if not cpu_kernels.copies("cpu", torch.float32):
        pytest.skip(f"the CPU kernels are not built here: {cpu_kernels.unavailable()}")
    target = f"{DEMO_DIR}/target"
    drafter = f"{DEMO_DIR}/{drafter}"
    loaded = speculate.load(target, drafter, cpu_kernels=False)
    copy = cpu_kernels.copied_bytes(loaded.drafter, "cpu", torch.float32)
    assert copy > 0 and checkpoint.drafter_copied_bytes(drafter, "cpu", torch.float32) == copy
    assert checkpoint.drafter_copied_bytes(drafter, "cpu", torch.bfloat16) == 0  # the kernels take float32
    with torch.device("meta"):
        shape = model.Transformer(checkpoint.read_target_args(target))
    rest = sum(p.numel() for p in shape.parameters()) * 4 + cpu_kernels.copied_bytes(shape, "cpu", torch.float32)
    rest += checkpoint.stored_numbers(drafter) * 4
    monkeypatch.setattr(checkpoint, "free_memory", lambda device: int(rest / 0.9) + 1)
    monkeypatch.setattr(checkpoint, "load_target", None)  # reading the weights would be a TypeError
    with pytest.raises(UserError, match=rf"^--target {target} and --drafter {drafter}: their weights need"):
        checkpoint.load_models(target, drafter, device="cpu", dtype="float32")
    checkpoint.check_target_memory(target, "cpu", torch.float32, drafter, kernels=False)  # no copy, it fits
    # eval.py's second and later drafters too, and the refusal counts the copy as the kernels'
    room = checkpoint.stored_numbers(drafter) * 4 + copy // 2
    monkeypatch.setattr(checkpoint, "free_memory", lambda device: int(room / 0.9))
    with pytest.raises(UserError, match=rf"^--drafter {drafter}: its weights need [\d.]+ GiB in float32 \(the CPU "
                                        rf"kernels' copy of them [\d.]+ GiB\)"):
        ev.load_extra_drafter(drafter, loaded)


@pytest.mark.parametrize("setting,message", [
    (dict(ignore_eos="no"), "--ignore-eos: invalid value 'no' (True or False)"),
    (dict(verbose=1), "--verbose: invalid value 1 (True or False)"),
    (dict(verify_buckets=[1, 8]), "--verify-buckets: invalid value [1, 8] (a string, or None)"),
    (dict(sps_table=5), "--sps-table: invalid value 5 (a file: a str or an os.PathLike)"),
    (dict(temperature=10**400), "--temperature: invalid value"),
    (dict(top_k=10**400), "--top-k: invalid value"),
])
def test_the_api_checks_every_settings_type(setting, message):
    """A setting of the wrong type from the API is one line naming it (ignore_eos="no" ignored the EOS token
    in silence; a list of buckets, a number for a table and an integer past a float's range were
    tracebacks)."""
    with pytest.raises(UserError) as e:
        flags.check_settings(speculate.Settings(**setting), "cpu")
    assert str(e.value).startswith(message), str(e.value)


def test_the_sps_table_setting_takes_a_path_like_and_holds_a_str(tmp_path):
    """sps_table takes a pathlib.Path as load's paths do (it was refused as not a string); the checked
    settings hold its str."""
    s = flags.check_settings(speculate.Settings(scheduler="hardware", sps_table=tmp_path / "t.json"), "cpu")
    assert s.sps_table == str(tmp_path / "t.json")


@pytest.mark.parametrize("program", ["train", "bench"])
def test_train_and_bench_check_a_targets_memory_before_reading_it(program, monkeypatch, capsys, tmp_path):
    """train.py and bench.py --target read a checkpoint as speculate.py and eval.py do: counted first, one
    line where it cannot fit (they read it whole, and the OOM killer ended the run without a word)."""
    from speculate import DEMO_DIR
    from support import checkpoint

    target = f"{DEMO_DIR}/target"
    monkeypatch.setattr(checkpoint, "free_memory", lambda device: 2**20)
    monkeypatch.setattr(checkpoint, "load_target", None)  # reading the weights would be a TypeError
    if program == "train":
        import train

        monkeypatch.setattr(train, "load_target", None)
        ids = tmp_path / "ids.jsonl"
        ids.write_text('{"prompt_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9]}\n')
        rc = train.main(["--target", target, "--data-ids", str(ids), "--out", str(tmp_path / "o"), "--steps", "1"])
    else:
        from scripts import bench

        monkeypatch.setattr(bench, "load_target", None)
        rc = bench.main(["--target", target, "--drafter", f"{DEMO_DIR}/drafter", "--no-compile"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith(f"error: --target {target}"), err
    assert "GiB are free on cpu" in err[-1], err


def test_a_trees_round_bytes_by_hand():
    """Rows of the vocabulary in float32 a row: the target's logits at the N + 1 nodes; greedy with a Markov
    head, a depth's bias, logits and log-probabilities for up to N parents; sampled, the tree's q at the
    nodes and each parent's race and distribution."""
    from sampling import tree_parent_count

    m = speculate.load()
    V = m.target.args.vocab_size
    N = 16
    assert m.drafter.markov_head is not None
    assert flags.tree_round_bytes(m.target, m.drafter, N, sampled=False) == 4 * V * (N + 1 + 3 * N)
    parents = tree_parent_count(N, m.drafter.cfg.num_drafts, V)
    assert flags.tree_round_bytes(m.target, m.drafter, N, sampled=True) == 4 * V * (2 * (N + 1) + 2 * parents)
