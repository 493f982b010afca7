"""kvtool.engines.installed: the dist-info reading answers as importlib.metadata does."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from kvtool.engines import installed as inst


def test_every_installed_distribution_reads_as_importlib_metadata_reads_it() -> None:
    names = {d.metadata["Name"] for d in metadata.distributions()}
    read = 0
    for name in sorted(n for n in names if n):
        got = inst._from_dist_info(name)
        if got is inst._UNSURE:
            continue
        read += 1
        assert got == metadata.version(name), name
    assert read >= len(names) // 2  # the fast path is the common case, not the exception


def _dist(site: Path, folder: str, metadata_text: str | None) -> None:
    d = site / folder
    d.mkdir(parents=True)
    if metadata_text is not None:
        (d / "METADATA").write_text(metadata_text)


@pytest.mark.parametrize("folder,text,expect", [
    ("Fake_Engine-1.2.3.dist-info", "Metadata-Version: 2.1\nName: fake-engine\nVersion: 1.2.3\n\nbody\n", "1.2.3"),
    ("fake.engine-2.0.dist-info", "Metadata-Version: 2.1\nName: fake.engine\nVersion: 2.0rc1\n", None),  # not plain
    ("fake_engine-3.dist-info", "Metadata-Version: 2.1\nSummary: a\n  folded\nVersion: 3\n", None),  # folded line
    ("fake_engine-4.dist-info", None, None),  # no METADATA
    ("fake_engine.egg-info", "Metadata-Version: 1.0\n", None),
])
def test_a_site_folder(tmp_path: Path, folder: str, text: str | None, expect: str | None, monkeypatch) -> None:
    """Plain cases are read here; everything else is left to importlib.metadata (and gives its answer)."""
    _dist(tmp_path, folder, text)
    monkeypatch.setattr(sys, "path", [str(tmp_path / "missing"), str(tmp_path)])
    got = inst._from_dist_info("fake-engine")
    if expect is not None:
        assert got == expect
    else:
        assert got is inst._UNSURE
    try:
        want = metadata.version("fake-engine")
    except Exception:
        want = None
    assert inst.version("fake-engine") == want


def test_the_first_folder_on_sys_path_wins(tmp_path: Path, monkeypatch) -> None:
    _dist(tmp_path / "a", "fake_engine-1.0.dist-info", "Metadata-Version: 2.1\nName: fake_engine\nVersion: 1.0\n")
    _dist(tmp_path / "b", "fake_engine-2.0.dist-info", "Metadata-Version: 2.1\nName: fake_engine\nVersion: 2.0\n")
    monkeypatch.setattr(sys, "path", [str(tmp_path / "b"), str(tmp_path / "a")])
    assert inst.version("fake-engine") == "2.0" == metadata.version("fake-engine")
    monkeypatch.setattr(sys, "path", [str(tmp_path / "a"), str(tmp_path / "b")])
    assert inst.version("fake-engine") == "1.0" == metadata.version("fake-engine")
    monkeypatch.setattr(sys, "path", [str(tmp_path / "nothing")])
    assert inst.version("fake-engine") is None


def test_a_zip_on_sys_path_is_left_to_importlib_metadata(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "deps.zip").write_bytes(b"PK\x05\x06" + b"\0" * 18)  # an empty zip
    monkeypatch.setattr(sys, "path", [str(tmp_path / "deps.zip")])
    assert inst._from_dist_info("fake-engine") is inst._UNSURE
    assert inst.version("fake-engine") is None


def test_reading_the_installed_releases_imports_neither_importlib_metadata_nor_packaging() -> None:
    code = ("import sys\n"
            "from kvtool.engines.releases import checked_default\n"
            "checked_default()\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'packaging' or m == 'importlib.metadata'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
