"""--target/--drafter as Hugging Face hub ids (checkpoint.resolve_checkpoint), against a cache built here.

The cache is laid out as huggingface_hub writes it — `models--ORG--NAME/refs/<ref>` holding a commit
hash, `snapshots/<hash>/<file>` a link to `blobs/<sha256>` — in a temporary directory that
HF_HUB_CACHE points at. Nothing touches the network: offline mode is on (conftest.py), and the
"online" tests replace huggingface_hub.snapshot_download's downloads with a function that copies
files from a local "repository" into the cache, filtered by the same allow patterns.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import types
from pathlib import Path

import bench
import huggingface_hub
import pytest
from conftest import make_target_dir, run_captured
from drafters import make_drafter
from huggingface_hub import constants
from huggingface_hub.utils import (
    GatedRepoError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
    filter_repo_objects,
)

import eval as ev
import train
from support import checkpoint
from support.files import CHECKPOINT_FILES

COMMIT_A, COMMIT_B = "a" * 40, "b" * 40
REAL_SNAPSHOT_DOWNLOAD = huggingface_hub.snapshot_download


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    """Local "repositories": two different tiny targets, a sharded one, a drafter; each also holds files a
    run never reads (they must never be downloaded)."""
    d = tmp_path_factory.mktemp("repos")
    a = make_target_dir(d / "target-a", seed=0).path
    b = make_target_dir(d / "target-b", seed=1).path
    sharded = make_target_dir(d / "sharded", seed=2, max_shard_size="20KB").path
    drafter = Path(make_drafter(d / "drafter", str(a), block_size=4, oracle=True))
    for repo in (a, b, sharded, drafter):
        (repo / "README.md").write_text("not read by a run\n")
        (repo / "original").mkdir()
        (repo / "original" / "consolidated.safetensors").write_bytes(b"never downloaded")
        (repo / "pytorch_model.bin").write_bytes(b"never downloaded")
    return types.SimpleNamespace(a=a, b=b, sharded=sharded, drafter=drafter)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An empty Hugging Face cache of this test's own, offline; `hub.online()` lifts offline mode."""
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))  # huggingface_hub reads both at its import
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    def online():
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.delenv("HF_HUB_OFFLINE")
    return types.SimpleNamespace(cache=cache, online=online)


