"""English prose of other genres than kvtool's pydoc calibration text, offline, from Debian packages.

- dev (every tuning decision, issue 17): the licence texts of /usr/share/common-licenses (Debian's
  base-files, on every Debian system): Apache-2.0, Artistic, BSD, CC0-1.0, GFDL-1.3, GPL-3, LGPL-2.1,
  MPL-2.0, in that order (legal prose; 127 KB, ~28k tokens).
- dev 2 (tuning decisions, issue 17's second round): the quotations of Debian's fortunes-min and fortunes
  (/usr/share/games/fortunes, the non-offensive files), entries shuffled with seed 0 (~2.5 MB).
- eval (reported, never used for calibration or tuning): Jane Austen, *Persuasion* (1818; public domain,
  Project Gutenberg's text) as shipped by Debian's r-cran-janeaustenr (MIT) in the R data file
  janeaustenr/data/Rdata.rdb (467 KB, ~110k tokens). Read here with a small reader of R's
  serialization format (character vectors only), so R itself is not needed: the package's files are
  taken from /usr/lib/R/site-library (after `apt-get install r-cran-janeaustenr`) or from the .deb
  (`apt-get download r-cran-janeaustenr`; unpacked with dpkg -x into the cache folder).

- check (a third genre, scored once after every choice was made): the Gospel of Luke in the King James
  Version (1611; public domain), printed by Debian's bible-kjv 4.38 from bible-kjv-text's data file
  (archaic narrative and speech).

    python bench/other_texts.py FOLDER      # writes FOLDER/licenses.txt, fortunes.txt, persuasion.txt, luke.txt
"""

from __future__ import annotations

import glob
import gzip
import struct
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

LICENSES = ("Apache-2.0", "Artistic", "BSD", "CC0-1.0", "GFDL-1.3", "GPL-3", "LGPL-2.1", "MPL-2.0")
LICENSE_DIR = Path("/usr/share/common-licenses")
AUSTEN_PACKAGE = "r-cran-janeaustenr"
FORTUNES_PACKAGES = ("fortunes-min", "fortunes")  # fortunes-min holds the `fortunes` file itself
AUSTEN_DATA = "usr/lib/R/site-library/janeaustenr/data"
BIBLE_PACKAGES = ("bible-kjv", "bible-kjv-text")  # the `bible` reader and its data file


def licenses_text() -> str:
    return "\n\n".join((LICENSE_DIR / name).read_text(encoding="utf-8") for name in LICENSES)


class _RReader:
    """R's XDR serialization (format 2 or 3), the subset a data file of character vectors uses."""

    def __init__(self, data: bytes):
        if data[:2] != b"X\n":
            raise ValueError("not an XDR R serialization")
        self.b, self.i = data, 2
        version = self._int()
        self._int(), self._int()  # writer and minimal reader versions
        if version == 3:
            n = self._int()  # native encoding name
            self.i += n
        self.refs: list = []

    def _int(self) -> int:
        (v,) = struct.unpack(">i", self.b[self.i:self.i + 4])
        self.i += 4
        return v

    def item(self):
        flags = self._int()
        kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind in (254, 242):  # NULL, empty environment
            return None
        if kind == 255:  # reference to an earlier symbol
            return self.refs[(flags >> 8) - 1]
        if kind == 1:  # symbol
            sym = ("symbol", self.item())
            self.refs.append(sym)
            return sym
        if kind == 9:  # one string
            n = self._int()
            if n == -1:
                return None
            s = self.b[self.i:self.i + n].decode("utf-8", "replace")
            self.i += n
            return s
        if kind == 2:  # pairlist (attributes)
            if has_attr:
                self.item()
            tag = self.item() if has_tag else None
            car, cdr = self.item(), self.item()
            return [(tag, car)] + (cdr or [])
        if kind in (16, 19, 20):  # character vector, list, expression
            items = [self.item() for _ in range(self._int())]
            return (items, self.item() if has_attr else None)
        if kind in (10, 13):  # logical, integer
            n = self._int()
            vals = list(struct.unpack(f">{n}i", self.b[self.i:self.i + 4 * n]))
            self.i += 4 * n
            return (vals, self.item() if has_attr else None)
        raise ValueError(f"R type {kind} is not read here")


def _names(attrs) -> list[str]:
    return next(v[0] for (tag, v) in attrs if tag == ("symbol", "names"))


