"""The one weight-file scan: which files are the weights, and the index checks every reader shares."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvtest import write_safetensors
from kvtool.errors import InputError
from kvtool.io.reader import CheckpointReader
from kvtool.io.weight_files import INDEX_NAME, is_inside, raise_first_error, scan_weights

A, B = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


def _two_shards(root, *, index=True, twice=False, weight_map=None):
    write_safetensors(root / A, {"x": np.zeros(2, np.float32), **({"y": np.ones(2, np.float32)} if twice else {})})
    write_safetensors(root / B, {"y": np.zeros(2, np.float32)})
    if index:
        (root / INDEX_NAME).write_text(json.dumps({"weight_map": weight_map or {"x": A, "y": B}}))


def _kinds(root):
    return [(p.kind, p.file, p.tensor) for p in scan_weights(root).problems]


def test_a_clean_index_has_no_problems(tmp_path):
    _two_shards(tmp_path)
    scan = scan_weights(tmp_path)
    assert scan.problems == [] and scan.files == [A, B]


def test_tensor_in_two_shards_names_both(tmp_path):
    _two_shards(tmp_path, twice=True)
    (p,) = scan_weights(tmp_path).problems
    assert p.kind == "tensor-twice" and p.tensor == "y" and A in p.message and B in p.message
    assert "no such tensor" not in p.message


def test_index_naming_the_other_shard_says_where_the_tensor_is(tmp_path):
    _two_shards(tmp_path, weight_map={"x": B, "y": A})
    msgs = {p.tensor: (p.kind, p.message) for p in scan_weights(tmp_path).problems}
    assert msgs["x"] == ("index-missing-tensor", f"index maps 'x' to {B!r} but it is stored in {A!r}")


@pytest.mark.parametrize("wm, word", [({}, "empty"), (None, "missing"), ([], "missing")])
def test_unusable_weight_map(tmp_path, wm, word):
    _two_shards(tmp_path, index=False)
    (tmp_path / INDEX_NAME).write_text(json.dumps({"weight_map": wm}))
    (p,) = scan_weights(tmp_path).problems
    assert p.kind == "index-invalid" and word in p.message


def test_several_files_without_an_index_are_ambiguous(tmp_path):
    _two_shards(tmp_path, index=False)
    assert [k for k, _, _ in _kinds(tmp_path)] == ["unindexed-shards"]
    with pytest.raises(InputError, match="no model.safetensors.index.json"):
        CheckpointReader(tmp_path)


@pytest.mark.parametrize("name", ["../outside.safetensors", "/abs/outside.safetensors", "sub\\x.safetensors",
                                  "link.safetensors"])
def test_names_outside_the_folder_are_never_opened(tmp_path, name):
    root = tmp_path / "m"
    root.mkdir()
    write_safetensors(tmp_path / "outside.safetensors", {"y": np.zeros(2, np.float32)})
    (root / "link.safetensors").symlink_to(tmp_path / "outside.safetensors")
    write_safetensors(root / A, {"x": np.zeros(2, np.float32)})
    (root / INDEX_NAME).write_text(json.dumps({"weight_map": {"x": A, "y": name}}))
    scan = scan_weights(root)
    assert ("index-escape", INDEX_NAME, "y") in [(p.kind, p.file, p.tensor) for p in scan.problems]
    assert scan.files == [A]
    with pytest.raises(InputError, match="outside the model folder"):
        raise_first_error(scan, root)


def test_hugging_face_cache_snapshot_links_are_inside(tmp_path):
    repo = tmp_path / "models--org--m"
    snap, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    write_safetensors(blobs / "sha256blob", {"x": np.zeros(2, np.float32)})
    (snap / "model.safetensors").symlink_to("../../blobs/sha256blob")
    assert is_inside(snap, "model.safetensors")
    (snap / "other.safetensors").symlink_to(tmp_path / "elsewhere")
    assert not is_inside(snap, "other.safetensors")


def test_pickle_only_folder_is_refused_without_opening(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(InputError, match="never unpickles"):
        raise_first_error(scan_weights(tmp_path), tmp_path)
