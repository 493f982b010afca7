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


def test_every_common_dtype_and_row_slices_round_trip(tmp_path):
    from safetensors.torch import save_file

    ts = {"bf16": torch.randn(5, 3).to(torch.bfloat16), "f16": torch.randn(4).half(), "i64": torch.arange(6).reshape(2, 3),
          "bool": torch.tensor([True, False, True]), "f8": torch.randn(4, 2).to(torch.float8_e4m3fn),
          "empty": torch.zeros(0, 4), "scalar": torch.tensor(2.5)}
    save_file(ts, tmp_path / "model.safetensors")
    with CheckpointReader(tmp_path) as r:
        for n, t in ts.items():
            got = r.get(n)
            assert got.dtype == t.dtype and got.shape == t.shape
            assert torch.equal(got.view(torch.uint8) if n == "f8" else got, t.view(torch.uint8) if n == "f8" else t)
        assert torch.equal(r.get_slice("bf16", 1, 4), ts["bf16"][1:4])
        assert r.get_slice("bf16", 4, 99).shape == (1, 3)
        assert r.get_slice("empty", 0, 0).shape == (0, 4)
        path, offset, n = r.byte_range("i64")
        raw = path.read_bytes()[offset:offset + n]
        assert torch.equal(torch.frombuffer(bytearray(raw), dtype=torch.int64).reshape(2, 3), ts["i64"])
