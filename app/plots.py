"""Matplotlib figures as PNG bytes, drawn off-screen by Agg: the plumbing every preview kind shares.

``Figure`` and ``FigureCanvasAgg`` are used directly, never ``pyplot`` (no global figure state, so
renders may run in the API's worker threads), and nothing here touches the global ``rcParams``.
matplotlib is imported on the first figure, not when the API starts (the import takes about a second).
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DPI = 100
TITLE_PT, TEXT_PT, SMALL_PT = 13, 10, 9
INK, MUTED = "#1e1e1e", "#5a5a5a"
PAD_IN = 0.12            # around the figure's edge
HEADER_IN = 0.75         # a title line and a subtitle line
FOOTER_IN = 0.34         # one line of small print


def new_figure(width_in: float, height_in: float, *, title: str = "", subtitle: str = "",
               footer: str = "") -> Figure:
    """A white figure with an Agg canvas, ``title`` in bold and ``subtitle`` below it at the top left
    (``HEADER_IN`` tall), ``footer`` in small print at the bottom left (``FOOTER_IN``); ``height_in``
    tall and ``width_in`` wide, or wider where these texts need it (read ``fig.get_figwidth()``).
    No layout engine (a constrained layout doubles the render time): place axes with ``add_axes_in``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width_in, height_in), dpi=DPI, facecolor="white")
    FigureCanvasAgg(fig)
    top = height_in - PAD_IN
    texts = []
    if title:
        texts.append(text_in(fig, PAD_IN, top, title, ha="left", va="top", fontsize=TITLE_PT,
                             fontweight="bold", color=INK))
    if subtitle:
        texts.append(text_in(fig, PAD_IN, top - 0.3, subtitle, ha="left", va="top", fontsize=TEXT_PT, color=MUTED))
    if footer:
        texts.append(text_in(fig, PAD_IN, PAD_IN, footer, ha="left", va="bottom", fontsize=SMALL_PT, color=INK))
    if texts:
        renderer = fig.canvas.get_renderer()
        needed_in = max(t.get_window_extent(renderer).x1 for t in texts) / DPI + PAD_IN
        fig.set_figwidth(max(width_in, needed_in))
    return fig


def add_axes_in(fig: Figure, left_in: float, bottom_in: float, width_in: float, height_in: float) -> Any:
    """Axes at a position given in inches from the figure's bottom-left corner."""
    fig_w, fig_h = fig.get_size_inches()
    return fig.add_axes((left_in / fig_w, bottom_in / fig_h, width_in / fig_w, height_in / fig_h))


def text_in(fig: Figure, x_in: float, y_in: float, text: str, **kwargs: Any) -> Any:
    """``fig.text`` at a position given in inches from the figure's bottom-left corner (kept there when
    the figure is resized), ``$`` taken literally (tensor names are not mathtext)."""
    return fig.text(x_in, y_in, text, transform=fig.dpi_scale_trans, **{"parse_math": False, **kwargs})


def figure_to_png(fig: Figure) -> bytes:
    """The figure drawn by Agg at ``DPI``, as PNG bytes (8-bit RGBA)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, facecolor="white", metadata={"Software": None})
    return buf.getvalue()


def placeholder(message: str) -> bytes:
    """A small PNG saying ``message`` (for a result with nothing to draw)."""
    fig = new_figure(max(3.0, 0.09 * len(message) + 0.6), 0.8)
    fig.text(0.5, 0.5, message, ha="center", va="center", fontsize=TEXT_PT + 1, color=INK, parse_math=False)
    return figure_to_png(fig)
