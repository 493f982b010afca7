"""Git LFS pointer files: a repository checked out without LFS holds these instead of the weights.

A pointer is a small text file (the spec allows at most 1024 bytes) that starts with
`version https://git-lfs.github.com/spec/v1` and names the real file by `oid sha256:...` and `size N`
(https://github.com/git-lfs/git-lfs/blob/main/docs/spec.md). Read as safetensors, its first 8 bytes
("version ") decode to a header length of ~2.3e18 bytes, which sent users hunting for a corrupt file;
kvtool recognises pointers before reading any header and says that the weights were not pulled.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvtool.units import fmt_bytes, plain_int

MAGIC = b"version https://git-lfs.github.com/spec/v1"
MAX_POINTER_BYTES = 1024
PULL_HINT = ("pull them with `git lfs install && git lfs pull` (in GitHub Actions: actions/checkout with "
             "`lfs: true`)")


@dataclass(frozen=True)
class LfsPointer:
    file: str  # as named in the model folder
    size: int | None  # bytes of the real file, from the pointer's `size` line (None if absent or invalid)
    oid: str | None


def read_pointer(path: Path, name: str | None = None) -> LfsPointer | None:
    """The pointer stored at `path`, or None when the file is not one (reads at most 1 KiB)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(MAX_POINTER_BYTES + 1)
    except OSError:
        return None
    if len(head) > MAX_POINTER_BYTES or not head.startswith(MAGIC):
        return None
    size = oid = None
    for line in head.decode("utf-8", "replace").splitlines():
        key, _, value = line.partition(" ")
        if key == "size" and plain_int(value.strip(), max_digits=30) is not None:
            size = int(value.strip())
        elif key == "oid":
            oid = value.strip()
    return LfsPointer(name or path.name, size, oid)


def not_pulled_message(pointers: list[LfsPointer]) -> str:
    """One sentence naming every pointer and the size it stands for."""
    total = sum(p.size or 0 for p in pointers)
    from kvtool.errors import listed

    files = listed(f"{p.file} ({fmt_bytes(p.size) if p.size is not None else 'size unknown'})" for p in pointers)
    return f"the weights were not pulled: {len(pointers)} file(s) are Git LFS pointers ({fmt_bytes(total)} in all): {files}"


def find_pointers(root: Path, names: list[str]) -> list[LfsPointer]:
    """Pointers among the files `names` of the folder `root`; only files of at most 1 KiB are opened."""
    out = []
    for name in names:
        path = root / name
        try:
            small = path.is_file() and path.stat().st_size <= MAX_POINTER_BYTES
        except OSError:
            small = False
        pointer = read_pointer(path, name) if small else None
        if pointer is not None:
            out.append(pointer)
    return out


def folder_pointers(root: Path) -> list[LfsPointer]:
    """Pointers among a model folder's *.safetensors files (stat only, except for files of at most 1 KiB)."""
    return find_pointers(root, sorted(p.name for p in root.glob("*.safetensors")))


def refuse_pointers(pointers: list[LfsPointer], source: str) -> None:
    """InputError (exit 2) naming the pointers: for every command that reads tensors, before any safetensors
    validity check (a pointer is not a corrupt file, it is a file not pulled)."""
    from kvtool.errors import InputError

    if pointers:
        raise InputError(f"{not_pulled_message(pointers)}; {PULL_HINT}", file=source)
