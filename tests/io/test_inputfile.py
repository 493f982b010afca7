"""kvtool/io/inputfile.py: regular files only, sizes bounded while reading, never blocking on a FIFO."""

from __future__ import annotations

import os
import threading
import time

import pytest

from kvtool.errors import InputError
from kvtool.io.inputfile import not_regular, read_bytes, read_text


def test_reads_a_regular_file_up_to_the_limit(tmp_path) -> None:
    p = tmp_path / "a.json"
    p.write_bytes(b"x" * 100)
    assert read_bytes(p, limit=100) == b"x" * 100
    with pytest.raises(InputError, match="larger than the 99 byte limit"):
        read_bytes(p, limit=99)


def test_bom_dropped_and_bad_utf8_named(tmp_path) -> None:
    p = tmp_path / "a.txt"
    p.write_bytes(b"\xef\xbb\xbfhi")
    assert read_text(p) == "hi"
    p.write_bytes(b"ok\xff")
    with pytest.raises(InputError, match=r"not UTF-8 \(byte 2\)"):
        read_text(p)


def test_fifo_is_refused_without_blocking(tmp_path) -> None:
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    t0 = time.monotonic()
    with pytest.raises(InputError) as e:
        read_bytes(fifo, what="config", field="--text")
    assert time.monotonic() - t0 < 2
    assert e.value.line() == f"{fifo}: --text: config is a FIFO (named pipe); kvtool reads regular files only"


def test_fifo_with_a_writer_is_still_refused(tmp_path) -> None:
    """Even when data is flowing, a pipe is not read: its size is unknown and may never end."""
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    stop = threading.Event()

    def writer():
        fd = os.open(fifo, os.O_RDWR)
        while not stop.wait(0.01):
            pass
        os.close(fd)

    th = threading.Thread(target=writer, daemon=True)
    th.start()
    try:
        with pytest.raises(InputError, match="FIFO"):
            read_bytes(fifo)
    finally:
        stop.set()
        th.join(2)


@pytest.mark.parametrize("target,word", [("/dev/zero", "character device"), ("/dev/null", "character device")])
def test_devices_are_refused_even_through_a_link(tmp_path, target, word) -> None:
    link = tmp_path / "config.json"
    link.symlink_to(target)
    with pytest.raises(InputError, match=word):
        read_bytes(link)


def test_folder_and_missing(tmp_path) -> None:
    with pytest.raises(InputError, match="is a folder"):
        read_bytes(tmp_path)
    with pytest.raises(InputError, match="no such file"):
        read_bytes(tmp_path / "nope")


def test_sparse_file_refused_by_size_not_read(tmp_path) -> None:
    p = tmp_path / "big.json"
    with p.open("wb") as fh:
        fh.truncate(1 << 30)
    t0 = time.monotonic()
    with pytest.raises(InputError, match="larger than"):
        read_bytes(p, limit=1 << 20)
    assert time.monotonic() - t0 < 2


def test_not_regular_describes(tmp_path) -> None:
    (tmp_path / "f").write_text("x")
    os.mkfifo(tmp_path / "p")
    assert not_regular(tmp_path / "f") is None
    assert not_regular(tmp_path / "missing") == "not found"
    assert not_regular(tmp_path) == "is a folder, not a file"
    assert not_regular(tmp_path / "p") == "is a FIFO (named pipe), not a file"
