"""Per-layer tensors waiting on disk: one safetensors file per layer in a temporary folder of their own.

Used for what would not fit beside one decoder layer in memory: the merged projections until the
writer takes them (method.MergedLayers) and each layer's distillation state (distill.py). The folder
goes on close(), or at garbage collection / interpreter exit, whichever comes first."""

from __future__ import annotations

import shutil
import tempfile
import weakref
from pathlib import Path

from kvtool.errors import InputError


class LayerFiles:
    """what: how a failed store names its layer, e.g. "the merged layer {layer}"."""

    def __init__(self, prefix: str, what: str) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix=prefix))
        self._what = what
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.folder), ignore_errors=True)

    def path(self, layer: int) -> Path:
        return self.folder / f"layer-{layer:05d}.safetensors"

    def save(self, layer: int, tensors: dict) -> None:
        """Store the tensors (as float32 on the CPU); a full disk is a one-line error naming the folder."""
        import torch
        from safetensors.torch import save_file

        try:
            save_file({k: v.detach().to("cpu", torch.float32).contiguous() for k, v in tensors.items()},
                      str(self.path(layer)))
        except OSError as exc:
            raise InputError(f"cannot store {self._what.format(layer=layer)}: {exc.strerror or exc}",
                             file=str(self.folder)) from None

    def load(self, layer: int, device: str = "cpu") -> dict:
        from safetensors.torch import load_file

        return load_file(str(self.path(layer)), device=str(device))

    def close(self) -> None:
        self._finalizer()
