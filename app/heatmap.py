"""Heatmap images with numpy only: block-averaged downsampling of a Zarr array read chunk by chunk,
a diverging colour map centred on zero, a 5x7 bitmap font for labels, and a minimal PNG encoder
(zlib + struct). No Pillow, no matplotlib.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# -- PNG ---------------------------------------------------------------------------------------------


def encode_png(rgb: np.ndarray, *, level: int = 6) -> bytes:
    """An 8-bit RGB image ``(h, w, 3)`` as PNG bytes (filter type 0 on every scanline)."""
    rgb = np.ascontiguousarray(rgb, dtype=np.uint8)
    if rgb.ndim != 3 or rgb.shape[2] != 3 or rgb.shape[0] < 1 or rgb.shape[1] < 1:
        raise ValueError(f"encode_png: want a non-empty (h, w, 3) array, got {rgb.shape}")
    h, w, _ = rgb.shape
    raw = np.zeros((h, 1 + 3 * w), dtype=np.uint8)
    raw[:, 1:] = rgb.reshape(h, 3 * w)

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)  # 8 bits, truecolour, deflate, no filter, no interlace
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw.tobytes(), level))
            + chunk(b"IEND", b""))


def decode_png(data: bytes) -> np.ndarray:
    """Inverse of ``encode_png`` for its own output (8-bit RGB, filter 0); for tests."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG")
    pos, idat, width, height = 8, b"", 0, 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        tag, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        if zlib.crc32(tag + body) & 0xFFFFFFFF != struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])[0]:
            raise ValueError(f"bad CRC in chunk {tag!r}")
        if tag == b"IHDR":
            width, height, depth, colour = struct.unpack(">IIBB", body[:10])
            if (depth, colour) != (8, 2):
                raise ValueError("only 8-bit RGB")
        elif tag == b"IDAT":
            idat += body
        pos += 12 + length
    raw = np.frombuffer(zlib.decompress(idat), dtype=np.uint8).reshape(height, 1 + 3 * width)
    if raw[:, 0].any():
        raise ValueError("only filter type 0")
    return raw[:, 1:].reshape(height, width, 3).copy()


# -- colours -----------------------------------------------------------------------------------------

# ColorBrewer RdBu (11 classes), from -1 (dark blue) through white-ish at 0 to +1 (dark red).
_STOPS = np.array([
    (5, 48, 97), (33, 102, 172), (67, 147, 195), (146, 197, 222), (209, 229, 240), (255, 255, 255),
    (253, 219, 199), (244, 165, 130), (214, 96, 77), (178, 24, 43), (103, 0, 31)], dtype=np.float64)
_POSITIONS = np.linspace(-1.0, 1.0, len(_STOPS))
NAN_RGB = (160, 160, 160)


def diverging(values: np.ndarray, limit: float) -> np.ndarray:
    """``values`` in ``[-limit, limit]`` -> RGB (blue negative, white zero, red positive); NaN grey."""
    v = np.asarray(values, dtype=np.float64)
    t = np.clip(v / limit if limit > 0 else np.zeros_like(v), -1.0, 1.0)
    t = np.where(np.isfinite(v), t, 0.0)
    rgb = np.stack([np.interp(t, _POSITIONS, _STOPS[:, c]) for c in range(3)], axis=-1)
    rgb = np.rint(rgb).astype(np.uint8)
    rgb[~np.isfinite(v)] = NAN_RGB
    return rgb


# -- a 5x7 bitmap font -------------------------------------------------------------------------------

