"""train.py at several processes and micro-batches: a 2-process gloo run (torchrun) gives the loss curve of
one process with the same global batch, a run stopped and resumed at another world size continues it exactly,
torchrun's variables and a missing peer are one-line errors, every new flag's bad values too; no gloo thread
outlives the process group; the progress figures (tokens/s, MFU) and --eval-every (what --wandb records:
test_wandb.py).

Tiny models (conftest's word-level target), a few steps each; the torchrun runs are subprocesses.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO_ROOT
from test_train import run_train
from test_train_data import write_chats

import model as mdl
import train
from support import distributed, trainer
from support.cli import UserError

torch.set_num_threads(1)

SMALL = ["--seq-len", 40, "--block-size", 3, "--depth", 1, "--markov-rank", 8, "--anchors-per-seq", 12,
         "--warmup-frac", 0.0, "--lr", 3e-3, "--steps", 4]


def torchrun(argv, cwd, nproc=2, timeout=300):
    # PYTHONFAULTHANDLER: a rank killed by a signal (SIGABRT, SIGSEGV) prints every thread's Python
    # stack into the stderr a failing assertion shows.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT), PYTHONFAULTHANDLER="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(REPO_ROOT / "train.py"), *map(str, argv), "--no-progress", "--device", "cpu"]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)


def curve(out):
    return [json.loads(line)["loss"] for line in open(out / trainer.LOG_JSONL)]


def weights(out):
    from safetensors.torch import load_file
    return load_file(str(out / "model.safetensors"))


def test_two_processes_equal_one_and_resume_at_another_world_size(tiny_target, tmp_path):
    """Chat rows (packed documents, loss masks, filler blocks) and a global batch of 4: one process with
    --grad-accum 2 == two gloo processes with --grad-accum 1 (steps 1-2, stopped) + one process with
    --batch-size 1 --grad-accum 4 resuming that state (steps 3-4)."""
    chats = write_chats(tmp_path / "chat.jsonl", 30)
    base = ["--target", tiny_target.path, "--data", chats, *SMALL]
    rc, one, err = run_train(base + ["--out", tmp_path / "one", "--batch-size", 2, "--grad-accum", 2])
    assert rc == 0, err
    p = torchrun(base + ["--out", tmp_path / "two", "--batch-size", 2, "--stop-at", 2], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "global batch 4 = 2 x 1 x 2 process(es)" in p.stderr and p.stdout.count("step 2: loss") == 1  # rank 0 only
    state = json.loads((Path(trainer.checkpoint_dir(str(tmp_path / "two"))) / trainer.STATE_JSON).read_text())
    assert (state["step"], state["world_size"], state["global_batch"]) == (2, 2, 4)
    rc, resumed, err = run_train(base + ["--out", tmp_path / "three", "--resume", tmp_path / "two",
                                         "--batch-size", 1, "--grad-accum", 4])
    assert rc == 0, err
    assert resumed["start"] == 2
    assert curve(tmp_path / "two") + curve(tmp_path / "three") == pytest.approx(one["losses"], rel=1e-5)
    assert curve(tmp_path / "one") == one["losses"]
    wa, wc = weights(tmp_path / "one"), weights(tmp_path / "three")
    assert wa.keys() == wc.keys() and all(torch.allclose(wa[k], wc[k], atol=1e-5, rtol=1e-4) for k in wa)
    # The global batch must be the saved one.
    rc, _, err = run_train(base + ["--out", tmp_path / "four", "--resume", tmp_path / "two", "--batch-size", 2])
    assert rc == 2 and "global batch is 4 sequences, now 2" in err


def test_micro_batches_split_the_global_batch_alike(tiny_target, tmp_path):
    """Plain --data-ids rows: 1x4, 2x2 and 4x1 (batch size x accumulation) are the same steps."""
    ids = tmp_path / "ids.jsonl"
    g = torch.Generator().manual_seed(0)
    ids.write_text("".join(json.dumps({"prompt_ids": torch.randint(0, 64, (40,), generator=g).tolist()}) + "\n"
                           for _ in range(10)))
    runs = []
    for b, a in ((4, 1), (2, 2), (1, 4)):
        rc, res, err = run_train(["--target", tiny_target.path, "--data-ids", ids, "--out", tmp_path / f"o{b}", *SMALL,
                                  "--batch-size", b, "--grad-accum", a])
        assert rc == 0, err
        runs.append(res["losses"])
    assert runs[1] == pytest.approx(runs[0], rel=1e-5) and runs[2] == pytest.approx(runs[0], rel=1e-5)


@pytest.mark.parametrize("env,needle", [
    ({"RANK": "0"}, "RANK set without WORLD_SIZE"),
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 but RANK is not set"),
    ({"WORLD_SIZE": "two", "RANK": "0"}, "WORLD_SIZE='two' is not an integer"),
    ({"WORLD_SIZE": "2", "RANK": "2", "LOCAL_RANK": "0"}, "RANK=2 is outside WORLD_SIZE=2"),
    ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}, "MASTER_ADDR, MASTER_PORT not set"),
    ({"WORLD_SIZE": "0", "RANK": "0"}, "WORLD_SIZE=0"),
])
def test_inconsistent_torchrun_variables_are_one_line_errors(env, needle):
    with pytest.raises(UserError) as e:
        distributed.torchrun_env(env)
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert distributed.torchrun_env({}) == (0, 1, 0)
    assert distributed.torchrun_env({"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}) == (0, 1, 0)


@pytest.mark.parametrize("rank", [0, 1])
def test_more_processes_than_gpus_is_one_line_on_every_rank(monkeypatch, rank):
    """torchrun --nproc_per_node 2 on a one-GPU machine: every rank refuses alike before joining the group
    (rank 0 prints it; it would otherwise wait for the rank that stopped)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: pytest.fail("set_device before the check"))
    env = {"WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(UserError) as e:
        distributed.dist_init("cuda", 1)
    assert str(e.value) == ("torchrun runs 2 processes on this machine, which has 1 GPU(s): "
                            "--nproc_per_node 1 at most (one GPU a process)")
    # Launched by hand, without LOCAL_WORLD_SIZE: the rank past the last GPU says it itself.
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    if rank == 1:
        with pytest.raises(distributed.RankError, match="^rank 1 of 2: LOCAL_RANK=1 but this machine has 1 GPU"):
            distributed.dist_init("cuda", 1)


def test_a_missing_peer_times_out_with_a_message(tiny_target, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               OMP_NUM_THREADS="1")
    ids = tmp_path / "ids.jsonl"
    ids.write_text(json.dumps({"prompt_ids": list(range(1, 40))}) + "\n")  # the data is checked before the peers
    p = subprocess.run([sys.executable, str(REPO_ROOT / "train.py"), "--target", str(tiny_target.path), "--data-ids",
                        str(ids), "--out", str(tmp_path / "o"), "--dist-timeout", "2", "--seq-len", "16",
                        "--device", "cpu"], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2
    last = p.stderr.strip().splitlines()[-1]  # torch's own C++ log lines may come first
    assert last.startswith("error: rank 0 of 2: no process group at 127.0.0.1") and "--dist-timeout" in last, p.stderr


LEFT_THREADS = """
import os, sys, torch, torch.distributed as dist
from support.distributed import dist_init
dist_init("cpu", 60)
with torch.device("meta"):
    torch.nn.Embedding(4, 2)  # its random init imports torch._dynamo, as load_target's model does
torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
dist.destroy_process_group()
print(sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads threads' names from /proc")
def test_no_gloo_thread_outlives_the_process_group(tmp_path):
    """After destroy_process_group no gloo thread is left to run into the interpreter's exit: modules
    imported after the group is made (by DDP, by a meta tensor's init) must not keep it alive."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "left_threads.py"
    script.write_text(LEFT_THREADS)
    procs = []
    for rank in range(2):
        env = dict(os.environ, WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        assert "gloo" not in out, out


PEER_LEAVES = """
import dataclasses, sys, time
import torch.distributed as dist
from support.distributed import dist_init
from support.trainer import train_main

@dataclasses.dataclass
class Args:
    dist_timeout: float = 60.0

def run(args):
    rank, _, _ = dist_init("cpu", args.dist_timeout)
    if rank == 0:
        return  # leaves the group: rank 1's barrier finds it gone
    time.sleep(1)
    dist.barrier()

sys.exit(train_main(Args, run))
"""


def test_a_process_that_left_is_one_line_from_the_rank_that_meets_it(tmp_path):
    """A collective whose peer has gone (stopped with its own line, or killed) is one line from the rank
    that met it (rank 1 here: not rank 0's alone), exit 2, no gloo traceback."""
    script = tmp_path / "peer_leaves.py"
    script.write_text(PEER_LEAVES)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = dict(os.environ, WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    (_, err0), (_, err1) = [p.communicate(timeout=120) for p in procs]
    assert procs[0].returncode == 0, err0
    assert procs[1].returncode == 2, err1
    lines = err1.strip().splitlines()
    assert len(lines) == 1, err1
    assert lines[0].startswith("error: rank 1 of 2: another process stopped or did not answer within "
                               "--dist-timeout 60 s (Connection closed by peer"), err1


def test_only_gloos_lost_peer_is_one_line():
    """Gloo's transport errors (a peer gone, a timeout) are one line; any other RuntimeError keeps its
    traceback."""
    def fails(message):
        def run(args):
            raise RuntimeError(message)
        return distributed.run_and_leave(run)

    args = SimpleNamespace(dist_timeout=5.0)
    gone = ("[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms "
            "for recv operation to complete")
    with pytest.raises(distributed.RankError, match=r"^rank 0 of 1: .* --dist-timeout 5 s \(Timed out waiting "
                                                    r"5000ms for recv operation to complete\)$"):
        fails(gone)(args)
    for bug in ("a bug's error", "[x.cc:1] Timed out waiting", "CUDA error: gloo/transport/ in a message"):
        with pytest.raises(RuntimeError, match=re.escape(bug)):
            fails(bug)(args)


@pytest.mark.parametrize("flags,needle", [
    (["--grad-accum", 0], "--grad-accum: invalid value 0"),
    (["--dist-timeout", 0], "--dist-timeout: invalid value 0.0"),
    (["--peak-tflops", -1], "--peak-tflops: invalid value -1.0"),
    (["--eval-every", -1], "--eval-every: invalid value -1"),
    (["--eval-samples", 0], "--eval-samples: invalid value 0"),
    (["--eval-max-new-tokens", 0], "--eval-max-new-tokens: invalid value 0"),
    (["--eval-every", 2, "--eval-datasets", "nope"], "--eval-datasets: no nope.jsonl"),
    (["--eval-every", 5, "--steps", 4], "--eval-every 5: past --steps 4, so no evaluation would run"),
    (["--wandb-artifacts"], "--wandb-artifacts: needs --wandb"),
    (["--anchors-per-seq", 0], "--anchors-per-seq: invalid value 0"),
])
def test_new_flags_bad_values_are_one_line_errors(tiny_target, tmp_path, capsys, flags, needle):
    ids = tmp_path / "x.jsonl"
    ids.write_text(json.dumps({"prompt_ids": list(range(1, 40))}) + "\n")  # exists: the flags are what is wrong
    rc = train.main([str(a) for a in ["--target", tiny_target.path, "--data-ids", ids, "--out", tmp_path / "o",
                                      *flags]])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err


@pytest.mark.parametrize("records,flags,needle", [
    # a budget the target's context cannot hold with any prompt: the flag, before anything loads
    (['{"turns": ["hello world"]}'], ["--eval-max-new-tokens", 128],
     "--eval-max-new-tokens 128: leaves no room for a prompt in the context of --target"),
    # a prompt too long for the budget, and a malformed record: eval.py's refusal, before the first step
    (['{"turns": ["hello world"]}'], ["--eval-max-new-tokens", 126],
     "--eval-every 2: eval.py would refuse it ("),
    (['{"turns": ["hello world"]}', '{bad'], ["--eval-max-new-tokens", 8],
     "--eval-every 2: eval.py would refuse it ("),
])
def test_an_evaluation_that_would_fail_is_refused_before_the_first_step(tiny_target, tmp_path, capsys, records,
                                                                         flags, needle):
    evals = tmp_path / "evals"
    evals.mkdir()
    (evals / "mt-bench.jsonl").write_text("".join(r + "\n" for r in records))
    ids = tmp_path / "x.jsonl"
    ids.write_text(json.dumps({"prompt_ids": list(range(1, 40))}) + "\n")
    rc = train.main([str(a) for a in ["--target", tiny_target.path, "--data-ids", ids, "--out", tmp_path / "o",
                                      *SMALL, "--steps", 4, "--eval-every", 2, "--eval-datasets", "mt-bench",
                                      "--eval-data-dir", evals, *flags]])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("error: ") and needle in err[-1], err
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").glob("checkpoint-*"))  # no step ran


def test_step_flops_by_hand():
    t = mdl.ModelArgs(vocab_size=10, hidden_size=4, intermediate_size=6, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=2)
    d = train.DrafterConfig(layers=mdl.ModelArgs(**{**t.__dict__, "num_hidden_layers": 1}), block_size=3,
                            target_layer_ids=(0,), mask_token_id=9, layout="dspark", markov_head_type="vanilla",
                            markov_rank=5, confidence_head=False, confidence_with_markov=False)
    layer = 2 * 4 * 4 + 2 * 4 * 2 + 3 * 4 * 6  # q, o (4x4); k, v (4x2); MLP (3 x 4x6)
    T, N, K = 8, 2, 3
    target = 2 * T * 2 * layer + 2 * 2 * T * T * 4 + 2 * N * K * 4 * 10
    drafter = 2 * T * 1 * 2 * 4 * 2 + 2 * N * K * (layer + 5 * 10) + 4 * 1 * N * K * (T + N * K) * 4
    # fc reads the target's features (no input gradient); the drafter's pass through the target's lm_head,
    # frozen, has no weight gradient: 2x each, not 3x
    fc = 2 * T * 1 * 4 * 4
    lm_head = 2 * N * K * 4 * 10
    assert train.step_flops(t, d, 3, T, N) == 3 * (target + 3 * drafter + 2 * (fc + lm_head))


def test_eagle3_flops_by_hand():
    t = mdl.ModelArgs(vocab_size=10, hidden_size=4, intermediate_size=6, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=2)
    d = train.DrafterConfig(layers=mdl.ModelArgs(**{**t.__dict__, "num_hidden_layers": 1}), block_size=3,
                            target_layer_ids=(0,), mask_token_id=9, layout="eagle3", markov_head_type=None,
                            markov_rank=0, confidence_head=False, confidence_with_markov=False)
    target_layer = 2 * 4 * 4 + 2 * 4 * 2 + 3 * 4 * 6
    T, S = 8, 3
    target = 2 * T * 2 * target_layer + 2 * 2 * T * T * 4 + 2 * T * 4 * 10
    layer = 2 * 4 * (4 + 2 * 2) + 4 * 4 + 3 * 4 * 6  # q, k, v read 2H; o; MLP
    # each step's layer; step j's attention over (j+1)·T keys
    drafter = 2 * T * S * layer + 4 * T * T * 4 * (1 + 2 + 3)
    fc = 2 * T * 1 * 4 * 4  # once, over the target's features: forward and weight gradient only
    lm_head = 2 * T * S * 4 * 10  # the target's, frozen: forward and input gradient only
    assert train.eagle3_flops(t, d, 3, T) == 3 * (target + 3 * drafter + 2 * (fc + lm_head))


def test_progress_and_eval_every(tiny_target, tmp_path, monkeypatch):
    """The bar shows tokens/s and (given a peak) MFU, and eval.py's lines below it; --eval-every 2 writes
    eval.py's results for steps 2 and 4 (what --wandb records of them, and --wandb-artifacts:
    tests/test_wandb.py)."""
    evals = tmp_path / "evals"
    evals.mkdir()
    (evals / "mt-bench.jsonl").write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in ("hello world", "print x")))
    chats = write_chats(tmp_path / "chat.jsonl", 12)
    import contextlib
    import io

    import tyro
    class Terminal(io.StringIO):  # the bar is drawn on a terminal only
        def isatty(self):
            return True

    err = Terminal()
    args = tyro.cli(train.Args, args=[str(a) for a in [
        "--target", tiny_target.path, "--data", chats, "--out", tmp_path / "o", *SMALL, "--batch-size", 2,
        "--peak-tflops", 1, "--eval-every", 2, "--eval-datasets", "mt-bench", "--eval-data-dir", evals,
        "--eval-samples", 2, "--eval-max-new-tokens", 8]])
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # eval.py's default is then half the CPUs
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):  # one terminal shows both
            res = train.run(args)
        # the training's threads, kept through its evaluations (eval.py's default halved them)
        assert torch.get_num_threads() == threads + 1
    finally:
        torch.set_num_threads(threads)
    assert "tok_s=" in err.getvalue() and "mfu=" in err.getvalue()
    # eval.py's lines start a line of their own, the bar wiped first (they were written on the bar's line)
    frames = [line for line in err.getvalue().splitlines() if "it/s" in line]
    # (a frame shorter than the one before it is padded with spaces)
    assert frames and all(line.rstrip().endswith("]") for line in frames), err.getvalue()
    assert res["tokens_per_second"] > 0
    for step in (2, 4):
        ev = json.loads((tmp_path / "o" / f"eval_step{step}.json").read_text())
        assert ev["config"]["step"] == step and ev["datasets"][0]["dataset"] == "mt-bench"
        # the checkpoint evaluated, not --out (which holds step 4's weights by the end)
        assert ev["config"]["drafter"] == [str(tmp_path / "o" / f"checkpoint-{step}")], ev["config"]
    log = [json.loads(line) for line in open(tmp_path / "o" / trainer.LOG_JSONL)]
    assert [r["step"] for r in log] == [1, 2, 3, 4] and all(0 < r["mfu"] and r["eta_seconds"] >= 0 for r in log)



def test_a_gpus_peak_is_its_own_cards(monkeypatch):
    """The MFU's peak: an H100 PCIe or NVL card is not the SXM part its name begins with (989 TFLOP/s
    understated their MFU by a quarter)."""
    from support import distributed

    for name, peak in (("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0), ("NVIDIA H100 80GB HBM3", 989.0),
                       ("NVIDIA H200", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA GeForce RTX 4090", None)):
        monkeypatch.setattr(distributed, "device_name", lambda device, name=name: name)
        assert distributed.peak_tflops("cuda:0") == peak, name
    assert distributed.peak_tflops("cpu") is None


def test_a_locked_out_stops_every_rank_at_once(tiny_target, tmp_path):
    """Rank 0 alone locks --out. Every rank joins the group first and leaves on its refusal: the others
    went into the group and waited for rank 0 until torchrun killed them, 30 s later."""
    import fcntl

    from test_train import write_ids

    ids = write_ids(tmp_path / "ids.jsonl", 4, 24, 64)
    out = tmp_path / "o"
    out.mkdir()
    held = os.open(out, os.O_RDONLY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)  # another run's
        p = torchrun(["--target", tiny_target.path, "--data-ids", ids, "--out", out, *SMALL], tmp_path)
    finally:
        os.close(held)
    assert p.returncode != 0
    assert p.stderr.count(f"error: --out {out}: another run is writing it now") == 1, p.stderr[-3000:]
    assert "Unable to shutdown process" not in p.stderr, p.stderr[-3000:]  # torchrun's SIGKILL after 30 s
