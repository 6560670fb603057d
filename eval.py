"""Benchmarks: τ and acceptance by position per dataset under the authors' protocol, and the confidence
head's calibration (ECE / AUROC / Brier, Sequential Temperature Scaling). docs/evaluation.md.

    python eval.py                                   # the demo pair on its held-out prompts
    python eval.py --target DIR --drafter DIR --datasets gsm8k,mt-bench --max-samples 8
    torchrun --nproc_per_node 8 eval.py ...          # every rank a shard of every dataset

Decoding is speculate.py's engine. Metrics are ratios of raw counts summed across ranks, and sample i
draws from a stream seeded seed + i, so N processes report what one does. "The authors'" figures are
those of DeepSpec's evaluation (the paper's code); "ours" are this project's additions.
"""

from __future__ import annotations

import functools
import os
import random
import sys
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Optional

import torch

from speculate import DEMO_DIR, Request, drafts_per_round, make_engine, size_engine
from support import flags, metrics, plots, runlog
from support.calibration import (
    ECE_BINS,
    STS_GRID,
    calibration_report,
    concat_rounds,
    fit_requests,
    round_arrays,
    saturated,
    uncalibrate,
)
from support.checkpoint import hub_snapshot, load_models, resolve_checkpoint
from support.cli import (
    Interrupted,
    Repeated,
    UserError,
    check_ranges,
    cli_main,
    device_line,
    device_name,
    dtype_name,
    flat,
    flat_fields,
    set_threads,
    use_compile_cache,
)
from support.distributed import (
    all_gather_list,
    all_max,
    dist_init,
    from_rank0,
    process_group,
    rank0,
    run_and_leave,
    sum_counts,
    torchrun_env,
)
from support.eval_report import format_comparison, format_table, log_dataset, say_written, write_outputs
from support.files import check_outputs, check_read_apart, directory_problem, optional_file, write_json
from support.flags import Machine, Rendering, Settings, calibration_note
from support.runlog import WandbFlags
from support.text import (
    StopStrings,
    auto_chat,
    check_chat_flags,
    check_chat_renders,
    check_prompts,
    is_token_ids,
    load_prompts,
    read_prompts_file,
)

# The paper's protocol (Table 1, DeepSpec's eval): per-dataset sample counts, the seed, ECE bins.
DEFAULT_SAMPLES = {"gsm8k": 500, "math500": 500, "aime25": 30, "humaneval": 164, "mbpp": 256,
                   "livecodebench": 500, "mt-bench": 80, "alpaca": 500, "arena-hard-v2": 500}
PAPER_DATASETS = tuple(DEFAULT_SAMPLES)
AUTHORS_SEED = 980406
BUDGET = 2048  # new tokens per request: the authors' script and DFlash's benchmarks
DEMO_BUDGET = 128
DEFAULT_OUT = "results.json"  # or results-2.json, -3, ...: the first name free (printed)
TREE_BUDGETS = (4, 8, 16, 32, 64, 128, 256, 512)  # the budget curve's points below --tree-budget
DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "eval")


@dataclass
class EvalArgs(WandbFlags):
    """Acceptance length and per-position acceptance per dataset; confidence calibration.

    The decode flags mean what they mean in speculate.py (their help is written for it), with the
    authors' protocol as defaults, shown below: temperature 1.0 (the paper's τ), their seed (it also picks
    a long dataset's subset; sample i draws from a stream seeded seed + i), and a budget of 2048 new
    tokens (128 in demo mode, whatever --datasets) capped with a note to what the context leaves the
    longest prompt; a --max-new-tokens given that does not fit is an error. --num-samples is refused
    (each prompt decodes once)."""

    target: Optional[str] = None
    """Qwen3 checkpoint directory or hub id ORG/NAME[@REVISION] (HF_HUB_OFFLINE=1:
    the cache only). Default, with no --drafter either: demo mode, the demo pair in demo/."""
    drafter: Repeated = ()
    """Drafter directory or hub id (any DSpark / DFlash / Eagle3 spelling); repeat it to compare drafters in
    one table, a row each; omitted: the autoregressive baseline."""
    data_dir: Optional[str] = None
    """Directory of <dataset>.jsonl files ("turns": the first turn is the prompt; or "prompt" /
    "prompt_ids"). Default: data/eval; in demo mode without --datasets: demo/."""
    datasets: Optional[str] = None
    """Comma-separated dataset names. Default: the paper's nine, missing files skipped; in demo mode
    without --data-dir: heldout (demo/heldout.jsonl)."""
    max_samples: Optional[int] = None
    """Prompts per dataset (default: the paper's count; a dataset outside the paper's nine is taken
    whole); a longer file is shuffled with random.Random(--seed) and cut, as the authors do."""
    # the decode settings, as speculate.py's, from the authors' protocol (the class's docstring: --help)
    decode: flat(Settings) = field(default_factory=lambda: Settings(temperature=1.0,
                                                                    seed=AUTHORS_SEED))
    rendering: flat(Rendering) = field(default_factory=Rendering)
    machine: flat(Machine) = field(default_factory=Machine)
    out: Optional[str] = None
    """Where to write the results (JSON); a file given is replaced. Default: results.json here, or when
    it exists results-2.json, -3, ...: the first name free (printed)."""
    progress: bool = True
    """Progress on stderr (rank 0): a bar on a terminal, else a line at most once a minute."""
    calibration: Optional[str] = None
    """Apply STS temperatures from an earlier --calibration-out to the confidences a schedule reads and
    that shape a sampled --tree-budget curve (as speculate.py). The calibration report stays the raw
    head's: the temperatures are undone before it."""
    calibration_split: float = 0.5
    """STS fits on this fraction of every dataset's requests (the first) and is scored on the rest;
    0 = no STS (the raw head's calibration is still reported)."""
    calibration_out: Optional[str] = None
    """Write the STS temperatures here (JSON: {"temperatures": [K floats], ...})."""
    calibration_plot: Optional[str] = None
    """Write a reliability diagram here (.png or .svg): one panel per position, before / after STS."""
    ece_bins: int = ECE_BINS
    """Equal-width bins of the expected calibration error (the authors use 20)."""
    step: Optional[int] = None
    """A training step to attach these results to (in --out, and the step of what --wandb logs)."""
    dist_timeout: float = 600.0
    """Under torchrun: seconds to wait for the other processes before giving up."""


