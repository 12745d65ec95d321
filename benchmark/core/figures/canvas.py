"""Figures at paper column width: matplotlib's object API on the Agg canvas (no pyplot, no
global state), one style for every analysis, and one writer that puts a figure's PNG and PDF
and the CSV of its numbers side by side, atomically.
"""
from __future__ import annotations

import contextlib
import logging
import math
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import matplotlib
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import LinearSegmentedColormap
from matplotlib.figure import Figure
from matplotlib.text import Text

from benchmark.core.store import atomic_path, atomic_write_text

logging.getLogger("fontTools").setLevel(logging.WARNING)  # its PDF font subsetting logs every glyph at INFO

COLUMN_WIDTH = 3.5
"""Inches: one column of a two-column paper."""
FONT_SIZE = 7
"""Points: the smallest text in a figure (tick labels, legends); titles are one point larger."""
DPI = 300
ACCENT = "#c96004"  # the paper's Figure 1 colour
PALETTE = ["#1b6ca8", "#c96004", "#3a923a", "#b8336a", "#7a5195", "#8c6d31", "#4d4d4d", "#17becf", "#bcbd22", "#e377c2"]

STYLE = {
    "font.size": FONT_SIZE,
    "axes.titlesize": FONT_SIZE + 1,
    "axes.labelsize": FONT_SIZE,
    "xtick.labelsize": FONT_SIZE,
    "ytick.labelsize": FONT_SIZE,
    "legend.fontsize": FONT_SIZE,
    "figure.titlesize": FONT_SIZE + 1,
    "axes.linewidth": 0.6,
    "lines.linewidth": 1.0,
    "xtick.major.width": 0.6,
    "ytick.major.width": 0.6,
    "xtick.major.size": 2.5,
    "ytick.major.size": 2.5,
    "legend.frameon": False,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "pdf.fonttype": 42,  # TrueType in the PDF: editable text
    "svg.fonttype": "none",
}


@contextlib.contextmanager
def style() -> Iterator[None]:
    """Inside the block, matplotlib draws with the suite's figure style."""
    with matplotlib.rc_context(STYLE):
        yield


def new_figure(height: float, width: float = COLUMN_WIDTH) -> Figure:
    """A figure ``width`` x ``height`` inches on the Agg canvas with constrained layout (call
    inside ``style()``)."""
    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


LEGEND_ROW_HEIGHT = 0.12  # inches a legend row takes at the suite's font size
LEGEND_LABEL_CHARS = 26  # two legend columns fit COLUMN_WIDTH for labels up to this many characters


def legend_layout(labels: Sequence[str]) -> tuple[int, float]:
    """``(columns, height in inches)`` of a figure legend with ``labels`` below the axes at
    ``COLUMN_WIDTH``: two columns when every label fits half the width, else one."""
    columns = 2 if max((len(label) for label in labels), default=0) <= LEGEND_LABEL_CHARS else 1
    return columns, LEGEND_ROW_HEIGHT * math.ceil(len(labels) / columns)


def sequential_colormap(color: str = ACCENT) -> LinearSegmentedColormap:
    """White to ``color``: for counts (hexbin densities)."""
    return LinearSegmentedColormap.from_list("white_to_accent", ["#ffffff", color])


def save_figure(figure: Figure, folder: Path, name: str, numbers: pd.DataFrame,
                extra: Mapping[str, pd.DataFrame] | None = None) -> list[Path]:
    """Write ``<folder>/<name>.png``, ``.pdf`` and ``<name>.csv`` (``numbers``: what the figure
    plots), plus ``<name>_<suffix>.csv`` for each entry of ``extra``; every file atomically.
    Returns the paths written. Refuses (``ValueError``) a figure with text smaller than
    ``FONT_SIZE`` points (it would not be readable at column width) or text that does not fit
    inside the canvas at its saved size (``outside_canvas``)."""
    figure.draw_without_rendering()  # tick labels exist once laid out
    small = sorted({t.get_text() for t in figure.findobj(Text) if t.get_text().strip() and t.get_fontsize() < FONT_SIZE})
    if small:
        raise ValueError(f"figure {name}: text below {FONT_SIZE} pt: {small[:5]}")
    cut = outside_canvas(figure)
    if cut:
        raise ValueError(f"figure {name}: text cut off at the edges of its {figure.get_figwidth():g} x "
                         f"{figure.get_figheight():g} in canvas: {cut[:5]}")
    folder = Path(folder)
    written = []
    for suffix in ("png", "pdf"):
        path = folder / f"{name}.{suffix}"
        with atomic_path(path) as tmp:
            figure.savefig(tmp, format=suffix, dpi=DPI, metadata=_metadata(suffix))
        written.append(path)
    tables = {"": numbers, **{f"_{key}": frame for key, frame in (extra or {}).items()}}
    for suffix, frame in tables.items():
        path = folder / f"{name}{suffix}.csv"
        atomic_write_text(path, frame.to_csv(index=False, float_format="%.6g"))
        written.append(path)
    return written


def outside_canvas(figure: Figure, tolerance_px: float = 1.0) -> list[str]:
    """What of a laid-out ``figure`` is drawn beyond its canvas at the saved size by more than
    ``tolerance_px`` pixels: figure texts and legends, and per axes its titles, texts, legend and
    each axis (label and the tick labels that are drawn), named by their text."""
    renderer = figure.canvas.get_renderer()
    box = figure.bbox
    parts: list[tuple[str, object]] = [(t.get_text(), t) for t in figure.texts] + \
        [("legend", legend) for legend in figure.legends]
    for axes in figure.axes:
        parts += [(t.get_text(), t) for t in (axes.title, axes._left_title, axes._right_title, *axes.texts)]
        parts += [(f"{name} axis '{axis.get_label().get_text()}'", axis) for name, axis in (("x", axes.xaxis), ("y", axes.yaxis))]
        if axes.get_legend() is not None:
            parts.append(("legend", axes.get_legend()))
    out = []
    for name, artist in parts:
        if not artist.get_visible() or (isinstance(artist, Text) and not artist.get_text().strip()):
            continue
        extent = artist.get_tightbbox(renderer)
        if extent is None:
            continue
        if (extent.x0 < box.x0 - tolerance_px or extent.x1 > box.x1 + tolerance_px
                or extent.y0 < box.y0 - tolerance_px or extent.y1 > box.y1 + tolerance_px):
            out.append(name)
    return out


def _metadata(suffix: str) -> dict[str, str | None]:
    """File metadata without dates, so the same numbers give the same bytes."""
    if suffix == "pdf":
        return {"Creator": "posterior-bench", "Producer": None, "CreationDate": None}
    return {"Software": "posterior-bench"}
