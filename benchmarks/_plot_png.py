"""A line plot written as a PNG with the standard library only (zlib, struct): the fallback of
the benchmarks' figures where matplotlib is not installed. Plain axes box, no text."""
from __future__ import annotations

import struct
import zlib

COLORS = ((31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189))


def _png(path: str, pixels: list[bytearray], width: int, height: int) -> None:
    raw = b"".join(b"\x00" + bytes(row) for row in pixels)  # filter type 0 per scanline

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))


def line_plot(path: str, series: list[tuple[list[float], list[float]]], width: int = 800,
              height: int = 500) -> None:
    """Write `series` [(xs, ys), ...] as coloured polylines (COLORS in order) in a box spanning
    their common x and y ranges, to the PNG file `path` (RGB, width x height pixels)."""
    pix = [bytearray(b"\xff" * (3 * width)) for _ in range(height)]
    pad = 20
    xs_all = [x for xs, _ in series for x in xs]
    ys_all = [y for _, ys in series for y in ys]
    x0, x1 = min(xs_all), max(xs_all)
    y0, y1 = min(ys_all), max(ys_all)
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1)

    def put(px: int, py: int, rgb) -> None:
        if 0 <= px < width and 0 <= py < height:
            pix[py][3 * px:3 * px + 3] = bytes(rgb)

    def to_px(x: float, y: float) -> tuple[int, int]:
        return (round(pad + (x - x0) / (x1 - x0) * (width - 2 * pad)),
                round(height - pad - (y - y0) / (y1 - y0) * (height - 2 * pad)))

    for i in range(pad, width - pad + 1):  # the axes box
        put(i, pad, (0, 0, 0))
        put(i, height - pad, (0, 0, 0))
    for j in range(pad, height - pad + 1):
        put(pad, j, (0, 0, 0))
        put(width - pad, j, (0, 0, 0))
    for k, (xs, ys) in enumerate(series):
        rgb = COLORS[k % len(COLORS)]
        pts = [to_px(x, y) for x, y in zip(xs, ys)]
        for (ax, ay), (bx, by) in zip(pts, pts[1:] or pts):
            n = max(abs(bx - ax), abs(by - ay), 1)
            for t in range(n + 1):
                put(round(ax + (bx - ax) * t / n), round(ay + (by - ay) * t / n), rgb)
    _png(path, pix, width, height)