def dataset_entry(name: str, c: dict, seconds: float) -> dict:
    """A dataset's entry of results.json from its summed counts: the authors' metrics, then ours."""
    tokens_per_second = None
    if seconds > 0:
        tokens_per_second = c["tokens"] / seconds
    return {
        "dataset": name,
        "num_samples": c["num_samples"],
        "acceptance_length": metrics.acceptance_length(c),
        "draft_tokens_per_proposal": metrics.verified_per_round(c),
        "verify_rate": metrics.verify_rate(c),
        # the authors': rounds that accepted more than j drafts / rounds that verified more than j
        "accept_rates_by_position": metrics.accept_rates_by_position(c),
        "num_rounds": c["num_rounds"],
        "num_tokens": c["tokens"],
        # the paper's Figure 2: draft k's acceptance given drafts 1 .. k-1 were accepted
        "accept_rate_by_position": metrics.accept_rate_by_position(c),
        "counts": {k: c[k] for k in metrics.COUNT_KEYS + metrics.LIST_KEYS},
        "tokens_per_second": tokens_per_second,
        "seconds": seconds,
    }


# ----------------------------------------------------------------------------------------
# Inputs, checked before anything loads; the run

def resolve_defaults(args: EvalArgs) -> tuple[EvalArgs, bool]:
    """(args with the defaults filled in, demo mode); --max-new-tokens stays None (see `token_budget`)."""
    for flag, value in (("--data-dir", args.data_dir), ("--datasets", args.datasets)):
        if value is not None and not value.strip():
            raise UserError(f"{flag}: empty value (leave the flag out for the default)")
    drafters = args.drafter
    if isinstance(drafters, str):  # one, as a string (the Python API's)
        drafters = (drafters,)
    args = replace(args, drafter=tuple(drafters))
    demo = args.target is None and not args.drafter
    if demo:
        target = os.path.join(DEMO_DIR, "target")
        drafter = os.path.join(DEMO_DIR, "drafter")
        args = replace(args, target=target, drafter=(drafter,))
        if args.datasets is None and args.data_dir is None:
            args = replace(args, data_dir=DEMO_DIR, datasets="heldout")
    if args.out is None:
        args = replace(args, out=free_name(DEFAULT_OUT))
    if args.data_dir is None:
        args = replace(args, data_dir=DATA_DIR)
    if args.datasets is None:
        args = replace(args, datasets=",".join(PAPER_DATASETS))
    return args, demo


def free_name(path: str, claim: bool = False) -> str:
    """`path`, or the first of path-2, path-3, ... (before its extension) that does not exist yet; `claim`:
    created empty now, so that an eval started beside this one takes another."""
    stem, extension = os.path.splitext(path)
    n = 1
    while True:
        if claim:
            try:
                os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
                return path
            except FileExistsError:
                pass
        elif not os.path.lexists(path):
            return path
        n += 1
        path = f"{stem}-{n}{extension}"


def check_flags(args: EvalArgs) -> Settings:
    """The flags alone; the decode settings are speculate.py's, checked as there (the budget stays None
    when not given: `token_budget` resolves it once the prompts are read)."""
    s = flags.check_settings(args.decode, args.machine.device, budget=None)
    flags.check_machine(args.machine, s.compile)
    check_ranges(args, max_samples="[1, 10000000]", calibration_split="[0, 1)",
                 ece_bins="[1, 10000]", step=f"[0, {2**62}]", dist_timeout="(0, 86400]")
    runlog.check(args)
    if s.num_samples != 1:
        raise UserError(f"--num-samples {s.num_samples}: eval.py decodes each prompt once, "
                        f"as the authors do")
    check_chat_flags(chat=args.rendering.chat, ids=None, system_prompt=args.rendering.system_prompt,
                     thinking=args.rendering.enable_thinking)
    if args.target is None:
        raise UserError(f"--drafter {args.drafter[0]}: "
                        "needs --target, the target it was trained for")
    if not args.drafter:
        flags.check_no_drafter(args.decode, args.calibration)
    several = len(args.drafter) > 1 or s.tree_budget > 0
    outputs = calibration_outputs(args)
    if outputs and several:  # one report: one drafter's chain
        raise UserError(f"{outputs[0]}: calibrates one drafter's confidence head; "
                        "this run compares several rows "
                        "(more than one --drafter, or a --tree-budget curve)")
    if args.calibration and len(args.drafter) > 1:  # its chain and its trees read the same temperatures
        raise UserError(f"--calibration {args.calibration}: calibrates one drafter's confidence head, "
                        f"and this run compares {len(args.drafter)} drafters")
    if outputs and not args.drafter:
        raise UserError(f"{outputs[0]}: needs a --drafter with a confidence head")
    flags.check_calibration_read(args.calibration, s)
    tuning = calibration_tuning(args)
    if tuning and (several or not args.drafter):
        raise UserError(f"{tuning[0]}: shapes the calibration report of one drafter's confidence "
                        f"head, and this run reports none (no --drafter, more than one, "
                        f"or a --tree-budget curve): it would change nothing")
    seen = {}
    for d in args.drafter:
        same = d  # a hub id as given; a directory under any spelling
        if os.path.isdir(d):
            same = os.path.realpath(d)
        if same in seen:
            raise UserError(f"--drafter {d}: the same drafter as --drafter {seen[same]}, given twice")
        seen[same] = d
    if s.sps_table is not None and several:
        raise UserError(f"--sps-table {s.sps_table}: holds one engine's SPS(B), and this run compares "
                        f"several rows (more than one --drafter, or a --tree-budget curve): give it to a "
                        f"run of one row")
    if args.calibration_out and args.calibration_split == 0:
        raise UserError("--calibration-out needs STS: a --calibration-split between 0 and 1")
    return s


