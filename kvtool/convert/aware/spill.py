"""Per-layer tensors waiting on disk: one safetensors file per layer in a temporary folder of their own.

Used for what would not fit beside one decoder layer in memory: the converted layers until the writer takes them
(`LayerStore`: the aware merge's projections, --to mla's solved blocks) and each layer's distillation state
(distill.py). The folder goes on close(), or at garbage collection / interpreter exit, whichever comes first."""

from __future__ import annotations

import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any, Callable

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


class LayerStore:
    """Converted layers waiting for the writer, one file per layer (all layers' attention in float32 can exceed one
    decoder layer many times over): `put` as each is made (and again when distillation improves it), `peek` to
    read one back, `take` once when the writer reaches it; the folder goes when the last layer is taken, on
    close(), or at garbage collection / interpreter exit. encode / decode: between what the caller holds and the
    name -> tensor dict stored (the aware merge's Proj; --to mla stores the dict as it is)."""

    def __init__(self, prefix: str, what: str, *, encode: Callable[[Any], dict] = dict,
                 decode: Callable[[dict], Any] = dict) -> None:
        self._files = LayerFiles(prefix, what)
        self.folder = self._files.folder
        self.layers: set[int] = set()
        self._encode, self._decode = encode, decode

    def put(self, layer: int, value) -> None:
        self._files.save(layer, self._encode(value))
        self.layers.add(layer)

    def peek(self, layer: int):
        """The layer (float32, CPU), left in place."""
        return self._decode(self._files.load(layer))

    def take(self, layer: int):
        """The layer (float32, CPU), or None when none is stored; removes it."""
        if layer not in self.layers:
            return None
        out = self.peek(layer)
        self._files.path(layer).unlink()
        self.layers.discard(layer)
        if not self.layers:
            self.close()
        return out

    def close(self) -> None:
        self._files.close()
