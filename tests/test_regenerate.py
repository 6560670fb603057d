"""scripts/regenerate.py end to end on the committed demo pair: records with the conversation regenerated turn
by turn (system kept, old answers replaced), sampling settings recorded, outputs independent of batch, chunk and
shard, greedy speculative == greedy autoregressive, --resume of a killed run (exactly the conversations not done,
the same settings only), outputs checked before any work, one-line errors, and the records training a drafter
through train.py."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import shutil
import sys

import pytest
import torch
from conftest import REPO_ROOT
from test_train import run_train

import speculate

torch.set_num_threads(1)

_spec = importlib.util.spec_from_file_location("regenerate", REPO_ROOT / "scripts" / "regenerate.py")
regenerate = sys.modules["regenerate"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(regenerate)

DEMO = REPO_ROOT / "demo"
# what a run on the demo target, which has no chat template, says before it generates
CHATML_NOTE = "note: --prompts: rendered as Qwen3's ChatML, the target having no chat template\n"
PROMPTS = [
    {"turns": ["def add(a, b):", "and now subtract"]},
    {"prompt": "import os\n"},
    {"messages": [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "class Point:"},
                  {"role": "assistant", "content": "an old answer"}], "id": 7},
    {"prompt": "for i in range(10):"},
]


def argv_of(tmp_path, name, *flags, drafter=True, prompts=None) -> list[str]:
    """The command line of a run on the demo pair writing tmp_path/name (prompts.jsonl written first); `flags`
    come last, so they override."""
    pf = tmp_path / "prompts.jsonl"
    pf.write_text("".join(json.dumps(p) + "\n" for p in (prompts or PROMPTS)))
    argv = ["--target", DEMO / "target", "--prompts", pf, "--out", tmp_path / name, "--max-new-tokens", 12,
            "--no-progress", "--device", "cpu", *(["--drafter", DEMO / "drafter"] if drafter else []), *flags]
    return [str(a) for a in argv]


def regen(tmp_path, name, *flags, drafter=True, prompts=None):
    argv = argv_of(tmp_path, name, *flags, drafter=drafter, prompts=prompts)
    import tyro
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), torch.inference_mode():
        res = regenerate.run(tyro.cli(regenerate.Args, args=argv))
    return [json.loads(line) for line in open(tmp_path / name)], res


class Killed(Exception):
    """Stands for a run killed mid-way."""


def killed_run(tmp_path, monkeypatch, name, calls, *flags, prompts=None):
    """A run stopped at its `calls`-th engine.generate, as a kill stops it: its OUT.partial is left behind."""
    seen = []

    class Engine(speculate.Engine):
        def generate(self, *a, **k):
            seen.append(1)
            if len(seen) == calls:
                raise Killed
            return super().generate(*a, **k)

    with monkeypatch.context() as mp, pytest.raises(Killed):
        mp.setattr(speculate, "Engine", Engine)  # what speculate.make_engine builds
        regen(tmp_path, name, *flags, prompts=prompts)
    return tmp_path / (name + ".partial")


def test_regenerate_end_to_end_on_the_demo_pair(tmp_path):
    recs, res = regen(tmp_path, "a.jsonl", "--batch-size", 3, "--chunk-size", 3)
    assert res["conversations"] == 4 and res["responses"] == 5 and res["acceptance_length"] > 1
    assert [r["source"] for r in recs] == [f"{tmp_path / 'prompts.jsonl'}:{i}" for i in range(1, 5)]
    roles = [[m["role"] for m in r["messages"]] for r in recs]
    assert roles == [["user", "assistant", "user", "assistant"], ["user", "assistant"],
                     ["system", "user", "assistant"], ["user", "assistant"]]
    assert recs[2]["id"] == 7 and recs[2]["messages"][0]["content"] == "You write Python."
    assert recs[2]["messages"][2]["content"] != "an old answer"
    assert recs[0]["messages"][2]["content"] == "and now subtract"
    g = recs[0]["regenerated"]
    assert (g["temperature"], g["top_p"], g["top_k"], g["min_p"], g["enable_thinking"], g["max_new_tokens"]) == \
        (0.7, 0.8, 20, 0.0, False, 12)
    assert len(g["finish_reasons"]) == 2 and all(0 < n <= 12 for n in g["response_tokens"])
    # The same records whatever the batch, the chunk or the shard (per-request random streams).
    again, _ = regen(tmp_path, "b.jsonl", "--batch-size", 1, "--chunk-size", 1)
    assert again == recs
    halves = [regen(tmp_path, f"s{i}.jsonl", "--num-shards", 2, "--shard-index", i)[0] for i in (0, 1)]
    assert halves[0] + halves[1] == [recs[0], recs[2], recs[1], recs[3]]
    # Greedy: speculative decoding is lossless.
    spec, _ = regen(tmp_path, "g1.jsonl", "--temperature", 0)
    plain, _ = regen(tmp_path, "g2.jsonl", "--temperature", 0, drafter=False)
    assert [r["messages"] for r in spec] == [r["messages"] for r in plain]
    # The records train a drafter (chat path of train.py, the demo target's ChatML fallback).
    rc, out, err = run_train(["--target", DEMO / "target", "--data", tmp_path / "a.jsonl", "--out", tmp_path / "d",
                              "--steps", 2, "--seq-len", 256, "--batch-size", 2, "--block-size", 3, "--depth", 1,
                              "--markov-rank", 8])
    assert rc == 0, err
    assert "4 conversations packed into" in err and len(out["losses"]) == 2


def test_a_drafter_with_a_shorter_context_bounds_the_prompts(tmp_path):
    """The models' context is the target's and the drafter's: a conversation past the drafter's is dropped
    (counted), as one past the target's is — it stopped the whole run after loading ("exceed the drafter's
    context"), the engine refusing what speculate.py refuses."""
    drafter = tmp_path / "drafter"
    shutil.copytree(DEMO / "drafter", drafter)
    cfg = json.loads((drafter / "config.json").read_text())
    cfg["max_position_embeddings"] = 64
    (drafter / "config.json").write_text(json.dumps(cfg))
    prompts = [{"prompt": "import os\n"}, {"prompt": "x = 1\n" * 40}]
    recs, res = regen(tmp_path, "c.jsonl", "--drafter", drafter, prompts=prompts)
    assert res["conversations"] == 1 and res["dropped"] == 1 and recs[0]["source"].endswith(":1")