def put(cache: Path, repo: str, src: Path, commit: str, refs=("main",), files=None) -> Path:
    """Cache `src`'s files (all, or `files`: repository paths) as snapshot `commit` of `repo`, the way
    huggingface_hub does; each ref in `refs` names the commit. Returns the snapshot directory."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / commit
    names = files if files is not None else [str(p.relative_to(src)) for p in src.rglob("*") if p.is_file()]
    for name in names:
        data = (src / name).read_bytes()
        blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.exists():
            link.symlink_to(os.path.relpath(blob, link.parent))
    snapshot.mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (folder / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (folder / "refs" / ref).write_text(commit)
    return snapshot


def fake_hub(monkeypatch, repositories: dict, calls: list, fail=None, unreachable=False):
    """snapshot_download with the hub replaced by `repositories` ({repo id: (commit, local directory)}):
    lookups in the cache (local_files_only) go to the real function; a download is recorded in `calls`,
    raises `fail` when given, returns what the cache holds when `unreachable` (as huggingface_hub 2.x does on
    a connection error), and otherwise copies the files that match allow_patterns into the cache."""
    def snapshot_download(repo_id, *, revision=None, cache_dir=None, local_files_only=False, allow_patterns=None,
                          **kwargs):
        if local_files_only:
            return REAL_SNAPSHOT_DOWNLOAD(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True,
                                          allow_patterns=allow_patterns, **kwargs)
        calls.append({"repo_id": repo_id, "revision": revision, "allow_patterns": allow_patterns})
        if fail is not None:
            raise fail
        if unreachable:
            return REAL_SNAPSHOT_DOWNLOAD(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True,
                                          allow_patterns=allow_patterns, **kwargs)
        if repo_id not in repositories:
            raise RepositoryNotFoundError("404 Repository Not Found", response=_response(404))
        commit, src = repositories[repo_id]
        if revision not in (None, "main", commit):
            raise RevisionNotFoundError(f"404 Revision Not Found: {revision}", response=_response(404))
        files = [str(p.relative_to(src)) for p in src.rglob("*") if p.is_file()]
        wanted = list(filter_repo_objects(files, allow_patterns=allow_patterns))
        return str(put(Path(cache_dir), repo_id, src, commit, refs=() if revision == commit else ("main",),
                       files=wanted))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)


def _response(status):
    return types.SimpleNamespace(status_code=status, headers={}, request=None)


def one_error_line(rc, err, *needles):
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


# ----------------------------------------------------------------------------------------
# Offline: the cache, or a one-line error

def test_offline_cached_ids_decode_end_to_end_as_the_directories_do(hub, repos, tmp_path):
    put(hub.cache, "org/tiny", repos.a, COMMIT_A)
    put(hub.cache, "org/drafter", repos.drafter, COMMIT_B)
    base = ["--prompt", "hello world", "--max-new-tokens", 6]
    rc, by_id, err = run_captured(["--target", "org/tiny", "--drafter", "org/drafter"] + base)
    assert rc == 0, err
    snap = hub.cache / "models--org--tiny" / "snapshots" / COMMIT_A
    assert f"--target org/tiny@{COMMIT_A}: {snap}\n" in err  # the id and commit read, once all is checked
    assert f"--drafter org/drafter@{COMMIT_B}: {hub.cache / 'models--org--drafter' / 'snapshots' / COMMIT_B}\n" in err
    rc, by_dir, err = run_captured(["--target", repos.a, "--drafter", repos.drafter] + base)
    assert rc == 0, err
    assert by_id.splitlines()[0] == by_dir.splitlines()[0]  # the same text, from the same weights


def test_offline_and_not_cached_is_one_line(hub, repos):
    put(hub.cache, "org/tiny", repos.a, COMMIT_A)
    rc, _, err = run_captured(["--target", "org/other", "--prompt-ids", "1,2"])
    one_error_line(rc, err, "--target org/other", "not in the Hugging Face cache", str(hub.cache), "HF_HUB_OFFLINE")
    rc, _, err = run_captured(["--target", "org/tiny", "--drafter", "org/nodrafter", "--prompt-ids", "1,2"])
    one_error_line(rc, err, "--drafter org/nodrafter", "HF_HUB_OFFLINE")
    rc, _, err = run_captured(["--target", "org/tiny@v9", "--prompt-ids", "1,2"])  # a ref the cache does not have
    one_error_line(rc, err, "--target org/tiny@v9", "not in the Hugging Face cache")


def test_offline_an_incomplete_snapshot_names_what_it_lacks(hub, repos, monkeypatch):
    """huggingface_hub >= 2 knows, from its cached listing of the repository, that a snapshot lacks files: offline,
    a snapshot with its config and weights is used as it is (as with the hub out of reach), and a note names
    the snapshot and the files."""
    errors = pytest.importorskip("huggingface_hub.errors")
    if not hasattr(errors, "IncompleteSnapshotError"):
        pytest.skip("huggingface_hub < 2 has no IncompleteSnapshotError")
    snap = put(hub.cache, "org/tiny", repos.a, COMMIT_A, files=["config.json", "model.safetensors"])

    def snapshot_download(repo_id, **kwargs):
        raise errors.IncompleteSnapshotError("missing files: tokenizer.json, tokenizer_config.json", str(snap))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    rc, _, err = run_captured(["--target", "org/tiny", "--prompt-ids", "1,2", "--max-new-tokens", 2])
    assert rc == 0, err
    assert (f"note: --target org/tiny: the cached snapshot {snap} lacks files the repository has (tokenizer.json, "
            "tokenizer_config.json); offline (HF_HUB_OFFLINE) it is used as it is") in err, err


def test_offline_cached_snapshot_without_weights_is_one_line(hub, repos):
    put(hub.cache, "org/tiny", repos.a, COMMIT_A, files=["config.json", "tokenizer.json"])  # an interrupted download
    rc, _, err = run_captured(["--target", "org/tiny", "--prompt-ids", "1,2"])
    one_error_line(rc, err, "--target org/tiny", "has no model.safetensors", "HF_HUB_OFFLINE")
    shards = sorted(p.name for p in repos.sharded.glob("model-*.safetensors"))
    assert len(shards) > 1
    put(hub.cache, "org/sharded", repos.sharded, COMMIT_A,
        files=["config.json", "model.safetensors.index.json"] + shards[:-1])  # the last shard missing
    rc, _, err = run_captured(["--target", "org/sharded", "--prompt-ids", "1,2"])
    one_error_line(rc, err, f"has no {shards[-1]}")


def test_revisions_a_ref_name_and_a_commit_hash(hub, repos):
    snap_a = put(hub.cache, "org/tiny", repos.a, COMMIT_A, refs=("main",))
    snap_b = put(hub.cache, "org/tiny", repos.b, COMMIT_B, refs=("v2", "refs/pr/1"))
    resolve = lambda spec: checkpoint.resolve_checkpoint(spec, "--target")  # noqa: E731
    assert resolve("org/tiny") == str(snap_a) == resolve("org/tiny@main") == resolve(f"org/tiny@{COMMIT_A}")
    assert resolve("org/tiny@v2") == str(snap_b) == resolve(f"org/tiny@{COMMIT_B}") == resolve("org/tiny@refs/pr/1")
    outs = {}
    for spec in ("org/tiny", "org/tiny@v2", f"org/tiny@{COMMIT_B}"):
        rc, out, err = run_captured(["--target", spec, "--prompt-ids", "7,8,9", "--max-new-tokens", 8])
        assert rc == 0, err
        outs[spec] = out.splitlines()[0]
    assert outs["org/tiny@v2"] == outs[f"org/tiny@{COMMIT_B}"] != outs["org/tiny"]  # two different models


@pytest.mark.parametrize("spec", ["a/b/c", "@", "org/name@", "org", "org/na..me", "org/-name", "org/name@x..y",
                                  "org/name@a b", "org--x/name", "org/name@v1@v2", " "])
def test_malformed_ids_are_one_line(hub, spec):
    rc, _, err = run_captured(["--target", spec, "--prompt-ids", "1,2"])
    line = one_error_line(rc, err, "--target")
    assert "not a Hugging Face hub id" in line or "empty" in line


def test_empty_target_is_one_line(hub):
    rc, _, err = run_captured(["--target", "", "--prompt-ids", "1,2"])
    one_error_line(rc, err, "--target: empty")


def test_a_local_directory_wins_over_an_id_of_the_same_spelling(hub, repos, tmp_path, monkeypatch):
    put(hub.cache, "org/tiny", repos.b, COMMIT_B)
    monkeypatch.chdir(tmp_path)
    shutil.copytree(repos.a, tmp_path / "org" / "tiny")
    assert checkpoint.resolve_checkpoint("org/tiny", "--target") == "org/tiny"
    rc, local, err = run_captured(["--target", "org/tiny", "--prompt-ids", "7,8,9", "--max-new-tokens", 8])
    assert rc == 0 and "Hugging Face" not in err, err
    rc, a, _ = run_captured(["--target", repos.a, "--prompt-ids", "7,8,9", "--max-new-tokens", 8])
    assert local.splitlines()[0] == a.splitlines()[0]


def test_paths_are_left_to_the_loader(hub, tmp_path):
    for spec in (str(tmp_path / "missing"), "./missing/dir"):
        assert checkpoint.resolve_checkpoint(spec, "--target") == spec
    assert checkpoint.resolve_checkpoint("~/missing", "--target") == os.path.expanduser("~/missing")
    rc, _, err = run_captured(["--target", tmp_path / "missing", "--prompt-ids", "1,2"])
    one_error_line(rc, err, "target directory not found")


def test_an_output_inside_the_snapshot_is_refused(hub, repos, tmp_path):
    """The snapshot's files are links into blobs/: an output named by the link is still an input."""
    snap = put(hub.cache, "org/tiny", repos.a, COMMIT_A)
    before = (snap / "config.json").read_bytes()
    rc, _, err = run_captured(["--target", "org/tiny", "--prompt-ids", "1,2", "--trace-file", snap / "config.json"])
    one_error_line(rc, err, "--trace-file", "input directory")
    blob = (snap / "config.json").resolve()
    rc, _, err = run_captured(["--target", "org/tiny", "--prompt-ids", "1,2", "--trace-file", blob])
    one_error_line(rc, err, "--trace-file", "input directory")
    assert (snap / "config.json").read_bytes() == before


