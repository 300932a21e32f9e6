"""A run's test accuracy per epoch on Fashion-MNIST beside the table its authors publish:
the figure of docs/results.md.

    python checks/fashion_table.py checkpoint/train_autocast/log.jsonl docs/fashion_full_alexnet.png

The rows are the README's benchmark table as Debian's dataset-fashion-mnist installs it
(/usr/share/doc/dataset-fashion-mnist/README.md.gz), its networks' test accuracies; the
run's line is each epoch's ``val_acc`` (all 10,000 test images) from its ``log.jsonl``.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# (name, test accuracy): the published table's rows, as its README gives them.
PUBLISHED = [("MLP 256-128-100", 0.883), ("2 Conv + pooling (weakest)", 0.876),
             ("AlexNet with triplet loss", 0.899), ("3 Conv + pooling + BN", 0.903),
             ("2 Conv + pooling", 0.916), ("5 Conv + BN + pooling", 0.931),
             ("2 Conv + 2 FC, flips", 0.939), ("ResNet18", 0.949), ("MobileNet", 0.950),
             ("WRN40-4", 0.967)]


def main(log: Path, out: Path) -> None:
    try:
        rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        if not rows or not all(isinstance(r, dict) and {"epoch", "val_acc"} <= r.keys()
                               for r in rows):
            raise ValueError("no rows of epoch and val_acc")
    except (OSError, ValueError) as e:
        sys.exit(f"{log}: not a run's log.jsonl ({type(e).__name__}: {e})")
    epochs = [r["epoch"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot(epochs, [r["val_acc"] for r in rows], "o-", color="black", lw=2,
            label="this run (AlexNet, 64 px)")
    placed = -1.0
    for name, acc in sorted(PUBLISHED, key=lambda row: row[1]):
        ax.axhline(acc, color="grey", lw=0.6, ls="--")
        # Labels of rows a point apart or less would print over each other: one above.
        placed = max(acc, placed + 0.0035)
        ax.text(epochs[-1] + 0.05, placed, f"{name} {acc:.3f}", va="center", fontsize=7)
    ax.set_xlabel("epoch")
    ax.set_ylabel("test accuracy (10,000 images)")
    ax.set_xlim(0.8, epochs[-1] + 1.6)
    ax.set_title("Fashion-MNIST: test accuracy per epoch, beside the published table")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"{out}: {len(rows)} epochs, last test accuracy {rows[-1]['val_acc']:.4f}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(f"usage: python {sys.argv[0]} LOG.jsonl OUT.png")
    main(Path(sys.argv[1]), Path(sys.argv[2]))
