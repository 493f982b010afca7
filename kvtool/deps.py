"""Optional heavy dependencies (torch and the `kvtool[torch]` extra): one place that says what to install.

`lint`, `kv-budget`, `rope` and `convert --method mean` never need them. The commands that run a model
call `require_torch(what)` before any work, and `kvtool.cli.main` turns a ModuleNotFoundError for one of
these packages raised anywhere else into the same one-line error (exit 2), never an "internal error".
"""

from __future__ import annotations

import importlib.util

from kvtool.errors import UsageError

# torch is installed by hand (a bare "torch" requirement pulls a multi-GB CUDA build); the rest come with the extra
TORCH_INSTALL = 'pip install torch==2.13.0 (CPU; on a GPU machine the build for your driver), then pip install "kvtool[torch]"'
EXTRA_INSTALL = 'pip install "kvtool[torch]"'
# import name -> how to get it
OPTIONAL = {
    "torch": TORCH_INSTALL,
    "transformers": EXTRA_INSTALL,
    "safetensors": EXTRA_INSTALL,
    "accelerate": EXTRA_INSTALL,
    "compressed_tensors": EXTRA_INSTALL,
}


class MissingDependency(UsageError):
    """A command needs a package this installation lacks: exit 2 with the install command."""


def missing(module: str, what: str | None = None) -> MissingDependency | None:
    """The error for a ModuleNotFoundError of `module` (its top-level name counts), or None when it is
    not one of kvtool's optional packages."""
    top = (module or "").split(".")[0]
    how = OPTIONAL.get(top)
    if how is None:
        return None
    who = f"{what} needs" if what else "this command needs"
    return MissingDependency(f"{who} {top}, which is not installed; install it with: {how}")


def require_torch(what: str) -> None:
    """Fail before any work when torch or the `kvtool[torch]` extra is missing (`what`: the command, for
    the message). Finds the packages without importing them."""
    for name in ("torch", "transformers", "safetensors", "accelerate"):
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            err = missing(name, what)
            assert err is not None  # each of these is one of kvtool's optional packages
            raise err
