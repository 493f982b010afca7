"""ShardWriter: HF shard naming and index, planned (streaming) and buffered modes, exact bytes."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from kvtool.io.reader import CheckpointReader  # noqa: E402
from kvtool.io.writer import PlannedTensor, ShardWriter, torch_dtype_to_st  # noqa: E402


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(16, 8, generator=g),  # 512 B
        "b.weight": torch.randn(16, 8, generator=g).to(torch.bfloat16),  # 256 B
        "c.bias": torch.randn(16, generator=g).to(torch.float16),  # 32 B
        "d.idx": torch.arange(10, dtype=torch.int64),  # 80 B
        "e.scalar": torch.tensor(3.5),
        "f.weight": torch.randn(32, 8, generator=g),  # 1024 B
    }


def _plan(ts):
    return [PlannedTensor(n, torch_dtype_to_st(t.dtype), tuple(t.shape)) for n, t in ts.items()]


@pytest.mark.parametrize("planned", [True, False], ids=["planned", "buffered"])
def test_sharded_output_names_index_and_roundtrip(tmp_path, planned):
    ts = _tensors()
    w = ShardWriter(tmp_path, max_shard_size=800, metadata={"who": "test"}, plan=_plan(ts) if planned else None)
    for n, t in (reversed(ts.items()) if planned else ts.items()):  # planned mode accepts any order
        w.add(n, t)
    res = w.finalize()
    n = len(res.files)
    assert n == 3  # [a b c] = 800 B | [d e] = 84 B | [f] (1024 B: alone, larger than the limit)
    assert res.files == [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(res.files + ["model.safetensors.index.json"])
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in ts.values())
    assert index["metadata"]["total_parameters"] == sum(t.numel() for t in ts.values())
    assert list(index["weight_map"]) == sorted(ts)
    for f in res.files:
        with safe_open(str(tmp_path / f), framework="pt") as fh:
            assert fh.metadata() == {"format": "pt", "who": "test"}
    back = {}
    for f in res.files:
        back.update(load_file(tmp_path / f))
    assert set(back) == set(ts)
    for k, t in ts.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t)
    # each shard within the size limit unless a single tensor is larger
    for f in res.files:
        with safe_open(str(tmp_path / f), framework="pt") as fh:
            size = sum(fh.get_tensor(k).numel() * fh.get_tensor(k).element_size() for k in fh.keys())
            assert size <= 800 or len(list(fh.keys())) == 1


def test_single_shard_is_model_safetensors_without_index(tmp_path):
    ts = _tensors()
    w = ShardWriter(tmp_path, plan=_plan(ts))
    for n, t in ts.items():
        w.add(n, t)
    res = w.finalize()
    assert res.files == ["model.safetensors"] and res.index_file is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    # the header is 8-byte aligned, as safetensors writes it
    raw = (tmp_path / "model.safetensors").read_bytes()
    assert (8 + int.from_bytes(raw[:8], "little")) % 8 == 0
    with CheckpointReader(tmp_path) as r:
        assert r.names() == list(ts)
        assert torch.equal(r.get("f.weight"), ts["f.weight"])


def test_planned_writer_rejects_mismatches(tmp_path):
    ts = _tensors()
    w = ShardWriter(tmp_path, plan=_plan(ts))
    with pytest.raises(ValueError, match="not in the write plan"):
        w.add("zzz", ts["a.weight"])
    with pytest.raises(ValueError, match="the plan said"):
        w.add("a.weight", ts["a.weight"].to(torch.float16))
    w.add("a.weight", ts["a.weight"])
    with pytest.raises(ValueError, match="twice"):
        w.add("a.weight", ts["a.weight"])
    with pytest.raises(RuntimeError, match="never written"):
        w.finalize()


def test_oversized_tensor_gets_its_own_shard(tmp_path):
    ts = {"small.a": torch.zeros(4), "big": torch.zeros(100), "small.b": torch.zeros(4)}
    w = ShardWriter(tmp_path, max_shard_size=64, plan=_plan(ts))
    for n, t in ts.items():
        w.add(n, t)
    res = w.finalize()
    assert [res.weight_map[k] for k in ("small.a", "big", "small.b")] == res.files


def test_copy_from_writes_source_bytes_without_loading(tmp_path):
    src_dir, out = tmp_path / "src", tmp_path / "out"
    src_dir.mkdir(), out.mkdir()
    ts = _tensors()
    from safetensors.torch import save_file

    save_file(ts, src_dir / "model.safetensors")
    with CheckpointReader(src_dir) as r:
        w = ShardWriter(out, max_shard_size=800, plan=_plan(ts))
        for n in ts:
            w.copy_from(n, *r.byte_range(n))
        res = w.finalize()
    back = {}
    for f in res.files:
        back.update(load_file(out / f))
    assert all(torch.equal(back[n], t) for n, t in ts.items())
    with pytest.raises(RuntimeError, match="planned"):
        ShardWriter(out).copy_from("a.weight", src_dir / "model.safetensors", 0, 4)


def test_background_copies_join_contiguous_runs_and_write_the_same_bytes(tmp_path, monkeypatch):
    import kvtool.io.writer as writer_mod

    src_dir = tmp_path / "src"
    src_dir.mkdir()
    ts = _tensors()
    from safetensors.torch import save_file

    save_file(ts, src_dir / "model.safetensors")
    calls = []
    real = writer_mod._copy_range
    monkeypatch.setattr(writer_mod, "_copy_range", lambda *a: (calls.append(a[2:]), real(*a))[1])
    outs = {}
    for background in (False, True):
        out = tmp_path / f"out-{background}"
        out.mkdir()
        calls.clear()
        with CheckpointReader(src_dir) as r:
            names = sorted(r.names(), key=lambda n: r.byte_range(n)[1])  # planned in the source's data order
            w = ShardWriter(out, plan=_plan({n: ts[n] for n in names}), background_copies=background)
            changed = names[len(names) // 2]  # written from memory: splits the copies into two runs
            for n in names:
                if n == changed:
                    w.add(n, ts[n])
                else:
                    w.copy_from(n, *r.byte_range(n))
            res = w.finalize()
        outs[background] = (out / res.files[0]).read_bytes()
        copied = len(calls)
        if background:
            assert copied == 2, calls  # one copy before the tensor written from memory, one after
        else:
            assert copied == len(names) - 1
    assert outs[True] == outs[False]


def test_a_failed_background_copy_is_raised_by_finalize(tmp_path):
    src_dir, out = tmp_path / "src", tmp_path / "out"
    src_dir.mkdir(), out.mkdir()
    ts = _tensors()
    from safetensors.torch import save_file

    save_file(ts, src_dir / "model.safetensors")
    with CheckpointReader(src_dir) as r, pytest.raises(OSError, match="end of the source"):
        with ShardWriter(out, plan=_plan(ts), background_copies=True) as w:
            for n in ts:  # raised by a later copy_from once the failed copy is done, else by finalize
                path, off, nb = r.byte_range(n)
                w.copy_from(n, path, off + 10**9, nb)  # past the end of the source file
            w.finalize()
    assert w._copier is None  # the copy thread was stopped before the files were closed


def _big_source(tmp_path):
    """A source file whose tensors start at offsets unlike the ones a fresh header would give them."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1)
    ts = {f"t{i}.weight": torch.randn(64, 1024 + 8 * i, generator=g).to(torch.bfloat16) for i in range(3)}
    src_dir = tmp_path / "src"
    src_dir.mkdir()
    save_file(ts, src_dir / "model.safetensors", metadata={"padding": "x" * 333})
    return src_dir, ts


