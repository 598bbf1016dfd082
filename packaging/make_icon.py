"""Draw the MLX Desk app icon and write every size the bundles need.

The icon is drawn, not painted by hand, so it can be regenerated at any size:
a superellipse tile (the macOS app-icon shape) with a diagonal indigo-to-teal
gradient, a white speech bubble, and a spark inside the bubble (a model that
answers).

    python packaging/make_icon.py            # writes resources/icons/
    python packaging/make_icon.py --out DIR

Outputs: mlx-desk.png (1024), mlx-desk-<N>.png for the Linux hicolor sizes,
mlx-desk.icns (macOS), mlx-desk.svg (the window icon the app sets) and
mlx-desk.ico (Windows, for completeness).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from PIL import Image, ImageChops, ImageDraw, ImageFilter

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "resources" / "icons"

CANVAS = 1024
# Supersampling factor: shapes are drawn large, then reduced with a good filter,
# which gives clean anti-aliased edges without a vector library.
SS = 4
# Apple's grid: an 824 px tile centred on a 1024 canvas leaves room for the shadow.
TILE = 824
LINUX_SIZES = (16, 24, 32, 48, 64, 128, 256, 512)
ICNS_SIZES = (16, 32, 64, 128, 256, 512, 1024)

INDIGO = (79, 70, 229)
VIOLET = (124, 58, 237)
TEAL = (20, 184, 166)
WHITE = (255, 255, 255)
GRADIENT = [(0.0, VIOLET), (0.45, INDIGO), (1.0, TEAL)]

# Geometry on the 1024 canvas, shared by the bitmap and the SVG.
BUBBLE = (262, 282, 762, 662)  # x0, y0, x1, y1
BUBBLE_RADIUS = 120
TAIL = [(330, 620), (300, 770), (460, 650)]
SPARKS = [(452, 472, 126), (620, 386, 56), (626, 560, 36)]  # cx, cy, r


def superellipse(cx: float, cy: float, half: float, n: float = 5.0, steps: int = 720) -> list[tuple[float, float]]:
    """Points of |x|^n + |y|^n = half^n: the continuous-curvature 'squircle'."""
    pts = []
    for i in range(steps):
        t = 2 * math.pi * i / steps
        c, s = math.cos(t), math.sin(t)
        x = half * math.copysign(abs(c) ** (2 / n), c)
        y = half * math.copysign(abs(s) ** (2 / n), s)
        pts.append((cx + x, cy + y))
    return pts


def diagonal_gradient(size: int, stops: list[tuple[float, tuple[int, int, int]]]) -> Image.Image:
    """An RGB image whose colour runs through ``stops`` from top-left to bottom-right."""
    # Build a 1-D ramp, then stretch it along the diagonal by rotating a wide strip.
    ramp_len = 256
    ramp = Image.new("RGB", (ramp_len, 1))
    for i in range(ramp_len):
        t = i / (ramp_len - 1)
        for (t0, c0), (t1, c1) in zip(stops, stops[1:]):
            if t0 <= t <= t1:
                u = (t - t0) / (t1 - t0) if t1 > t0 else 0.0
                ramp.putpixel((i, 0), tuple(round(a + (b - a) * u) for a, b in zip(c0, c1)))
                break
    diag = int(size * math.sqrt(2)) + 2
    strip = ramp.resize((diag, diag), Image.Resampling.BILINEAR)
    strip = strip.rotate(-45, resample=Image.Resampling.BICUBIC, expand=False)
    off = (diag - size) // 2
    return strip.crop((off, off, off + size, off + size))


def spark(cx: float, cy: float, r: float, waist: float = 0.22, steps: int = 64) -> list[tuple[float, float]]:
    """A four-pointed star with concave sides (the common 'AI' sparkle)."""
    pts = []
    for i in range(steps * 4):
        t = 2 * math.pi * i / (steps * 4)
        c, s = math.cos(t), math.sin(t)
        # An astroid-like curve: |x|^p + |y|^p = r^p with p < 1 pinches the sides in.
        p = waist * 2.6
        x = r * math.copysign(abs(c) ** (2 / p), c)
        y = r * math.copysign(abs(s) ** (2 / p), s)
        pts.append((cx + x, cy + y))
    return pts


def draw_icon() -> Image.Image:
    """The 1024 px master, RGBA."""
    S = CANVAS * SS
    centre = S / 2
    half = TILE * SS / 2

    tile_mask = Image.new("L", (S, S), 0)
    ImageDraw.Draw(tile_mask).polygon(superellipse(centre, centre, half), fill=255)

    # Soft shadow under the tile, offset downwards like the system icons.
    shadow = Image.new("L", (S, S), 0)
    ImageDraw.Draw(shadow).polygon(superellipse(centre, centre + 12 * SS, half - 4 * SS), fill=90)
    shadow = shadow.filter(ImageFilter.GaussianBlur(18 * SS))

    bg = diagonal_gradient(S, GRADIENT)
    # A faint highlight fading out down the top half gives the tile some depth.
    gloss = Image.linear_gradient("L").resize((S, S)).point(lambda v: max(0, 40 - v * 40 // 140))
    bg = Image.composite(Image.new("RGB", (S, S), WHITE), bg, gloss)

    icon = Image.new("RGBA", (S, S), (0, 0, 0, 0))
    icon.paste((0, 0, 0, 255), (0, 0), shadow)
    icon.paste(bg, (0, 0), tile_mask)

    # The speech bubble: a rounded rectangle with a tail at its lower left.
    bubble = Image.new("L", (S, S), 0)
    d = ImageDraw.Draw(bubble)
    d.rounded_rectangle([v * SS for v in BUBBLE], radius=BUBBLE_RADIUS * SS, fill=255)
    d.polygon([(x * SS, y * SS) for x, y in TAIL], fill=255)

    # Bubble shadow, so the white shape lifts off the gradient.
    bshadow = bubble.filter(ImageFilter.GaussianBlur(14 * SS)).point(lambda v: v * 0.28)
    bshadow = ImageChops.offset(bshadow, 0, 10 * SS)
    icon.paste((30, 20, 90, 255), (0, 0), ImageChops.multiply(bshadow, tile_mask))
    icon.paste((*WHITE, 255), (0, 0), bubble)

    # Sparks inside the bubble, filled with the tile's own gradient.
    sparks = Image.new("L", (S, S), 0)
    sd = ImageDraw.Draw(sparks)
    for cx, cy, r in SPARKS:
        sd.polygon(spark(cx * SS, cy * SS, r * SS), fill=255)
    spark_fill = diagonal_gradient(S, GRADIENT)
    icon.paste(spark_fill, (0, 0), sparks)

    return icon.resize((CANVAS, CANVAS), Image.Resampling.LANCZOS)


def _path(points: list[tuple[float, float]]) -> str:
    head, *rest = points
    return f"M{head[0]:.1f} {head[1]:.1f}" + "".join(f"L{x:.1f} {y:.1f}" for x, y in rest) + "Z"


def icon_svg() -> str:
    """The same icon as an SVG (no drop shadows: Qt's SVG renderer has no filters)."""
    stops = "".join(f'<stop offset="{t}" stop-color="#{r:02x}{g:02x}{b:02x}"/>' for t, (r, g, b) in GRADIENT)
    x0, y0, x1, y1 = BUBBLE
    sparks = "".join(f'<path d="{_path(spark(cx, cy, r, steps=24))}" fill="url(#tile)"/>' for cx, cy, r in SPARKS)
    tile = _path(superellipse(CANVAS / 2, CANVAS / 2, TILE / 2, steps=160))
    return (
        '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 1024 1024">'
        "<defs>"
        f'<linearGradient id="tile" x1="0" y1="0" x2="1" y2="1">{stops}</linearGradient>'
        '<linearGradient id="gloss" x1="0" y1="0" x2="0" y2="1">'
        '<stop offset="0" stop-color="#fff" stop-opacity="0.16"/>'
        '<stop offset="0.55" stop-color="#fff" stop-opacity="0"/></linearGradient>'
        "</defs>"
        f'<path d="{tile}" fill="url(#tile)"/><path d="{tile}" fill="url(#gloss)"/>'
        f'<rect x="{x0}" y="{y0}" width="{x1 - x0}" height="{y1 - y0}" rx="{BUBBLE_RADIUS}" fill="#fff"/>'
        f'<path d="{_path(TAIL)}" fill="#fff"/>{sparks}</svg>\n'
    )


def write_all(out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    master = draw_icon()
    written = []
    png = out / "mlx-desk.png"
    master.save(png, optimize=True)
    written.append(png)
    for size in LINUX_SIZES:
        p = out / f"mlx-desk-{size}.png"
        master.resize((size, size), Image.Resampling.LANCZOS).save(p, optimize=True)
        written.append(p)
    icns = out / "mlx-desk.icns"
    # Pillow's ICNS writer takes the images for each slot from append_images.
    master.save(icns, append_images=[master.resize((s, s), Image.Resampling.LANCZOS) for s in ICNS_SIZES])
    written.append(icns)
    svg = out / "mlx-desk.svg"
    svg.write_text(icon_svg(), encoding="utf-8")
    written.append(svg)
    ico = out / "mlx-desk.ico"
    master.save(ico, sizes=[(s, s) for s in (16, 24, 32, 48, 64, 128, 256)])
    written.append(ico)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for the icon files")
    args = parser.parse_args()
    for p in write_all(args.out):
        print(f"{p}  {p.stat().st_size // 1024} KiB")


if __name__ == "__main__":
    main()
