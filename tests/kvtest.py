"""Helpers shared by test modules: tiny checkpoints written without torch (numpy + safetensors).

Import as `from kvtest import ...` (tests/ is on sys.path through tests/conftest.py). Not named
conftest: several conftest.py files exist, and `from kvtest import` picks whichever loaded first.
"""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data"


def write_config(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    p = folder / "config.json"
    p.write_text(json.dumps(config, indent=2))
    return p


def write_safetensors(path: Path, tensors: dict, metadata: dict | None = None) -> Path:
    """tensors: name -> numpy array."""
    from safetensors.numpy import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=metadata)
    return path


def running_kv_amax(model, batches) -> dict:
    """{(layer, "k"|"v"): running max |x| per KV head} over `batches`, from an ordinary whole-model forward
    through kvtool's KV hook (the reference calibration results are compared against)."""
    import torch

    from kvtool.runtime.kv_hooks import kv_hook

    seen: dict = {}

    def fn(layer, k, v):
        for role, x in (("k", k), ("v", v)):
            a = x.abs().amax(dim=(0, 2, 3))
            seen[(layer, role)] = torch.maximum(seen[(layer, role)], a) if (layer, role) in seen else a
        return k, v

    with torch.inference_mode(), kv_hook(model, fn):
        for ids in batches:
            model(input_ids=ids, use_cache=False)
    return seen