def test_copy_offsets_pad_the_header_so_copied_tensors_are_page_congruent_with_their_source(tmp_path):
    src_dir, ts = _big_source(tmp_path)
    with CheckpointReader(src_dir) as r:
        names = sorted(r.names(), key=lambda n: r.byte_range(n)[1])
        offsets = {n: r.byte_range(n)[1] for n in names}
        results = {}
        for hint in (False, True):
            out = tmp_path / f"out-{hint}"
            out.mkdir()
            with ShardWriter(out, plan=_plan({n: ts[n] for n in names}), background_copies=True,
                             copy_offsets=offsets if hint else None) as w:
                for n in names:
                    w.copy_from(n, *r.byte_range(n))
                results[hint] = w.finalize()
    with CheckpointReader(tmp_path / "out-True") as hinted, CheckpointReader(tmp_path / "out-False") as plain:
        for n in names:
            assert (hinted.byte_range(n)[1] - offsets[n]) % 4096 == 0
            assert hinted.byte_range(n)[1] % 8 == 0
        assert any((plain.byte_range(n)[1] - offsets[n]) % 4096 for n in names)  # the padding made the difference
    back = load_file(tmp_path / "out-True" / "model.safetensors")  # the safetensors library accepts the padding
    assert all(torch.equal(back[n], t) for n, t in ts.items())
    with safe_open(tmp_path / "out-True" / "model.safetensors", "pt") as f:
        assert f.metadata()["format"] == "pt"


def test_a_page_congruent_copy_starts_with_a_short_copy_to_a_64k_boundary(tmp_path, monkeypatch):
    import os

    import kvtool.io.writer as writer_mod

    src = tmp_path / "src.bin"
    data = os.urandom(300_000)
    src.write_bytes(data)
    calls = []
    real = os.copy_file_range

    def spy(fi, fo, count, off_in, off_out):
        calls.append((count, off_in, off_out))
        return real(fi, fo, count, off_in, off_out)

    monkeypatch.setattr(writer_mod.os, "copy_file_range", spy)
    dst = tmp_path / "dst.bin"
    for src_off, dst_off, first_end in ((4096 + 40, 40, 65536), (4096 + 40, 48, None)):
        calls.clear()
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            writer_mod._copy_file(str(src), fd, src_off, dst_off, 200_000)
        finally:
            os.close(fd)
        assert dst.read_bytes()[dst_off:] == data[src_off:src_off + 200_000]
        if first_end is None:  # not page-congruent: one plain copy
            assert calls[0] == (200_000, src_off, dst_off)
        else:
            assert calls[0][2] + calls[0][0] == first_end and calls[1][2] == first_end


@pytest.mark.parametrize("code,raised", [("ENOSPC", True), ("EOPNOTSUPP", False)])
def test_planned_shards_are_preallocated_and_a_full_disk_fails_at_once(tmp_path, monkeypatch, code, raised):
    import errno
    import os

    import kvtool.io.writer as writer_mod

    seen = []

    def fallocate(fd, offset, length):
        seen.append(length)
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))

    monkeypatch.setattr(writer_mod.os, "posix_fallocate", fallocate)
    ts = _tensors()
    w = ShardWriter(tmp_path, plan=_plan(ts))
    first = next(iter(ts))
    if raised:
        with pytest.raises(OSError) as exc:
            w.add(first, ts[first])
        assert exc.value.errno == errno.ENOSPC
        w.abort()
    else:  # a file system without fallocate: written all the same
        for n, t in ts.items():
            w.add(n, t)
        res = w.finalize()
        back = load_file(tmp_path / res.files[0])
        assert all(torch.equal(back[n], t) for n, t in ts.items())
        assert seen == [os.path.getsize(tmp_path / res.files[0])]  # the shard's whole size, asked up front
