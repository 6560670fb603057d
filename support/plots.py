"""The figures: eval.py's reliability diagram, the concurrency plot (scripts/bench_concurrency.py) and τ and
speed against the tree budget (scripts/bench.py --tree-plot).

matplotlib is imported only when drawing, and figures are `Figure` objects, not pyplot: no GUI backend,
no global state. The extension picks the format: .png, or .svg with text as text and no date (a rerun
is the same file). Files are written whole or not at all. The metrics arrive precomputed; the
reliability diagram bins its points as the ECE does.
"""

from __future__ import annotations

import os
from typing import Optional

import numpy as np

from support.calibration import ECE_BINS, bin_index
from support.cli import UserError
from support.files import atomic_write

FORMATS = (".png", ".svg")
DPI = 144
PANELS_PER_ROW = 4  # a long block wraps
MODE_COLOURS = {"autoregressive": "tab:gray", "none": "tab:blue", "threshold": "tab:orange",
                "hardware": "tab:green", "async": "tab:red"}
OTHER_COLOURS = ("tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")


def _format(path: str) -> Optional[str]:
    ext = os.path.splitext(path)[1].lower()
    if ext not in FORMATS:
        return None
    return ext[1:]


def _bad_extension(path: str) -> str:
    return f"{path}: a plot is written as {' or '.join(FORMATS)} (the extension picks the format)"


def check_plot_path(path: Optional[str], flag: str):
    """Refuse, before any work, a plot path that is not .png or .svg."""
    if path is not None and _format(path) is None:
        raise UserError(f"{flag} {_bad_extension(path)}")


def _save(fig, path: str, fmt: str):
    import matplotlib

    rc = {"svg.fonttype": "none", "svg.hashsalt": "dspark-fast"}  # text as text, stable ids
    metadata = None
    if fmt == "svg":
        metadata = {"Date": None}  # no date: a rerun writes the same file

    def write(tmp):
        fig.savefig(tmp, format=fmt, dpi=DPI, metadata=metadata)

    with matplotlib.rc_context(rc):
        atomic_write(path, write)


