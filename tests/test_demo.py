"""The committed demo pair (demo/, made by scripts/train_demo.sh) and `python speculate.py` with no flags."""

from __future__ import annotations

import json
import os
import signal

import torch
from conftest import REPO_ROOT

import speculate
from support.checkpoint import load_drafter, load_target
from support.flags import DEMO_PROMPT, Prompts
from support.text import Tokenizer

DEMO = REPO_ROOT / "demo"


def test_demo_pair_loads_strictly():
    target = load_target(str(DEMO / "target"))  # strict: every tensor, every shape
    drafter = load_drafter(str(DEMO / "drafter"), target)
    tok = Tokenizer(str(DEMO / "target"))
    assert tok.chat_template is None  # prompts go in raw
    assert tok.decode(tok.encode(DEMO_PROMPT)) == DEMO_PROMPT
    assert target.args.vocab_size == tok.tok.get_vocab_size(with_added_tokens=True)
    assert drafter.cfg.confidence_head and drafter.cfg.num_drafts >= 4
    size = sum(os.path.getsize(p) for p in DEMO.rglob("*") if p.is_file())
    assert size <= 25 * 2 ** 20, size
    held = (DEMO / "heldout.txt").read_text().split()
    assert "shutil.py" in held  # the default prompt's source file was not trained on


