"""The plain-text tables that ``benchmark.py`` prints: the steps' (with each row's speed-up
over fp32) and the input paths'."""
from __future__ import annotations

from typing import List, Optional, Sequence


def fmt(v: Optional[float], spec: str) -> str:
    """``v`` in ``spec``, or ``-`` for no value."""
    return "-" if v is None else format(v, spec)


def text_table(head: List[str], rows: List[List[str]], left: set) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(head)]

    def line(cells):
        return "  ".join(c.ljust(w) if i in left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])


def add_speedups(results: Sequence) -> None:
    """Each result's images/s over those of the fp32 row of the same parallel mode and
    settings (batch, accumulation, memory format, compilation, comm hook), where there is one: the
    article's question, what a precision buys over fp32."""
    def key(r) -> tuple:
        return (r.parallel, r.batch_size, r.accum_steps, r.channels_last, r.compiled,
                r.dp_scope, r.comm_hook)

    base = {key(r): r for r in results if r.precision == "fp32" and r.status == "ok"}
    for r in results:
        b = base.get(key(r))
        if r.status == "ok" and b is not None and b.images_per_s:
            r.speedup = r.images_per_s / b.images_per_s


def step_table(results: Sequence) -> str:
    head = ["variant", "precision", "math", "dev", "batch", "step ms", "images/s", "x fp32",
            "peak MB", "GFLOP/step", "TFLOP/s", "util", "GPU busy", "wire MB/step", "note"]
    rows = []
    for r in results:
        ok = r.status == "ok"
        rows.append([r.variant, r.precision, r.amp_dtype or r.fp32_math or "-",
                     f"{r.devices} {r.device}",
                     f"{r.batch_size}" + (f"x{r.accum_steps}" if r.accum_steps > 1 else ""),
                     fmt(r.step_ms, ".1f"), fmt(r.images_per_s, ".1f"),
                     fmt(r.speedup, ".2f"), fmt(r.peak_mem_mb, ".0f"),
                     fmt(r.gflop_per_step, ".2f"), fmt(r.achieved_tflops, ".3f"),
                     "-" if r.utilisation is None else f"{100 * r.utilisation:.1f}%",
                     "-" if r.gpu_busy is None else f"{100 * r.gpu_busy:.0f}%",
                     "-" if r.wire_mb_per_step is None else
                     f"{r.wire_mb_per_step:.2f} {r.comm_hook}",
                     r.note if ok else f"{r.status}: {r.reason}"])
    return text_table(head, rows, left={0, 1, 2, 14})


def pipeline_table(results: Sequence) -> str:
    head = ["input path", "dataset", "img", "batch", "workers", "device", "images/s", "note"]
    rows = [[r.path, r.dataset, str(r.img_size), str(r.batch_size), str(r.num_workers),
             r.device, fmt(r.images_per_s, ".1f"),
             "" if r.status == "ok" else f"{r.status}: {r.reason}"] for r in results]
    return text_table(head, rows, left={0, 1, 5, 7})
