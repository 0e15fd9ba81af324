"""Every plot Zoo draws (PNG, matplotlib's Agg backend): line plots, loss against step and wall time,
grouped memory bars, a speed-up bar chart. Each takes plain numbers and a path and returns the path.
A run's wall time up to a row is the sum of its rows' step_time_s x steps (evaluations left out).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional


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


def _lines(ax, series: dict, x: int = 0, markers=(), styles: Optional[dict] = None):
    """One line per name of `series` (points as tuples; coordinate `x` against the last one);
    names in `markers` drawn with dots; styles: name -> matplotlib keywords."""
    for i, (name, pts) in enumerate(series.items()):
        if not pts:
            continue
        cols = list(zip(*pts))
        style = {**dict(label=name, color=f"C{i % 10}", marker="o" if name in markers or len(pts) < 12 else None,
                        markersize=3), **(styles or {}).get(name, {})}
        ax.plot(cols[x], cols[-1], **style)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _save(fig, png: Path) -> Path:
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=90)
    _plt().close(fig)
    return png


def line_plot(series: dict[str, list[tuple]], png: Path, xlabel: str, ylabel: str, title: str = "",
              logx: bool = False, markers=(), vline: Optional[tuple[float, str]] = None,
              ylim: Optional[tuple] = None, styles: Optional[dict] = None) -> Path:
    """Lines of (x, y) points, one per name; vline: (x, label) of a dashed vertical line."""
    fig, ax = _plt().subplots(figsize=(7, 4))
    if vline is not None:
        ax.axvline(vline[0], color="k", ls="--", label=vline[1])
    _lines(ax, series, markers=markers, styles=styles)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title, xscale="log" if logx else "linear")
    if ylim is not None:
        ax.set_ylim(*ylim)
    return _save(fig, png)


def line_panels(panels: dict[str, dict[str, list[tuple]]], png: Path, xlabel: str, ylabel: str) -> Path:
    """Panels side by side, each titled by its name and holding lines of (x, y) points."""
    fig, axes = _plt().subplots(1, len(panels), figsize=(5 * len(panels), 3.8), squeeze=False)
    for ax, (title, series) in zip(axes[0], panels.items()):
        _lines(ax, series)
        ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    return _save(fig, png)


def loss_curves(series: dict[str, list[tuple[int, float, float]]], png: Path, title: str, ylabel: str = "loss") -> Path:
    """Value against step and against wall time in two panels, a line per name of `series` (`curves`' points)."""
    fig, axes = _plt().subplots(1, 2, figsize=(10, 3.6))
    _lines(axes[0], series, x=0)
    _lines(axes[1], series, x=1)
    axes[0].set(xlabel="step", ylabel=ylabel)
    axes[1].set(xlabel="training wall time (s)", ylabel=ylabel)
    fig.suptitle(title, fontsize=10)
    return _save(fig, png)


def _hbars(labels: list[str], values: list[float], colors: list, png: Path, title: str, xlabel: str,
           fmt: str = "{:.1f}", marks: Optional[dict[int, float]] = None, line: Optional[float] = None) -> Path:
    """Horizontal bars, one per label (top to bottom), each with its value written beside it;
    `marks`: bar index -> a value marked with a tick (labelled 'claimed'); `line`: a vertical line there."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 0.34 * len(labels) + 1.2))
    ax.barh(range(len(values)), values, color=colors)
    for y, v in enumerate(values):
        ax.text(v, y, " " + fmt.format(v), va="center", fontsize=7)
    for i, (y, v) in enumerate((marks or {}).items()):
        ax.plot([v], [y], "k|", markersize=14, mew=2, label="claimed" if i == 0 else None)
    if marks:
        ax.legend(fontsize=8, loc="lower right")
    if line is not None:
        ax.axvline(line, color="k", lw=0.8)
    ax.set_yticks(range(len(values)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set(xlabel=xlabel, title=title)
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, png)


def memory_bars(groups: dict[str, dict[str, float]], png: Path, title: str, unit: str = "MiB") -> Path:
    """Grouped horizontal bars: per comparison (the keys of `groups`), each side's memory (the first side grey)."""
    labels, values, colors = [], [], []
    for gi, (group, sides) in enumerate(groups.items()):
        for si, (side, v) in enumerate(sides.items()):
            labels.append(f"{group}: {side}")
            values.append(v)
            colors.append("0.6" if si == 0 else f"C{gi % 10}")
    return _hbars(labels, values, colors, png, title, unit)


def speed_bars(speedups: dict[str, float], claimed: dict[str, float], png: Path, title: str) -> Path:
    """Horizontal bars of measured speed-ups (x, 1 = the baseline's speed), the claimed one marked."""
    names = list(speedups)
    vals = [speedups[n] for n in names]
    return _hbars(names, vals, ["C2" if v >= 1 else "C3" for v in vals], png, title,
                  "speed-up over the baseline (x): paired medians; the loop runs' tokens/s and images/s unpaired",
                  "{:.2f}x", {i: claimed[n] for i, n in enumerate(names) if n in claimed}, line=1.0)
