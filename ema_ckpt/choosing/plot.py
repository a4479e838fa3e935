"""The plot of a selection: score against σ_rel (post-hoc EMAs) and against K (averages of
the newest K), one panel each, the chosen candidate marked. Drawn only where matplotlib is
installed (``pip install 'ema-ckpt[demo]'``).

Example:
    >>> scores = {"sigma_rel_0.05": 1.0, "sigma_rel_0.1": 0.8, "last_4": 2.0, "last_8": 1.5}
    >>> panels = series(scores, {"sigma_rel_0.05": 0.05, "sigma_rel_0.1": 0.1})
    >>> panels["σ_rel"]
    [(0.05, 1.0, 'sigma_rel_0.05'), (0.1, 0.8, 'sigma_rel_0.1')]
    >>> panels["K (uniform)"]
    [(4.0, 2.0, 'last_4'), (8.0, 1.5, 'last_8')]
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["draw_scores", "series"]

_LAST = re.compile(r"^(?:(?P<weights>.+)_)?last_(?P<k>\d+)(?:_every_\d+)?$")


def series(scores: dict[str, float], sigma_rels: dict[str, float]) -> dict[str, list[tuple[float, float, str]]]:
    """Points to draw, by panel: ``σ_rel`` and, per weighting, ``K`` (x, score, name)."""
    panels: dict[str, list[tuple[float, float, str]]] = {}
    for name, score in scores.items():
        if name in sigma_rels:
            panels.setdefault("σ_rel", []).append((sigma_rels[name], score, name))
        elif match := _LAST.match(name):
            label = f"K ({match.group('weights') or 'uniform'})"
            panels.setdefault(label, []).append((float(match.group("k")), score, name))
    return {label: sorted(points) for label, points in panels.items() if len(points) >= 2}


def draw_scores(path: Path, scores: dict[str, float], sigma_rels: dict[str, float], chosen: str, *,
                metric: str, maximize: bool) -> Path | None:
    """Write the plot to ``path``; None when there is nothing to draw or no matplotlib."""
    panels = series(scores, sigma_rels)
    if not panels:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.4), squeeze=False)
    for ax, (label, points) in zip(axes[0], panels.items(), strict=True):
        ax.plot([p[0] for p in points], [p[1] for p in points], "o-", color="#3b6ea8")
        for x, y, name in points:
            if name == chosen:
                ax.plot([x], [y], "*", color="#d1495b", markersize=14, label=f"chosen: {name}")
                ax.legend(loc="best", fontsize=8)
        ax.set_xlabel(label)
        ax.set_ylabel(f"{metric} ({'higher' if maximize else 'lower'} is better)")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