def austen_novels(data_dir: Path) -> dict[str, str]:
    """{name: text} of the novels in janeaustenr's lazy-load data (Rdata.rdx index, Rdata.rdb values)."""
    index, attrs = _RReader(gzip.decompress((data_dir / "Rdata.rdx").read_bytes())).item()
    fields = dict(zip(_names(attrs), index))
    variables, var_attrs = fields["variables"]
    blob = (data_dir / "Rdata.rdb").read_bytes()
    out = {}
    for name, ((offset, length), _) in zip(_names(var_attrs), variables):
        chunk = blob[offset:offset + length]
        lines, _ = _RReader(zlib.decompress(chunk[4:])).item()  # 4 bytes of length, then zlib
        out[name] = "\n".join(line or "" for line in lines)
    return out


def _download(cache: Path, packages: tuple[str, ...]) -> None:
    """The packages' .deb files (apt-get download) unpacked into cache (dpkg -x); nothing is installed."""
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for pkg in packages:
            subprocess.run(["apt-get", "download", pkg], cwd=tmp, check=True, capture_output=True)
            (deb,) = glob.glob(f"{tmp}/{pkg}_*.deb")
            subprocess.run(["dpkg", "-x", deb, str(cache)], check=True)


def austen_data_dir(cache: Path) -> Path:
    """The installed package's data folder, else the .deb unpacked into cache (apt-get download)."""
    for root in (Path("/"), cache):
        if (root / AUSTEN_DATA / "Rdata.rdb").exists():
            return root / AUSTEN_DATA
    _download(cache, (AUSTEN_PACKAGE,))
    return cache / AUSTEN_DATA


def fortunes_text(cache: Path) -> str:
    """Debian's fortunes-min + fortunes quotations (the files but *.dat / *.u8), entries shuffled with seed 0."""
    import os
    import random

    data = Path("/usr/share/games/fortunes")
    if not (data / "wisdom").exists():
        data = cache / "usr/share/games/fortunes"
        if not (data / "wisdom").exists():
            _download(cache, FORTUNES_PACKAGES)
    entries = []
    for f in sorted(glob.glob(str(data / "*"))):
        if f.endswith((".dat", ".u8")) or not os.path.isfile(f) or "off" in f:
            continue
        text = open(f, encoding="utf-8", errors="replace").read()
        entries += [e.strip() for e in text.split("\n%\n") if e.strip()]
    random.Random(0).shuffle(entries)
    return "\n\n".join(entries)


def luke_text(cache: Path) -> str:
    """The Gospel of Luke, King James Version, as Debian's bible-kjv 4.38 prints it (`bible Luke1:1-24:53`):
    chapter headings and verse numbers dropped, each chapter one paragraph."""
    import re

    if not (cache / "usr/bin/bible").exists():
        _download(cache, BIBLE_PACKAGES)
    out = subprocess.run([str(cache / "usr/bin/bible"), "-p", str(cache / "usr/lib"), "Luke1:1-24:53"],
                         check=True, capture_output=True, text=True).stdout
    chapters: list[list[str]] = []
    for line in out.splitlines():
        if re.fullmatch(r"Luke \d+", line.strip()):
            chapters.append([])
        elif line.strip():
            verse = re.match(r"\s+\d+ (.*)", line)
            chapters[-1].append(verse.group(1) if verse else line.strip())
    return "\n\n".join(" ".join(words) for words in chapters) + "\n"


def write_texts(folder: str | Path, names: list[str] | None = None) -> dict[str, Path]:
    """FOLDER/licenses.txt (dev), FOLDER/fortunes.txt (dev 2), FOLDER/persuasion.txt (eval) and FOLDER/luke.txt
    (a check of a third genre), or only those in names; existing files are kept."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    makers = {"licenses": licenses_text, "fortunes": lambda: fortunes_text(folder / "deb"),
              "persuasion": lambda: austen_novels(austen_data_dir(folder / "deb"))["persuasion"],
              "luke": lambda: luke_text(folder / "deb")}
    paths = {}
    for name in names or list(makers):
        paths[name] = folder / f"{name}.txt"
        if not paths[name].exists():
            paths[name].write_text(makers[name](), encoding="utf-8")
    return paths


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python bench/other_texts.py FOLDER")
    for p in write_texts(sys.argv[1]).values():
        print(p)
