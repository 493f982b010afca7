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
