"""The pre-load gate: corrupt weights, pickles and auto_map refused before anything is loaded."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvtest import write_config, write_safetensors
from kvtool.errors import InputError
from kvtool.model.preflight import check_loadable, preflight

CFG = {"model_type": "llama", "hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 1}


@pytest.fixture
def model(tmp_path):
    write_config(tmp_path, CFG)
    write_safetensors(tmp_path / "model.safetensors", {"x": np.zeros(2, np.float32)})
    return tmp_path


def test_a_clean_folder_passes_and_returns_the_checkpoint(model):
    ckpt = preflight(model, model_code=True)
    assert list(ckpt.tensors) == ["x"]


def test_a_file_the_library_refuses_is_refused(model):
    p = model / "model.safetensors"
    p.write_bytes(p.read_bytes() + b"\0")
    with pytest.raises(InputError) as e:
        preflight(model)
    assert "model.safetensors" in e.value.line() and "bytes after the last tensor" in e.value.line()


@pytest.mark.parametrize("file, auto_map, field", [
    ("config.json", {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}, "auto_map.AutoModelForCausalLM"),
    ("tokenizer_config.json", {"AutoTokenizer": ["tokenization_x.XTok", None]}, "auto_map.AutoTokenizer"),
    ("config.json", "modeling_x.XForCausalLM", "auto_map"),
])
def test_auto_map_is_refused_only_when_the_model_is_loaded(model, file, auto_map, field):
    data = json.loads((model / file).read_text()) if (model / file).is_file() else {}
    (model / file).write_text(json.dumps({**data, "auto_map": auto_map}))
    preflight(model)  # reading headers runs nothing
    with pytest.raises(InputError) as e:
        check_loadable(model)
    line = e.value.line()
    assert line.startswith(str(model / file)) and f": {field}: names checkpoint code (" in line
    assert "kvtool never runs it" in line and "modeling_x" in line or "tokenization_x" in line


def test_weightless_folder_only_when_allowed(tmp_path):
    write_config(tmp_path, CFG)
    preflight(tmp_path, require_weights=False)
    with pytest.raises(InputError, match="no safetensors weights"):
        preflight(tmp_path)
    (tmp_path / "model.pt").write_bytes(b"never opened")
    with pytest.raises(InputError, match="never unpickles"):
        preflight(tmp_path, require_weights=False)


def test_hub_ids_and_missing_paths_are_checked_by_the_loader_gate(monkeypatch, tmp_path):
    """A missing path, or a hub id the hub cannot serve, is one line before torch is imported (None passes)."""
    constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", constants.HF_HUB_OFFLINE)  # stay_offline() sets it
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    check_loadable(None)
    with pytest.raises(InputError, match="not in the local Hugging Face cache"):
        check_loadable("org/not-a-local-folder")
    with pytest.raises(InputError, match="no such file"):
        check_loadable(str(tmp_path / "missing" / "x"))
