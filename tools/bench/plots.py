"""Figures for the patch benchmark: KL against the bytes a patch costs, and the oracle curve.

Figures are drawn on a matplotlib `Figure` with the Agg canvas directly (no pyplot, no display,
no change to the process-wide backend). KL is drawn on a log axis; a KL of exactly zero (an exact
patch) cannot sit on it, so it is drawn a decade below the smallest positive KL of the figure
(`KL_FLOOR` when there is none) and labelled "KL=0".
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

KL_FLOOR = 1e-12
BLIND = "blind"
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*", "<", ">"]


def _kl(value: float) -> float:
    """A KL value as a float; rejects what is not a number or is negative."""
    value = float(value)
    if math.isnan(value) or value < 0:
        raise ValueError(f"KL must be a non-negative number, got {value}")
    return value


def _zero_level(rows: list[dict]) -> float:
    """Where a KL of zero is drawn: a decade below the smallest positive KL."""
    positive = [_kl(row["kl"]) for row in rows if _kl(row["kl"]) > 0]
    return min(positive) / 10 if positive else KL_FLOOR


def _curves(rows: list[dict], x_key: str, default_method: str) -> dict[str, list[tuple[float, float]]]:
    """(x in percent, kl) points per method, each sorted by x; blind rows left out."""
    curves: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for row in rows:
        method = str(row.get("method", default_method))
        if method != BLIND:
            curves[method].append((100.0 * float(row[x_key]), _kl(row["kl"])))
    return {method: sorted(points) for method, points in curves.items()}


def _blind_level(rows: list[dict]) -> float | None:
    """The KL of blind reuse (mean over its rows), or None when no row is blind."""
    values = [_kl(row["kl"]) for row in rows if row.get("method") == BLIND]
    return sum(values) / len(values) if values else None


def _draw(curves: dict[str, list[tuple[float, float]]], blind: float | None, zero: float,
          path: str, title: str, xlabel: str) -> None:
    """One marked line per curve, the blind level as a dashed line; saved as PNG to `path`.

    Points with KL 0 are drawn at `zero` and labelled.
    """
    fig = Figure(figsize=(7.0, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for i, (method, points) in enumerate(sorted(curves.items())):
        xs = [x for x, _ in points]
        ys = [kl if kl > 0 else zero for _, kl in points]
        ax.plot(xs, ys, marker=MARKERS[i % len(MARKERS)], label=method)
        for x, kl in points:
            if kl == 0:
                ax.annotate("KL=0", (x, zero), textcoords="offset points", xytext=(0, 7),
                            ha="center", fontsize="x-small")
    if blind is not None:
        ax.axhline(blind if blind > 0 else zero, color="black", linestyle="--", linewidth=1.2,
                   label=f"blind reuse (0 bytes), KL={blind:.3g}")
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("next-token KL vs full re-prefill")
    ax.set_title(title)
    ax.grid(True, which="major", alpha=0.5)
    ax.grid(True, which="minor", axis="y", alpha=0.15)
    ax.legend(loc="best", fontsize="small")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def plot_kl_vs_bytes(rows: list[dict], path: str, title: str) -> None:
    """KL against patch size: one line per `method`, x = `bytes_frac` in percent of the chunk's
    KV bytes; rows whose method is "blind" become a dashed horizontal reference line."""
    if not rows:
        raise ValueError("no rows to plot")
    _draw(_curves(rows, "bytes_frac", default_method="patch"), _blind_level(rows),
          _zero_level(rows), path, title, "patch size (% of the chunk's KV bytes)")


def plot_token_recompute(rows: list[dict], path: str,
                         title: str = "Oracle token recompute") -> None:
    """KL against the fraction of the chunk's tokens recomputed (`frac_tokens`, in percent).

    Rows may carry a `method` to draw several curves; without one they form a single curve.
    """
    if not rows:
        raise ValueError("no rows to plot")
    _draw(_curves(rows, "frac_tokens", default_method="oracle token recompute"),
          _blind_level(rows), _zero_level(rows), path, title, "tokens recomputed (% of the chunk)")