def test_a_signal_while_out_is_published_leaves_no_resume_file(tmp_path, monkeypatch):
    """SIGTERM between OUT's rename and its resume file's removal left OUT.partial.json beside a complete
    OUT: the two steps now happen together, then the signal acts (143)."""
    import signal
    argv = argv_of(tmp_path, "p.jsonl", "--temperature", 0)
    out, real = str(tmp_path / "p.jsonl"), os.replace

    def replace(src, dst):
        if dst == out:
            os.kill(os.getpid(), signal.SIGTERM)
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert regenerate.main(argv) == 143
    assert sorted(os.listdir(tmp_path)) == ["p.jsonl", "prompts.jsonl"]


def test_resume_continues_a_torn_partial(tmp_path, monkeypatch):
    full, _ = regen(tmp_path, "full.jsonl", "--chunk-size", 1)
    out = tmp_path / "r.jsonl"
    partial = killed_run(tmp_path, monkeypatch, "r.jsonl", 3, "--chunk-size", 1)  # in the second conversation
    assert [json.loads(line) for line in open(partial)] == full[:1]
    with open(partial, "a") as f:
        f.write('{"messages": [{"ro')  # killed mid-write
    import tqdm

    bars = []

    class Bar(tqdm.tqdm):  # what the bar was told: the resumed responses as its start, not as an update
        def __init__(self, *args, **kwargs):
            bars.append(kwargs.get("initial", 0))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(tqdm, "tqdm", Bar)
    resumed, res = regen(tmp_path, "r.jsonl", "--chunk-size", 1, "--resume")
    assert resumed == full and res["responses"] == 3  # the first conversation (two turns) was not redone
    assert bars == [2]  # an update of 2 at once set the bar's rate and ETA as if done in no time
    assert not partial.exists() and not (tmp_path / "r.jsonl.partial.json").exists() and out.exists()


def test_resume_with_the_prompts_file_named_otherwise(tmp_path, monkeypatch):
    """A run started with --prompts /abs/prompts.jsonl resumes with --prompts prompts.jsonl (the same file): the
    file is compared, and the records name, by its real path."""
    full, _ = regen(tmp_path, "full.jsonl", "--chunk-size", 1, "--max-prompts", 2)
    partial = killed_run(tmp_path, monkeypatch, "r.jsonl", 3, "--chunk-size", 1, "--max-prompts", 2)
    assert [json.loads(line) for line in open(partial)] == full[:1]
    monkeypatch.chdir(tmp_path)
    resumed, res = regen(tmp_path, "r.jsonl", "--chunk-size", 1, "--max-prompts", 2, "--resume", "--prompts",
                         "prompts.jsonl")
    assert resumed == full and res["responses"] == 1  # only the second conversation was generated
    assert [r["source"] for r in resumed] == [f"{tmp_path.resolve() / 'prompts.jsonl'}:{i}" for i in (1, 2)]


def test_resume_compares_the_models_and_prompts_by_content(tmp_path, monkeypatch):
    """A byte-identical target and prompts file resume the run, however they were copied, moved or touched
    since (it was refused: "its files changed"); the records name the prompts file the run was started with,
    whichever path each resume read it from, and are those of a run never stopped."""
    flags = ["--chunk-size", 1, "--max-prompts", 3]
    full, _ = regen(tmp_path, "full.jsonl", *flags)
    shutil.copytree(DEMO / "target", tmp_path / "t1")
    killed_run(tmp_path, monkeypatch, "r.jsonl", 3, *flags, "--target", tmp_path / "t1")  # one conversation kept
    (tmp_path / "t1").rename(tmp_path / "t2")
    for f in (tmp_path / "t2").iterdir():
        os.utime(f, ns=(1, 1))
    shutil.copyfile(tmp_path / "prompts.jsonl", tmp_path / "p2.jsonl")
    moved = ["--target", tmp_path / "t2", "--prompts", tmp_path / "p2.jsonl"]
    partial = killed_run(tmp_path, monkeypatch, "r.jsonl", 2, *flags, *moved, "--resume")  # two kept
    assert partial.read_text().count("\n") == 2
    shutil.copytree(tmp_path / "t2", tmp_path / "t3", copy_function=shutil.copyfile)
    shutil.copyfile(tmp_path / "prompts.jsonl", tmp_path / "p3.jsonl")
    copied = ["--target", tmp_path / "t3", "--prompts", tmp_path / "p3.jsonl"]
    resumed, res = regen(tmp_path, "r.jsonl", *flags, *copied, "--resume")
    assert res["responses"] == 1  # only the third conversation was generated here
    assert [(r["source"], r["messages"]) for r in resumed] == [(r["source"], r["messages"]) for r in full]


