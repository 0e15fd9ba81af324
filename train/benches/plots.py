"""The report's plots (PNG, matplotlib's Agg backend): loss curves against step and wall time,
grouped memory bars, a speed-up bar chart. Each takes plain numbers and a path, and returns the path.

Wall time of a loop run comes from its metrics rows (train/loop.py): each logged row holds the
mean `step_time_s` over the steps since the previous row, so the time up to a row is the sum of
step_time_s x steps over the rows so far (evaluations, checkpoints and start-up left out).
"""
from __future__ import annotations

from pathlib import Path


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def curves(rows: list[dict], key: str = "loss") -> list[tuple[int, float, float]]:
    """(step, training seconds so far, value of `key`) for every metrics row holding `key`; a row
    without step_time_s (an evaluation) takes the training time of the last logged step before it."""
    wall, prev, at = 0.0, 0, {}
    for r in rows:
        if "step_time_s" in r:
            wall += r["step_time_s"] * (r["step"] - prev)
            prev = r["step"]
            at[r["step"]] = wall
    out = []
    for r in rows:
        if key in r:
            before = [s for s in at if s <= r["step"]]
            out.append((r["step"], at[max(before)] if before else 0.0, r[key]))
    return out


def loss_curves(series: dict[str, list[tuple[int, float, float]]], png: Path, title: str,
                ylabel: str = "loss") -> Path:
    """Two panels, value against step and against wall time, one line per name of `series`
    ((step, seconds, value) points, as `curves` gives them)."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for i, (name, pts) in enumerate(series.items()):
        if not pts:
            continue
        s, w, v = zip(*pts)
        style = dict(label=name, color=f"C{i % 10}", marker="o" if len(pts) < 12 else None, markersize=3)
        axes[0].plot(s, v, **style)
        axes[1].plot(w, v, **style)
    axes[0].set(xlabel="step", ylabel=ylabel)
    axes[1].set(xlabel="training wall time (s)", ylabel=ylabel)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return png


def memory_bars(groups: dict[str, dict[str, float]], png: Path, title: str, unit: str = "MiB") -> Path:
    """Grouped horizontal bars: per comparison (the keys of `groups`), each side's memory."""
    plt = _plt()
    labels, values, colors = [], [], []
    for gi, (group, sides) in enumerate(groups.items()):
        for si, (side, v) in enumerate(sides.items()):
            labels.append(f"{group}: {side}")
            values.append(v)
            colors.append("0.6" if si == 0 else f"C{gi % 10}")
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(labels) + 1.2))
    ax.barh(range(len(values)), values, color=colors)
    ax.set_yticks(range(len(values)), labels, fontsize=8)
    ax.invert_yaxis()
    for y, v in enumerate(values):
        ax.text(v, y, f" {v:.1f}", va="center", fontsize=7)
    ax.set(xlabel=unit, title=title)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return png


def speed_bars(speedups: dict[str, float], claimed: dict[str, float], png: Path, title: str) -> Path:
    """Horizontal bars of measured speed-ups (x, 1 = the baseline's speed), the claimed one marked."""
    plt = _plt()
    names = list(speedups)
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(names) + 1.2))
    vals = [speedups[n] for n in names]
    ax.barh(range(len(names)), vals, color=["C2" if v >= 1 else "C3" for v in vals])
    marked = False
    for y, n in enumerate(names):
        ax.text(vals[y], y, f" {vals[y]:.2f}x", va="center", fontsize=7)
        if n in claimed:
            ax.plot([claimed[n]], [y], "k|", markersize=14, mew=2, label=None if marked else "claimed")
            marked = True
    if marked:
        ax.legend(fontsize=8, loc="lower right")
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set(xlabel="speed-up over the baseline (paired median, x)", title=title)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return png
