"""plots.py: both figures as valid PNG and SVG files (the SVG's text holds the axis labels, legend
entries and titles), the edge cases (no STS, one concurrency level, empty bins), the binning against
eval.py's ECE, bad extensions, and saving whole or not at all."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import numpy as np
import pytest
from conftest import REPO_ROOT

from support import plots
from support.cli import UserError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TAB_BLUE, TAB_ORANGE, TAB_GREEN = (31, 119, 180), (255, 127, 14), (44, 160, 44)


def events(n: int, seed: int, power: float = 1.0):
    """(a, y): n predicted survival probabilities and outcomes drawn with P(y=1) = a**power
    (power > 1: an over-confident head)."""
    rng = np.random.default_rng(seed)
    a = rng.uniform(size=n)
    return a, (rng.uniform(size=n) < a ** power).astype(np.int64)


PANELS = [
    {"position": 1, "before": events(400, 1, 2.0), "after": events(400, 2), "ece_before": 0.081,
     "ece_after": 0.023, "auroc": 0.7104},
    {"position": 2, "before": events(300, 3, 2.0), "after": None, "ece_before": 0.105, "ece_after": None,
     "auroc": 0.65},
    {"position": 3, "before": events(200, 4), "after": events(200, 5)},  # no numbers: the title is "k=3"
]
ROWS = [{"concurrency": c, "mode": m, "total_tokens_per_second": c * s * 10 / (1 + c / 8),
         "per_request_tokens_per_second": s * 10 / (1 + c / 8), "acceptance_length": 2.0}
        for c in (1, 2, 4, 8) for m, s in (("autoregressive", 1.0), ("none", 1.5), ("threshold", 1.8),
                                          ("hardware", 2.0), ("a-later-mode", 1.2))]


def read_png(path, width: int, height: int) -> np.ndarray:
    """The pixels [H, W, 3] (uint8) of a PNG of about width x height, checked not blank."""
    import matplotlib.image

    with open(path, "rb") as f:
        assert f.read(8) == PNG_SIGNATURE
    img = matplotlib.image.imread(path)
    h, w = img.shape[:2]
    assert abs(w - width) <= 2 and abs(h - height) <= 2, (w, h)
    rgb = (img[..., :3] * 255).round().astype(np.int64)
    assert (rgb < 250).any(axis=-1).mean() > 0.02  # more than a white page
    return rgb


def has_colour(rgb: np.ndarray, colour) -> bool:
    return bool((np.abs(rgb - np.array(colour)).max(axis=-1) <= 3).any())


def svg_texts(path) -> set[str]:
    """Every text string of an SVG (the XML parses)."""
    root = ET.parse(path).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    return {e.text for e in root.iter("{http://www.w3.org/2000/svg}text") if e.text}


# ----------------------------------------------------------------------------------------
# Reliability diagram

def test_reliability_diagram_png_and_svg(tmp_path):
    png, svg = tmp_path / "rel.png", tmp_path / "rel.svg"
    plots.reliability_diagram(str(png), PANELS)
    rgb = read_png(png, 3 * 3.6 * plots.DPI, 3.4 * plots.DPI)  # three panels in one row
    right = rgb[:, rgb.shape[1] // 3:]  # the panels without the legend
    assert has_colour(right, TAB_BLUE) and has_colour(right, TAB_ORANGE)  # bars before STS, markers after
    plots.reliability_diagram(str(svg), PANELS)
    texts = svg_texts(svg)
    assert {"predicted survival a_k", "observed survival", "rounds",
            "before STS", "after STS", "perfect calibration",
            "k=1  ECE 8.1% -> 2.3%  AUROC 0.710", "k=2  ECE 10.5%  AUROC 0.650", "k=3"} <= texts
    assert {"0.0", "0.2", "1.0"} <= texts  # ticks 0..1
    first = svg.read_bytes()
    plots.reliability_diagram(str(svg), PANELS)
    assert svg.read_bytes() == first  # no date, fixed ids: a rerun is the same file
    assert sorted(os.listdir(tmp_path)) == ["rel.png", "rel.svg"]  # no temporary file left


def test_reliability_diagram_without_sts_empty_bins_and_wrapping(tmp_path):
    one_bin = (np.full(50, 0.97), np.ones(50, dtype=np.int64))  # every other bin empty
    nothing = (np.zeros(0), np.zeros(0, dtype=np.int64))  # a position no round reached
    panels = [{"position": k, "before": ev, "after": None} for k, ev in enumerate([one_bin, nothing] * 3, 1)]
    svg = tmp_path / "rel.svg"
    plots.reliability_diagram(str(svg), panels, bins=10)
    texts = svg_texts(svg)
    assert {"before STS", "k=6"} <= texts and "after STS" not in texts
    png = tmp_path / "rel.png"
    plots.reliability_diagram(str(png), panels, bins=10)
    read_png(png, plots.PANELS_PER_ROW * 3.6 * plots.DPI, 2 * 3.4 * plots.DPI)  # six panels wrap to two rows


def test_many_bins_draw_as_one_artist_per_series(tmp_path, monkeypatch):
    """--ece-bins goes to 10,000: a patch per bin made the diagram take minutes. Each series (rounds,
    bars before STS) is one artist whatever the bins."""
    drawn = []
    monkeypatch.setattr(plots, "_save", lambda fig, path, fmt: drawn.append(fig))
    plots.reliability_diagram(str(tmp_path / "rel.png"), PANELS, bins=5000)
    (fig,) = drawn
    shapes = sum(len(ax.patches) + len(ax.collections) for ax in fig.axes)
    assert shapes < 10 * len(PANELS), shapes


def test_bin_stats_bins_as_eval_ece():
    from support import calibration as cal

    a = np.array([0.0, 0.1, 0.2, 0.3999, 0.61, 0.8, 0.99, 1.0])
    y = np.array([0, 1, 1, 0, 1, 1, 1, 0])
    count, predicted, observed = plots.bin_stats(a, y, bins=5)
    assert count.tolist() == [2, 2, 0, 1, 3]  # [b/5, (b+1)/5), the last bin closed
    assert np.isnan(predicted[2]) and np.isnan(observed[2])  # empty bin
    assert predicted[1] == pytest.approx((0.2 + 0.3999) / 2) and observed[4] == pytest.approx(2 / 3)
    for seed in range(3):  # the bars are the ones eval.py's ECE sums over
        a, y = events(500, seed, 1.5)
        count, predicted, observed = plots.bin_stats(a, y, cal.ECE_BINS)
        seen = count > 0
        gap = (count[seen] * np.abs(observed[seen] - predicted[seen])).sum() / a.size
        assert gap == pytest.approx(cal.ece(a, y, cal.ECE_BINS), abs=1e-12)


# ----------------------------------------------------------------------------------------
# Concurrency plot

def test_concurrency_plot_png_and_svg(tmp_path):
    png, svg = tmp_path / "conc.png", tmp_path / "conc.svg"
    plots.concurrency_plot(str(png), ROWS)
    rgb = read_png(png, 10 * plots.DPI, 4 * plots.DPI)
    assert all(has_colour(rgb[:, rgb.shape[1] // 2:], c) for c in (TAB_BLUE, TAB_ORANGE, TAB_GREEN))  # no legend there
    plots.concurrency_plot(str(svg), ROWS)
    texts = svg_texts(svg)
    assert {"autoregressive", "none", "threshold", "hardware", "a-later-mode", "mode"} <= texts  # legend
    assert {"total tokens/s (all requests)", "per-request tokens/s", "concurrency (requests in flight)",
            "tokens/s"} <= texts
    assert {"1", "2", "4", "8"} <= texts  # x ticks at the measured levels


def test_concurrency_plot_one_level(tmp_path):
    rows = [r for r in ROWS if r["concurrency"] == 4]
    png, svg = tmp_path / "conc.png", tmp_path / "conc.svg"
    plots.concurrency_plot(str(png), rows)
    rgb = read_png(png, 10 * plots.DPI, 4 * plots.DPI)
    assert all(has_colour(rgb[:, rgb.shape[1] // 2:], c) for c in (TAB_BLUE, TAB_ORANGE, TAB_GREEN))  # in view
    plots.concurrency_plot(str(svg), rows)
    assert {"4", "hardware", "concurrency (requests in flight)"} <= svg_texts(svg)


# ----------------------------------------------------------------------------------------
# Tree plot

TREE_ROWS = [{"mode": "autoregressive", "acceptance_length": 1.0},
             {"mode": "speculative", "acceptance_length": 5.75, "speed_up": 2.99}] + [
    {"mode": f"tree {b}", "acceptance_length": 4.0 + b / 20, "speed_up": 2.5 - b / 40} for b in (4, 8, 16, 64)]


def test_tree_plot_png_and_svg(tmp_path):
    png, svg = tmp_path / "trees.png", tmp_path / "trees.svg"
    plots.tree_plot(str(png), TREE_ROWS, "demo, batch 1")
    rgb = read_png(png, 10 * plots.DPI, 4 * plots.DPI)
    assert has_colour(rgb, TAB_GREEN) and has_colour(rgb, TAB_BLUE)  # the trees and the chain
    plots.tree_plot(str(svg), TREE_ROWS, "demo, batch 1")
    texts = svg_texts(svg)
    assert {"tree", "chain", "demo, batch 1", "tree budget (nodes a round)", "τ (tokens committed a round)",
            "tokens/s ÷ autoregressive tokens/s"} <= texts
    assert {"4", "8", "16", "64"} <= texts  # x ticks at the measured budgets


def test_tree_plot_needs_chain_and_trees(tmp_path):
    for rows in (TREE_ROWS[:2], [r for r in TREE_ROWS if r["mode"] != "speculative"]):
        with pytest.raises(ValueError, match="needs the chain's row and at least one tree's"):
            plots.tree_plot(str(tmp_path / "t.png"), rows, "x")
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------------------
# Paths and failures

DRAW = {"reliability": lambda path: plots.reliability_diagram(path, PANELS[:1]),
        "concurrency": lambda path: plots.concurrency_plot(path, ROWS),
        "trees": lambda path: plots.tree_plot(path, TREE_ROWS, "demo")}


@pytest.mark.parametrize("figure", DRAW)
@pytest.mark.parametrize("name", ["plot.pdf", "plot", "plot.png.txt"])
def test_bad_extension(tmp_path, figure, name):
    path = str(tmp_path / name)
    with pytest.raises(ValueError, match=r"plot.*: a plot is written as \.png or \.svg"):
        DRAW[figure](path)
    with pytest.raises(UserError) as e:
        plots.check_plot_path(path, "--plot")
    assert str(e.value) == f"--plot {path}: a plot is written as .png or .svg (the extension picks the format)"
    assert os.listdir(tmp_path) == []


def test_check_plot_path_accepts():
    for path in (None, "a.png", "dir/b.svg", "C.PNG"):
        plots.check_plot_path(path, "--calibration-plot")


@pytest.mark.parametrize("figure", DRAW)
def test_failed_save_writes_nothing(tmp_path, monkeypatch, figure):
    import matplotlib.figure

    def fail(*args, **kwargs):
        raise OSError("disk full")

    DRAW[figure](str(tmp_path / "old.png"))
    old = (tmp_path / "old.png").read_bytes()
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", fail)
    for name in ("new.png", "old.png"):
        with pytest.raises(OSError, match="disk full"):
            DRAW[figure](str(tmp_path / name))
    assert os.listdir(tmp_path) == ["old.png"] and (tmp_path / "old.png").read_bytes() == old


def test_import_does_not_load_matplotlib():
    code = "import sys; from support import plots; assert 'matplotlib' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True, timeout=120)


def test_the_reliability_diagram_says_which_rounds_it_shows(tmp_path):
    """With STS the panels are the held-out rounds, not every round the table scores, and a schedule may
    have chosen them: the figure said neither, so its ECE and AUROC read as the table's."""
    from support.calibration import reliability_title

    held = {"_heldout": (), "heldout_rounds": 52, "fit_rounds": 57, "rounds": 109, "bins": 20}
    assert reliability_title(held) == "held-out requests: 52 rounds (the other 57 fitted STS); ECE over 20 bins"
    every = {"rounds": 109, "bins": 10, "scheduled": "threshold"}
    assert reliability_title(every) == ("every round: 109 (no STS); ECE over 10 bins; "
                                        "chosen under --scheduler threshold: biased")
    svg = tmp_path / "rel.svg"
    plots.reliability_diagram(str(svg), PANELS, title=reliability_title(held))
    assert reliability_title(held) in svg_texts(svg)