def test_out_that_is_a_link_writes_the_file_it_names(tmp_path, monkeypatch):
    """--out LINK: the partial and resume files go beside the file LINK names, a resume through the link or the
    file continues them, and the file is written, the link kept."""
    (tmp_path / "data").mkdir()
    target = tmp_path / "data" / "real.jsonl"
    target.write_text("old\n")
    (tmp_path / "link.jsonl").symlink_to(target)
    killed_run(tmp_path, monkeypatch, "link.jsonl", 3, "--chunk-size", 1, "--max-prompts", 2)
    assert (tmp_path / "data" / "real.jsonl.partial").is_file()
    assert (tmp_path / "data" / "real.jsonl.partial.json").is_file()
    assert not (tmp_path / "link.jsonl.partial").exists() and not (tmp_path / "link.jsonl.partial.json").exists()
    recs, res = regen(tmp_path, "link.jsonl", "--chunk-size", 1, "--max-prompts", 2, "--resume")
    assert len(recs) == 2 and res["responses"] == 1
    assert (tmp_path / "link.jsonl").is_symlink() and os.readlink(tmp_path / "link.jsonl") == str(target)
    assert [json.loads(line) for line in open(target)] == recs
    assert sorted(os.listdir(tmp_path / "data")) == ["real.jsonl"]


LONG = {"prompt": "x = 1 " * 40}  # over --max-context 64 less --max-new-tokens 12: dropped


def test_resume_after_drops_skips_exactly_the_conversations_done(tmp_path, monkeypatch, capsys):
    """Dropped conversations leave no line in OUT.partial; a resume neither repeats a kept conversation nor
    retries a dropped one, and its progress counts the earlier run's drops as drops, not responses."""
    prompts = [PROMPTS[1], LONG, PROMPTS[3], LONG, {"prompt": "x = "}, {"prompt": "y = "}]
    flags = ["--max-context", 64, "--chunk-size", 2]
    full, res = regen(tmp_path, "full.jsonl", *flags, prompts=prompts)
    assert [r["source"].rsplit(":", 1)[1] for r in full] == ["1", "3", "5", "6"] and res["dropped"] == 2
    partial = killed_run(tmp_path, monkeypatch, "r.jsonl", 3, *flags, prompts=prompts)  # in the third chunk
    assert [json.loads(line) for line in open(partial)] == full[:2]
    resumed, res = regen(tmp_path, "r.jsonl", *flags, "--resume", prompts=prompts)
    assert resumed == full
    assert (res["conversations"], res["responses"], res["dropped"]) == (4, 2, 2)  # nothing redone or retried
    partial = killed_run(tmp_path, monkeypatch, "p.jsonl", 3, *flags, prompts=prompts)
    argv = argv_of(tmp_path, "p.jsonl", *flags, "--resume", "--progress", prompts=prompts)
    assert regenerate.main(argv) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("regenerate.py: ")]
    assert lines[-1].startswith("regenerate.py: 4/6 responses, 2 dropped, "), lines


def test_resume_after_a_kill_before_the_resume_file_counted_a_chunk_counts_its_drops(tmp_path, monkeypatch):
    """Killed after a chunk's records were written and before the resume file counted the chunk: the resume
    generates that chunk again, the same, and counts the conversation it dropped (it took the records as
    done, and the drop went uncounted: "0 dropped")."""
    prompts = [PROMPTS[1], PROMPTS[3], LONG, {"prompt": "x = "}]
    flags = ["--max-context", 64, "--chunk-size", 2]
    full, res = regen(tmp_path, "full.jsonl", *flags, prompts=prompts)
    assert len(full) == 3 and res["dropped"] == 1
    real = regenerate.append_durably
    appends = []

    def append_then_kill(path, lines):
        real(path, lines)
        appends.append(1)
        if len(appends) == 2:  # the second chunk, [LONG, x], on disk; the resume file counts the first
            raise Killed

    with monkeypatch.context() as mp, pytest.raises(Killed):
        mp.setattr(regenerate, "append_durably", append_then_kill)
        regen(tmp_path, "r.jsonl", *flags, prompts=prompts)
    assert (tmp_path / "r.jsonl.partial").read_text().count("\n") == 3
    resumed, res = regen(tmp_path, "r.jsonl", *flags, "--resume", prompts=prompts)
    assert resumed == full
    assert (res["conversations"], res["responses"], res["dropped"]) == (3, 1, 1)


def test_a_budget_past_the_default_context_cap_names_both_ways_out(tmp_path, capsys):
    """A target whose context is past regenerate.py's 8192 cap: the budget's line names the cap, not the
    target's max_position_embeddings, and --max-context as the other way out."""
    target = tmp_path / "target"
    shutil.copytree(DEMO / "target", target)
    cfg = json.loads((target / "config.json").read_text())
    cfg["max_position_embeddings"] = 16384
    (target / "config.json").write_text(json.dumps(cfg))
    argv = argv_of(tmp_path, "o.jsonl", "--target", target, "--max-new-tokens", 8192, drafter=False)
    assert regenerate.main(argv) == 2
    assert capsys.readouterr().err == ("error: --max-new-tokens 8192: leaves no room for a prompt in regenerate.py's "
                                       "default context of 8192 tokens; give --max-new-tokens below 8192, or "
                                       "--max-context up to 16384\n")


def test_a_run_that_drops_every_conversation_is_an_error(tmp_path, capsys):
    """Every conversation dropped: one line naming the flags and the count, exit 2, no OUT (it exited 0
    with an empty OUT); the progress counts the dropped turns apart, not as responses."""
    argv = argv_of(tmp_path, "o.jsonl", "--max-context", 64, prompts=[LONG, LONG])
    assert regenerate.main(argv) == 2
    err = capsys.readouterr().err
    assert err == CHATML_NOTE + ("error: --prompts: all 2 conversations dropped (a prompt over 52 tokens: "
                                 "--max-context 64 less --max-new-tokens 12); give a smaller --max-new-tokens or a "
                                 "larger --max-context\n"), err
    assert sorted(os.listdir(tmp_path)) == ["prompts.jsonl"]
    assert regenerate.main(argv + ["--progress"]) == 2
    assert "regenerate.py: 0/2 responses, 2 dropped, 0.00/s\n" in capsys.readouterr().err