_GLYPHS_SRC = {
    "0": ".###. #...# #..## #.#.# ##..# #...# .###.", "1": "..#.. .##.. ..#.. ..#.. ..#.. ..#.. .###.",
    "2": ".###. #...# ....# ...#. ..#.. .#... #####", "3": "##### ...#. ..#.. ...#. ....# #...# .###.",
    "4": "...#. ..##. .#.#. #..#. ##### ...#. ...#.", "5": "##### #.... ####. ....# ....# #...# .###.",
    "6": "..##. .#... #.... ####. #...# #...# .###.", "7": "##### ....# ...#. ..#.. .#... .#... .#...",
    "8": ".###. #...# #...# .###. #...# #...# .###.", "9": ".###. #...# #...# .#### ....# ...#. .##..",
    "A": ".###. #...# #...# ##### #...# #...# #...#", "B": "####. #...# #...# ####. #...# #...# ####.",
    "C": ".###. #...# #.... #.... #.... #...# .###.", "D": "###.. #..#. #...# #...# #...# #..#. ###..",
    "E": "##### #.... #.... ####. #.... #.... #####", "F": "##### #.... #.... ####. #.... #.... #....",
    "G": ".###. #...# #.... #.### #...# #...# .####", "H": "#...# #...# #...# ##### #...# #...# #...#",
    "I": ".###. ..#.. ..#.. ..#.. ..#.. ..#.. .###.", "J": "..### ...#. ...#. ...#. ...#. #..#. .##..",
    "K": "#...# #..#. #.#.. ##... #.#.. #..#. #...#", "L": "#.... #.... #.... #.... #.... #.... #####",
    "M": "#...# ##.## #.#.# #.#.# #...# #...# #...#", "N": "#...# #...# ##..# #.#.# #..## #...# #...#",
    "O": ".###. #...# #...# #...# #...# #...# .###.", "P": "####. #...# #...# ####. #.... #.... #....",
    "Q": ".###. #...# #...# #...# #.#.# #..#. .##.#", "R": "####. #...# #...# ####. #.#.. #..#. #...#",
    "S": ".#### #.... #.... .###. ....# ....# ####.", "T": "##### ..#.. ..#.. ..#.. ..#.. ..#.. ..#..",
    "U": "#...# #...# #...# #...# #...# #...# .###.", "V": "#...# #...# #...# #...# #...# .#.#. ..#..",
    "W": "#...# #...# #...# #.#.# #.#.# #.#.# .#.#.", "X": "#...# #...# .#.#. ..#.. .#.#. #...# #...#",
    "Y": "#...# #...# .#.#. ..#.. ..#.. ..#.. ..#..", "Z": "##### ....# ...#. ..#.. .#... #.... #####",
    "-": "..... ..... ..... ##### ..... ..... .....", "+": "..... ..#.. ..#.. ##### ..#.. ..#.. .....",
    ".": "..... ..... ..... ..... ..... .##.. .##..", ":": "..... .##.. .##.. ..... .##.. .##.. .....",
    "/": "..... ....# ...#. ..#.. .#... #.... .....", "_": "..... ..... ..... ..... ..... ..... #####",
    "(": "...#. ..#.. .#... .#... .#... ..#.. ...#.", ")": ".#... ..#.. ...#. ...#. ...#. ..#.. .#...",
    ",": "..... ..... ..... ..... .##.. ..#.. .#...", "=": "..... ..... ##### ..... ##### ..... .....",
    "?": ".###. #...# ....# ...#. ..#.. ..... ..#..", " ": "..... ..... ..... ..... ..... ..... .....",
    "[": ".###. .#... .#... .#... .#... .#... .###.", "]": ".###. ...#. ...#. ...#. ...#. ...#. .###.",
    "*": "..... ..#.. #.#.# .###. #.#.# ..#.. .....", "'": "..#.. ..#.. .#... ..... ..... ..... .....",
}
GLYPHS = {ch: np.array([[c == "#" for c in row] for row in src.split()], dtype=bool)
          for ch, src in _GLYPHS_SRC.items()}
GLYPH_W, GLYPH_H = 5, 7


def text_size(text: str, scale: int = 2) -> tuple[int, int]:
    """``(width, height)`` in pixels of ``text`` drawn at ``scale``."""
    return (max(0, len(text) * (GLYPH_W + 1) - 1) * scale, GLYPH_H * scale)


def draw_text(img: np.ndarray, x: int, y: int, text: str, *, scale: int = 2,
              colour: tuple[int, int, int] = (30, 30, 30)) -> None:
    """Draw ``text`` (upper-cased; unknown characters as ``?``) with its top-left corner at ``(x, y)``."""
    for i, ch in enumerate(text.upper()):
        glyph = GLYPHS.get(ch, GLYPHS["?"])
        big = np.repeat(np.repeat(glyph, scale, axis=0), scale, axis=1)
        x0 = x + i * (GLYPH_W + 1) * scale
        y1, x1 = min(img.shape[0], y + big.shape[0]), min(img.shape[1], x0 + big.shape[1])
        if x0 >= img.shape[1] or y >= img.shape[0] or x0 < 0 or y < 0:
            continue
        region = img[y:y1, x0:x1]
        region[big[:y1 - y, :x1 - x0]] = colour