def calibration_outputs(args: EvalArgs) -> list[str]:
    """The calibration files asked for, as their flags."""
    given = {"--calibration-out": args.calibration_out, "--calibration-plot": args.calibration_plot}
    return [flag for flag, path in given.items() if path]


def calibration_tuning(args: EvalArgs) -> list[str]:
    """--calibration-split and --ece-bins where given (not at their defaults), flag and value."""
    given = []
    if args.calibration_split != EvalArgs.calibration_split:
        given.append(f"--calibration-split {args.calibration_split:g}")
    if args.ece_bins != EvalArgs.ece_bins:
        given.append(f"--ece-bins {args.ece_bins}")
    return given


def dataset_names(listed: str, flag: str, dir_flag: str) -> list[str]:
    """A comma-separated list of dataset names (eval.py's --datasets, train.py's --eval-datasets), checked:
    at least one, none empty, none a path, none twice."""
    names = [n.strip() for n in listed.split(",")]
    if not any(names):
        raise UserError(f"{flag} {listed!r}: no dataset named")
    if not all(names):
        raise UserError(f"{flag} {listed}: an empty name between commas")
    for name in names:
        if name in (".", "..") or any(c in name for c in "/\\\0"):
            raise UserError(f"{flag}: {name!r} is not a dataset name (a <name>.jsonl in {dir_flag})")
        if name.endswith(".jsonl") and name != ".jsonl":  # the file's name, not the dataset's
            raise UserError(f"{flag}: {name!r} is a file's name; the dataset is named without .jsonl "
                            f"({name[:-len('.jsonl')]!r}: its <name>.jsonl in {dir_flag})")
    for i, name in enumerate(names):
        if name in names[:i]:
            raise UserError(f"{flag}: {name!r} is named twice")
    return names


def resolve_datasets(args: EvalArgs) -> tuple[list[tuple[str, str, int]], list[str]]:
    """(name, path, sample count) of the datasets present; the known ones' missing files (after
    `resolve_defaults`)."""
    data_dir = args.data_dir
    problem = directory_problem(data_dir)
    if problem:
        raise UserError(f"--data-dir {data_dir}: {problem}")
    names = dataset_names(args.datasets, "--datasets", "--data-dir")
    out = []
    skipped = []
    for name in names:
        path = os.path.join(data_dir, f"{name}.jsonl")
        present = optional_file(path)
        if not present:
            if name not in DEFAULT_SAMPLES:
                known = ", ".join(PAPER_DATASETS)
                raise UserError(f"--datasets: unknown dataset {name!r} "
                                f"(known: {known}; or any <name>.jsonl in {data_dir})")
            skipped.append(path)
            continue
        samples = args.max_samples or DEFAULT_SAMPLES.get(name, 0)  # 0: every prompt in the file
        out.append((name, path, samples))
    if not out:
        text = f"--datasets: none of {', '.join(names)} is in {data_dir}"
        found = sorted(n for n in os.listdir(data_dir) if n.endswith(".jsonl"))
        if found:  # the user's own datasets: named, as --datasets takes them
            mine = ",".join(dataset_name(n) for n in found)
            text += f" (it holds {', '.join(found)}: give --datasets {mine})"
        raise UserError(text)
    return out, skipped


def dataset_name(path: str) -> str:
    """The dataset a --data-dir file holds: its name without .jsonl."""
    return os.path.basename(path)[:-len(".jsonl")]


def select(prompts: list, n: int, seed: int) -> list:
    """The authors' subset: longer than n, shuffled with random.Random(seed) and cut; else whole."""
    if n and len(prompts) > n:
        prompts = list(prompts)
        random.Random(seed).shuffle(prompts)
        prompts = prompts[:n]
    return prompts


def token_budget(given: Optional[int], demo: bool, prompts: dict, context: int,
                 verbose: bool) -> int:
    """--max-new-tokens as given, or the protocol's budget capped (with a note) to what the context leaves."""
    if given is not None:
        return given
    want = BUDGET
    if demo:
        want = DEMO_BUDGET
    longest = max(len(p) for ps in prompts.values() for p in ps)
    if longest + want <= context:
        return want
    if verbose:  # read_datasets left every prompt room for one new token at least
        print(f"note: --max-new-tokens {context - longest}: the default {want} capped to what the "
              f"{context}-token context leaves the longest prompt ({longest} tokens); "
              f"give --max-new-tokens to choose", file=sys.stderr)
    return context - longest


