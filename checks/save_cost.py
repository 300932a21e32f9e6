"""What a checkpoint save costs written into a new file, as every save is (a reader holding
the old last.pth keeps its bytes), against rewriting an existing file in place: AlexNet's
weights and AdamW state (~685 MB, 10 classes), torch.save then fsync, the two taking turns.

    python checks/save_cost.py /tmp/save_cost        # a folder on the disk to measure
"""
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "AMP"))
from alexnet import alexnet  # noqa: E402

ROUNDS = 5


def write(state, path: Path, mode: str) -> float:
    start = time.perf_counter()
    with open(path, mode) as f:
        torch.save(state, f)
        f.truncate()
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - start


def main(folder: Path) -> None:
    net = alexnet(num_classes=10)
    optimizer = torch.optim.AdamW(net.parameters(), fused=True)
    net(torch.randn(2, 3, 64, 64)).sum().backward()
    optimizer.step()
    state = {"model": net.state_dict(), "optimizer": optimizer.state_dict()}
    folder.mkdir(parents=True, exist_ok=True)
    existing = folder / "existing.pth"
    torch.save(state, existing)
    new, in_place = [], []
    for r in range(ROUNDS):
        new.append(write(state, folder / f"new{r}.pth", "wb"))
        in_place.append(write(state, existing, "r+b"))
        (folder / f"new{r}.pth").unlink()
    size = existing.stat().st_size / 1e6
    existing.unlink()
    print(f"{size:.0f} MB, median of {ROUNDS}: into a new file {statistics.median(new):.3f} s "
          f"(min {min(new):.3f}), rewritten in place {statistics.median(in_place):.3f} s "
          f"(min {min(in_place):.3f})")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: python {sys.argv[0]} FOLDER")
    main(Path(sys.argv[1]))