def test_a_run_that_drops_its_one_conversation_at_the_models_context_names_the_one_way_out(tmp_path, capsys):
    """The context in use is the models' whole context: a larger --max-context cannot be given, so the
    error asks for a smaller --max-new-tokens alone."""
    argv = argv_of(tmp_path, "o.jsonl", "--max-new-tokens", 2040, prompts=[PROMPTS[1]])
    assert regenerate.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(CHATML_NOTE + "error: --prompts: its one conversation dropped (a prompt over 8 tokens: the "
                          "context of 2048 less --max-new-tokens 2040); give a smaller --max-new-tokens\n"), err


def test_a_target_without_a_chat_template_says_how_the_prompts_are_rendered(tmp_path, capsys):
    """The prompts of a target with no chat template are rendered as Qwen3's ChatML, as train.py says of its
    records (regenerate.py said nothing); a target with one, nothing."""
    from conftest import QWEN3_LIKE_TEMPLATE

    assert regenerate.main(argv_of(tmp_path, "a.jsonl", drafter=False, prompts=[PROMPTS[1]])) == 0
    assert capsys.readouterr().err == CHATML_NOTE
    target = tmp_path / "t"
    shutil.copytree(DEMO / "target", target)
    (target / "chat_template.jinja").write_text(QWEN3_LIKE_TEMPLATE)
    argv = argv_of(tmp_path, "b.jsonl", "--target", target, drafter=False, prompts=[PROMPTS[1]])
    assert regenerate.main(argv) == 0
    assert capsys.readouterr().err == ""


def test_a_summary_says_why_conversations_were_dropped(tmp_path, capsys):
    argv = argv_of(tmp_path, "o.jsonl", "--max-context", 64, prompts=[LONG, PROMPTS[1]])
    assert regenerate.main(argv) == 0
    out = capsys.readouterr().out
    assert "; 1 dropped (a prompt over 52 tokens: --max-context 64 less --max-new-tokens 12); written to" in out


def test_an_interruption_names_the_partial_file_and_resume(tmp_path, monkeypatch, capsys):
    """SIGINT after a chunk was written: the line names OUT.partial and --resume (it said "what was finished
    is kept"); before any was: nothing was written."""
    import signal
    real = regenerate.append_durably

    def append_then_interrupt(path, lines):
        real(path, lines)
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(regenerate, "append_durably", append_then_interrupt)
    assert regenerate.main(argv_of(tmp_path, "o.jsonl", "--chunk-size", 1, drafter=False)) == 130
    partial = os.path.realpath(tmp_path / "o.jsonl") + ".partial"
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"interrupted by SIGINT: stopped; what was written: {partial} (rerun with --resume to continue it)")
    monkeypatch.setattr(regenerate, "append_durably", lambda path, lines: os.kill(os.getpid(), signal.SIGINT))
    assert regenerate.main(argv_of(tmp_path, "p.jsonl", "--chunk-size", 1, drafter=False)) == 130
    assert capsys.readouterr().err.splitlines()[-1] == "interrupted by SIGINT: stopped; nothing was written"


