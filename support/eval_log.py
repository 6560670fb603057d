"""What eval.py logs to Weights & Biases: each dataset's figures as soon as it is done, then the run's
tables, charts and scalars (acceptance by position, the rows compared, the calibration) and its files."""

from __future__ import annotations

import os
from typing import Optional

from support import runlog

DATASET_FIGURES = ("num_samples", "num_rounds", "num_tokens", "acceptance_length",
                   "draft_tokens_per_proposal", "verify_rate", "tokens_per_second", "seconds")
CALIBRATION_FIGURES = ("ece", "auroc", "brier")


def log_dataset(log: runlog.Log, entry: dict, step: Optional[int], prefix: str):
    """One dataset's row of results.json under `<prefix><dataset>/`, as soon as it is done."""
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
    log.log(row, step=step)


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
        out["accept_rate_by_position"] = wb.plot.line(by_pos, "position", "accept_rate", stroke="dataset",
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
    for what, path in files.items():
        if path is not None and os.path.isfile(path):
            metadata = {"program": "eval.py", "step": step, "path": os.path.abspath(path)}
            log.artifact(what, what, [path], metadata=metadata)