def run(args: EvalArgs) -> dict:
    """Everything `python eval.py` does; returns the results."""
    defaulted = args.out is None
    args, demo = resolve_defaults(args)
    rank, _, _ = torchrun_env()
    claimed = False
    try:
        s = check_flags(args)
        note = StopStrings.escape_note(s.stop)
        if note and rank == 0:
            print(note, file=sys.stderr)
        datasets, skipped = resolve_datasets(args)
        sps_read, sps_written = flags.sps_paths(s.sps_table)
        outputs = {"--out": args.out, "--calibration-out": args.calibration_out,
                   "--calibration-plot": args.calibration_plot, "--sps-table": sps_written}
        given = [args.target, *args.drafter, args.calibration]
        given += [path for _, path, _ in datasets]
        inputs = given + [sps_read, args.machine.compile_cache]
        check_outputs(outputs, inputs=inputs)
        check_read_apart(sps_read, "--sps-table", inputs=given)
        flags.check_calibration_file(args.calibration)
        plots.check_plot_path(args.calibration_plot, "--calibration-plot")
        target_dir = resolve_checkpoint(args.target, "--target")
        drafter_dirs = [resolve_checkpoint(d, "--drafter") for d in args.drafter]
        # the outputs not inside the snapshots hub ids resolved to either
        check_outputs(outputs, inputs=[target_dir, *drafter_dirs])
        # the default name is checked unclaimed, as the same name given is; taken now, before loading,
        # and written when the first dataset is done
        if defaulted and rank == 0:
            args = replace(args, out=free_name(args.out, claim=True))
            claimed = True
        if s.compile:
            compile_cache = use_compile_cache(args.machine.compile_cache)
            machine = replace(args.machine, compile_cache=compile_cache)
            args = replace(args, machine=machine)
        dist_init(args.machine.device, args.dist_timeout)  # before W&B: its failure must stop every rank
        with runlog.logged_run(args, "eval", "eval.py", enabled=rank == 0, from_rank0=from_rank0) as log:
            out = evaluate(args, s, datasets, skipped, target_dir, drafter_dirs, log, demo)
        if log is not None:  # wandb's closing lines came after the file was named: named again, last
            say_written(args.out)
        return out
    except BaseException:  # nothing written under the name taken: it goes
        nothing_written = os.path.isfile(args.out) and os.path.getsize(args.out) == 0
        if claimed and nothing_written:
            os.remove(args.out)
        raise


class Row(NamedTuple):
    """One row of the comparison: a drafter (None: autoregressive) at a tree budget (0: its chain)."""
    label: str
    directory: Optional[str]
    drafter: object
    tree_budget: int


def row_name(directory: str) -> str:
    """A drafter's name in the comparison: a hub snapshot's ORG/NAME, else its directory's name."""
    hub = hub_snapshot(directory)
    if hub is not None:
        repo, _, _ = hub.partition("@")
        return repo
    return os.path.basename(os.path.normpath(directory))


def rows_of(drafters: list, directories: list, tree_budget: int, draft_length: Optional[int]) -> list[Row]:
    """Every drafter's row; with --tree-budget N, a block drafter's at 0 (the chain), at each of
    TREE_BUDGETS below N, and at N: the τ-per-budget curve. --draft-length is an Eagle3 row's chain
    (`row_settings`)."""
    if not drafters:
        return [Row("autoregressive", None, None, 0)]
    block_drafters = [d for d in drafters if d.cfg.layout != "eagle3"]
    if tree_budget and not block_drafters:
        raise UserError(f"--tree-budget {tree_budget}: trees grow from a block drafter's "
                        f"distributions (DSpark or DFlash), and every --drafter is an Eagle3 "
                        f"drafter, which drafts a chain: it would change nothing")
    if draft_length is not None and len(block_drafters) == len(drafters):
        raise UserError(f"--draft-length {draft_length}: only an Eagle3 drafter's chain length "
                        f"is chosen, and no --drafter is one (a block drafter drafts its block)")
    rows = []
    names = [row_name(d) for d in directories]
    if len(set(names)) < len(names):
        names = list(directories)
    for name, directory, drafter in zip(names, directories, drafters):
        budgets = [0]
        if tree_budget and drafter.cfg.layout != "eagle3":
            budgets += [b for b in TREE_BUDGETS if b < tree_budget] + [tree_budget]
        for row_budget in budgets:
            if len(budgets) == 1:
                label = name
            elif row_budget == 0:
                label = f"{name} chain"
            else:
                label = f"{name} tree {row_budget}"
            rows.append(Row(label, directory, drafter, row_budget))
    return rows


def row_engine(m, row: Row, prompts: list, s: Settings, rank: int):
    """A row's engine. Under torchrun with --sps-table, rank 0 builds its engine first, profiling and
    writing the table if it is not there, and the other ranks read that table (each profiling and writing
    its own, they raced for the file)."""
    dist = process_group()
    shared_table = dist is not None and s.sps_table is not None
    if shared_table and rank != 0:
        dist.barrier()  # rank 0 has its table written
    engine = make_engine(m, row.drafter, prompts, s, verbose=rank == 0)
    if shared_table and rank == 0:
        dist.barrier()
    return engine


