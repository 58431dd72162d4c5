"""``lightning-shard plot RUN_DIR``: a picture of a run, loss and MFU over steps, from its CSV logs.

Reads every ``metrics.csv`` Lightning's ``CSVLogger`` wrote under ``RUN_DIR`` (the newest version
directory when there are several) and draws the training loss and, where ``MFUMonitor`` logged it, MFU and
tokens/s against the step. matplotlib is the optional ``plot`` extra.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

LOSS_KEYS = ("train_loss", "train_loss_step", "loss")


def read_metrics(run_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """``{metric: [(step, value), ...]}`` from the newest ``metrics.csv`` under ``run_dir``."""
    files = sorted(Path(run_dir).rglob("metrics.csv"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise FileNotFoundError(
            f"lightning-shard plot: no metrics.csv under {str(run_dir)!r}. Log with Lightning's CSVLogger"
            " (configs/zero3.yaml does: trainer.logger), then pass the run's directory."
        )
    series: dict[str, list[tuple[int, float]]] = {}
    with open(files[-1], newline="") as file:
        for row in csv.DictReader(file):
            step = row.get("step")
            if not step:
                continue
            for key, value in row.items():
                if key in ("step", "epoch") or value in ("", None):
                    continue
                number = float(value)
                if math.isfinite(number):
                    series.setdefault(key, []).append((int(float(step)), number))
    return series


def plot_run(run_dir: str | Path, out: str | Path) -> Path:
    """Write a PNG of the run's loss (and MFU, tokens/s where logged) over steps; returns its path."""
    try:
        import matplotlib  # optional: matplotlib (the plot extra)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # optional: matplotlib (the plot extra)
    except ImportError as error:
        raise ImportError(
            "lightning-shard plot needs matplotlib: pip install 'lightning-shard[plot]'."
        ) from error
    series = read_metrics(run_dir)
    loss_key = next((key for key in LOSS_KEYS if key in series), None)
    if loss_key is None:
        raise ValueError(
            f"lightning-shard plot: no training loss ({', '.join(LOSS_KEYS)}) in the logs of {run_dir}."
        )
    panels = [(loss_key, "loss")]
    panels += [
        (key, label)
        for key, label in (("perf/mfu", "MFU"), ("perf/tokens_per_sec", "tokens/s"))
        if key in series
    ]
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 2.4 * len(panels)), sharex=True, squeeze=False)
    for ax, (key, label) in zip(axes[:, 0], panels, strict=True):
        steps, values = zip(*series[key], strict=True)
        ax.plot(steps, [100 * v for v in values] if key == "perf/mfu" else values)
        ax.set_ylabel(f"{label} (%)" if key == "perf/mfu" else label)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(f"{Path(run_dir)}")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