# ----------------------------------------------------------------------------------------
# Online: the cache first, else a download of only what a run reads

def test_download_fetches_only_what_a_run_reads(hub, repos, monkeypatch):
    hub.online()
    calls = []
    fake_hub(monkeypatch, {"org/tiny": (COMMIT_A, repos.a)}, calls)
    rc, out, err = run_captured(["--target", "org/tiny", "--prompt", "hello world", "--max-new-tokens", 6])
    assert rc == 0, err
    snap = hub.cache / "models--org--tiny" / "snapshots" / COMMIT_A
    assert f"--target org/tiny@{COMMIT_A}: {snap}\n" in err
    assert calls == [{"repo_id": "org/tiny", "revision": None, "allow_patterns": list(CHECKPOINT_FILES)},
                     {"repo_id": "org/tiny", "revision": COMMIT_A, "allow_patterns": ["model.safetensors"]}]
    got = sorted(str(p.relative_to(snap)) for p in snap.rglob("*") if p.is_file())
    assert got == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                   "tokenizer_config.json"]
    rc, local, _ = run_captured(["--target", repos.a, "--prompt", "hello world", "--max-new-tokens", 6])
    assert out.splitlines()[0] == local.splitlines()[0]
    # A second run finds it complete in the cache: the hub is not asked.
    rc, _, err = run_captured(["--target", "org/tiny", "--prompt", "hello world", "--max-new-tokens", 6])
    assert rc == 0 and len(calls) == 2 and f"--target org/tiny@{COMMIT_A}: {snap}\n" in err, err


