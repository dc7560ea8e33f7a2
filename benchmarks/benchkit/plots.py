"""The plotting every benchmark shares: matplotlib's pyplot off-screen, a figure written atomically, an accuracy
plot's axes."""

from __future__ import annotations

import pathlib

from cppo import fileio


def pyplot():
    """matplotlib's pyplot on the file-only Agg back-end."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(plt, fig, path: pathlib.Path) -> None:
    """The figure as a PNG at ``path``, replaced atomically (:func:`cppo.fileio.atomic_path`), then closed."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    with fileio.atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)


def label_axes(ax, *, x: str, y: str, title: str) -> None:
    """An accuracy plot's axis labels, its title (small), a light grid and the legend where it fits best."""
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
