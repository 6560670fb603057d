"""What eval.py prints, writes and logs: its tables (the authors' columns, the rows compared, the
calibration), results.json and the calibration file, and to Weights & Biases each dataset's figures as
soon as it is done, then the run's tables, charts, scalars and files."""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Optional

from support import plots, runlog
from support.calibration import STS_GRID, reliability_panels, reliability_title
from support.cli import UserError, signals_deferred
from support.files import write_json

DATASET_FIGURES = ("num_samples", "num_rounds", "num_tokens", "acceptance_length",
                   "draft_tokens_per_proposal", "verify_rate", "tokens_per_second", "seconds")
CALIBRATION_FIGURES = ("ece", "auroc", "brier")


def log_dataset(log: runlog.Log, entry: dict, step: Optional[int], prefix: str):
    """One dataset's row of results.json under `<prefix><dataset>/`, as soon as it is done."""
    log.log(dataset_figures(entry, prefix), step=step)


def dataset_figures(entry: dict, prefix: str) -> dict:
    """A dataset's row of results.json as W&B figures under `<prefix><dataset>/` (eval.py's, and train.py's
    evaluations under eval/)."""
    d = prefix + entry["dataset"]
    row = {}
    for k in DATASET_FIGURES:
        if entry[k] is not None:
            row[f"{d}/{k}"] = entry[k]
    for j, r in enumerate(entry["accept_rates_by_position"]):
        if r is not None:
            row[f"{d}/accept_rate@{j}"] = r
    for j, r in enumerate(entry["accept_rate_by_position"]):
        if r is not None:
            row[f"{d}/conditional_accept_rate@{j + 1}"] = r
    return row


def calibration_rows(cal: dict, columns: list[str]) -> list[list]:
    """The W&B calibration table's rows: a position's figures, then (with STS) its temperature and the
    held-out ECE and Brier before and after."""
    sts = "temperatures" in cal
    rows = []
    for j, m in enumerate(cal["raw"]):
        row = [m[c] for c in columns]
        if sts:
            row.append(cal["temperatures"][j])
            for k in ("ece", "brier"):
                for w in ("raw", "sts"):
                    row.append(cal[f"{w}_heldout"][j][k])
        else:
            row += [None] * 5
        rows.append(row)
    return rows


def calibration_scalars(cal: dict) -> dict:
    """The calibration figures as W&B scalars: per position, per held-out split and per dataset."""
    sts = "temperatures" in cal
    out = {}
    for j, m in enumerate(cal["raw"]):
        for k in CALIBRATION_FIGURES:
            if m[k] is not None:
                out[f"calibration/{k}_{j + 1}"] = m[k]
        if not sts:
            continue
        out[f"calibration/temperature_{j + 1}"] = cal["temperatures"][j]
        for k in ("ece", "brier"):
            for w in ("raw", "sts"):
                value = cal[f"{w}_heldout"][j][k]
                if value is not None:
                    out[f"calibration/heldout_{k}_{w}_{j + 1}"] = value
    for d, ms in cal["raw_by_dataset"].items():
        for m in ms:
            for k in CALIBRATION_FIGURES:
                if m[k] is not None:
                    out[f"{d}/calibration/{k}_{m['position']}"] = m[k]
    return out


def log_results(log: runlog.Log, results: dict, step: Optional[int], image: Optional[str],
                files: dict):
    """The end of the run: tables, charts, scalars, the reliability diagram, the files."""
    wb = log.wandb
    cal = results["calibration"]
    # every row's datasets, each labelled with its row in a comparison (one drafter's run has one row)
    rows = results["rows"]
    several = len(rows) > 1
    K = 0  # the most positions any row measured (an Eagle3 row may draft more than a block drafter)
    for row in rows:
        for e in row["datasets"]:
            K = max(K, len(e["accept_rates_by_position"]))
    cols = ["dataset", "num_samples", "num_rounds", "acceptance_length", "draft_tokens_per_proposal",
            "verify_rate", "tokens_per_second"]
    lead = []
    if several:
        lead = ["row", "tree_budget"]
    acceptance = []
    by_position = []
    for row in rows:
        for e in row["datasets"]:
            rates = e["accept_rates_by_position"]
            padding = [None] * (K - len(rates))
            cells = [e[c] for c in cols] + rates + padding
            if several:
                cells = [row["label"], row["tree_budget"]] + cells
            acceptance.append(cells)
            series = e["dataset"]
            if several:
                series = f"{row['label']}: {e['dataset']}"
            pairs = zip(rates, e["accept_rate_by_position"])
            for j, (a, c) in enumerate(pairs):
                by_position.append((series, j + 1, a, c))
    rate_cols = [f"accept_rate@{j}" for j in range(K)]
    out = {"acceptance": log.table(lead + cols + rate_cols, acceptance)}
    if K:
        by_pos = log.table(["dataset", "position", "accept_rate", "conditional_accept_rate"], by_position)
        title = "accept_rate@j at draft position j + 1 (authors' definition)"
        # named as results.json's accept_rates_by_position, the authors' rates it plots
        out["accept_rates_by_position"] = wb.plot.line(by_pos, "position", "accept_rate", stroke="dataset",
                                                       title=title)
    if cal is not None:
        ccols = ["position", "rounds", "mean_survival", "observed_survival", "ece", "auroc", "brier"]
        held_out = ["temperature", "heldout_ece_raw", "heldout_ece_sts", "heldout_brier_raw",
                    "heldout_brier_sts"]
        out["calibration"] = log.table(ccols + held_out, calibration_rows(cal, ccols))
        out.update(calibration_scalars(cal))
        series = {"all rounds, raw": cal["raw"]}
        if "temperatures" in cal:
            series["held-out, raw"] = cal["raw_heldout"]
            series["held-out, after STS"] = cal["sts_heldout"]
        ys = []
        for ms in series.values():
            eces = []
            for m in ms:
                value = m["ece"]
                if value is None:  # a position no round verified has no ECE
                    value = float("nan")
                eces.append(value)
            ys.append(eces)
        positions = [m["position"] for m in cal["raw"]]
        out["calibration/ece_by_position"] = wb.plot.line_series(
            xs=positions, keys=list(series), xname="position", ys=ys,
            title="ECE of the prefix survival a_k by position")
    if image is not None:
        out["calibration/reliability_diagram"] = wb.Image(image)
    log.log(out, step=step)
    scalars = {k: v for k, v in out.items() if isinstance(v, (int, float))}
    log.summary(scalars)
    log.outputs(files, program="eval.py", step=step)


