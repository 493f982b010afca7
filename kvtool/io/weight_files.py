"""Which safetensors files make up a model folder, and the checks every reader shares.

One place decides which files are the weights and whether each may be opened: lint's reader
(kvtool.model.checkpoint), the streaming reader (kvtool.io.reader), the KV-scale reader (kvtool.eval.fp8)
and the pre-load gate (kvtool.model.preflight) all call `scan_weights`, so they agree on every verdict.

- With model.safetensors.index.json: its weight_map must be a non-empty object of tensor -> plain
  file name; a name that is absolute, has `..` or a backslash, or resolves (through symlinks)
  outside the folder is never opened; every named shard must exist; every tensor must be in the
  shard the index names and in only one shard.
- Without an index: the folder's *.safetensors. More than one is refused: transformers reads only
  model.safetensors when there is no index (and finds nothing when none has that name), so which
  files form the model is ambiguous. (Files found this way may be symlinks, e.g. into a shared
  cache: they are the folder's own entries, not paths a file named.)
- Every file's header is validated as the safetensors library does (kvtool.io.safetensors_header).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvtool.io.jsonfile import JsonDocument, load_json_object
from kvtool.io.safetensors_header import SafetensorsHeader, read_header

INDEX_NAME = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt", ".pickle")
# Problem kinds that are warnings: the weights still load as the index says.
WARNING_KINDS = ("index-extra",)


@dataclass(frozen=True)
class ReaderProblem:
    """Something wrong found while reading; lint turns each kind into a coded finding."""

    # header | index-invalid | index-escape | index-missing-file | index-missing-tensor | index-extra |
    # tensor-twice | unindexed-shards
    kind: str
    message: str
    file: str | None = None
    tensor: str | None = None

    @property
    def is_error(self) -> bool:
        return self.kind not in WARNING_KINDS


@dataclass
class WeightScan:
    files: list[str] = field(default_factory=list)  # the safetensors files opened, relative to the folder
    headers: list[SafetensorsHeader] = field(default_factory=list)
    index_doc: JsonDocument | None = None
    problems: list[ReaderProblem] = field(default_factory=list)


def scan_weights(root: Path) -> WeightScan:
    """Locate and validate the safetensors weights of a model folder (headers only, no tensor data).

    Raises InputError only when the index is not a readable JSON object; everything else is a problem."""
    scan = WeightScan()
    index_path = root / INDEX_NAME
    if index_path.is_file():
        scan.index_doc = load_json_object(index_path, what="safetensors index")
        names = _index_files(scan, root)
        single = root / "model.safetensors"
        if "model.safetensors" not in names and (single.is_file() or single.is_symlink()):
            # transformers loads model.safetensors before it looks for an index; vLLM follows the index
            scan.problems.append(ReaderProblem(
                "unindexed-shards", f"model.safetensors is not in {INDEX_NAME}, yet transformers would read it alone "
                "(it looks for the index only when that file is absent), so which files form the model is ambiguous",
                "model.safetensors"))
    else:
        # not only regular files: a FIFO, device or folder named *.safetensors is reported, not skipped
        names = sorted(p.name for p in root.glob("*.safetensors"))
        if len(names) > 1:
            scan.problems.append(ReaderProblem(
                "unindexed-shards", f"{len(names)} safetensors files ({', '.join(names[:3])}"
                f"{' ...' if len(names) > 3 else ''}) and no {INDEX_NAME}; transformers would read only "
                "model.safetensors, so which files form the model is ambiguous", names[0]))
    for name in names:
        h = read_header(root / name, name)
        scan.files.append(name)
        scan.headers.append(h)
        for prob in h.problems:
            scan.problems.append(ReaderProblem("header", prob.message, name, prob.tensor))
    _check_placement(scan)
    return scan


def is_inside(root: Path, name: str) -> bool:
    """A plain relative name that stays in `root` after symlinks are resolved.

    One exception: the Hugging Face cache keeps a snapshot's files as symlinks into the repository's
    blobs/ folder (models--org--name/snapshots/REV/x -> ../../blobs/SHA); those are inside the model."""
    p = Path(name)
    if not name or p.is_absolute() or ".." in p.parts or "\\" in name:
        return False
    try:
        real_root, target = root.resolve(), (root / p).resolve()
    except (OSError, RuntimeError, ValueError):  # a loop, an unreadable link, an embedded NUL
        return False
    if real_root in target.parents:
        return True
    blobs = real_root.parent.parent / "blobs"
    return real_root.parent.name == "snapshots" and target.parent == blobs


def _index_files(scan: WeightScan, root: Path) -> list[str]:
    """Shard names from the index, refusing any that escape the model folder or do not exist."""
    assert scan.index_doc is not None  # called only for a checkpoint with an index
    wm = scan.index_doc.data.get("weight_map")
    if not isinstance(wm, dict) or not wm:
        what = "empty" if isinstance(wm, dict) else "missing or not an object"
        scan.problems.append(ReaderProblem("index-invalid", f"weight_map is {what}", INDEX_NAME, "weight_map"))
        return []
    files: dict[str, bool] = {}
    for tensor, fname in wm.items():
        if not isinstance(fname, str) or not fname:
            scan.problems.append(ReaderProblem(
                "index-invalid", f"weight_map entry is not a file name: {fname!r}", INDEX_NAME, tensor))
            continue
        if fname in files:
            continue
        files[fname] = False
        if not is_inside(root, fname):
            scan.problems.append(ReaderProblem(
                "index-escape", f"weight_map names {fname!r}, outside the model folder; it was not opened",
                INDEX_NAME, tensor))
        elif not (root / fname).exists():
            scan.problems.append(ReaderProblem(
                "index-missing-file", f"shard {fname!r} named by the index does not exist", INDEX_NAME, tensor))
        else:
            files[fname] = True
    return [f for f, ok in files.items() if ok]


def _check_placement(scan: WeightScan) -> None:
    """Each tensor in one shard only, and (with an index) in the shard the index names."""
    where: dict[str, list[str]] = {}
    for h in scan.headers:
        for name in h.tensors:
            where.setdefault(name, []).append(h.file)
    for name, files in where.items():
        if len(files) > 1:
            scan.problems.append(ReaderProblem(
                "tensor-twice", f"tensor {name!r} is stored in both {files[0]} and {files[1]}", files[1], name))
    if scan.index_doc is None:
        return
    wm = scan.index_doc.data.get("weight_map")
    if not isinstance(wm, dict):
        return
    opened = {h.file for h in scan.headers if h.ok}
    for tensor, fname in wm.items():
        if fname not in opened or fname in where.get(tensor, ()):
            continue
        elsewhere = where.get(tensor)
        msg = (f"index maps {tensor!r} to {fname!r} but it is stored in {elsewhere[0]!r}" if elsewhere
               else f"index maps {tensor!r} to {fname!r} but no shard stores it")
        scan.problems.append(ReaderProblem("index-missing-tensor", msg, INDEX_NAME, tensor))
    for tensor, files in where.items():
        if tensor not in wm:
            scan.problems.append(ReaderProblem(
                "index-extra", f"tensor {tensor!r} in {files[0]!r} is not listed in the index", files[0], tensor))



def raise_first_error(scan, root: Path, *, require_weights: bool = True) -> None:
    """Refuse a folder whose weights any reader would refuse: one line naming the file and tensor or field.

    `scan` is a WeightScan or a kvtool.model.checkpoint.Checkpoint (the same problems, headers, index_doc).
    A folder with no safetensors at all is refused too; if it holds pickle files, the line says kvtool
    never opens them."""
    from kvtool.errors import InputError

    prob = next((p for p in scan.problems if p.is_error), None)
    if prob is not None:
        raise InputError(prob.message, file=str(root / prob.file) if prob.file else str(root), field=prob.tensor)
    if not scan.headers and scan.index_doc is None:
        pickles = sorted(p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES and p.is_file())
        if pickles:
            raise InputError(f"weights only in pickle files ({', '.join(pickles[:3])}); kvtool never unpickles: "
                             "convert them to safetensors in a sandbox", file=str(root))
        if require_weights:
            raise InputError("no safetensors weights in the model folder", file=str(root))