# -- downsampling ------------------------------------------------------------------------------------


@dataclass
class Downsampled:
    """Block means ``panels`` ``(P, H, W)`` of a ``rows x cols`` matrix view, and raw min/max."""

    panels: np.ndarray
    rows: int
    cols: int
    raw_min: float = math.inf
    raw_max: float = -math.inf
    panels_total: int = 1


def _bins(n: int, size: int) -> np.ndarray:
    return (np.arange(n, dtype=np.int64) * size) // max(1, n)


def _ravel(shape: Sequence[int], sels: Sequence[slice]) -> np.ndarray:
    """Flat C-order indices within ``shape`` of the rectangle ``sels`` (increasing)."""
    flat = np.zeros(1, dtype=np.int64)
    for dim, sel in zip(shape, sels):
        flat = (flat[:, None] * dim + np.arange(sel.start, sel.stop, dtype=np.int64)[None, :]).ravel()
    return flat


def _runs(bins: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start positions of the runs of a non-decreasing array, and the value of each run."""
    starts = np.concatenate([[0], np.flatnonzero(np.diff(bins)) + 1]).astype(np.intp)
    return starts, bins[starts]


def block_mean(array: Any, *, row_axes: int, batch: bool = False, max_panels: int = 4,
               max_side: int = 512) -> Downsampled:
    """Block means of ``array`` seen as a matrix (the first ``row_axes`` axes flattened into rows, the
    rest into columns; with ``batch``, axis 0 gives one panel per example, at most ``max_panels``),
    downsampled to at most ``max_side`` per side. Reads the array one storage chunk at a time (its
    ``shards``, else its ``chunks``), so memory stays at one chunk plus the ``(P, H, W)`` sums."""
    shape = tuple(int(d) for d in array.shape)
    lead = 1 if batch else 0
    if batch and not shape:
        raise ValueError("batch needs a leading batch axis")
    n_panels = min(shape[0], max_panels) if batch else 1
    row_shape, col_shape = shape[lead:lead + row_axes], shape[lead + row_axes:]
    rows, cols = math.prod(row_shape), math.prod(col_shape)
    height, width = min(rows, max_side), min(cols, max_side)
    sums = np.zeros((n_panels, height, width), dtype=np.float64)
    out = Downsampled(sums, rows, cols, panels_total=shape[0] if batch else 1)
    if rows == 0 or cols == 0 or n_panels == 0:
        out.panels = np.full((max(1, n_panels), max(1, height), max(1, width)), np.nan)
        return out
    row_bins, col_bins = _bins(rows, height), _bins(cols, width)
    counts = np.outer(np.bincount(row_bins, minlength=height), np.bincount(col_bins, minlength=width))
    chunks = tuple(getattr(array, "shards", None) or array.chunks) if shape else ()
    limits = list(shape)
    if batch:
        limits[0] = n_panels
    grid = [range(0, lim, max(1, c)) for lim, c in zip(limits, chunks)]
    for corner in np.ndindex(*[len(g) for g in grid]):
        sel = tuple(slice(g[i], min(g[i] + c, lim)) for g, i, c, lim in zip(grid, corner, chunks, limits))
        data = np.asarray(array[sel] if sel else array[...])
        b = sel[0].stop - sel[0].start if batch else 1
        row_sel, col_sel = sel[lead:lead + row_axes], sel[lead + row_axes:]
        r = _ravel(row_shape, row_sel)
        c = _ravel(col_shape, col_sel)
        block = data.reshape(b, r.size, c.size)
        finite = block[np.isfinite(block)]
        if finite.size:
            out.raw_min = min(out.raw_min, float(finite.min()))
            out.raw_max = max(out.raw_max, float(finite.max()))
        c_starts, c_bins = _runs(col_bins[c])
        r_starts, r_bins = _runs(row_bins[r])
        part = np.add.reduceat(block, c_starts, axis=2, dtype=np.float64)
        part = np.add.reduceat(part, r_starts, axis=1)
        p0 = sel[0].start if batch else 0
        sums[np.ix_(np.arange(p0, p0 + b), r_bins, c_bins)] += part
    out.panels = sums / counts[None, :, :]
    return out


# -- the picture -------------------------------------------------------------------------------------

WHITE = (255, 255, 255)
INK = (30, 30, 30)
GREY = (120, 120, 120)
FRAME = (90, 90, 90)


def _fmt(v: float) -> str:
    if not math.isfinite(v):
        return "NAN"
    return f"{v:.3g}".upper().replace("E-0", "E-").replace("E+0", "E+")


def _display_scale(n: int, target: int) -> int:
    """Integer upscaling so that ``n`` cells cover at least ``target`` pixels when ``n`` is small."""
    return max(1, target // n) if n < target else 1


def render(ds: Downsampled, *, title: str, subtitle: str = "", panel_labels: Sequence[str] | None = None,
           axis_labels: tuple[str, str] = ("ROWS", "COLS")) -> bytes:
    """The heatmap panels side by side, one shared colour scale (symmetric at the largest absolute
    block mean), a colour bar with its limits, labels; PNG bytes."""
    panels = ds.panels
    n, height, width = panels.shape
    finite = panels[np.isfinite(panels)]
    limit = float(np.abs(finite).max()) if finite.size else 0.0
    limit = limit if limit > 0 else 1.0
    target = 512 if n == 1 else 256
    sy, sx = _display_scale(height, target), _display_scale(width, target)
    ph, pw = height * sy, width * sx
    scale, line_h = 2, GLYPH_H * 2 + 8
    margin, gap, bar_w = 20, 24, 18
    label_w = text_size("-0.000E-00", scale)[0]
    top = margin + line_h * (2 if subtitle else 1) + 6 + (line_h if panel_labels else 0)
    axis_pad = line_h + 10
    img_w = margin + n * pw + (n - 1) * gap + gap + bar_w + 8 + label_w + margin
    img_h = top + ph + axis_pad + line_h + margin
    img = np.full((img_h, img_w, 3), WHITE, dtype=np.uint8)

    draw_text(img, margin, margin, title, scale=scale, colour=INK)
    if subtitle:
        draw_text(img, margin, margin + line_h, subtitle, scale=scale, colour=GREY)
    for p in range(n):
        x0 = margin + p * (pw + gap)
        rgb = diverging(panels[p], limit)
        img[top:top + ph, x0:x0 + pw] = np.repeat(np.repeat(rgb, sy, axis=0), sx, axis=1)
        img[top - 1, x0 - 1:x0 + pw + 1] = FRAME
        img[top + ph, x0 - 1:x0 + pw + 1] = FRAME
        img[top - 1:top + ph + 1, x0 - 1] = FRAME
        img[top - 1:top + ph + 1, x0 + pw] = FRAME
        if panel_labels:
            draw_text(img, x0, top - line_h, panel_labels[p], scale=scale, colour=INK)
        if p == 0:
            draw_text(img, x0, top + ph + 8, f"{axis_labels[0]} DOWN, {axis_labels[1]} ACROSS", scale=scale,
                      colour=GREY)

    # colour bar: +limit at the top, -limit at the bottom
    bx = margin + n * pw + (n - 1) * gap + gap
    ramp = np.linspace(limit, -limit, ph)[:, None].repeat(bar_w, axis=1)
    img[top:top + ph, bx:bx + bar_w] = diverging(ramp, limit)
    img[top - 1, bx - 1:bx + bar_w + 1] = FRAME
    img[top + ph, bx - 1:bx + bar_w + 1] = FRAME
    img[top - 1:top + ph + 1, bx - 1] = FRAME
    img[top - 1:top + ph + 1, bx + bar_w] = FRAME
    lx = bx + bar_w + 8
    th = GLYPH_H * scale
    draw_text(img, lx, top, "+" + _fmt(limit), scale=scale, colour=INK)
    draw_text(img, lx, top + ph // 2 - th // 2, "0", scale=scale, colour=INK)
    draw_text(img, lx, top + ph - th, "-" + _fmt(limit), scale=scale, colour=INK)

    footer = f"MIN {_fmt(ds.raw_min)}  MAX {_fmt(ds.raw_max)}  COLOUR SCALE +-{_fmt(limit)}"
    draw_text(img, margin, top + ph + axis_pad, footer, scale=scale, colour=INK)
    return encode_png(img)


def placeholder(message: str) -> bytes:
    """A small PNG with one line of text (an empty result)."""
    w, h = text_size(message, 2)
    img = np.full((h + 40, w + 40, 3), WHITE, dtype=np.uint8)
    draw_text(img, 20, 20, message, colour=INK)
    return encode_png(img)