def test_download_of_a_sharded_checkpoint_at_a_revision(hub, repos, monkeypatch):
    hub.online()
    calls = []
    fake_hub(monkeypatch, {"org/sharded": (COMMIT_B, repos.sharded)}, calls)
    shards = sorted(set(json.loads((repos.sharded / "model.safetensors.index.json").read_text())["weight_map"].values()))
    assert len(shards) > 1
    path = checkpoint.resolve_checkpoint(f"org/sharded@{COMMIT_B}", "--target")
    assert calls == [{"repo_id": "org/sharded", "revision": COMMIT_B, "allow_patterns": list(CHECKPOINT_FILES)},
                     {"repo_id": "org/sharded", "revision": COMMIT_B, "allow_patterns": shards}]
    assert path == str(hub.cache / "models--org--sharded" / "snapshots" / COMMIT_B)
    assert not (Path(path) / "original").exists() and not (Path(path) / "pytorch_model.bin").exists()
    rc, _, err = run_captured(["--target", f"org/sharded@{COMMIT_B}", "--prompt-ids", "1,2", "--max-new-tokens", 2])
    assert rc == 0 and len(calls) == 2, err


def test_a_cached_snapshot_without_its_tokenizer_is_completed_online(hub, repos, monkeypatch):
    """A cache filled by another program (transformers' model download) holds the config and weights but not
    the tokenizer, template or generation config: online they are fetched, not silently done without; with
    the hub out of reach the snapshot is used as it is, and a note says so."""
    put(hub.cache, "org/tiny", repos.a, COMMIT_A, files=["config.json", "model.safetensors"])
    hub.online()
    calls = []
    fake_hub(monkeypatch, {"org/tiny": (COMMIT_A, repos.a)}, calls)
    rc, _, err = run_captured(["--target", "org/tiny", "--prompt", "hello world", "--max-new-tokens", 2])
    assert rc == 0 and calls[0]["allow_patterns"] == list(CHECKPOINT_FILES), err
    assert (hub.cache / "models--org--tiny" / "snapshots" / COMMIT_A / "tokenizer.json").is_file()
    rc, _, err = run_captured(["--target", "org/tiny", "--prompt-ids", "1,2", "--max-new-tokens", 2])
    assert rc == 0 and len(calls) == 1, err  # complete now: the hub is not asked again (nor for weights it had)
    put(hub.cache, "org/other", repos.a, COMMIT_B, files=["config.json", "model.safetensors"])
    fake_hub(monkeypatch, {}, [], fail=LocalEntryNotFoundError("Got: ConnectError: no network"))
    rc, _, err = run_captured(["--target", "org/other", "--prompt-ids", "1,2", "--max-new-tokens", 2])
    assert rc == 0 and "the hub cannot be reached" in err and "using the cached snapshot" in err, err


