"""A small real data set for comparisons on a machine without a network: scikit-learn's
handwritten digits (1,797 8x8 images of 0-9, shipped inside the scikit-learn package),
written as an ImageFolder (``train/<digit>/*.png``, ``val/<digit>/*.png``).

    pip install scikit-learn
    python AMP/tools/digits.py data/digits          # 1,438 train / 359 val images
    python AMP/compare.py --dataset ImageFolder --dataset_root data/digits --img_size 64

The split is stratified and seeded: each digit keeps the same share in both halves, and
the same files every time. Pixels (0-16) are scaled to 0-255, grey in all three channels.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from PIL import Image


def write_digits(root: Path, val_fraction: float = 0.2, seed: int = 0) -> Path:
    """Write the digits under ``root`` (which must not hold them yet); returns ``root``."""
    # Imported here: scikit-learn is needed for this data set alone.
    from sklearn.datasets import load_digits

    digits = load_digits()
    rng = np.random.default_rng(seed)
    root = Path(root)
    for label in range(10):
        indices = rng.permutation(np.flatnonzero(digits.target == label))
        n_val = round(len(indices) * val_fraction)
        for split, part in (("val", indices[:n_val]), ("train", indices[n_val:])):
            folder = root / split / str(label)
            folder.mkdir(parents=True)
            for i in part:
                grey = (digits.images[i] * (255.0 / 16.0)).round().astype(np.uint8)
                Image.fromarray(np.stack([grey] * 3, axis=-1)).save(folder / f"{i:04d}.png")
    return root


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="digits.py", description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="where train/ and val/ go (a new folder)")
    root = parser.parse_args(argv).folder
    if root.exists() and any(root.iterdir()):
        sys.exit(f"digits.py: error: {root} is not empty: give a new folder")
    print(write_digits(root))


if __name__ == "__main__":
    main()
