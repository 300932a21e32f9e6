"""Images/s that each input path delivers to the device (article, classic, fast).

    python bench/input_pipeline.py                          # 227x227, batch 64, generated data
    python bench/input_pipeline.py --dataset_root data --n 8192 --num_workers 4

Without CIFAR-10 in --dataset_root, --n generated images in CIFAR-10's format are
used. The measurement itself is ampkit.pipeline_bench.measure_input_pipeline.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "AMP"))

import torch  # noqa: E402

from ampkit.pipeline_bench import KINDS, cifar_root, measure_input_pipeline  # noqa: E402

LABELS = {"article": "article: torchvision CIFAR10 + Resize + ToTensor (PIL), workers 0",
          "classic": "classic: ampkit.data DataLoader (PIL), workers {w}",
          "fast": "fast: ampkit.fastdata, uint8 on the device, batched"}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--img_size", type=int, default=227)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--num_workers", type=int, default=0, help="workers of the classic path")
    p.add_argument("--n", type=int, default=2048, help="generated images when there is no CIFAR-10")
    p.add_argument("--dataset_root", type=Path, default=None)
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--max_batches", type=int, default=None, help="timed batches per path (default: one epoch)")
    p.add_argument("--channels_last", action="store_true", help="fast path in channels_last")
    p.add_argument("--repeat", type=int, default=1,
                   help="measure each path this many times (interleaved) and keep the best: "
                        "steadier figures on a shared machine")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's choice)")
    args = p.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)")
    print(f"input pipeline to {device} [{where}], {args.img_size}x{args.img_size}, "
          f"batch {args.batch_size}, torch {torch.__version__}", flush=True)
    results = {kind: 0.0 for kind in args.kinds}
    with cifar_root(args.dataset_root, args.n) as root:
        for _ in range(args.repeat):
            for kind in args.kinds:
                results[kind] = max(results[kind], measure_input_pipeline(
                    kind, root=root, img_size=args.img_size, batch_size=args.batch_size,
                    num_workers=args.num_workers, device=device, max_batches=args.max_batches,
                    channels_last=args.channels_last))
    for kind, rate in results.items():
        print(f"  {LABELS[kind].format(w=args.num_workers):<66} {rate:>9.0f} images/s")
    if "article" in results and "fast" in results:
        print(f"fast / article: {results['fast'] / results['article']:.1f}x")


if __name__ == "__main__":
    main()
