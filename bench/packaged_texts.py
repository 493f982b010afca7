"""Rebuild kvtool/data/calibration/*.txt.gz: the public-domain texts of the `mixed` calibration dataset.

- The Devil's Dictionary (Ambrose Bierce, 1911; "A Public Domain Text, Copyright Expired"), from Debian's
  dict-devil 1.0-13.1;
- The Jargon File 4.4.7 (2003; "in the public domain"), from Debian's dict-jargon 4.4.7-3.1.

Both .debs are fetched with `apt-get download` (or taken from FOLDER if already there) and unpacked with
`dpkg -x`; nothing else is needed. Each dictionary is split into entries (dictd headers dropped, `{cross
reference}` braces removed, wrapped lines joined into paragraphs, short-line verse kept as it is; Jargon File
entries shorter than 200 characters, mostly bare cross-references, dropped), shuffled with a fixed seed so that
the first tokens cover the whole alphabet, and cut at ~90,000 characters. The output is deterministic (gzip
mtime 0).

    python bench/packaged_texts.py [FOLDER]      # FOLDER: where the .debs go (default: a temp folder)
"""

from __future__ import annotations

import glob
import gzip
import random
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

PACKAGES = ("dict-devil", "dict-jargon")
OUT = Path(__file__).resolve().parents[1] / "kvtool" / "data" / "calibration"
SIZE = 90_000
SEED = 17


def _unpack(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for pkg in PACKAGES:
        if not glob.glob(str(folder / f"{pkg}_*.deb")):
            subprocess.run(["apt-get", "download", pkg], cwd=folder, check=True)
    root = folder / "x"
    for deb in sorted(glob.glob(str(folder / "*.deb"))):
        subprocess.run(["dpkg", "-x", deb, str(root)], check=True)
    return root / "usr" / "share" / "dictd"


def _reflow(block: str) -> str:
    out = []
    for para in re.split(r"\n\s*\n", textwrap.dedent(block).strip()):
        lines = [line.strip() for line in para.splitlines() if line.strip()]
        verse = len(lines) > 1 and all(len(line) < 60 for line in lines)
        out.append("\n".join(lines) if verse else " ".join(lines))
    return "\n\n".join(out)


def _unbrace(text: str) -> str:
    return re.sub(r"\{\s*([^}]*?)\s*\}", r"\1", text)


def devil_entries(dictd: Path) -> list[str]:
    text = gzip.open(dictd / "devil.dict.dz").read().decode("utf-8")
    text = text[text.index("\nABASEMENT, n."):]
    return [_reflow(_unbrace(e.strip())) for e in re.split(r"\n(?=[A-Z][A-Z' -]+, [a-z.]+\s)", text)
            if e.strip() and not e.strip().startswith("00-database")]


def jargon_entries(dictd: Path) -> list[str]:
    text = gzip.open(dictd / "jargon.dict.dz").read().decode("utf-8")
    entries = []
    for e in re.split(r"\n\n(?=\S)", text):
        if e.startswith("00-database") or "\n" not in e:
            continue
        head, _, body = e.partition("\n")
        _pronunciation, _, body = body.partition("\n")
        body = _reflow(_unbrace(body))
        if len(body) > 200:
            entries.append(f"{head.strip()}: {body}")
    return entries


def sample(entries: list[str]) -> str:
    entries = list(entries)
    random.Random(SEED).shuffle(entries)
    out, n = [], 0
    for e in entries:
        if n >= SIZE:
            break
        out.append(e)
        n += len(e) + 2
    return "\n\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    folder = Path(argv[0]) if argv else Path(tempfile.mkdtemp(prefix="kvtool-texts-"))
    dictd = _unpack(folder)
    OUT.mkdir(parents=True, exist_ok=True)
    for name, entries in (("devils_dictionary", devil_entries(dictd)), ("jargon_file", jargon_entries(dictd))):
        text = sample(entries)
        with gzip.GzipFile(OUT / f"{name}.txt.gz", "wb", mtime=0) as f:
            f.write(text.encode("utf-8"))
        print(f"{OUT / name}.txt.gz: {len(entries)} entries, {len(text)} characters")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
