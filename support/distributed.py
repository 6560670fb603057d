"""Several processes under torchrun (train.py, eval.py, scripts/train_target.py): torchrun's
variables checked, the process group joined with a timeout; one process without them."""

from __future__ import annotations

import os
import re
from typing import Callable, Optional

import torch

from support.cli import RankError, UserError, device_name, first_line

# Dense bf16 tensor-core peaks from the vendors' data sheets (TFLOP/s), for MFU estimates: the first
# whose name the GPU's holds, so the PCIe and NVL cards come before the SXM ones of their name.
PEAK_TFLOPS = {"H100 PCIe": 756.0, "H800 PCIe": 756.0, "H100 NVL": 835.0, "H200 NVL": 835.0,
               "H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0}


def peak_tflops(device: str) -> Optional[float]:
    """The data-sheet dense bf16 peak of a known GPU, else None (CPUs: give it yourself)."""
    if not device.startswith("cuda"):
        return None
    name = device_name(device)
    for model, peak in PEAK_TFLOPS.items():
        if model in name:
            return peak
    return None


def rank0() -> bool:
    """Whether this process speaks for the run (any process when torchrun's variables are broken)."""
    try:
        return torchrun_env()[0] == 0
    except UserError:
        return True


def torchrun_env(environ=None) -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's variables, (0, 1, 0) without them. Variables that
    contradict each other (WORLD_SIZE without RANK, a rank outside the world, no MASTER_ADDR/PORT for
    several processes, ...) are a one-line UserError, not a hang or a traceback."""
    env = os.environ if environ is None else environ
    vals = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        if name in env:
            try:
                vals[name] = int(env[name])
            except ValueError:
                raise UserError(f"torchrun environment: {name}={env[name]!r} "
                                "is not an integer") from None
    if "WORLD_SIZE" not in vals:
        if vals:
            raise UserError(f"torchrun environment: {', '.join(vals)} set without WORLD_SIZE "
                            "(launch with torchrun, or unset them)")
        return 0, 1, 0
    world = vals["WORLD_SIZE"]
    if world < 1:
        raise UserError(f"torchrun environment: WORLD_SIZE={world} (valid: >= 1)")
    if "RANK" not in vals:
        if world == 1:
            return 0, 1, vals.get("LOCAL_RANK", 0)
        raise UserError(f"torchrun environment: WORLD_SIZE={world} but RANK is not set "
                        "(launch with torchrun)")
    rank = vals["RANK"]
    if not 0 <= rank < world:
        raise UserError(f"torchrun environment: RANK={rank} is outside WORLD_SIZE={world} "
                        f"(valid: 0 to {world - 1})")
    if world > 1:
        missing = [n for n in ("LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if n not in env]
        if missing:
            names = ", ".join(missing)
            raise UserError(f"torchrun environment: WORLD_SIZE={world} but {names} not set "
                            "(launch with torchrun)")
        if vals["LOCAL_RANK"] < 0:
            raise UserError(f"torchrun environment: LOCAL_RANK={vals['LOCAL_RANK']} (valid: >= 0)")
    return rank, world, vals.get("LOCAL_RANK", 0)


def check_gpus(rank: int, world: int, local: int):
    """One GPU a process. torchrun's count of processes on this machine (LOCAL_WORLD_SIZE) is the same on
    each, so every process refuses too many with the same line; without it, or contradicting LOCAL_RANK,
    only the ranks past the last GPU know, and each says so."""
    gpus = torch.cuda.device_count()
    here = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    if here.isdigit() and int(here) > gpus:
        raise UserError(f"torchrun runs {int(here)} processes on this machine, which has {gpus} GPU(s): "
                        f"--nproc_per_node {gpus} at most (one GPU a process)")
    if local >= gpus:
        raise RankError(f"rank {rank} of {world}: LOCAL_RANK={local} but this machine has {gpus} GPU(s) "
                        f"(one GPU a process)")


def dist_init(device: str, timeout_s: float) -> tuple[int, int, str]:
    """(rank, world size, device) after joining torchrun's process group (gloo on cpu, nccl on cuda, the
    rank's LOCAL_RANK GPU); one process without torchrun's variables. Waiting for the other processes gives
    up after timeout_s with a one-line UserError; a later collective that another process left or does not
    join in timeout_s fails with gloo's error, which `run_and_leave` makes one line."""
    rank, world, local = torchrun_env()
    if world == 1:
        return 0, 1, device
    import datetime

    import torch.distributed as dist

    # Its functions take the default group as an argument default, bound at import. Imported after
    # the group is made (by DDP, torch.compile or a meta tensor's init, through torch._dynamo), they
    # would keep the group alive past destroy_process_group, and its threads running into exit.
    import torch.distributed.nn.functional  # noqa: F401

    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UserError("--device cuda: no CUDA device is available")
        check_gpus(rank, world, local)
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    if not dist.is_initialized():
        where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        backend = "gloo"
        if device.startswith("cuda"):
            backend = "nccl"
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            dist.init_process_group(backend, timeout=timeout)
        # rendezvous failures come as RuntimeError, DistError, TimeoutError, ...
        except Exception as e:
            raise UserError(f"rank {rank} of {world}: no process group at {where} "
                            f"within {timeout_s:g} s "
                            f"({first_line(e)}); "
                            "start every process (torchrun --nproc_per_node N) "
                            "or raise --dist-timeout") from None
    return rank, world, device


def peer_lost(e: BaseException) -> bool:
    """Whether a collective failed because another process stopped or did not answer in time: gloo's
    transport error (a RuntimeError whose message starts with its source file's path), not a bug's."""
    return isinstance(e, RuntimeError) and re.match(r"\[[^\]]*gloo/transport/", str(e)) is not None


def run_and_leave(run: Callable) -> Callable:
    """`run(args)`, then out of the process group if it joined one. A collective that fails because
    another process stopped or did not answer within --dist-timeout (`peer_lost`) is one line from the
    rank that met it, whichever it is (a RankError; a process that stopped on an error said so in its
    own line); any other error goes on."""
    def run_in_group(args):
        try:
            return run(args)
        except RuntimeError as e:
            if not peer_lost(e):
                raise
            rank, world, _ = torchrun_env()
            what = first_line(e).split("] ", 1)[-1].split(". ")[0]  # without gloo's source file
            raise RankError(f"rank {rank} of {world}: another process stopped or did not answer within "
                            f"--dist-timeout {args.dist_timeout:g} s ({what})") from None
        finally:
            if (dist := process_group()) is not None:
                dist.destroy_process_group()
    return run_in_group


# Collectives: every rank a shard, raw counts summed (one process: the values as they are)

def process_group():
    """torch.distributed when this process is in a group, else None."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist
    return None


def from_rank0(value):
    """Rank 0's value on every rank (a picklable object); one process: the value itself."""
    dist = process_group()
    if dist is None:
        return value
    shared = [value]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def all_sum(values: list[int], device: str) -> list[int]:
    if (dist := process_group()) is None:
        return values
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def sum_counts(c: dict, device: str) -> dict:
    """`metrics.count`'s raw counts (integers, and lists by position) summed across processes."""
    flat = []  # every count in order, a list's entries one by one
    for value in c.values():
        if isinstance(value, list):
            flat += value
        else:
            flat.append(value)
    total = all_sum(flat, device)
    out = {}
    i = 0
    for key, value in c.items():
        if isinstance(value, list):
            out[key] = total[i:i + len(value)]
            i += len(value)
        else:
            out[key] = total[i]
            i += 1
    return out


def all_max(value: float, device: str) -> float:
    if (dist := process_group()) is None:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def all_gather_list(items: list) -> list:
    if (dist := process_group()) is None:
        return items
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, items)
    return [x for part in out for x in part]
