"""The release of an installed distribution, read from its `*.dist-info` folder on sys.path; never an import.

`importlib.metadata.version` answers the same question, but importing it (email, its adapters) costs ~20 ms and
each call parses METADATA with the email package: a sixth of a cold `kvtool lint`. This reads what it reads in
the common case, in the order it searches (sys.path in order, each folder in listing order, the first
`NAME-*.dist-info` or `NAME-*.egg-info` whose normalised name matches, the first `Version:` header of its
METADATA), and hands every case it does not read the same way to importlib.metadata: another metadata finder on
sys.meta_path, a zip or `.egg` entry on sys.path, an `.egg-info`, a METADATA without a plain header, a value
that is not a plain release number.

Only absolute sys.path entries are searched, by both: an empty or relative entry follows the working folder, and
a model folder kvtool runs in must not plant a `transformers-99.0.dist-info` that lint then reads as the installed
release (issue 39; the command line also strips the working folder from sys.path, kvtool/__init__.py).
"""

from __future__ import annotations

import os
import re
import sys

# the header lines of METADATA (RFC 822 as the email package reads them): NAME: VALUE
_HEADER = re.compile(r"([\041-\071\073-\176]+):[ \t]*(.*?)\r?\n?\Z", re.S)
PLAIN_RELEASE = re.compile(r"[0-9]+(?:\.[0-9]+)*")  # 4.44.2: always a valid PEP 440 version
_UNSURE = object()


def normalize(name: str) -> str:
    """importlib.metadata's normalised distribution name (Prepared.normalize)."""
    return re.sub(r"[-_.]+", "-", name).lower().replace("-", "_")


def version(name: str) -> str | None:
    """importlib.metadata.version(name) when that is a plain release number, else None (not installed, or a
    metadata it would raise on). Anything read differently falls back to importlib.metadata itself."""
    found = _from_dist_info(name)
    if found is not _UNSURE:
        return found
    from importlib import metadata

    try:
        found = next(iter(metadata.distributions(name=name, path=trusted_path())), None)
        return None if found is None else found.version
    except Exception:  # a broken dist-info: no reason to stop lint
        return None


def trusted_path() -> list[str]:
    """sys.path without the entries that follow the working folder ('' and relative ones)."""
    return [p for p in sys.path if isinstance(p, str) and os.path.isabs(p)]


def _from_dist_info(name: str):
    """The version string, None when no folder on sys.path has the distribution, or _UNSURE."""
    from importlib.machinery import PathFinder

    if any(f is not PathFinder and hasattr(f, "find_distributions") for f in sys.meta_path):
        return _UNSURE  # another finder answers first (importlib.metadata asks every finder in order)
    wanted = normalize(name)
    for entry in sys.path:
        if not isinstance(entry, str) or os.path.basename(entry).lower().endswith(".egg"):
            return _UNSURE
        if not os.path.isabs(entry):
            continue  # the working folder's: never an installed release
        try:
            children = _metadata_folders(entry)
        except OSError:
            if os.path.exists(entry):
                return _UNSURE  # a zip file (importlib.metadata reads its member names)
            continue  # a missing folder: importlib.metadata finds nothing there either
        for normalized, child in children:
            if normalized == wanted:
                return _unsure_or(_metadata_version(os.path.join(entry, child)) if child.lower().endswith(
                    ".dist-info") else _UNSURE)
    return None


_LISTED: dict[tuple[str, int], list[tuple[str, str]]] = {}


def _metadata_folders(folder: str) -> list[tuple[str, str]]:
    """(normalised name, child) of each `*.dist-info` / `*.egg-info` in `folder`, in listing order; one listing per
    folder and version of it (its mtime) for the process: lint asks for each engine several times."""
    key = (folder, os.stat(folder).st_mtime_ns)
    if key not in _LISTED:
        _LISTED[key] = [(normalize(low.rpartition(".")[0].partition("-")[0]), child) for child in os.listdir(folder)
                        if (low := child.lower()).endswith((".dist-info", ".egg-info"))]
    return _LISTED[key]


def _unsure_or(v):
    return v if v is not None else _UNSURE


def _metadata_version(folder: str) -> str | None:
    """The first Version header of folder/METADATA when it is a plain release written on one line, else None."""
    try:
        with open(os.path.join(folder, "METADATA"), encoding="utf-8") as fh:
            lines = [fh.readline() for _ in range(64)]  # Metadata-Version, Name, Version come first
    except (OSError, UnicodeDecodeError):
        return None
    for i, line in enumerate(lines):
        m = _HEADER.match(line)
        if m is None:
            return None  # the end of the headers, a continuation or a line the email package reads otherwise
        if m.group(1).lower() == "version":
            nxt = lines[i + 1] if i + 1 < len(lines) else ""
            folded = nxt[:1] in (" ", "\t")
            return m.group(2) if PLAIN_RELEASE.fullmatch(m.group(2)) and not folded else None
    return None
