"""Training killed outright (SIGKILL) at random moments, many times over, while it saves a checkpoint
after every step: each time the directory holds a complete, consistent checkpoint that `latest`
names, --resume takes it, and the run that results equals one that was never interrupted."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import REPO_ROOT
from drafters import make_target

import train
from support import trainer

STEPS = 160
KILLS = 10


def tiny_run_inputs(tmp_path):
    """A 2-layer target and 8 rows of token ids: what each run here trains on."""
    target = make_target(tmp_path / "target", vocab_size=32, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    ids = tmp_path / "ids.jsonl"
    g = torch.Generator().manual_seed(0)
    ids.write_text("".join(json.dumps({"prompt_ids": torch.randint(0, 32, (17,), generator=g).tolist()}) + "\n"
                           for _ in range(8)))
    return target, ids


def test_sigkill_during_saves_then_resume_equals_uninterrupted(tmp_path):
    from safetensors.torch import load_file

    target, ids = tiny_run_inputs(tmp_path)
    flags = ["--target", target, "--data-ids", ids, "--steps", STEPS, "--seq-len", 16, "--batch-size", 2,
             "--anchors-per-seq", 4, "--block-size", 3, "--depth", 1, "--markov-rank", 4, "--save-every", 1,
             "--device", "cpu", "--no-progress"]
    flags = [str(a) for a in flags]
    t0 = time.time()
    assert train.main(flags + ["--out", str(tmp_path / "straight")]) == 0
    step_seconds = (time.time() - t0) / STEPS  # (over) a step's time on this machine, saves included

    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    rng, steps_seen, kills = random.Random(0), [], 0
    while kills < KILLS:
        resume = ["--resume", str(out)] if (out / "latest").exists() else []
        before = (out / "latest").read_text() if resume else None
        p = subprocess.Popen([sys.executable, str(REPO_ROOT / "train.py"), *flags, "--out", str(out), *resume],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        t0 = time.time()
        while p.poll() is None and ((out / "latest").read_text() if (out / "latest").exists() else None) == before:
            assert time.time() - t0 < 60, "no checkpoint appeared"
            time.sleep(0.01)  # wait for this run's first save, then kill it a little later: mid-save, often
        time.sleep(rng.uniform(0, 3 * step_seconds))  # a few steps on: the kills stay well inside the run
        if p.poll() is not None:  # it finished before the kill: the loop has no more to interrupt
            break
        p.send_signal(signal.SIGKILL)
        p.wait()
        kills += 1
        ckpt = trainer.checkpoint_dir(str(out))  # complete and consistent, or an exception here
        state = json.loads(open(os.path.join(ckpt, trainer.STATE_JSON)).read())
        trainer.check_checkpoint(ckpt, state["step"])
        steps_seen.append(state["step"])
        assert not [d for d in os.listdir(out) if d.startswith("checkpoint-") and d != os.path.basename(ckpt)
                    and not os.path.isdir(os.path.join(out, d))]
    assert kills == KILLS, f"only {kills} kills: the run is too short for this machine"
    assert steps_seen == sorted(steps_seen) and steps_seen[-1] < STEPS
    assert train.main(flags + ["--out", str(out), "--resume", str(out)]) == 0
    a, b = load_file(str(tmp_path / "straight" / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_killed_between_first_checkpoint_and_latest_resumes(tmp_path, monkeypatch):
    """A kill after the first checkpoint is renamed into place and before `latest` is written: --resume OUT
    takes that checkpoint, and the run that results equals one that was never interrupted."""
    from safetensors.torch import load_file

    target, ids = tiny_run_inputs(tmp_path)
    flags = [str(a) for a in ["--target", target, "--data-ids", ids, "--steps", 4, "--seq-len", 16, "--batch-size", 2,
                              "--anchors-per-seq", 4, "--block-size", 3, "--depth", 1, "--markov-rank", 4,
                              "--save-every", 2, "--device", "cpu", "--no-progress"]]
    assert train.main(flags + ["--out", str(tmp_path / "straight")]) == 0

    class Killed(BaseException):
        pass

    write = trainer.atomic_write

    def killed_at_latest(path, text):
        if os.path.basename(path) == trainer.LATEST:
            raise Killed
        write(path, text)

    out = tmp_path / "run"
    monkeypatch.setattr(trainer, "atomic_write", killed_at_latest)
    with pytest.raises(Killed):
        train.main(flags + ["--out", str(out)])
    monkeypatch.undo()
    assert not (out / "latest").exists() and (out / "checkpoint-2").is_dir()
    assert trainer.checkpoint_dir(str(out)) == str(out / "checkpoint-2")
    assert train.main(flags + ["--out", str(out), "--resume", str(out)]) == 0
    a, b = load_file(str(tmp_path / "straight" / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