def test_too_many_turns_names_the_record(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(regenerate, "TURN_STRIDE", 1)
    assert regenerate.main(argv_of(tmp_path, "o.jsonl", prompts=PROMPTS[:1])) == 2
    err = capsys.readouterr().err
    assert err == (f"error: {tmp_path / 'prompts.jsonl'}:1: the conversation has 2 user turns; "
                   "regenerate.py takes at most 1\n"), err


def test_resume_of_a_finished_run_is_refused(tmp_path, capsys):
    """--resume with OUT written and no OUT.partial: nothing was interrupted, so one line and OUT kept (the
    run was done again from the start, in silence, and replaced it)."""
    regen(tmp_path, "o.jsonl", "--temperature", 0)
    done = (tmp_path / "o.jsonl").read_bytes()
    assert regenerate.main(argv_of(tmp_path, "o.jsonl", "--temperature", 0, "--resume")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --resume: {tmp_path / 'o.jsonl'} is a finished run's output, and there is no "
                   f"{tmp_path / 'o.jsonl.partial'} to continue; leave out --resume to generate it again"], err
    assert (tmp_path / "o.jsonl").read_bytes() == done


def test_resume_of_a_run_killed_while_publishing_out_is_refused(tmp_path, monkeypatch, capsys):
    """Killed between OUT's rename and its resume file's removal: the resume file left beside OUT counts every
    conversation, so --resume refuses as for a finished run, OUT kept, and removes that file (the whole run
    was generated again and OUT replaced)."""
    out, real = str(tmp_path / "o.jsonl"), os.replace

    def replace_then_kill(src, dst):
        real(src, dst)
        if dst == out:
            raise Killed

    with monkeypatch.context() as mp, pytest.raises(Killed):
        mp.setattr(os, "replace", replace_then_kill)
        regen(tmp_path, "o.jsonl", "--temperature", 0)
    assert sorted(os.listdir(tmp_path)) == ["o.jsonl", "o.jsonl.partial.json", "prompts.jsonl"]
    done = (tmp_path / "o.jsonl").read_bytes()
    assert regenerate.main(argv_of(tmp_path, "o.jsonl", "--temperature", 0, "--resume")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --resume: {out} is a finished run's output, and there is no "
                   f"{out}.partial to continue; leave out --resume to generate it again"], err
    assert (tmp_path / "o.jsonl").read_bytes() == done
    assert sorted(os.listdir(tmp_path)) == ["o.jsonl", "prompts.jsonl"]


def test_resume_of_a_run_killed_before_its_first_record_starts_afresh_beside_an_earlier_out(tmp_path, monkeypatch):
    """An earlier run's OUT, and a later run's resume file counting no conversation (killed before its first
    record): --resume generates the run, as it was asked to, rather than refusing it as finished."""
    regen(tmp_path, "o.jsonl", "--temperature", 0)
    killed_run(tmp_path, monkeypatch, "o.jsonl", 1, "--temperature", 0)
    assert json.loads((tmp_path / "o.jsonl.partial.json").read_text())["consumed"] == 0
    recs, res = regen(tmp_path, "o.jsonl", "--temperature", 0, "--resume")
    assert res["conversations"] == len(PROMPTS) and not (tmp_path / "o.jsonl.partial.json").exists()


def test_resume_refuses_to_mix_runs(tmp_path, monkeypatch, capsys):
    """A resume with other settings, other prompts (named or edited) or another model (by content), or without
    the drafter: one line naming the flag, OUT.partial kept as it was."""
    target = tmp_path / "target"
    shutil.copytree(DEMO / "target", target)
    (tmp_path / "other.jsonl").write_text(json.dumps({"prompt": "x"}) + "\n")
    shutil.copytree(DEMO / "drafter", tmp_path / "drafter")
    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    (tmp_path / "drafter" / "config.json").write_text(json.dumps(config, indent=1))  # the same model, other bytes
    partial = killed_run(tmp_path, monkeypatch, "o.jsonl", 3, "--chunk-size", 1, "--target", target)
    kept = partial.read_text()
    assert kept.count("\n") == 1

    def refused(*flags, prompts=None, drafter=True, needle):
        argv = argv_of(tmp_path, "o.jsonl", "--chunk-size", 1, "--target", target, "--resume", *flags, prompts=prompts,
                       drafter=drafter and "--drafter" not in flags)  # one --drafter: a second is refused
        capsys.readouterr()
        assert regenerate.main(argv) == 2, flags
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], (flags, err)
        assert partial.read_text() == kept

    refused("--temperature", 0, needle=f"--temperature 0.0: {partial} was started with --temperature 0.7; ")
    refused("--seed", 5, needle="--seed 5: ")
    # started without --dtype on a CPU: float32, as it resolved there
    refused("--dtype", "bfloat16", needle=f"--dtype bfloat16: {partial} was started with --dtype float32; ")
    refused("--top-k", 5, needle="--top-k 5: ")
    refused("--max-context", 100, needle="--max-context 100: ")
    refused("--max-prompts", 3, needle="--max-prompts 3: ")
    prompts = tmp_path / "prompts.jsonl"
    refused("--prompts", tmp_path / "other.jsonl",
            needle=f"--prompts {tmp_path / 'other.jsonl'}: its records differ from those {partial} was started "
                   f"with ({prompts}); restore them, or remove {partial} to start over")
    refused("--drafter", tmp_path / "drafter", needle=f"--drafter {tmp_path / 'drafter'}: its files differ from those ")
    refused(drafter=False, needle=f"--drafter (not given): {partial} was started with --drafter {DEMO / 'drafter'}; ")
    refused(prompts=PROMPTS[:3] + [{"prompt": "while True:"}],  # a prompt edited
            needle=f"--prompts {prompts}: its records differ from those ")
    with open(target / "model.safetensors", "r+b") as f:  # the model replaced in place: its last weight's last byte
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    refused(needle=f"--target {target}: its files differ from those {partial} was started with ({target}); ")


def test_a_resume_compares_the_dtype_a_run_resolved(tmp_path, monkeypatch):
    """Not given, --dtype is float32 on a CPU: a resume that names it continues the run. (Compared as given,
    it was refused here, and a run started on a CPU resumed on a GPU in bfloat16 unseen.)"""
    partial = killed_run(tmp_path, monkeypatch, "o.jsonl", 3, "--chunk-size", 1)
    assert partial.read_text().count("\n") == 1
    records, _ = regen(tmp_path, "o.jsonl", "--chunk-size", 1, "--resume", "--dtype", "float32")
    whole, _ = regen(tmp_path, "whole.jsonl", "--chunk-size", 1)
    assert records == whole


