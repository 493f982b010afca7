"""`--plot FILE`: the file name checked before any work, matplotlib imported headless, the figure written whole
(rendered into a fresh file next to the destination and renamed: never half a file). kv-budget's and
`eval --kv-sweep`'s plots."""

from __future__ import annotations

from pathlib import Path

from kvtool.errors import InputError, UsageError
from kvtool.io.outputfile import replace

SUFFIXES = (".png", ".svg", ".pdf")


def check_target(path: str) -> Path:
    """The plot's path, refused (option `plot`) unless .png / .svg / .pdf in a folder that exists."""
    target = Path(path)
    if target.suffix.lower() not in SUFFIXES:
        raise UsageError(f"{path}: use a .png, .svg or .pdf file name", option="plot")
    if not target.parent.is_dir():
        raise InputError("folder does not exist", file=str(target.parent))
    return target


def pyplot():
    """matplotlib.pyplot on the Agg backend, or the one line naming the extra to install."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("needs matplotlib (pip install 'kvtool[plot]')", option="plot") from None
    return plt


def save(fig, target: Path) -> None:
    """Write the figure in the format its suffix names, then close it."""
    import matplotlib.pyplot as plt

    try:
        replace(target, lambda fh: fig.savefig(fh, format=target.suffix.lower()[1:]))
    finally:
        plt.close(fig)