def test_the_hubs_own_fallback_to_the_cache_is_said(hub, repos, monkeypatch):
    """huggingface_hub 2.x answers a connection error with the cached snapshot, raising nothing: the note
    that it is used as it is was never printed (the run went on silently without its tokenizer), and the
    weights were asked for again (another round of retries) though they were there."""
    put(hub.cache, "org/tiny", repos.a, COMMIT_A, files=["config.json", "model.safetensors"])
    hub.online()
    calls = []
    fake_hub(monkeypatch, {}, calls, unreachable=True)
    rc, _, err = run_captured(["--target", "org/tiny", "--prompt-ids", "1,2", "--max-new-tokens", 2])
    assert rc == 0 and len(calls) == 1, err
    assert "still has no tokenizer.json, tokenizer_config.json, generation_config.json after asking the hub" in err


def test_a_hub_drafter_is_downloaded_once_without_a_note(hub, repos, monkeypatch):
    """A drafter's repository holds no tokenizer or generation config: nothing is missing, so no note (every
    online run with a hub drafter said the hub was out of reach), and once cached it is not asked again."""
    hub.online()
    calls = []
    fake_hub(monkeypatch, {"org/tiny": (COMMIT_A, repos.a), "org/drafter": (COMMIT_B, repos.drafter)}, calls)
    flags = ["--target", "org/tiny", "--drafter", "org/drafter", "--prompt-ids", "1,2", "--max-new-tokens", 4]
    rc, _, err = run_captured(flags)
    assert rc == 0 and "note:" not in err, err
    asked = len(calls)
    rc, _, err = run_captured(flags)
    assert rc == 0 and "note:" not in err and len(calls) == asked, (calls, err)


def test_a_partial_snapshot_is_completed_online(hub, repos, monkeypatch):
    put(hub.cache, "org/tiny", repos.a, COMMIT_A, files=["config.json"])
    hub.online()
    calls = []
    fake_hub(monkeypatch, {"org/tiny": (COMMIT_A, repos.a)}, calls)
    rc, _, err = run_captured(["--target", "org/tiny", "--prompt-ids", "1,2", "--max-new-tokens", 2])
    assert rc == 0 and [c["revision"] for c in calls] == [None, COMMIT_A], err


@pytest.mark.parametrize("fail,needles", [
    (RepositoryNotFoundError("404 Repository Not Found", response=_response(404)),
     ["no repository org/tiny on the Hugging Face hub", "HF_TOKEN"]),
    (GatedRepoError("403 gated", response=_response(403)), ["gated", "huggingface.co/org/tiny"]),
    (RevisionNotFoundError("404 Revision Not Found", response=_response(404)), ["no revision 'v7'"]),
    (LocalEntryNotFoundError("Got: ConnectError: [Errno -2] Name or service not known\nAn error happened"),
     ["the hub cannot be reached", "Name or service not known"]),
    (OSError(28, "No space left on device"), ["downloading from the Hugging Face hub failed", "No space left"]),
])
def test_a_failing_download_is_one_line(hub, monkeypatch, fail, needles):
    hub.online()
    calls = []
    fake_hub(monkeypatch, {}, calls, fail=fail)
    rc, _, err = run_captured(["--target", "org/tiny@v7", "--prompt-ids", "1,2"])
    one_error_line(rc, err, "--target org/tiny@v7", *needles)
    assert calls and calls[0]["repo_id"] == "org/tiny" and calls[0]["revision"] == "v7"


def test_a_repository_without_safetensors_is_one_line(hub, repos, tmp_path, monkeypatch):
    bin_only = tmp_path / "bin-only"
    bin_only.mkdir()
    shutil.copy(repos.a / "config.json", bin_only)
    (bin_only / "pytorch_model.bin").write_bytes(b"weights in the old format")
    hub.online()
    fake_hub(monkeypatch, {"org/old": (COMMIT_A, bin_only)}, [])
    rc, _, err = run_captured(["--target", "org/old", "--prompt-ids", "1,2"])
    one_error_line(rc, err, "--target org/old", "has no model.safetensors")


# ----------------------------------------------------------------------------------------
# Every program that takes --target/--drafter resolves them the same way

