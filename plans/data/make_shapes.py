"""Make plans/data/shapes.npz, the small image data set of plans/cnn.yaml (numpy only).

Four classes of 16x16 grey images, one shape each, drawn at a random size and place on
a noisy background:

    0 square (outline)   1 cross (plus sign)   2 circle (ring)   3 line (any angle)

The file holds x_train [1200, 1, 16, 16] uint8, y_train [1200] int64, x_val [300, 1, 16,
16] uint8 and y_val [300] int64, balanced classes. Pixels are 0..255 in steps of 17 (16
grey levels) so that the compressed file stays small (< 300 KB); the plan scales them to
0..1. The output is the same for a given seed on every machine.

    python plans/data/make_shapes.py                  # rewrites plans/data/shapes.npz
    python plans/data/make_shapes.py --seed 1 -o /tmp/shapes.npz --train 4000 --val 1000
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

SIZE = 16
CLASSES = ("square", "cross", "circle", "line")
LEVELS = 15  # grey levels above black; a pixel is k * 17 for k in 0..15


def _grid() -> tuple[np.ndarray, np.ndarray]:
    ys, xs = np.mgrid[0:SIZE, 0:SIZE]
    return ys.astype(np.float64), xs.astype(np.float64)


def draw(kind: int, rng: np.random.Generator) -> np.ndarray:
    """One shape as a float image in [0, 1] (before noise)."""
    ys, xs = _grid()
    r = rng.uniform(3.0, 6.0)  # half size
    cy, cx = rng.uniform(r + 0.5, SIZE - 1.5 - r, size=2)
    width = rng.uniform(0.6, 1.1)  # stroke half width
    if kind == 0:  # square outline: near the border of a box of half side r
        d = np.maximum(np.abs(ys - cy), np.abs(xs - cx))
        ink = np.abs(d - r) <= width
    elif kind == 1:  # cross: a horizontal and a vertical bar through the centre
        inside = (np.abs(ys - cy) <= r) & (np.abs(xs - cx) <= r)
        ink = inside & ((np.abs(ys - cy) <= width) | (np.abs(xs - cx) <= width))
    elif kind == 2:  # ring
        d = np.hypot(ys - cy, xs - cx)
        ink = np.abs(d - r) <= width
    else:  # a line segment of length 2r at a random angle
        a = rng.uniform(0.0, np.pi)
        dy, dx = np.sin(a), np.cos(a)
        along = (ys - cy) * dy + (xs - cx) * dx
        across = -(ys - cy) * dx + (xs - cx) * dy
        ink = (np.abs(along) <= r) & (np.abs(across) <= width)
    return ink * rng.uniform(0.6, 1.0)


def make(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    y = np.arange(n) % len(CLASSES)
    rng.shuffle(y)
    x = np.zeros((n, 1, SIZE, SIZE), dtype=np.uint8)
    for i, kind in enumerate(y):
        img = draw(int(kind), rng)
        img = img + np.abs(rng.normal(0.0, 0.12, size=img.shape))  # background noise
        img = img * (rng.random(img.shape) > 0.05)  # a few dropped pixels
        x[i, 0] = np.clip(np.rint(img * LEVELS), 0, LEVELS).astype(np.uint8) * 17
    return x, y.astype(np.int64)


def main() -> None:
    here = Path(__file__).resolve().parent
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("-o", "--output", type=Path, default=here / "shapes.npz")
    p.add_argument("--train", type=int, default=1200)
    p.add_argument("--val", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = np.random.default_rng(args.seed)
    x_train, y_train = make(args.train, rng)
    x_val, y_val = make(args.val, rng)
    np.savez_compressed(args.output, x_train=x_train, y_train=y_train, x_val=x_val, y_val=y_val)
    print(f"wrote {args.output} ({args.output.stat().st_size / 1024:.0f} KB)")


if __name__ == "__main__":
    main()