@pytest.mark.parametrize("files,flags,needle", [
    ({}, ["--out", "p.jsonl"], "--out p.jsonl: is an input of this run (p.jsonl)"),
    ({"q.jsonl": '{"prompt": "y"}\n'}, ["--prompts", "q.jsonl,p.jsonl", "--out", "p.jsonl"],
     "--out p.jsonl: is an input"),
    ({"o.jsonl.partial": '{"prompt": "y"}\n'}, ["--prompts", "o.jsonl.partial"],
     "o.jsonl.partial: is an input of this run"),
    ({"o.jsonl.partial/": ""}, [], "o.jsonl.partial: is a directory"),
    ({"o.jsonl.partial.json/": ""}, [], "o.jsonl.partial.json: is a directory"),
    ({"o.jsonl.partial": "{}\n"}, [], "o.jsonl.partial: holds an earlier run's output; pass --resume"),
    ({"o.jsonl.partial": '{"mess'}, [], "o.jsonl.partial: holds an earlier run's output; pass --resume"),
    ({"o.jsonl.partial": '{"source": "p.jsonl:1"}\n'}, ["--resume"], "o.jsonl.partial.json: not found"),
    # counts the summary prints as the run's: none negative, a boolean or more dropped than consumed
    *[({"o.jsonl.partial": '{"source": "p.jsonl:1"}\n',
        "o.jsonl.partial.json": json.dumps({"resume_key": {}, "consumed": consumed, "dropped": dropped})},
       ["--resume"], "o.jsonl.partial.json: not a resume file of regenerate.py")
      for consumed, dropped in ((2, -7), (2, True), (True, 0), (1, 10**22))],
    # a resume file that keyed the models by their files' dates
    ({"o.jsonl.partial": '{"source": "p.jsonl:1"}\n',
      "o.jsonl.partial.json": json.dumps({"resume_key": {"--target": "/m", "--target files": {"config.json": [1, 2]}},
                                          "consumed": 1, "dropped": 0})},
     ["--resume"], "o.jsonl.partial.json: written by an older regenerate.py, which keyed the models by their files' "
                   "dates; finish "),
])
def test_outputs_are_checked_before_the_models_load(tmp_path, capsys, monkeypatch, files, flags, needle):
    """No input overwritten, an earlier run's work not truncated, a directory in the way said: before any work."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(regenerate, "load_models", None)  # loading the models would be a TypeError
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "x"}) + "\n")
    for name, text in files.items():
        if name.endswith("/"):
            (tmp_path / name).mkdir()
        else:
            (tmp_path / name).write_text(text)
    before = {f: f.read_bytes() for f in tmp_path.iterdir() if f.is_file()}
    argv = ["--target", DEMO / "target", "--prompts", "p.jsonl", "--out", "o.jsonl", "--max-new-tokens", 12,
            "--no-progress", "--device", "cpu", *flags]
    assert regenerate.main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err
    assert {f: f.read_bytes() for f in tmp_path.iterdir() if f.is_file()} == before


@pytest.mark.parametrize("flags,needle", [
    (["--shard-index", 2, "--num-shards", 2], "--shard-index: invalid value 2"),
    (["--max-context", 12], "--max-context 12: must exceed --max-new-tokens 12"),
    (["--max-context", 4096], "fit the models' context of 2048 (max_position_embeddings of the target)"),
    # --max-context not given: the budget is what leaves no room (it blamed --max-context 2048)
    (["--max-new-tokens", 4096], "error: --max-new-tokens 4096 (regenerate.py's default): leaves no room for a "
     "prompt in the context of 2048 tokens (max_position_embeddings of the target); give --max-new-tokens below 2048"),
    (["--drafter", DEMO / "drafter", "--max-new-tokens", 2048], "error: --max-new-tokens 2048: leaves no room for a "
     "prompt in the context of 2048 tokens (max_position_embeddings of the target and the drafter); give"),
    (["--temperature", -1], "--temperature: invalid value -1.0"),
    # None is not regenerate.py's default for these (was a TypeError traceback for --max-new-tokens)
    (["--max-new-tokens", "None"], "--max-new-tokens: invalid value None"),
    (["--temperature", "None"], "--temperature: invalid value None"),
    (["--chunk-size", 0], "--chunk-size: invalid value 0"),
    (["--num-samples", 2], "--num-samples: regenerate.py decodes with --max-new-tokens, --temperature"),
    (["--stop", "x"], "--stop: regenerate.py decodes with"),
    (["--prompts", "nope.jsonl"], "--prompts nope.jsonl: file not found"),
    (["--prompts", "bad.jsonl"], "bad.jsonl:1: 'turns' must be a non-empty list of strings"),
    # its conversations would be written twice (a link to it is the same file)
    (["--prompts", "p.jsonl,./p.jsonl"], "--prompts p.jsonl,./p.jsonl: names p.jsonl twice"),
])
def test_bad_inputs_are_one_line_errors(tmp_path, capsys, monkeypatch, flags, needle):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "x"}) + "\n")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"turns": []}) + "\n")
    argv = ["--target", DEMO / "target", "--prompts", "p.jsonl", "--out", "o.jsonl", "--max-new-tokens", 12,
            "--no-progress", "--device", "cpu", *flags]
    assert regenerate.main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err


@pytest.mark.parametrize("record,needle", [
    ('{"prompt": "a\\udc80"}', "bad.jsonl:1: the text is not valid Unicode"),  # was a TypeError traceback
    ('{"prompt": ""}', "bad.jsonl:1: empty user turn"),  # was answered, as speculate.py refuses to
    ('{"turns": ["hi", "  "]}', "bad.jsonl:1: empty user turn"),
    ('{"messages": [{"role": "user", "content": "\\n"}]}', "bad.jsonl:1: empty user turn"),
    # two prompts in one record, or one of the wrong shape: one was answered and the other dropped
    ('{"turns": ["def foo"], "prompt": "class Bar"}', "bad.jsonl:1: a record gives one prompt, and this one has "
                                                    "turns and prompt"),
    ('{"messages": [{"role": "user", "content": "x"}], "conversations": []}', "has messages and conversations"),
    ('{"turns": [5]}', "bad.jsonl:1: 'turns' must be a non-empty list of strings"),
    ('{"prompt": 5}', "bad.jsonl:1: 'prompt' must be a string"),
    # ShareGPT's turns: named under the record's key, and said not to be read
    ('{"conversations": [{"from": "human", "value": "hi"}]}', "bad.jsonl:1: 'conversations' must be a list of "
     '{"role": system/user/assistant, "content": str} turns (ShareGPT\'s {"from", "value"} turns are not read)'),
    # plain text, not JSON lines: said so, with the records a line may hold
    ("write a poem", "bad.jsonl:1: malformed JSON (Expecting value at column 1); the file looks like plain text, "
     'not JSON lines: write one JSON object per line, each one of {"turns": [str]}, {"prompt": str} or'),
    # a JSON array of records on one line, as a dataset export writes it
    ('[{"prompt": "a"}, {"prompt": "b"}]', "bad.jsonl:1: a JSON array, not a record: write one record per line "
     '(JSON lines), each one of {"turns": [str]}, {"prompt": str} or'),
])
def test_bad_prompt_records_are_one_line_errors(tmp_path, capsys, monkeypatch, record, needle):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.jsonl").write_text(record + "\n")
    argv = ["--target", DEMO / "target", "--prompts", "bad.jsonl", "--out", "o.jsonl", "--max-new-tokens", 12,
            "--no-progress", "--device", "cpu"]
    assert regenerate.main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.parametrize("record,needle", [
    # a dataset's system prompt: it never reached the target, and the record had no system turn
    ('{"prompt": "hi", "system": "be brief"}', "bad.jsonl:1: a record cannot set 'system'; give it as a system "
     'message in "messages" (other keys are metadata, ignored)'),
    ('{"prompt": "hi", "temperature": 0.3}', "bad.jsonl:1: a record cannot set 'temperature'; that is the run's "
     "--temperature (other keys"),
    ('{"prompt": "hi", "max_tokens": 5}', "a record cannot set 'max_tokens'; that is the run's --max-new-tokens"),
    ('{"prompt": "hi", "n": 2}', "a record cannot set 'n'; regenerate.py sets it for every record or not at all"),
    ('{"prompt": "hi", "tools": [{"type": "function"}]}', 'bad.jsonl:1: tools [{"type": "function"}] is not '
     "applied here (no such control in this decoding); drop it"),
])
def test_a_record_key_for_what_the_run_sets_is_a_one_line_error(tmp_path, capsys, monkeypatch, record, needle):
    """A record's system prompt, decode setting or request option was dropped in silence, where
    speculate.py's prompts file refuses it; the error says where it goes for regenerate.py."""
    test_bad_prompt_records_are_one_line_errors(tmp_path, capsys, monkeypatch, record, needle)


