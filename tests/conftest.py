"""Shared test helpers: tiny checkpoints written without torch (numpy + safetensors)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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


@pytest.fixture
def tiny_llama_config() -> dict:
    return {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 128, "max_position_embeddings": 256, "rope_theta": 10000.0, "torch_dtype": "float32",
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    }