# Printed and written

def _fmt(x, spec=".2f"):
    if x is None:
        return "-"
    return format(x, spec)


def format_table(e: dict, header: bool = True) -> str:
    """A dataset's line of the table, under its header when `header`: the authors' columns in their
    order (#propose: drafts verified per round, "+1" the bonus), then samples, rounds, tokens/s and the
    paper's conditional acceptance by position."""
    rates = e["accept_rates_by_position"]
    head = f"{'dataset':<16}{'#propose':>10}{'τ':>11}{'verify_rate':>12}"
    for j in range(len(rates)):
        head += f"{f'accept_rate@{j}':>15}"
    head += f"{'samples':>9}{'rounds':>8}{'tok/s':>9}  conditional accept by position"
    lines = []
    if header:
        lines = [head, "-" * len(head)]
    cond = " ".join(_fmt(r) for r in e["accept_rate_by_position"])
    propose = "-"
    if e["draft_tokens_per_proposal"] is not None:
        propose = f"{e['draft_tokens_per_proposal']:.2f}+1"
    line = f"{e['dataset']:<16}{propose:>10}{_fmt(e['acceptance_length']):>11}"
    line += f"{_fmt(e['verify_rate'], '.4f'):>12}"
    for r in rates:
        line += f"{_fmt(r, '.4f'):>15}"
    line += f"{e['num_samples']:>9}{e['num_rounds']:>8}"
    line += f"{_fmt(e['tokens_per_second'], '.1f'):>9}  {cond}"
    lines.append(line)
    return "\n".join(lines)


def format_comparison(rows: list[dict], temperature: float) -> str:
    """The paper's Table 1: τ per dataset, a row a drafter (and tree budget), and their mean."""
    names = [e["dataset"] for e in rows[0]["datasets"]]
    width = max([16] + [len(r["label"]) + 2 for r in rows])
    columns = [max(10, len(n) + 2) for n in names]
    title = "τ at T=" + format(temperature, "g")
    head = f"{title:<{width}}"
    for n, w in zip(names, columns):
        head += f"{n:>{w}}"
    head += f"{'mean':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        taus = [e["acceptance_length"] for e in r["datasets"]]
        mean = None  # over every dataset, or undefined: rows must average the same datasets
        if taus and None not in taus:
            mean = sum(taus) / len(taus)
        cells = ""
        for t, w in zip(taus, columns):
            cells += f"{_fmt(t):>{w}}"
        lines.append(f"{r['label']:<{width}}{cells}{_fmt(mean):>9}")
    return "\n".join(lines)