def drop_caches(model):
    """Free the KV caches `model` holds (an engine set up later makes new ones)."""
    for layer in model.layers:
        layer.self_attn.kv_cache = None


def row_settings(s: Settings, row: Row) -> Settings:
    """The settings a row decodes with: its tree budget, and --draft-length for an Eagle3 chain only (a
    block drafter drafts its block)."""
    draft_length = None
    if row.drafter is not None and row.drafter.cfg.layout == "eagle3":
        draft_length = s.draft_length
    return flags.derived(s, tree_budget=row.tree_budget, draft_length=draft_length)


def evaluate(args: EvalArgs, s: Settings, datasets: list, skipped: list, target_dir: str,
             drafter_dirs: list, log: Optional[runlog.Log], demo: bool) -> dict:
    """Load; decode every dataset with every row's drafter, reporting each as soon as it is done;
    calibrate (one drafter); print the rows side by side, then write. skipped: the missing datasets'
    files, said once the models have loaded (a run that stops before then is one line)."""
    rank, world, device = dist_init(args.machine.device, args.dist_timeout)
    threads = set_threads(args.machine.threads)
    if s.compile and rank == 0:
        print(flags.compiling_line(args.machine.compile_cache, s.max_new_tokens), file=sys.stderr)
    first = None
    if drafter_dirs:
        first = drafter_dirs[0]
    m = load_models(target_dir, first, device=device, dtype=args.machine.dtype,
                    calibration=args.calibration, seed=s.seed)
    drafters = []
    if first is not None:
        drafters.append(m.drafter)
    for directory in drafter_dirs[1:]:
        drafters.append(load_extra_drafter(directory, m))
    rows = rows_of(drafters, drafter_dirs, s.tree_budget, s.draft_length)
    tree_drafters = [row.drafter for row in rows if row.tree_budget]
    sampling = flags.sampling_for(m, s)
    temperature = sampling.temperature
    flags.check_tree_temperature(s, tree_drafters, temperature)
    flags.check_calibration_read(args.calibration, s, temperature)  # a greedy tree reads no confidence
    if rank == 0:
        for path in skipped:
            print(f"warning: {path} not found; skipping dataset {dataset_name(path)} "
                  f"(scripts/fetch_eval_data.py builds the paper's datasets)", file=sys.stderr)
    chat = auto_chat(args.rendering.chat, m.tokenizer)
    if rank == 0 and args.calibration:
        note = calibration_note(m, temperature)
        if note:
            print(note, file=sys.stderr)
    calibrates = reports_calibration(args, rows, m, first)
    # drafts a round, as the engines take it
    K = 0
    for row in rows:
        K = max(K, drafts_per_round(row.drafter, row_settings(s, row).draft_length))

    # Every rank reads every dataset, so its caches are as long as a single process's (and its batch
    # is its shard's).
    context = m.target.args.max_position_embeddings
    for d in drafters:
        context = min(context, d.cfg.layers.max_position_embeddings)
    prompts, texts = read_datasets(args, s, datasets, m, drafters, chat, context)
    budget = token_budget(s.max_new_tokens, demo, prompts, context, verbose=rank == 0)
    s = flags.derived(s, max_new_tokens=budget)
    # what results.json says ran
    args = replace(args, decode=replace(args.decode, max_new_tokens=s.max_new_tokens))
    check_calibration_room(args, s, prompts)
    # the largest shard of any rank (rank 0's): every rank's engine has one batch size, so that under
    # hardware and async scheduling they share one SPS table
    most = max(len(range(0, len(ps), world)) for ps in prompts.values())
    s = flags.derived(s, batch_size=max(1, min(s.batch_size, most)))
    every_prompt = [p for ps in prompts.values() for p in ps]
    for row in rows:  # each row's engine, checked before the first decodes
        try:
            size_engine(m, row.drafter, every_prompt, row_settings(s, row))
        except UserError as e:
            if len(args.drafter) < 2 or row.directory is None:
                raise
            raise UserError(f"--drafter {row.directory}: {e}") from None  # which of the drafters
    drafters_resolved = []  # one a row, as `rows` (None: the autoregressive row)
    for row in rows:
        described = None
        if row.drafter is not None:
            described = row.drafter.cfg.describe(row_settings(s, row).draft_length)
        drafters_resolved.append(described)
    if log is not None:
        log.config(world_size=world,
                   hardware=device_name(device),
                   dtype_resolved=dtype_name(m.dtype),
                   threads_resolved=torch.get_num_threads(),
                   scheduler_resolved=s.scheduler,
                   sampling=sampling.record(),
                   chat_resolved=chat,
                   compile_resolved=s.compile,
                   num_drafts=K,
                   datasets_resolved={n: len(ps) for n, ps in prompts.items()},
                   target_config=runlog.checkpoint_config(target_dir),
                   drafter_config=one_or_list([runlog.checkpoint_config(d) for d in drafter_dirs]),
                   drafter_resolved=drafters_resolved,
                   rows=[r.label for r in rows],
                   max_new_tokens=s.max_new_tokens)  # resolved, as results.json's config has it
    if rank == 0:
        print(f"{device_line(device)}; {threads}", file=sys.stderr)
        # the protocol renders text prompts with the template
        if texts and not chat and args.rendering.chat is None and not demo:
            print(f"chat: off (--target {args.target} has no chat template): text prompts are decoded as "
                  f"written, not rendered as the authors render them", file=sys.stderr)
        for d in drafters:
            print(d.cfg.describe(s.draft_length), file=sys.stderr)
        for line in m.hub_snapshots:
            print(line, file=sys.stderr)
    decoder = RowDecoder(args, rank, world, device, log, prompts, len(rows) > 1)
    done = []  # each row: {"label", "drafter", "tree_budget", "datasets"}, once its engine is built
    calibration = None
    latest = None  # the latest row's engine's batch and scheduler, kept once the engine is dropped

    def results(complete: bool, public_calibration=None, **more) -> dict:
        """results.json: the first row's datasets at the top (one drafter's run), every row after."""
        revisions = hub_revisions([args.target, *args.drafter], [target_dir, *drafter_dirs])
        compile_seconds = sum(row["compile_seconds"] for row in done)
        run_config = config(args, world, K, *latest, compile_seconds, drafters, chat, s.compile, m,
                            skipped, sampling, revisions)
        record = {"config": run_config, "complete": complete}
        record.update(more)
        record["datasets"] = done[0]["datasets"]
        record["calibration"] = public_calibration
        record["rows"] = done
        return record

    # a signal anywhere in here (writing --out included) leaves what is done marked interrupted
    try:
        for index, row in enumerate(rows):
            engine = row_engine(m, row, every_prompt, row_settings(s, row), rank)
            latest = (engine.max_batch, engine.scheduler.kind)
            if log is not None:  # as results.json's config: the latest row's engine's
                log.config(batch_size_resolved=engine.max_batch)
            entries = []
            parts = None  # each dataset's rounds, for the calibration
            if calibrates:
                parts = []
            done.append({"label": row.label, "drafter": row.directory, "tree_budget": row.tree_budget,
                         "compile_seconds": engine.compile_seconds, "datasets": entries})
            snapshot = functools.partial(results, False)
            decoder.decode_datasets(row, engine, s, entries, parts, snapshot)
            if calibrates:
                names = [e["dataset"] for e in entries]
                counts = [len(ps) for ps in prompts.values()]
                applied = row.drafter.confidence_head.temperature  # what --calibration set as the models loaded
                calibration = calibrate(args, rank, parts, names, counts, applied)
            # Each row was checked alone against free memory: the next row's engine is built with this
            # one gone (a live engine keeps its caches), and a drafter the next row does not draft with
            # frees its caches. The target's are reused, or replaced as the next engine makes its own.
            engine = None
            following = rows[index + 1:index + 2]
            if row.drafter is not None and following and following[0].drafter is not row.drafter:
                drop_caches(row.drafter)
    except Interrupted as e:
        if not done:  # stopped while the first engine compiled or profiled: no results yet
            e.written = []
        elif rank == 0:
            write_json(args.out, results(False, interrupted=True))
            e.written = [args.out]  # named: a default --out is whichever name was free
        raise
    if calibration is not None and s.scheduler != "none":
        calibration["scheduled"] = s.scheduler
        if rank == 0:
            print(f"warning: calibration measured under --scheduler {s.scheduler}: "
                  "the schedule chose from these same confidences which drafts were verified, "
                  "so the figures are biased (the authors record calibration unscheduled)",
                  file=sys.stderr)
    unfitted = []
    at_edge = []  # the grid's ends: the best temperature may lie beyond
    if calibration is not None and args.calibration_out:  # said of the temperatures a file keeps
        unfitted = [str(k + 1) for k, n in enumerate(calibration.get("fit_rounds_by_position", [])) if n == 0]
        ends = (STS_GRID[0], STS_GRID[-1])
        at_edge = [str(k + 1) for k, t in enumerate(calibration.get("temperatures", [])) if t in ends]
    if unfitted and rank == 0:
        print(f"warning: no round of the STS fit part verified position {', '.join(unfitted)}: "
              f"its temperature stays 1, unfitted", file=sys.stderr)
    if at_edge and rank == 0:
        print(f"note: STS temperatures at an end of their grid ({STS_GRID[0]:g} to {STS_GRID[-1]:g}) at "
              f"position {', '.join(at_edge)}: the best ones may lie beyond (more rounds help)", file=sys.stderr)
    public = None
    if calibration:
        public = {k: v for k, v in calibration.items() if not k.startswith("_")}
    out = results(True, public)
    if rank == 0:
        if len(rows) > 1:
            print()
            print(format_comparison(done, temperature))
            if skipped:  # the paper's mean is over every dataset
                names = ", ".join(dataset_name(path) for path in skipped)
                print(f"(the mean leaves out {names}: not found)")
        write_outputs(args, calibration_outputs(args), out, calibration, log, first, temperature)
    return out