def test_every_program_resolves_hub_ids(hub, repos, tmp_path, capsys, monkeypatch):
    """An id missing from the cache is the same one-line error in each program (it goes through
    resolve_checkpoint), and a cached one is decoded by eval.py end to end."""
    monkeypatch.chdir(tmp_path)  # eval without --out: its default results.json belongs here, not in the checkout
    data = tmp_path / "data"
    data.mkdir()
    (data / "gsm8k.jsonl").write_text(json.dumps({"turns": ["hello world"]}) + "\n")
    (tmp_path / "corpus.txt").write_text("hello world . " * 50)
    ev_args = ["--data-dir", data, "--datasets", "gsm8k", "--max-new-tokens", 4, "--no-progress"]
    programs = {
        "eval": (ev.main, ["--target", "org/missing"] + ev_args),
        "bench": (bench.main, ["--target", "org/missing", "--no-compile"]),
        "train": (train.main, ["--target", "org/missing", "--data", tmp_path / "corpus.txt", "--out",
                               tmp_path / "out", "--steps", 1, "--seq-len", 16, "--no-progress"]),
    }
    for name, (main, args) in programs.items():
        rc = main([str(a) for a in args])
        one_error_line(rc, capsys.readouterr().err, "--target org/missing", "HF_HUB_OFFLINE")
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    import bench_concurrency
    import regenerate
    (tmp_path / "conv.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    for main, args in ((bench_concurrency.main, ["--concurrency", 2, "--target", "org/missing", "--drafter",
                                                 "org/missing-drafter", "--prompts-file", tmp_path / "conv.jsonl"]),
                       (regenerate.main, ["--target", "org/missing", "--prompts", tmp_path / "conv.jsonl", "--out",
                                          tmp_path / "regen.jsonl"])):
        rc = main([str(a) for a in args])
        one_error_line(rc, capsys.readouterr().err, "org/missing", "HF_HUB_OFFLINE")

    put(hub.cache, "org/tiny", repos.a, COMMIT_A)
    put(hub.cache, "org/drafter", repos.drafter, COMMIT_B)
    rc = ev.main([str(a) for a in ["--target", "org/tiny", "--drafter", "org/drafter", "--out", tmp_path / "r.json"]
                  + ev_args])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert f"--target org/tiny@{COMMIT_A}:" in err and json.loads((tmp_path / "r.json").read_text())["datasets"]
    # results.json says which commits the ids resolved to (a branch moves), and names the row by its repository
    results = json.loads((tmp_path / "r.json").read_text())
    assert results["config"]["hub_revisions"] == {"org/tiny": f"org/tiny@{COMMIT_A}",
                                                  "org/drafter": f"org/drafter@{COMMIT_B}"}
    assert [r["label"] for r in results["rows"]] == ["org/drafter"]



@pytest.mark.parametrize("fail,needles", [
    (LocalEntryNotFoundError("Got: ConnectError: [Errno -2] Name or service not known\nAn error happened"),
     ["not in the Hugging Face cache", "the hub cannot be reached", "Name or service not known"]),
    (RepositoryNotFoundError("404 Repository Not Found", response=_response(404)),
     ["no repository demo/targt on the Hugging Face hub"]),
    (OSError(28, "No space left on device"), ["downloading from the Hugging Face hub failed", "No space left"]),
    (None, ["not in the Hugging Face cache", "HF_HUB_OFFLINE"]),  # offline
])
def test_a_mistyped_path_that_reads_as_an_id_says_both(hub, tmp_path, monkeypatch, fail, needles):
    """`--target demo/targt` (a typo for demo/target) is a path or a hub id: with neither there, the line says
    both, naming the directory looked for (absolute) and keeping the hub's own reason."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo" / "target").mkdir(parents=True)
    if fail is not None:
        hub.online()
        fake_hub(monkeypatch, {}, [], fail=fail)
    rc, _, err = run_captured(["--target", "demo/targt", "--prompt-ids", "1,2"])
    line = one_error_line(rc, err, "--target demo/targt: no such local directory, and ", *needles)
    assert line.endswith(f"; checked the local path {tmp_path / 'demo' / 'targt'}"), line


@pytest.mark.parametrize("fail,needle", [
    (GatedRepoError("403 gated", response=_response(403)), "gated"),
    (RevisionNotFoundError("404 Revision Not Found", response=_response(404)), "no revision 'v7'"),
])
def test_an_id_the_hub_knows_is_not_said_to_be_a_path(hub, monkeypatch, fail, needle):
    """The hub has the repository (gated, or without that revision): the id was meant, no directory is named."""
    hub.online()
    fake_hub(monkeypatch, {}, [], fail=fail)
    rc, _, err = run_captured(["--target", "org/tiny@v7", "--prompt-ids", "1,2"])
    line = one_error_line(rc, err, "--target org/tiny@v7: ", needle)
    assert "local" not in line, line
