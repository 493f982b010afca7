"""kvtool.io.outputfile: new files never through a link or over a file; copies of exactly the validated bytes."""

from __future__ import annotations

import errno
import os
import stat

import pytest

from kvtool.errors import InputError
from kvtool.io import outputfile
from kvtool.io.outputfile import (SourceChanged, copy_source, create, create_first_free, identity_of, make_dir,
                                  make_subdirs, replace, write_new)


@pytest.fixture
def outside(tmp_path):
    """A folder standing for 'anywhere outside the output': nothing may appear in it."""
    d = tmp_path / "outside"
    d.mkdir()
    return d


@pytest.mark.parametrize("planted", ["file", "link", "dangling_link", "link_to_folder"])
def test_create_refuses_anything_already_at_the_name(tmp_path, outside, planted):
    target = tmp_path / "new.json"
    victim = outside / "victim"
    if planted == "file":
        target.write_text("theirs")
    elif planted == "link":
        victim.write_text("theirs")
        target.symlink_to(victim)
    elif planted == "dangling_link":
        target.symlink_to(victim)
    else:
        target.symlink_to(outside)
    with pytest.raises(InputError) as e:
        write_new(target, "ours")
    assert str(target) in e.value.line() and "\n" not in e.value.line()
    assert sorted(p.name for p in outside.iterdir()) == (["victim"] if planted == "link" else [])
    if planted in ("file", "link"):
        assert (victim if planted == "link" else target).read_text() == "theirs"


def test_create_is_exclusive_and_nofollow(tmp_path):
    fd = create(tmp_path / "a")
    os.close(fd)
    with pytest.raises(InputError):
        create(tmp_path / "a")


@pytest.mark.parametrize("planted", ["link", "dangling_link"])
def test_replace_refuses_a_target_that_is_a_link(tmp_path, outside, planted):
    victim = outside / "victim"
    if planted == "link":
        victim.write_text("theirs")
    (tmp_path / "config.json").symlink_to(victim)
    with pytest.raises(InputError, match="symlink"):
        replace(tmp_path / "config.json", "ours")
    assert os.readlink(tmp_path / "config.json") == str(victim)
    assert [p.read_text() for p in outside.iterdir()] == (["theirs"] if planted == "link" else [])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "outside"]


def test_replace_uses_a_fresh_unguessable_name_and_leaves_nothing_on_failure(tmp_path, monkeypatch):
    target = tmp_path / "config.json"
    target.write_text("old")
    names = {outputfile.temp_name(target).name for _ in range(50)}
    assert len(names) == 50 and all(n.startswith(".config.json.kvtool-tmp-") for n in names)

    def boom(fh):
        fh.write(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError):
        replace(target, boom)
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]
    replace(target, "new")
    assert target.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


def test_create_first_free_steps_over_planted_links(tmp_path, outside):
    (tmp_path / "r.json").symlink_to(outside / "x")
    (tmp_path / "r.1.json").write_text("earlier")
    got = create_first_free(lambda n: tmp_path / (f"r.{n}.json" if n else "r.json"), "mine")
    assert got == tmp_path / "r.2.json" and got.read_text() == "mine"
    assert list(outside.iterdir()) == [] and (tmp_path / "r.1.json").read_text() == "earlier"


def test_folders_are_new_or_real(tmp_path, outside):
    (tmp_path / "planted").symlink_to(outside)
    with pytest.raises(InputError):
        make_dir(tmp_path / "planted")
    root = make_dir(tmp_path / "out")
    (root / "sub").symlink_to(outside)
    with pytest.raises(InputError, match="symlink"):
        make_subdirs(root, "sub/deeper")
    assert list(outside.iterdir()) == []
    assert make_subdirs(root, "a/b").is_dir() and not (root / "a").is_symlink()


