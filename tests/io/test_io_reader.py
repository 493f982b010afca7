"""CheckpointReader: lazy names/info from headers, whole tensors and row slices, bad inputs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvtool.errors import InputError
from kvtool.io.reader import CheckpointReader
from tests.conftest import write_safetensors

torch = pytest.importorskip("torch")


def test_reads_sharded_folder_lazily(tmp_path):
    a = np.arange(24, dtype=np.float32).reshape(6, 4)
    b = np.ones((3,), dtype=np.float16)
    write_safetensors(tmp_path / "model-00001-of-00002.safetensors", {"x.a": a})
    write_safetensors(tmp_path / "model-00002-of-00002.safetensors", {"x.b": b})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"x.a": "model-00001-of-00002.safetensors", "x.b": "model-00002-of-00002.safetensors"}}))
    with CheckpointReader(tmp_path) as r:
        assert r.names() == ["x.a", "x.b"]
        assert r.info("x.a").shape == (6, 4) and r.info("x.a").dtype == "F32"
        assert r.info("x.b").dtype == "F16"
        assert torch.equal(r.get_slice("x.a", 2, 4), torch.from_numpy(a[2:4]))
        assert torch.equal(r.get("x.b"), torch.from_numpy(b))
        assert r.total_bytes == a.nbytes + b.nbytes
        assert r._open_file == "model-00002-of-00002.safetensors"  # one shard open at a time


def test_missing_tensor_and_bad_index(tmp_path):
    write_safetensors(tmp_path / "model.safetensors", {"x": np.zeros(2, np.float32)})
    with CheckpointReader(tmp_path) as r:
        with pytest.raises(InputError, match="not in the checkpoint"):
            r.get("nope")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../evil.safetensors"}}))
    with pytest.raises(InputError, match="outside the model folder"):
        CheckpointReader(tmp_path)


def test_empty_folder_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match="no safetensors"):
        CheckpointReader(tmp_path)