def reports_calibration(args: EvalArgs, rows: list, m, first: Optional[str]) -> bool:
    """Whether the run measures the calibration report: one row, a drafter with a confidence head.
    The flags that shape or write the report are refused where it is not measured."""
    one_row = len(rows) == 1
    has_head = m.drafter is not None and m.drafter.confidence_head is not None
    calibrates = one_row and has_head
    asked = calibration_outputs(args)
    if asked and not calibrates:
        raise UserError(f"{asked[0]}: needs a --drafter with a confidence head")
    tuning = calibration_tuning(args)
    if tuning and not calibrates:
        raise UserError(f"{tuning[0]}: shapes the calibration report of a confidence head, "
                        f"and --drafter {first} has none: it would change nothing")
    return calibrates


def read_datasets(args: EvalArgs, s: Settings, datasets: list, m, drafters: list, chat: bool,
                  context: int) -> tuple[dict, bool]:
    """Each dataset's prompts as ids (the authors' subset), checked against the target and every drafter;
    and whether a chosen record is a text (or a conversation), which chat renders."""
    budget_or_one = s.max_new_tokens or 1  # the budget is resolved from the prompts, after this
    if budget_or_one >= context:
        raise UserError(f"--max-new-tokens {budget_or_one}: leaves no room for a prompt in the context of "
                        f"{context} tokens")
    if args.rendering.chat:  # as speculate.py's --chat: refused where no dataset holds a record to render
        records = []
        for _, path, _ in datasets:
            records += [p for _, p in read_prompts_file(path)]
        paths = ", ".join(path for _, path, _ in datasets)
        check_chat_renders(True, records, f"every record of {paths}")
    prompts = {}
    texts = False
    for name, path, n in datasets:
        sources = []
        picked = []  # the subset's records, (where, prompt) each

        def choose(records):  # called within this iteration, by load_prompts
            picked.extend(select(records, n, s.seed))
            return picked
        # the subset drawn from the records, and only it rendered and tokenized (as the authors read them)
        ps = load_prompts(tokenizer=m.tokenizer, chat=chat, prompts_file=path,
                          max_len=context - budget_or_one, sources=sources,
                          system_prompt=args.rendering.system_prompt,
                          thinking=args.rendering.enable_thinking, choose=choose)
        prompts[name] = ps
        if not all(is_token_ids(p) for _, p in picked):
            texts = True
        check_prompts(ps, m.target, s.max_new_tokens, sources=sources)
        for d, given in zip(drafters, args.drafter):  # what is left: each drafter's context
            try:
                check_prompts(ps, m.target, s.max_new_tokens, drafter=d, sources=sources)
            except UserError as e:
                if len(drafters) < 2:
                    raise
                raise UserError(f"--drafter {given}: {e}") from None  # which of the drafters
    return prompts, texts