def test_speculate_without_flags_runs_the_demo(capsys):
    """The demo's prompt (shutil.copyfileobj's signature) and the 20 held-out prompts, each decoded
    without and with the drafter: one completion printed per block, the others counted, and the
    figures of all 21 (held-out prompts: 64 tokens each; 128 new tokens)."""
    assert speculate.main([]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == "--- prompt 1 of 21 (the figures cover all 21: this one, then the 20 of demo/heldout.jsonl) ---"
    assert lines[1] == DEMO_PROMPT.splitlines()[0]
    ar = [l for l in lines if l.startswith("autoregressive:")]
    sp = [l for l in lines if l.startswith("speculative:")]
    assert len(ar) == 1 and len(sp) == 1 and "tokens/s" in ar[0] and "τ=" in sp[0]
    held = sum(1 for _ in open(DEMO / "heldout.jsonl"))
    tokens = 128 * (1 + held)
    assert ar[0].startswith(f"autoregressive: {tokens} tokens") and sp[0].startswith(f"speculative: {tokens} tokens")
    assert [l for l in lines if l.startswith("--- request")] == [
        "--- request 1 of 21 (prompt 1): 128 tokens, length, τ 1.00 ---", lines[lines.index("--- speculative ---") + 1]]
    # --output-file keeps the speculative decode's completions, not the baseline's
    assert lines.count(f"({held} more completions not shown)") == 1
    assert lines.count(f"({held} more completions not shown; --output-file FILE keeps every one)") == 1
    assert any(l.startswith("speed-up:") and l.endswith("identical: True)") for l in lines), out


def test_the_demo_with_an_output_file_names_it_for_the_completions_not_shown(tmp_path, capsys):
    """With --output-file given, the speculative block says where every completion is (it told the user
    to give the flag they gave); the baseline's, written nowhere, says nothing."""
    out = tmp_path / "o.jsonl"
    assert speculate.main(["--max-new-tokens", "4", "--output-file", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    held = sum(1 for _ in open(DEMO / "heldout.jsonl"))
    assert lines.count(f"({held} more completions not shown)") == 1
    assert lines.count(f"({held} more completions not shown; {out} has every one)") == 1
    assert len(out.read_text().splitlines()) == held + 1


def test_the_demos_baseline_summary_names_its_own_schedule(monkeypatch, capsys):
    """The autoregressive baseline schedules nothing: its summary (logged to W&B) said the speculative run's
    scheduler."""
    from support import report

    said = {}
    real = report.summarize

    def summarize(completions, engine, scheduler, tokens_per_second):
        said[engine.drafter is None] = scheduler
        return real(completions, engine, scheduler, tokens_per_second)

    monkeypatch.setattr(report, "summarize", summarize)
    assert speculate.main(["--prompt-ids", "1,2,3", "--max-new-tokens", "6", "--confidence-threshold", "0.75"]) == 0
    capsys.readouterr()
    assert said == {True: "none", False: "threshold"}


def test_demo_greedy_speculative_equals_autoregressive(tmp_path):
    trace = tmp_path / "t.jsonl"
    args = speculate.Args(decode=speculate.Settings(max_new_tokens=48), trace_file=str(trace))
    with torch.inference_mode():
        summary = speculate.run(args)
    assert args.target is None and args.prompts.prompt is None  # the demo defaults do not rewrite the caller's Args
    assert args.decode == speculate.Settings(max_new_tokens=48)
    assert summary["acceptance_length"] > 1.0
    tok = Tokenizer(str(DEMO / "target"))
    with torch.inference_mode():  # the same as asking for the demo pair and prompt by name
        ids = ",".join(map(str, tok.encode(DEMO_PROMPT)))
        named = speculate.run(speculate.Args(target=str(DEMO / "target"), drafter=str(DEMO / "drafter"),
                                             prompts=Prompts(prompt_ids=ids),
                                             decode=speculate.Settings(max_new_tokens=48)))
    assert len(summary["outputs"]) == 1 + sum(1 for _ in open(DEMO / "heldout.jsonl"))
    assert named["outputs"] == summary["outputs"][:1]  # the demo prompt first, then the held-out ones
    rows = [json.loads(l) for l in open(trace)]
    assert any("output_ids" in r for r in rows)


def test_drafter_without_target_is_still_an_error(capsys):
    assert speculate.main(["--drafter", str(DEMO / "drafter"), "--prompt-ids", "1,2"]) == 2
    assert "--target" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------
# The held-out prompts and the corpus record (scripts/demo_prompts.py, scripts/demo_corpus.py, train_demo.sh)

def _script(name: str):
    import importlib
    import sys

    if str(REPO_ROOT / "scripts") not in sys.path:
        sys.path.insert(0, str(REPO_ROOT / "scripts"))
    return importlib.import_module(name)


def _scripts():
    return _script("demo_prompts"), _script("demo_corpus")


def test_committed_heldout_prompts_are_the_demo_pairs():
    """demo/heldout.jsonl: 20 prompts of 64 in-vocabulary ids from the held-out files, which
    corpus.json names too; where this Python's library is the one the pair was cut from, cutting
    them again gives the committed file, and elsewhere the cut is refused in one line."""
    import sysconfig

    import pytest

    from support.cli import UserError

    dp, _ = _scripts()
    rows = [json.loads(line) for line in open(DEMO / "heldout.jsonl")]
    held = (DEMO / "heldout.txt").read_text().split()
    corpus = json.loads((DEMO / "corpus.json").read_text())
    assert corpus["heldout_files"] == held and corpus["training_files"] + len(held) > 100
    vocab = Tokenizer(str(DEMO / "target")).tok.get_vocab_size(with_added_tokens=True)
    assert len(rows) == 20 and {r["source"] for r in rows} == set(held)
    assert all(len(r["prompt_ids"]) == 64 and all(0 <= t < vocab for t in r["prompt_ids"]) for r in rows)
    paths = [os.path.join(sysconfig.get_paths()["stdlib"], n) for n in held]
    if all(os.path.isfile(p) for p in paths) and dp.files_digest(paths) == corpus["heldout_sha256"]:
        assert dp.heldout_prompts() == rows
    else:
        with pytest.raises(UserError, match="demo/heldout.jsonl"):
            dp.heldout_prompts()


def test_demo_prompts_refuses_another_standard_library(tmp_path, capsys):
    dp, _ = _scripts()
    held = (DEMO / "heldout.txt").read_text().split()
    lib = tmp_path / "lib"
    lib.mkdir()
    for n in held[:-1]:
        (lib / n).write_text("x = 1\n")
    out = tmp_path / "p.jsonl"
    assert dp.main(["--out", str(out), "--stdlib", str(lib)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and held[-1] in err and "not in this standard library" in err, err
    (lib / held[-1]).write_text("x = 1\n")  # all present, other bytes
    assert dp.main(["--out", str(out), "--stdlib", str(lib)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "differ" in err and "heldout_sha256" in err, err
    assert not out.exists()


def test_demo_prompts_stay_inside_the_targets_context(tmp_path, capsys):
    """--prompt-tokens at or past the target's max_position_embeddings is one line, exit 2, nothing written
    (no model could decode such a prompt); one less is cut, a file shorter than it giving all its tokens."""
    import shutil

    dp, _ = _scripts()
    demo = tmp_path / "demo"
    (demo / "target").mkdir(parents=True)
    shutil.copy(DEMO / "target" / "tokenizer.json", demo / "target")
    config = json.loads((DEMO / "target" / "config.json").read_text())
    config["max_position_embeddings"] = 16
    (demo / "target" / "config.json").write_text(json.dumps(config))
    (demo / "heldout.txt").write_text("a.py\nb.py\n")
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "a.py").write_text("def f(x):\n    return x + 1\n" * 20)
    (lib / "b.py").write_text("x = 1\n")
    out = tmp_path / "p.jsonl"
    argv = ["--demo", str(demo), "--stdlib", str(lib), "--out", str(out), "--num-prompts", "2"]
    assert dp.main(argv + ["--prompt-tokens", "16"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--prompt-tokens 16: at most 15" in err and "max_position_embeddings" in err
    assert not out.exists()
    assert dp.main(argv + ["--prompt-tokens", "15"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    short = len(Tokenizer(str(demo / "target")).encode("x = 1\n"))
    assert [len(r["prompt_ids"]) for r in rows] == [15, short] and rows[1]["start"] == 0


def test_demo_corpus_splits_records_and_checks_same_as(tmp_path, capsys):
    _, dc = _scripts()
    lib = tmp_path / "lib"
    lib.mkdir()
    for i in range(41):
        (lib / f"m{i:02d}.py").write_text(f"x = {i}\n")
    pair, corpus = tmp_path / "pair", tmp_path / "corpus"
    assert dc.main(["--corpus", str(corpus), "--out", str(pair), "--stdlib", str(lib)]) == 0
    line = capsys.readouterr().out
    assert line.startswith("corpus: the standard library") and "38 training files" in line and "3 held out" in line
    assert (pair / "heldout.txt").read_text().split() == ["m00.py", "m20.py", "m40.py"]
    assert sorted(os.listdir(corpus)) == [f"m{i:02d}.py" for i in range(41) if i % 20]
    rec = json.loads((pair / "corpus.json").read_text())
    assert rec["training_files"] == 38 and rec["heldout_files"] == ["m00.py", "m20.py", "m40.py"]
    assert rec["python"] is None and rec["stdlib"] == str(lib)  # not the running Python's library: no version
    # The pair's record is never replaced: another run into the same --out is refused.
    assert dc.main(["--corpus", str(tmp_path / "c3"), "--out", str(pair), "--stdlib", str(lib)]) == 2
    assert "already holds heldout.txt" in capsys.readouterr().err
    (lib / "m05.py").write_text("x = 'changed'\n")  # another library: a drafter-only rebuild must refuse it
    assert dc.main(["--corpus", str(tmp_path / "c2"), "--out", str(tmp_path / "p2"), "--stdlib", str(lib),
                    "--same-as", str(pair / "corpus.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "training_sha256 differs" in err, err
    assert not (tmp_path / "p2").exists() and not (tmp_path / "c2").exists()  # checked before anything is made


def _stdlib(tmp_path):
    lib = tmp_path / "lib"
    lib.mkdir()
    for i in range(41):
        (lib / f"m{i:02d}.py").write_text(f"x = {i}\n")
    return lib


def test_demo_corpus_stopped_leaves_nothing_and_runs_again(tmp_path, capsys, monkeypatch):
    """SIGINT while the training files are copied: exit 130, no half-filled --corpus, no record in --out,
    no temporary folder, the folders it made gone (an empty --corpus given stays as it was); the same
    command then runs."""
    import signal

    _, dc = _scripts()
    lib = _stdlib(tmp_path)
    copy, copied = dc.shutil.copy, []

    def stopped(src, dst):
        copied.append(src)
        if len(copied) == 5:
            os.kill(os.getpid(), signal.SIGINT)
        return copy(src, dst)

    (tmp_path / "empty").mkdir()
    for corpus in (tmp_path / "new" / "c", tmp_path / "empty"):
        argv = ["--corpus", str(corpus), "--out", str(tmp_path / "pair"), "--stdlib", str(lib)]
        monkeypatch.setattr(dc.shutil, "copy", stopped)
        copied.clear()
        assert dc.main(argv) == 130
        assert "interrupted by SIGINT" in capsys.readouterr().err
        assert sorted(os.listdir(tmp_path)) == ["empty", "lib"] and os.listdir(tmp_path / "empty") == []
        monkeypatch.setattr(dc.shutil, "copy", copy)
        assert dc.main(argv) == 0, capsys.readouterr().err
        assert len(os.listdir(corpus)) == 38 and sorted(os.listdir(tmp_path / "pair")) == ["corpus.json", "heldout.txt"]
        for p in (corpus, tmp_path / "pair", tmp_path / "new"):
            dc.shutil.rmtree(p, ignore_errors=True)
    capsys.readouterr()


def test_demo_corpus_refuses_shared_or_unwritable_folders_before_any_work(tmp_path, capsys, monkeypatch):
    """--corpus and --out the same folder, or one inside the other (corpus.json and heldout.txt would be read
    as training text), or in a folder that takes no files (a read-only filesystem; as root chmod does not
    stop writes, so the read-only mount is simulated), or an empty path: one line, exit 2, neither folder
    made."""
    from conftest import make_read_only

    _, dc = _scripts()
    lib = _stdlib(tmp_path)
    ro = tmp_path / "ro"
    ro.mkdir()
    make_read_only(monkeypatch, ro)
    x = tmp_path / "x"
    monkeypatch.chdir(tmp_path)  # where an empty path would lead
    for corpus, out, needle in ((x, x, "separate directories"), (x / "c", x, "separate directories"),
                                (x, x / "p", "separate directories"),
                                (ro / "c", tmp_path / "p", f"--corpus {ro / 'c'}: cannot write in {ro}"),
                                (tmp_path / "c", ro / "p", f"--out {ro / 'p'}: cannot write in {ro}"),
                                (tmp_path / "c", ro, f"--out {ro}: cannot write in {ro}"),
                                ("", x / "p", "--corpus: empty path"), (x / "c", "", "--out: empty path"),
                                ("-", x / "p", "--corpus -: standard output is not supported here"),
                                (x / "c", "-", "--out -: standard output is not supported here")):
        assert dc.main(["--corpus", str(corpus), "--out", str(out), "--stdlib", str(lib)]) == 2, (corpus, out)
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and needle in err, (corpus, out, err)
        assert sorted(os.listdir(tmp_path)) == ["lib", "ro"] and os.listdir(ro) == [], (corpus, out)


def test_train_demo_sh_asks_before_touching_a_pair(tmp_path):
    """--help prints the usage and does nothing; no --out, an unknown flag, a bad step count or a
    non-empty --out without --force are one line and exit 2, before any work."""
    import subprocess

    script = str(REPO_ROOT / "scripts" / "train_demo.sh")
    before = sorted(p.name for p in DEMO.iterdir())
    mtimes = {p: p.stat().st_mtime_ns for p in DEMO.rglob("*")}
    p = subprocess.run(["bash", script, "--help"], capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert p.returncode == 0 and "--out DIR" in p.stdout and "--force" in p.stdout and p.stderr == ""
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep").write_text("x")
    kept = tmp_path / "kept"  # a pair's target without the corpus record beside it
    (kept / "target").mkdir(parents=True)
    (kept / "target" / "model.safetensors").write_bytes(b"")
    for argv, env, needle in (([], {}, "--out DIR"), (["--bogus"], {}, "--bogus: unknown argument"),
                              (["--out", str(full)], {}, "add --force"),
                              (["--out", str(DEMO)], {}, "add --force"),
                              (["--out", str(tmp_path / "new")], {"TARGET_STEPS": "0"}, "TARGET_STEPS=0"),
                              # heads of 64 in pairs sharing a K/V head: 64 failed later, naming flags not given
                              (["--out", str(tmp_path / "new")], {"TARGET_HIDDEN": "64"},
                               "TARGET_HIDDEN=64: a multiple of 128"),
                              (["--out", str(full / "keep" / "sub")], {}, "cannot be created"),
                              # the kept target's corpus cannot be checked without its record
                              (["--out", str(kept), "--force"], {"DRAFTER_ONLY": "1"},
                               "DRAFTER_ONLY=1: " + str(kept / "corpus.json") + " not found")):
        p = subprocess.run(["bash", script, *argv], capture_output=True, text=True, timeout=30, cwd=tmp_path,
                           env=dict(os.environ, **env))
        assert p.returncode == 2 and p.stdout == "" and p.stderr.count("\n") == 1 and needle in p.stderr, (argv, p)
    assert sorted(p.name for p in DEMO.iterdir()) == before
    assert {p: p.stat().st_mtime_ns for p in DEMO.rglob("*")} == mtimes
    assert os.listdir(full) == ["keep"] and not (tmp_path / "new").exists()


# Stand-ins for train_demo.sh's programs: `python` writes what each step's --out names, saying $TAG (the
# rounding step, `python - SRC DST`, copies); `mv` is mv, but first signals (Ctrl-C: INT to the process
# group; SIG=TERM: TERM to the script alone) when its destination matches $STOP_AT, or fails when its
# source matches $FAIL_FROM.
FAKE_PYTHON = r"""#!/usr/bin/env bash
if [ "$1" = - ]; then cat >/dev/null; cp "$2"/* "$3"/; exit 0; fi
prog=$(basename "$1"); shift
while [ $# -gt 0 ]; do case "$1" in --out) out=$2; shift ;; --corpus) corpus=$2; shift ;; esac; shift; done
case "$prog" in
    demo_corpus.py) mkdir -p "$corpus" "$out"; echo x > "$corpus/a.py"
                    for f in heldout.txt corpus.json; do echo "$TAG" > "$out/$f"; done ;;
    train_target.py|train.py) mkdir -p "$out"
                    for f in config.json model.safetensors tokenizer.json generation_config.json; do
                        echo "$TAG" > "$out/$f"; done ;;
    *) echo "$TAG" > "$out" ;;
esac
"""
FAKE_MV = r"""#!/usr/bin/env bash
if [[ "${@: -1}" == $STOP_AT ]]; then
    if [ "${SIG:-INT}" = TERM ]; then kill -TERM "$PPID"; else kill -INT 0; fi
fi
[[ "${@: -2:1}" != $FAIL_FROM ]] || exit 1
exec MV "$@"
"""


def test_train_demo_sh_stopped_while_the_pair_moves_in_keeps_the_old_pair(tmp_path):
    """The last step of scripts/train_demo.sh, the new pair into DIR, stopped (Ctrl-C, TERM) or failing at
    any move: DIR holds its old pair again, exactly (no *.old, no staging folder left; a DIR the run made is
    gone), and the exit status says why; not stopped, DIR holds the new pair whole. The training steps are
    stand-ins (FAKE_PYTHON): only the script's own file handling runs."""
    build = _fake_train_demo(tmp_path)

    def run(out, tag, **env):
        return build(out, tag, **env)[0]

    assert run(tmp_path / "new", "new").returncode == 0
    new = _tree(tmp_path / "new")
    assert set(new) >= {"target", "drafter/model.safetensors", "heldout.txt", "heldout.jsonl", "corpus.json"}
    assert set(new.values()) == {None, "new\n"}
    out = tmp_path / "out"
    assert run(out, "old").returncode == 0
    old = _tree(out)
    assert old == {k: v and "old\n" for k, v in new.items()}
    (out / "notes.txt").write_text("kept")  # not the pair's: stays
    old = _tree(out)
    for env, rc in (({"STOP_AT": f"{out}/drafter"}, 130),  # Ctrl-C mid-swap: the new target is in
                    ({"STOP_AT": f"{out}/target.old"}, 130),  # the first move aside
                    ({"STOP_AT": f"{out}/corpus.json"}, 130),  # the last move in
                    ({"STOP_AT": f"{out}/.new-pair.*/drafter"}, 130),  # moving the pair beside DIR
                    ({"STOP_AT": f"{out}/drafter", "SIG": "TERM"}, 143),  # noted; the swap goes on, then undone
                    ({"FAIL_FROM": f"{out}/.new-pair.*/heldout.jsonl"}, 1)):  # a move that fails
        p = run(out, "new", **env)
        assert p.returncode == rc and _tree(out) == old, (env, p.returncode, p.stderr, _tree(out))
    p = run(tmp_path / "fresh", "new", STOP_AT=f"{tmp_path}/fresh/drafter")
    assert p.returncode == 130 and not (tmp_path / "fresh").exists(), p.stderr
    p = run(out, "new")
    assert p.returncode == 0 and _tree(out) == {**new, "notes.txt": "kept"}, p.stderr


def _default_signals():  # a shell started with SIGINT ignored (inherited) could not trap it
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _fake_train_demo(tmp_path):
    """scripts/train_demo.sh run with test_demo.py's stand-ins, which note each program's arguments."""
    import shutil
    import subprocess

    bin_ = tmp_path / "bin"
    bin_.mkdir()
    log = tmp_path / "args.log"
    fake = FAKE_PYTHON.replace("#!/usr/bin/env bash\n", '#!/usr/bin/env bash\necho "$*" >> "$ARGS_LOG"\n', 1)
    (bin_ / "python").write_text(fake)
    (bin_ / "mv").write_text(FAKE_MV.replace("MV", shutil.which("mv")))
    for f in bin_.iterdir():
        f.chmod(0o755)
    script = str(REPO_ROOT / "scripts" / "train_demo.sh")

    def build(out, tag, **env):
        log.unlink(missing_ok=True)
        env = dict(os.environ, PATH=f"{bin_}{os.pathsep}{os.environ['PATH']}", TAG=tag, THREADS="1",
                   ARGS_LOG=str(log), **env)
        p = subprocess.run(["bash", script, "--out", str(out), "--force"], capture_output=True, text=True,
                           timeout=60, env=env, start_new_session=True,  # `kill -INT 0` reaches it alone
                           preexec_fn=_default_signals)
        calls = log.read_text().splitlines() if log.exists() else []
        return p, calls

    return build


def _tree(d):
    return {str(p.relative_to(d)): p.read_text() if p.is_file() else None for p in d.rglob("*")}


def test_train_demo_sh_with_a_new_target_drops_the_other_kinds_drafter(tmp_path):
    """A new target makes a drafter of the other kind in DIR (trained on the old one) unusable: it goes
    with the old pair, in the same swap (a failed swap puts it back); DRAFTER_ONLY=1 keeps the target,
    so the other drafter stays."""
    build = _fake_train_demo(tmp_path)
    out = tmp_path / "out"
    p, _ = build(out, "old", DRAFTER_KIND="both")
    assert p.returncode == 0 and {"drafter", "eagle3"} <= set(os.listdir(out)), p.stderr
    old = _tree(out)
    for env, rc in (({"FAIL_FROM": f"{out}/eagle3"}, 1),  # moving the old eagle3 aside fails
                    ({"FAIL_FROM": f"{out}/.new-pair.*/corpus.json"}, 1)):  # before it is touched
        p, _ = build(out, "new", **env)
        assert p.returncode == rc and _tree(out) == old, (env, p.stderr, _tree(out))
    p, _ = build(out, "new")
    assert p.returncode == 0 and "eagle3" not in os.listdir(out), p.stderr
    assert not [n for n in os.listdir(out) if n.endswith(".old")]
    assert set(_tree(out).values()) == {None, "new\n"}
    p, _ = build(out, "e3", DRAFTER_KIND="eagle3")
    assert p.returncode == 0 and "drafter" not in os.listdir(out) and "eagle3" in os.listdir(out), p.stderr
    p, _ = build(out, "d", DRAFTER_ONLY="1")  # the target kept: the eagle3 drafter still fits it
    assert p.returncode == 0 and (out / "eagle3" / "model.safetensors").read_text() == "e3\n", p.stderr
    assert (out / "drafter" / "model.safetensors").read_text() == "d\n"


def test_train_demo_sh_checks_its_programs_limits_before_any_work(tmp_path, capsys):
    """BLOCK_SIZE (train.py's: at most MAX_BLOCK and below the script's --seq-len 256), SELFDATA_PROMPTS
    (demo_selfdata.py's --num-prompts), TARGET_LAYERS and TARGET_HIDDEN (train_target.py's) and an Eagle3
    drafter's two target layers are checked with the other variables: one line, exit 2, no program run;
    the limits themselves pass. The trainers are left to show their progress."""
    import train
    from support.cli import MAX_BLOCK
    from support.configs import LAYER_KEYS

    block = min(MAX_BLOCK, 255)
    layers = LAYER_KEYS["num_hidden_layers"][2]  # train_target.py's --layers and --hidden-size
    hidden = LAYER_KEYS["hidden_size"][2]
    ids = tmp_path / "ids.jsonl"
    ids.write_text('{"prompt_ids": [1, 2, 3]}\n')
    for kind, size in (("dspark", "--block-size"), ("eagle3", "--ttt-length")):  # train.py's own limit
        for value, needle in ((block + 1, f"{size} {block + 1}: "), (block, "--target")):  # (no target here)
            argv = ["--drafter-kind", kind, size, str(value), "--seq-len", "256", "--data-ids", str(ids),
                    "--target", str(tmp_path / "none"), "--out", str(tmp_path / "d")]
            assert train.main(argv) == 2
            assert needle in capsys.readouterr().err
    build = _fake_train_demo(tmp_path)
    out = tmp_path / "out"
    for env, needle in (({"BLOCK_SIZE": str(block + 1)}, f"BLOCK_SIZE={block + 1}: 1 to {block}"),
                        ({"SELFDATA_PROMPTS": "1000001"}, "SELFDATA_PROMPTS=1000001: 1 to 1000000"),
                        ({"TARGET_LAYERS": str(layers + 1)}, f"TARGET_LAYERS={layers + 1}: 1 to {layers}"),
                        ({"TARGET_HIDDEN": str(hidden + 128)}, f"TARGET_HIDDEN={hidden + 128}: 128 to {hidden}"),
                        ({"TARGET_LAYERS": "1", "DRAFTER_KIND": "eagle3"}, "TARGET_LAYERS=1: at least 2"),
                        ({"TARGET_LAYERS": "1", "DRAFTER_KIND": "both"}, "TARGET_LAYERS=1: at least 2")):
        p, calls = build(out, "x", **env)
        assert p.returncode == 2 and p.stderr.count("\n") == 1 and needle in p.stderr, (env, p.stderr)
        assert calls == [] and not out.exists()
    p, calls = build(out, "x", BLOCK_SIZE=str(block), SELFDATA_PROMPTS="1000000", TARGET_LAYERS="1",
                     TARGET_HIDDEN=str(hidden))
    assert p.returncode == 0, p.stderr
    # DRAFTER_ONLY=1: the kept target's layers are what an Eagle3 drafter needs two of
    (out / "target" / "config.json").write_text(json.dumps({"num_hidden_layers": 1}))
    (out / "corpus.json").write_text("{}")
    p, redone = build(out, "x", DRAFTER_ONLY="1", DRAFTER_KIND="eagle3")
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and redone == [], p.stderr
    assert f"DRAFTER_ONLY=1: {out / 'target'} has 1 layer(s)" in p.stderr
    trains = [c for c in calls if "/train.py " in c or "/train_target.py " in c]
    assert len(trains) == 2 and not [c for c in trains if "--no-progress" in c], calls


def test_demo_selfdata_writes_the_targets_greedy_continuations(tiny_target, tmp_path, capsys):
    """Each record is a corpus window of --prompt-tokens followed by the target's own greedy
    continuation (what speculate.py decodes from that prompt); bad inputs are one line, exit 2."""
    sd = _script("demo_selfdata")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_text("def x ( y ) : return x + 1 if y else z\n" * 3)
    (corpus / "b.py").write_text("import the world while x in y : print ( hello )\n" * 2)
    (corpus / "notes.txt").write_text("not read")
    out = tmp_path / "self.jsonl"
    argv = ["--target", str(tiny_target.path), "--corpus", str(corpus), "--out", str(out), "--num-prompts", "5",
            "--prompt-tokens", "4", "--new-tokens", "6", "--batch-size", "2"]
    assert sd.main(argv) == 0
    records = [json.loads(line)["prompt_ids"] for line in out.read_text().splitlines()]
    tok = Tokenizer(str(tiny_target.path))
    docs = [tok.encode((corpus / n).read_text()) for n in ("a.py", "b.py")]
    assert len(records) == 5 and all(len(r) == 10 for r in records)
    m = speculate.load(str(tiny_target.path))
    for i, r in enumerate(records):
        doc = docs[i % 2]  # prompt i from file i mod F
        assert any(doc[s:s + 4] == r[:4] for s in range(len(doc) - 3))
        done = speculate.generate(m, [r[:4]], max_new_tokens=6, temperature=0.0, ignore_eos=True)
        assert done[0].output_ids == r[4:]
    capsys.readouterr()
    for bad, needle in ((["--corpus", str(tmp_path / "none")], "directory not found"),
                        (["--out", str(corpus / "a.py")], "--out"), (["--num-prompts", "0"], "--num-prompts")):
        args = list(argv)
        for flag, value in zip(bad[::2], bad[1::2]):
            args[args.index(flag) + 1] = value
        assert sd.main(args) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and needle in err, (bad, err)
    (corpus / "dir.py").mkdir()  # not a file: not read
    (corpus / "c.py").write_bytes(b'x = "\xe9\xff"\n')
    assert sd.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "c.py: not UTF-8 text" in err, err


def test_demo_selfdata_names_the_flags_when_no_file_is_long_enough(tiny_target, tmp_path, capsys):
    sd = _script("demo_selfdata")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_text("x = 1\n")
    argv = ["--target", str(tiny_target.path), "--corpus", str(corpus), "--out", str(tmp_path / "o.jsonl"),
            "--num-prompts", "2", "--new-tokens", "2"]
    assert sd.main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"error: --corpus {corpus}: no *.py file has --prompt-tokens 64 tokens (the longest has 3)\n", err


def test_demo_corpus_names_the_flag_given(tmp_path, capsys):
    """--stdlib and --same-as are named when they are what is wrong; a record without the key is not
    a corpus.json (it said the key "differs")."""
    _, dc = _scripts()
    lib = tmp_path / "few"
    lib.mkdir()
    for i in range(3):
        (lib / f"m{i}.py").write_text("x = 1\n")
    argv = ["--corpus", str(tmp_path / "c"), "--out", str(tmp_path / "pair")]
    assert dc.main(argv + ["--stdlib", str(lib)]) == 2
    assert capsys.readouterr().err == f"error: --stdlib {lib}: 3 top-level *.py files; not a standard library\n"
    other = tmp_path / "config.json"
    other.write_text("{}")
    assert dc.main(argv + ["--stdlib", str(_stdlib(tmp_path)), "--same-as", str(other)]) == 2
    assert capsys.readouterr().err == f"error: --same-as {other}: not a corpus.json (no training_sha256)\n"
    assert dc.main(argv + ["--same-as", str(tmp_path / "nope.json")]) == 2
    assert capsys.readouterr().err == f"error: --same-as {tmp_path / 'nope.json'}: file not found\n"


def test_demo_scripts_refuse_an_empty_stdlib(tmp_path, capsys):
    """An empty --stdlib is a mistake, not a request for the running Python's library."""
    dp, dc = _scripts()
    for main, argv in ((dp.main, ["--out", str(tmp_path / "p.jsonl")]),
                       (dc.main, ["--corpus", str(tmp_path / "c"), "--out", str(tmp_path / "pair")])):
        for blank in ("", " "):
            assert main(argv + ["--stdlib", blank]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and "--stdlib: empty" in err, err
    assert sorted(os.listdir(tmp_path)) == []