def test_a_record_key_that_asks_for_nothing_is_metadata(tmp_path):
    """A null setting (a table's empty column) or a request option at the value that asks for nothing is
    read as speculate.py reads it: the prompt alone."""
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "hi", "system": None, "temperature": None, "tools": []}) + "\n")
    [(_, _, messages, _)] = regenerate.read_conversations(str(path))
    assert messages == [{"role": "user", "content": "hi"}]


def test_a_resumed_runs_summary_says_which_figures_are_its_own(capsys):
    """The conversations and drops count the file written; responses, tokens and tokens/s are this run's, and
    a resumed run says how many conversations it took over."""
    stats = {"conversations": 4, "responses": 2, "tokens": 30, "dropped": 2}
    regenerate.print_summary(stats, 3.0, None, "why", "o.jsonl", resumed=2)
    regenerate.print_summary(stats, 3.0, None, "why", "o.jsonl", resumed=0)
    resumed, fresh = capsys.readouterr().out.splitlines()
    assert resumed.startswith("4 conversations (2 from the run resumed; this run generated 2 responses, 30 tokens) "
                              "in 3.0 s, "
                              "10.0 tokens/s; 2 dropped")
    assert fresh.startswith("4 conversations (generated 2 responses, 30 tokens) in 3.0 s, 10.0 tokens/s; 2 dropped")


def test_progress_off_a_terminal_is_lines_not_bar_frames(tmp_path, capsys, monkeypatch):
    """A long regeneration's stderr is often a log file: there the progress is a plain line (the last one at
    the end) with the rate and the time to go, not tqdm's carriage-return frames; it came once a chunk of
    256 conversations, however long that took, and with neither figure."""
    argv = argv_of(tmp_path, "o.jsonl", "--progress")
    assert regenerate.main(argv) == 0
    err = capsys.readouterr().err
    total = sum(len(p.get("turns", [1])) for p in PROMPTS)
    assert re.search(rf"regenerate.py: {total}/{total} responses, [\d.]+/s, 0.0 min to go\n", err), err
    assert "\r" not in err, err
    # within a chunk, not once a chunk: each response may say it (at most once a minute; here every time)
    monkeypatch.setattr(regenerate.runlog.Lines, "__init__", lambda self, every=60.0: setattr(self, "every", 0.0)
                        or setattr(self, "last", 0.0))
    assert regenerate.main(argv_of(tmp_path, "p.jsonl", "--progress", "--chunk-size", 256)) == 0
    err = capsys.readouterr().err
    done = [int(x) for x in re.findall(rf"regenerate.py: (\d+)/{total} responses", err)]
    assert done[:total] == list(range(1, total + 1)), err


def test_an_interruption_line_starts_below_the_bar(tmp_path, monkeypatch):
    """On a terminal the bar is closed before the interruption's line, which starts a line of its own (it
    was written after the bar's last frame, and the bar drawn again below it)."""
    import signal

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    class Engine(speculate.Engine):
        def generate(self, *a, **k):
            done = super().generate(*a, **k)
            os.kill(os.getpid(), signal.SIGINT)  # after the first chunk's first turn
            return done

    monkeypatch.setattr(speculate, "Engine", Engine)
    err = Terminal()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = regenerate.main(argv_of(tmp_path, "o.jsonl", "--progress", "--chunk-size", 1))
    lines = err.getvalue().split("\n")
    assert rc == 130 and lines[-1] == "" and lines[-2].startswith("interrupted by SIGINT"), err.getvalue()