def check_calibration_room(args: EvalArgs, s: Settings, prompts: dict):
    """The calibration flags need rounds to measure, and --calibration-out requests to fit STS on (the
    first --calibration-split of a dataset's) and requests held out to measure it on."""
    asked = calibration_outputs(args)
    if asked and s.max_new_tokens == 1:
        raise UserError(f"{asked[0]}: --max-new-tokens 1 ends every request at its first token, "
                        "before any round: nothing to calibrate")
    if not args.calibration_out:
        return
    sizes = [len(ps) for ps in prompts.values()]
    fitted = [fit_requests(args.calibration_split, n) for n in sizes]
    given = f"--calibration-out: --calibration-split {args.calibration_split} of {' / '.join(map(str, sizes))}"
    if not any(fitted):
        raise UserError(f"{given} requests leaves none to fit STS on; more --max-samples or a larger split")
    if fitted == sizes:  # the fitted temperatures are measured on the requests held out
        raise UserError(f"{given} requests leaves none held out to measure STS on; "
                        "more --max-samples or a smaller split")


def load_extra_drafter(directory: str, m):
    """A second (third, ...) drafter for the loaded target, as load_models loads the first: its tensors,
    counted from its files' headers, must fit in what is free beside the models already loaded."""
    from support import cpu_kernels
    from support.checkpoint import check_memory, drafter_copied_bytes, load_drafter, stored_numbers

    device = m.target.embed_tokens.weight.device
    need = stored_numbers(directory) * m.dtype.itemsize
    copy = drafter_copied_bytes(directory, device, m.dtype)  # the CPU kernels' (0 where they make none)
    check_memory([], device, m.dtype, f"--drafter {directory}: its weights", "fewer --drafter rows",
                 extra=need, extra_copies=copy)
    drafter = load_drafter(directory, m.target, device, m.dtype)
    cpu_kernels.install(drafter)
    return drafter


class Progress:
    """Rank 0's count of every rank's prompts done, as a tqdm bar, lines or nothing (`runlog.show`).
    A rank sees only its own shard finish: a dataset's count moves `world` prompts a request this
    rank finishes, at most the dataset's size, and is exact once the dataset is done."""

    def __init__(self, shown: Optional[str], label: str, total: int, world: int):
        self.label = label
        self.total = total
        self.world = world
        self.finished = 0  # the prompts of the datasets done
        self.current = 0   # ... and of the one being decoded
        self.size = 0      # that one's prompts
        self.bar = None
        self.lines = None
        if shown == "bar":
            from tqdm import tqdm
            self.bar = tqdm(total=total, file=sys.stderr, unit="prompt", dynamic_ncols=True)
        elif shown == "lines":
            self.lines = runlog.Lines()

    def say(self, text: str):
        """A line that does not break the bar."""
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text)

    def start(self, description: str, size: int):
        self.size = size
        self.current = 0
        if self.bar is not None:
            self.bar.set_description(description)

    def on_finish(self, req):
        self.current = min(self.current + self.world, self.size)
        self.show()

    def end_dataset(self):
        self.finished += self.size
        self.current = 0
        self.show()

    def show(self):
        done = self.finished + self.current
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
        if self.lines is not None:
            self.lines.say(f"{self.label}: {done}/{self.total} prompts of all datasets done")

    def close(self):
        if self.bar is not None:
            self.bar.close()


