"""staging's safety rules: DST never inside SRC, copies never share an inode, stale staging swept."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import pytest

from kvtool.errors import InputError, UsageError
from kvtool.io import staging
from kvtool.io.staging import (MARKER, check_destination, check_inside, interrupted_line,
                               scratch_outputs, stale_staging_dirs, staged_output, sweep_stale)


@pytest.fixture
def src(tmp_path):
    s = tmp_path / "model"
    (s / "sub").mkdir(parents=True)
    (s / "config.json").write_text("{}")
    return s


@pytest.mark.parametrize("where", ["child", "grandchild", "same", "parent", "symlink_into", "dotdot_into"])
def test_destination_inside_same_or_above_source_is_refused(tmp_path, src, where):
    (tmp_path / "link").symlink_to(src)
    dst = {"child": src / "out", "grandchild": src / "sub" / "out", "same": src, "parent": tmp_path,
           "symlink_into": tmp_path / "link" / "out", "dotdot_into": tmp_path / "x" / ".." / "model" / "o"}[where]
    with pytest.raises(UsageError, match="source|input checkpoint"):
        check_destination(dst, force=True, protect=[src])
    with pytest.raises(UsageError):
        with staged_output(dst, force=True, protect=[src], verify=None):
            pytest.fail("the block must not run")
    assert sorted(p.name for p in src.iterdir()) == ["config.json", "sub"]


def test_source_given_through_a_symlink_is_protected_too(tmp_path, src):
    (tmp_path / "alias").symlink_to(src)
    with pytest.raises(UsageError, match="inside the source"):
        check_destination(src / "out", force=False, protect=[tmp_path / "alias"])


def test_sibling_destination_is_fine(tmp_path, src):
    check_destination(tmp_path / "model-out", force=False, protect=[src])  # a name prefix is not "inside"


def test_symlink_loop_destination_is_one_line_usage_error(tmp_path, src):
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(UsageError) as ei:
        check_destination(tmp_path / "loop" / "out", force=False, protect=[src])
    assert "\n" not in ei.value.line()


def test_copy_side_files_refuses_a_symlink_leading_outside(tmp_path, src):
    secret = tmp_path / "secret.txt"
    secret.write_text("token")
    (src / "tokenizer.json").symlink_to(secret)
    (tmp_path / "d").mkdir()
    with pytest.raises(InputError, match="outside the model folder") as ei:
        staging.copy_side_files(src, tmp_path / "d")
    assert "tokenizer.json" in ei.value.line()
    assert not (tmp_path / "d" / "tokenizer.json").exists()
    check_inside(src, src / "config.json")  # a plain file is fine


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _fake_staging(parent, dst_name, pid, *, marker=True, kind="tmp", host=None):
    import socket

    d = parent / f".{dst_name}.kvtool-{kind}-{pid}-0123abcd"
    d.mkdir()
    (d / "model-00001-of-00002.safetensors").write_bytes(b"half a shard")
    if marker:
        (d / MARKER).write_text(json.dumps({"host": host or socket.gethostname(), "pid": pid}))
    return d


def test_stale_staging_of_a_dead_run_is_removed_and_reported(tmp_path, capsys):
    pid = _dead_pid()
    tmp_dir = _fake_staging(tmp_path, "out", pid)
    work_dir = _fake_staging(tmp_path, "out", pid, kind="work")
    with staged_output(tmp_path / "out", verify=None) as tmp:
        (tmp / "f").write_text("1")
    assert not tmp_dir.exists() and not work_dir.exists()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "removed 2 staging folder(s)" in err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["f"]  # the marker does not travel


@pytest.mark.parametrize("case", ["live_pid", "no_marker", "other_host", "other_dst", "plain_folder", "file"])
def test_sweep_never_removes_what_it_cannot_prove_is_a_dead_kvtool_run(tmp_path, capsys, case):
    pid = _dead_pid()
    if case == "live_pid":
        victim = _fake_staging(tmp_path, "out", os.getppid())
    elif case == "no_marker":
        victim = _fake_staging(tmp_path, "out", pid, marker=False)
    elif case == "other_host":
        victim = _fake_staging(tmp_path, "out", pid, host="elsewhere.example")
    elif case == "other_dst":
        victim = _fake_staging(tmp_path, "other", pid)
    elif case == "plain_folder":
        victim = tmp_path / ".out.kvtool-tmp-notapid"
        victim.mkdir()
    else:
        victim = tmp_path / f".out.kvtool-tmp-{pid}-0123abcd"
        victim.write_text("a user's file")
    sweep_stale(tmp_path, "out")
    assert victim.exists()
    err = capsys.readouterr().err
    if case in ("no_marker", "other_host"):
        assert "left alone 1" in err and err.count("\n") == 1
    else:
        assert err == ""


def test_stale_listing_splits_removable_and_foreign(tmp_path):
    pid = _dead_pid()
    ours = _fake_staging(tmp_path, "out", pid)
    theirs = _fake_staging(tmp_path, "out", pid, marker=False, kind="work")
    assert stale_staging_dirs(tmp_path, "out") == ([ours], [theirs])


def test_interrupted_line_says_what_was_written(tmp_path, monkeypatch):
    monkeypatch.setattr(staging, "COMPLETED", [])
    assert interrupted_line() == "kvtool: interrupted: nothing was written"
    with scratch_outputs():
        with staged_output(tmp_path / "scratch", verify=None):
            pass
    assert interrupted_line() == "kvtool: interrupted: nothing was written"
    with staged_output(tmp_path / "out", verify=None):
        pass
    assert interrupted_line().endswith(f"{tmp_path / 'out'} is written")


@pytest.mark.parametrize("code,words", [(errno.ENOSPC, "no space left"), (errno.EFBIG, "file too large"),
                                        (errno.EDQUOT, "quota")])
def test_write_errors_are_one_line_and_leave_nothing(tmp_path, code, words):
    with pytest.raises(InputError, match=words) as ei:
        with staged_output(tmp_path / "out", verify=None):
            raise OSError(code, os.strerror(code))
    assert "\n" not in ei.value.line() and "nothing was written" in ei.value.line()
    assert list(tmp_path.iterdir()) == []


def test_hugging_face_cache_snapshot_links_count_as_inside(tmp_path):
    """models--org--name/snapshots/REV/x -> ../../blobs/SHA: the cache's own layout, as KV704 allows."""
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (repo / "blobs" / "f00d").write_text("{}")
    (snap / "tokenizer.json").symlink_to("../../blobs/f00d")
    (tmp_path / "d").mkdir()
    assert staging.copy_side_files(snap, tmp_path / "d") == ["tokenizer.json"]
    assert not (tmp_path / "d" / "tokenizer.json").is_symlink()