def bin_stats(a, y, bins: int = ECE_BINS) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(count, mean predicted, observed rate) per bin, the bins of the ECE; NaN means in empty bins."""
    a = np.asarray(a, dtype=np.float64).ravel()
    y = np.asarray(y, dtype=np.float64).ravel()
    idx = bin_index(a, bins)
    count = np.bincount(idx, minlength=bins)
    predicted = np.bincount(idx, weights=a, minlength=bins)
    observed = np.bincount(idx, weights=y, minlength=bins)
    with np.errstate(invalid="ignore", divide="ignore"):  # 0/0 -> NaN in empty bins
        return count, predicted / count, observed / count


def _title(panel: dict) -> str:
    title = f"k={panel['position']}"
    eb = panel.get("ece_before")
    ea = panel.get("ece_after")
    auc = panel.get("auroc")
    if eb is not None:
        title += f"  ECE {100 * eb:.1f}%"
        if ea is not None:
            title += f" -> {100 * ea:.1f}%"
    if auc is not None:
        title += f"  AUROC {auc:.3f}"
    return title


def reliability_diagram(path: str, panels: list[dict], bins: int = ECE_BINS, title: Optional[str] = None):
    """One panel per position k: rounds per bin of a_k (gray), the diagonal, the observed survival
    before STS (bars) and after (markers). panels: [{"position", "before": (a, y), "after": (a, y) or
    None, and optionally "ece_before", "ece_after", "auroc" for the title}]; `title`: which rounds they
    are, above them all."""
    fmt = _format(path)
    if fmt is None:
        raise ValueError(_bad_extension(path))
    if not panels:
        raise ValueError(f"{path}: no panels to draw")
    from matplotlib.figure import Figure

    cols = min(len(panels), PANELS_PER_ROW)
    rows = -(-len(panels) // cols)
    fig = Figure(figsize=(3.6 * cols, 3.4 * rows), layout="constrained")
    if title:
        fig.suptitle(title, fontsize="medium")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    centres = (np.arange(bins) + 0.5) / bins
    ticks = np.linspace(0, 1, 6)
    for j, (ax, panel) in enumerate(zip(axes, panels)):
        count, _, observed = bin_stats(*panel["before"], bins)
        hist = ax.twinx()  # counts behind the rates
        hist.add_collection(bars(centres, count, 1 / bins, color="0.88", label="rounds"))
        hist.set_ylim(0, max(int(count.max()), 1) / 0.9)
        hist.set_ylabel("rounds", color="0.45")
        hist.tick_params(axis="y", colors="0.45", labelsize="small")
        ax.set_zorder(hist.get_zorder() + 1)
        ax.patch.set_visible(False)
        ax.plot([0, 1], [0, 1], color="0.5", linestyle="--", linewidth=1, label="perfect calibration")
        seen = count > 0
        ax.add_collection(bars(centres[seen], observed[seen], 0.7 / bins, color="tab:blue", label="before STS"))
        if panel.get("after") is not None:
            count_after, _, observed_after = bin_stats(*panel["after"], bins)
            seen = count_after > 0
            ax.plot(centres[seen], observed_after[seen], "o", color="tab:orange", markersize=4,
                    label="after STS")
        ax.set(xlim=(0, 1), ylim=(0, 1), xticks=ticks, yticks=ticks, title=_title(panel),
               xlabel="predicted survival a_k", ylabel="observed survival")
        ax.title.set_fontsize("medium")
        if j == 0:  # every panel draws the same things
            handles, labels = ax.get_legend_handles_labels()
            more, more_labels = hist.get_legend_handles_labels()
            ax.legend(handles + more, labels + more_labels, loc="upper left", fontsize="small")
    for ax in axes[len(panels):]:
        ax.set_axis_off()
    _save(fig, path, fmt)


def bars(centres: np.ndarray, heights: np.ndarray, width: float, **style):
    """Bars from 0 as one artist: thousands of bins draw in a moment, where a patch each took minutes."""
    from matplotlib.collections import PolyCollection

    left = centres - width / 2
    right = centres + width / 2
    zero = np.zeros_like(heights)
    corners = np.stack([np.stack([left, zero], -1), np.stack([left, heights], -1),
                        np.stack([right, heights], -1), np.stack([right, zero], -1)], axis=1)
    return PolyCollection(corners, linewidths=0, **style)


def concurrency_plot(path: str, rows: list[dict]):
    """Total and per-request tokens/s against concurrency (log2 axis), one line per mode. rows:
    [{"concurrency", "mode", "total_tokens_per_second", "per_request_tokens_per_second", ...}]."""
    fmt = _format(path)
    if fmt is None:
        raise ValueError(_bad_extension(path))
    if not rows:
        raise ValueError(f"{path}: no rows to draw")
    from matplotlib.figure import Figure

    levels = sorted({r["concurrency"] for r in rows})
    modes = list(dict.fromkeys(r["mode"] for r in rows))  # in the order measured
    others = iter(OTHER_COLOURS * len(modes))
    colours = {}
    for m in modes:
        colours[m] = MODE_COLOURS.get(m) or next(others)
    fig = Figure(figsize=(10, 4), layout="constrained")
    axes = fig.subplots(1, 2)
    panels = (("total_tokens_per_second", "total tokens/s (all requests)"),
              ("per_request_tokens_per_second", "per-request tokens/s"))
    for ax, (key, title) in zip(axes, panels):
        for m in modes:
            pts = sorted((r["concurrency"], r[key]) for r in rows if r["mode"] == m)
            xs = [c for c, _ in pts]
            ys = [v for _, v in pts]
            ax.plot(xs, ys, marker="o", color=colours[m], label=m)
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, labels=[str(c) for c in levels])
        ax.minorticks_off()
        ax.set_xlim(levels[0] / 2 ** 0.5, levels[-1] * 2 ** 0.5)  # half an octave each side
        ax.set_ylim(bottom=0)
        ax.set(title=title, xlabel="concurrency (requests in flight)", ylabel="tokens/s")
        ax.grid(alpha=0.3)
    axes[0].legend(title="mode", fontsize="small")
    _save(fig, path, fmt)


def tree_plot(path: str, rows: list[dict], title: str):
    """τ and speed-up over autoregressive decoding against the tree budget (log2 axis), the chain a
    dashed line: scripts/bench.py --tree-plot. rows: bench's, one batch size ({"mode": "speculative" or
    "tree N", "acceptance_length", "speed_up"})."""
    fmt = _format(path)
    if fmt is None:
        raise ValueError(_bad_extension(path))
    trees = []  # (budget, row)
    chain = None
    for r in rows:
        if r["mode"].startswith("tree "):
            trees.append((int(r["mode"].split()[1]), r))
        elif r["mode"] == "speculative" and chain is None:
            chain = r
    trees.sort(key=lambda pair: pair[0])
    if not trees or chain is None:
        raise ValueError(f"{path}: needs the chain's row and at least one tree's")
    from matplotlib.figure import Figure

    budgets = [b for b, _ in trees]
    fig = Figure(figsize=(10, 4), layout="constrained")
    fig.suptitle(title)
    axes = fig.subplots(1, 2)
    panels = ((axes[0], "acceptance_length", "τ (tokens committed a round)"),
              (axes[1], "speed_up", "tokens/s ÷ autoregressive tokens/s"))
    for ax, key, label in panels:
        values = [r[key] for _, r in trees]
        ax.plot(budgets, values, marker="o", color="tab:green", label="tree")
        ax.axhline(chain[key], color="tab:blue", linestyle="--", label="chain")
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, labels=[str(b) for b in budgets])
        ax.minorticks_off()
        ax.set(xlabel="tree budget (nodes a round)", ylabel=label)
        ax.grid(alpha=0.3)
    axes[1].axhline(1.0, color="tab:gray", linewidth=0.8)
    axes[1].set_ylim(bottom=0)
    axes[0].legend(fontsize="small")
    _save(fig, path, fmt)