class RowDecoder:
    """What every row's decode shares: the prompts, the progress shown, where results go."""

    def __init__(self, args: EvalArgs, rank: int, world: int, device, log, prompts: dict,
                 several: bool):
        self.args = args
        self.rank = rank
        self.world = world
        self.device = device
        self.log = log
        self.prompts = prompts
        self.several = several
        self.shown = runlog.show(args.progress and rank == 0)

    def decode_datasets(self, row: Row, engine, s: Settings, entries: list,
                        parts: Optional[list], snapshot):
        """Every dataset on `engine`, this rank's interleaved shard; its counts summed across ranks, its
        entry appended to `entries` (its rounds to `parts`, for the calibration), its table line
        printed and --out rewritten with `snapshot()` as each is done (a crash later keeps them)."""
        total = sum(len(ps) for ps in self.prompts.values())
        progress = Progress(self.shown, row.label, total, self.world)
        K = engine.K
        try:
            if self.rank == 0 and self.several:
                progress.say(f"--- {row.label} ---")
            for index, (name, ps) in enumerate(self.prompts.items()):
                mine = range(self.rank, len(ps), self.world)  # this rank's interleaved shard
                requests = [Request(i, ps[i]) for i in mine]
                description = name
                if self.several:
                    description = f"{row.label}: {name}"
                progress.start(description, len(ps))
                seconds0 = engine.prefill_seconds + engine.decode_seconds
                engine.generate(requests, s.max_new_tokens, on_finish=progress.on_finish)
                elapsed = engine.prefill_seconds + engine.decode_seconds - seconds0
                seconds = all_max(elapsed, self.device)  # the slowest rank's
                counts = sum_counts(metrics.count(requests, K, engine.stop_ids), self.device)
                entry = dataset_entry(name, counts, seconds)
                entries.append(entry)
                if parts is not None:
                    parts.append(round_arrays(requests, index, K, engine.stop_ids))
                progress.end_dataset()
                if self.rank == 0:  # written before it is printed: a reader gone (`| head`) loses no row
                    write_json(self.args.out, snapshot())
                    first_dataset = index == 0
                    progress.say(format_table(entry, header=first_dataset))
                if self.log is not None:
                    prefix = ""
                    if self.several:  # a W&B section of its own: a path's slashes would nest it
                        prefix = row.label.replace("/", "|") + "/"
                    log_dataset(self.log, entry, self.args.step, prefix)
        finally:  # an interruption's line starts below the bar, not on it
            progress.close()


def calibrate(args: EvalArgs, rank: int, parts: list[dict], names: list[str], counts: list[int],
              applied: Optional[torch.Tensor]) -> Optional[dict]:
    """Every rank's rounds gathered; STS always fitted on the raw head, --calibration undone first (`applied`:
    the temperatures the drafter's confidence head applied, None without). counts: each dataset's requests."""
    rec = concat_rounds(all_gather_list(parts))
    lost = 0  # confidences a --calibration saturated, which STS cannot undo
    if applied is not None:
        lost = saturated(rec["confidence"])
        rec["confidence"] = uncalibrate(rec["confidence"], applied.tolist())
    calibration = calibration_report(rec, args.calibration_split, counts, args.ece_bins, names)
    if applied is not None:  # every figure is the raw head's: the title says so
        calibration["undone"] = args.calibration
    if lost:
        calibration["unrecoverable"] = lost
        if rank == 0:
            print(f"warning: --calibration {args.calibration}: "
                  f"{lost} recorded confidences are exactly 0 or 1 in float32 "
                  "(sigmoid(logit / T_k) saturated), "
                  "so the raw head's values cannot be recovered from them: "
                  "the raw calibration figures and the STS temperatures are not the raw head's; "
                  "calibrate without --calibration", file=sys.stderr)
    return calibration


def one_or_list(values: list):
    """How a run's config names its drafters: none as None, one as itself, several as a list in row order."""
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return values


def hub_revisions(given: list[str], directories: list[str]) -> dict:
    """Each hub id given (--target, --drafter) and the snapshot it resolved to, ORG/NAME@COMMIT: a branch
    such as main moves, and the commit says which weights ran."""
    revisions = {}
    for spec, directory in zip(given, directories):
        hub = hub_snapshot(directory)
        if hub is not None:
            revisions[spec] = hub
    return revisions


def config(args: EvalArgs, world: int, K: int, batch: int, scheduler: str, compile_seconds: float,
           drafters: list, chat: bool, compile: bool, m, skipped_files: list, sampling: flags.Sampling,
           revisions: Optional[dict] = None) -> dict:
    """results.json's config: the flags as given, and what the run resolved them to (`batch`, `scheduler`:
    the latest row's engine's; `revisions`: `hub_revisions`; `compile_seconds`: every row's compile;
    `sampling`: how tokens were drawn)."""
    drafter_config = one_or_list([d.cfg.describe(args.decode.draft_length) for d in drafters])
    skipped = [dataset_name(path) for path in skipped_files]  # datasets asked for, not found
    dtype = dtype_name(m.dtype)
    return dict(flat_fields(args), world_size=world, num_drafts=K, compile_seconds=compile_seconds,
                drafter_config=drafter_config, chat_resolved=chat, compile_resolved=compile,
                dtype_resolved=dtype, batch_size_resolved=batch,
                scheduler_resolved=scheduler, sampling=sampling.record(), skipped=skipped,
                hub_revisions=revisions or {})


def main(argv: Optional[list[str]] = None) -> int:
    return cli_main(EvalArgs, run_and_leave(run), argv, rank0=rank0)


if __name__ == "__main__":
    sys.exit(main())