def format_calibration(cal: dict) -> str:
    title = (f"confidence calibration (prefix survival a_k vs drafts 1..k accepted; "
             f"ECE with {cal['bins']} bins)")
    if "undone" in cal:
        title += f"\nof the raw head: the --calibration {cal['undone']} temperatures undone"
    lines = [title]
    head = f"{'k':>3}{'rounds':>8}{'mean a_k':>10}{'observed':>10}{'ECE':>8}{'AUROC':>8}{'Brier':>8}"
    sts = "temperatures" in cal
    if sts:
        head += f"{'T_k':>8}{'held-out ECE raw -> STS':>26}"
    lines += [head, "-" * len(head)]
    for j, m in enumerate(cal["raw"]):
        line = f"{m['position']:>3}{m['rounds']:>8}{_fmt(m['mean_survival'], '.3f'):>10}"
        line += f"{_fmt(m['observed_survival'], '.3f'):>10}{_fmt(m['ece'], '.3f'):>8}"
        line += f"{_fmt(m['auroc'], '.3f'):>8}{_fmt(m['brier'], '.3f'):>8}"
        if sts:
            raw = _fmt(cal["raw_heldout"][j]["ece"], ".3f")
            scaled = _fmt(cal["sts_heldout"][j]["ece"], ".3f")
            change = f"{raw} -> {scaled}"
            line += f"{cal['temperatures'][j]:>8.3f}{change:>26}"
        lines.append(line)
    if "sts_note" in cal:
        lines.append(cal["sts_note"])
    by = cal["raw_by_dataset"]
    if len(by) > 1:
        lines += ["", "ECE of a_k per dataset (the table above pools every dataset's rounds; "
                      "rounds: those that sent draft 1)"]
        head = f"{'dataset':<16}{'rounds':>8}"
        for k in range(1, cal["positions"] + 1):
            head += f"{f'k={k}':>7}"
        lines += [head, "-" * len(head)]
        for name, ms in by.items():
            line = f"{name:<16}{ms[0]['rounds']:>8}"
            for m in ms:
                line += f"{_fmt(m['ece'], '.3f'):>7}"
            lines.append(line)
    return "\n".join(lines)


def calibration_file(args, results: dict, calibration: dict, drafter_dir: str, temperature: float) -> dict:
    """--calibration-out's record: the fitted STS temperatures, what they were fitted on (`temperature`:
    the run's sampling temperature, as resolved), and how."""
    return {
        "temperatures": calibration["temperatures"],
        "method": "sequential temperature scaling",
        "apply": "c_k = sigmoid(logit_k / T_k) on the head's raw logit, before the threshold",
        "drafter": args.drafter,
        "target": args.target,
        "datasets": [e["dataset"] for e in results["datasets"]],
        "drafter_dir": os.path.realpath(drafter_dir),
        "temperature": temperature,
        "split": calibration["split"],
        "fit_rounds": calibration["fit_rounds"],
        "fit_rounds_by_position": calibration["fit_rounds_by_position"],
        "scheduler": calibration.get("scheduled", "none"),
        "bins": calibration["bins"],
        "grid": [float(STS_GRID[0]), float(STS_GRID[-1])],
        "heldout_ece_raw": [m["ece"] for m in calibration["raw_heldout"]],
        "heldout_ece_sts": [m["ece"] for m in calibration["sts_heldout"]],
    }


def say_written(path: str):
    """Standard error's line naming the results file: a default --out is whichever name was free."""
    print(f"results written to {path}", file=sys.stderr)


def write_outputs(args, asked: list[str], results: dict, calibration: Optional[dict],
                  log: Optional[runlog.Log], drafter_dir: Optional[str], temperature: float):
    """--out and the calibration's files (`asked`: those of them given), then W&B, then the calibration
    table: a reader of stdout that went away (`| head`) cannot cost the files or their logging.
    temperature: the run's sampling temperature, as resolved."""
    panels = None
    refused = None
    # --out and the calibration's files are published together: a signal waits for the last of them
    with signals_deferred():
        write_json(args.out, results)
        say_written(args.out)
        if asked and calibration is None:
            raise UserError(f"{asked[0]}: no request ran a round (each ended at its first token), "
                            f"so there is nothing to calibrate; {args.out} has the rest")
        if calibration is not None:
            panels = reliability_panels(calibration)
            if args.calibration_plot:
                plots.reliability_diagram(args.calibration_plot, panels, bins=args.ece_bins,
                                          title=reliability_title(calibration))
            if args.calibration_out and "temperatures" not in calibration:
                refused = f"--calibration-out: {calibration['sts_note']}"  # said after the table
            elif args.calibration_out:
                record = calibration_file(args, results, calibration, drafter_dir, temperature)
                write_json(args.calibration_out, record)
    if refused is None:
        log_outputs(args, results, calibration, log, panels)
    if calibration is not None:
        print()
        print(format_calibration(calibration))
    if refused is not None:
        raise UserError(refused)


def log_outputs(args, results: dict, calibration: Optional[dict], log: Optional[runlog.Log], panels):
    """results.json, the calibration and their files to W&B (with --wandb)."""
    if log is None:
        return
    if calibration is None:
        log_results(log, results, args.step, None, {"results": args.out})
        return
    with tempfile.TemporaryDirectory() as tmp:  # wandb.Image wants a PNG
        image = args.calibration_plot
        if image is None or not image.lower().endswith(".png"):
            image = os.path.join(tmp, "reliability_diagram.png")
            plots.reliability_diagram(image, panels, bins=args.ece_bins, title=reliability_title(calibration))
        files = {"results": args.out, "calibration": args.calibration_out}
        log_results(log, results, args.step, image, files)