def test_two_runs_writing_one_out_at_once_are_refused(tmp_path, monkeypatch, capsys):
    """A run whose OUT.partial another run holds (a job submitted twice, one --out for two shards) is refused
    in one line, the other's records untouched; under torchrun, where every rank would write the same
    conversations to one --out, the run is refused before any work (both reported success with most of the
    records lost). The lock is taken before OUT.partial is read (a --resume that read it first, then found
    it published, padded a new one with NULs over the finished OUT); without locks, the run goes on."""
    import fcntl

    argv = argv_of(tmp_path, "o.jsonl", "--temperature", 0)
    partial = tmp_path / "o.jsonl.partial"
    partial.write_text("")
    with open(partial, "a") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)  # the other run's
        assert regenerate.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"error: --out {tmp_path / 'o.jsonl'}: another run is writing it now ({partial} is "
                       "locked); give each run its own --out"], err
    assert partial.read_text() == "" and not (tmp_path / "o.jsonl").exists()
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert regenerate.main(argv) == 2
    assert "not under torchrun" in capsys.readouterr().err
    monkeypatch.delenv("WORLD_SIZE")
    # the lock is taken before OUT.partial is read: a run that stops before its first record leaves none
    monkeypatch.setattr(regenerate, "load_models", lambda *a, **k: (_ for _ in ()).throw(regenerate.UserError("x")))
    partial.unlink()
    assert regenerate.main(argv) == 2 and not partial.exists()
    monkeypatch.undo()
    # the other run published (renamed) OUT.partial between this one's open and its lock: refused
    real_flock = fcntl.flock

    def published_first(fd, how):
        os.replace(partial, tmp_path / "o.jsonl")
        partial.write_text("")
        real_flock(fd, how)

    monkeypatch.setattr(regenerate.fcntl, "flock", published_first)
    capsys.readouterr()
    assert regenerate.main(argv) == 2 and "another run is writing it now" in capsys.readouterr().err
    monkeypatch.undo()
    # a filesystem without locks: the run goes on, unguarded, and says so
    def no_locks(fd, how):
        raise OSError(37, "No locks available")

    monkeypatch.setattr(regenerate.fcntl, "flock", no_locks)
    partial.unlink()
    assert regenerate.main(argv) == 0 and (tmp_path / "o.jsonl").exists() and not partial.exists()
    assert "cannot be locked (No locks available)" in capsys.readouterr().err


def test_prompt_files_may_be_listed_with_spaces(tmp_path):
    """--prompts "a.jsonl, b.jsonl" reads both, as eval.py's --datasets takes its list (the second was
    " b.jsonl", not found)."""
    (tmp_path / "a.jsonl").write_text(json.dumps({"prompt": "import os\n"}) + "\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"prompt": "def add(a, b):"}) + "\n")
    convs = regenerate.read_conversations(f"{tmp_path / 'a.jsonl'}, {tmp_path / 'b.jsonl'}")
    assert [where for where, *_ in convs] == [f"{tmp_path / 'a.jsonl'}:1", f"{tmp_path / 'b.jsonl'}:1"]


def test_records_are_utf8_whatever_the_locale(tmp_path):
    """The records are appended as UTF-8, as every other output file is: under an ASCII locale the first
    non-ASCII character was a UnicodeEncodeError after the whole chunk had been generated."""
    import subprocess

    out = tmp_path / "r.jsonl"
    code = ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('regenerate', {str(REPO_ROOT / 'scripts' / 'regenerate.py')!r})\n"
            "module = sys.modules['regenerate'] = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(module)\n"
            f"module.append_durably({str(out)!r}, ['{{\"text\": \"\\u00e9\"}}\\n'])\n")  # ASCII source
    env = dict(os.environ, LC_ALL="C", LANG="C", PYTHONUTF8="0", PYTHONCOERCECLOCALE="0")
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO_ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert out.read_bytes() == '{"text": "é"}\n'.encode("utf-8")


def test_a_response_cut_inside_a_character_leaves_its_first_bytes_out():
    """A "length" cut in the middle of a character's bytes: the record's text ends before the character,
    not with U+FFFD; a response ended by its stop token, or holding bytes that are not UTF-8, is kept."""
    from types import SimpleNamespace

    class Tok:  # one token a byte
        def decode(self, ids):
            return bytes(ids).decode("utf-8", errors="replace")

    def answer(data: bytes, finish_reason: str) -> str:
        c = {"history": [], "finish": [], "ntok": []}
        req = SimpleNamespace(output_ids=list(data), finish_reason=finish_reason)
        stats = {"responses": 0, "tokens": 0}
        regenerate.add_answers([c], [req], SimpleNamespace(tokenizer=Tok()), stats)
        assert c["ntok"] == [len(data) - (finish_reason == "stop")] and stats["tokens"] == len(data)
        return c["history"][0]["content"]

    assert answer("ok \u4e2d".encode()[:-1], "length") == "ok "
    assert answer("ok \U0001f600".encode()[:-1], "length") == "ok "
    assert answer("ok \u00e9".encode()[:-1], "length") == "ok "
    assert answer("ok \u4e2d".encode(), "length") == "ok \u4e2d"
    assert answer(b"ok \xff\xff\xff\xff", "length") == "ok \ufffd\ufffd\ufffd\ufffd"
    assert answer("\u4e2d".encode()[:2], "length") == ""
    assert answer("ok \u4e2d".encode()[:-1] + b"\x00", "stop") == "ok \ufffd"

    class Merged(Tok):  # id 1000: a space and the first byte of "é", as a byte-level vocabulary may hold
        def decode(self, ids):
            data = b"".join(b" \xc3" if i == 1000 else bytes([i]) for i in ids)
            return data.decode("utf-8", errors="replace")

    c = {"history": [], "finish": [], "ntok": []}
    req = SimpleNamespace(output_ids=list(b"word") + [1000], finish_reason="length")
    regenerate.add_answers([c], [req], SimpleNamespace(tokenizer=Merged()), {"responses": 0, "tokens": 0})
    assert c["history"][0]["content"] == "word "  # the token's space stays (it lost the whole token)


def test_a_null_key_in_a_record_counts_as_absent(tmp_path):
    """A JSON-lines export of a table writes every column on every row, an empty one as null: a record
    with a prompt and null turns is one prompt, as speculate.py reads it (it was "gives one prompt, and this
    one has turns and prompt")."""
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"turns": None, "prompt": "import os\n", "messages": None}) + "\n")
    [(where, _, messages, turns)] = regenerate.read_conversations(str(path))
    assert where == f"{path}:1" and messages == [{"role": "user", "content": "import os\n"}] and turns == 1