def test_copy_source_refuses_a_source_that_is_not_the_validated_one(tmp_path):
    a = tmp_path / "a"
    a.write_bytes(b"x" * 1000)
    validated = identity_of(os.stat(a))
    os.truncate(a, 500)
    with pytest.raises(SourceChanged, match="changed size") as e:
        copy_source(a, tmp_path / "b", expect=validated)
    assert str(a) in e.value.line() and not (tmp_path / "b").exists()
    a2 = tmp_path / "a2"
    a2.write_bytes(b"y" * 1000)
    os.replace(a2, a)
    with pytest.raises(SourceChanged, match="replaced"):
        copy_source(a, tmp_path / "b", expect=validated)
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("change", ["truncate", "append", "rewrite", "replace"])
@pytest.mark.parametrize("link", [False, True])
def test_copy_source_refuses_a_source_changed_during_the_copy(tmp_path, monkeypatch, change, link):
    a = tmp_path / "a"
    a.write_bytes(os.urandom(200_000))
    real = outputfile.copy_range if not link else outputfile.os.link

    def racing(*args, **kw):
        if change == "truncate":
            os.truncate(a, 1000)
        elif change == "append":
            with open(a, "ab") as fh:
                fh.write(b"more")
        elif change == "rewrite":
            st = os.stat(a)
            with open(a, "r+b") as fh:
                fh.write(b"\0" * 10)
            os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
        else:
            (tmp_path / "other").write_bytes(b"z" * 200_000)
            os.replace(tmp_path / "other", a)
        return real(*args, **kw)

    monkeypatch.setattr(outputfile, "_reflink", lambda i, o: False)
    if link:  # the hard link then names another file than the one opened and checked
        monkeypatch.setattr(outputfile.os, "link", racing)
    else:
        monkeypatch.setattr(outputfile, "copy_range", racing)
    with pytest.raises(SourceChanged) as e:
        copy_source(a, tmp_path / "b", link=link)
    assert str(a) in e.value.line()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def test_copy_source_keeps_mode_and_times_without_following_the_destination(tmp_path):
    a = tmp_path / "a"
    a.write_bytes(b"w")
    os.chmod(a, 0o640)
    os.utime(a, ns=(1_000_000_000, 2_000_000_000))
    copy_source(a, tmp_path / "b")
    st = os.stat(tmp_path / "b")
    assert stat.S_IMODE(st.st_mode) == 0o640 and st.st_mtime_ns == 2_000_000_000


def test_copy_source_never_shares_the_inode_and_keeps_bytes(tmp_path):
    a = tmp_path / "a.safetensors"
    a.write_bytes(os.urandom(3 << 20) + b"tail")
    how = copy_source(a, tmp_path / "b.safetensors")
    assert how in ("reflink", "copy_file_range", "copy")
    b = tmp_path / "b.safetensors"
    assert b.read_bytes() == a.read_bytes()
    assert os.stat(a).st_ino != os.stat(b).st_ino
    b.write_bytes(b"changed")  # editing the copy leaves the source alone
    assert a.read_bytes().endswith(b"tail")
    with pytest.raises(InputError, match="already there"):  # never writes over an existing file
        copy_source(a, b)


def test_copy_source_falls_back_to_plain_copy(tmp_path, monkeypatch):
    monkeypatch.setattr(outputfile, "_reflink", lambda fin, fout: False)
    monkeypatch.delattr(os, "copy_file_range", raising=False)
    a = tmp_path / "a"
    a.write_bytes(b"x" * 100_000)
    assert copy_source(a, tmp_path / "b") == "copy"
    assert (tmp_path / "b").read_bytes() == a.read_bytes()


def test_copy_source_range_short_copy_is_finished_by_read_write(tmp_path, monkeypatch):
    monkeypatch.setattr(outputfile, "_reflink", lambda fin, fout: False)
    real = os.copy_file_range
    calls = []

    def one_chunk_then_nothing(fi, fo, n, *a):
        calls.append(n)
        return real(fi, fo, min(n, 1000)) if len(calls) == 1 else 0

    monkeypatch.setattr(os, "copy_file_range", one_chunk_then_nothing)
    a = tmp_path / "a"
    a.write_bytes(os.urandom(50_000))
    copy_source(a, tmp_path / "b")
    assert (tmp_path / "b").read_bytes() == a.read_bytes()


def test_copy_source_copies_by_default_and_links_only_when_asked(tmp_path, monkeypatch):
    def link_or_copy(src, dst, link=False):
        return copy_source(src, dst, link=link) == "link"

    src = tmp_path / "a.bin"
    src.write_bytes(b"weights")
    assert link_or_copy(src, tmp_path / "copied.bin") is False
    assert (tmp_path / "copied.bin").read_bytes() == b"weights"
    assert os.stat(tmp_path / "copied.bin").st_ino != os.stat(src).st_ino
    assert link_or_copy(src, tmp_path / "linked.bin", link=True) is True
    assert os.stat(tmp_path / "linked.bin").st_ino == os.stat(src).st_ino

    def fail(code):
        def _link(a, b):
            raise OSError(code, os.strerror(code))
        return _link

    monkeypatch.setattr(os, "link", fail(errno.EXDEV))  # another filesystem: copy
    assert link_or_copy(src, tmp_path / "xdev.bin", link=True) is False
    assert (tmp_path / "xdev.bin").read_bytes() == b"weights"
    monkeypatch.setattr(os, "link", fail(errno.EIO))  # a real I/O error is not hidden by a copy
    with pytest.raises(OSError):
        link_or_copy(src, tmp_path / "eio.bin", link=True)


