"""The checkpoint reader shared by every command: config, safetensors headers, index, side files.

Accepts a model folder, a path to a config.json, or a Hugging Face hub id (config and header
metadata only). Never reads tensor data and never unpickles anything.
"""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from kvtool.errors import InputError
from kvtool.io.jsonfile import JsonDocument, collector_paused, load_json_object
from kvtool.io.weight_files import INDEX_NAME, PICKLE_SUFFIXES, ReaderProblem, is_inside, scan_weights
from kvtool.io.safetensors_header import SafetensorsHeader, TensorInfo

__all__ = ["INDEX_NAME", "PICKLE_SUFFIXES", "Checkpoint", "ReaderProblem", "open_checkpoint"]

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass
class Checkpoint:
    source: str
    root: Path | None
    config_doc: JsonDocument
    headers: list[SafetensorsHeader] = field(default_factory=list)
    index_doc: JsonDocument | None = None
    pickle_files: list[str] = field(default_factory=list)
    problems: list[ReaderProblem] = field(default_factory=list)
    generation_config: dict | None = None
    tokenizer_config: dict | None = None
    tokenizer_vocab_size: int | None = None
    hub: bool = False
    # Git LFS pointer files standing where weights should be (kvtool.io.lfs); headers are then not read at all
    lfs_pointers: list = field(default_factory=list)

    @property
    def config(self) -> dict:
        return self.config_doc.data

    @property
    def config_path(self) -> Path:
        return self.config_doc.path

    @property
    def has_weights(self) -> bool:
        return bool(self.headers)

    @property
    def tensors(self) -> dict[str, TensorInfo]:
        out: dict[str, TensorInfo] = {}
        for h in self.headers:
            out.update(h.tensors)
        return out

    @property
    def weight_bytes(self) -> int:
        return sum(t.nbytes for h in self.headers for t in h.tensors.values())

    def require_pulled_weights(self) -> None:
        """InputError (exit 2) when the weights are Git LFS pointers: commands that read tensors stop here."""
        if self.lfs_pointers and self.root is not None:
            from kvtool.io.lfs import refuse_pointers

            refuse_pointers(self.lfs_pointers, self.source)

    def planned(self, config: dict | None = None, tensors: dict | None = None):
        """(config, tensors, spec) a plan works on: the checkpoint's, or those a recipe's earlier steps leave.
        Refuses, as every command that reads tensors does, a folder without weights (or with LFS pointers)
        and numbers outside kvtool.model.numbers' bounds."""
        from kvtool.model.numbers import require_valid_numbers
        from kvtool.model.spec import build_spec

        config = self.config if config is None else config
        if tensors is None:
            if not self.has_weights:  # what preflight refuses when weights are required
                self.require_pulled_weights()
                raise InputError("no safetensors weights in the model folder", file=str(self.root or self.config_path))
            tensors = self.tensors
        spec = build_spec(config)
        require_valid_numbers(spec, str(self.config_path))
        return config, tensors, spec

    def display(self, path: Path | None) -> str:
        """A path as users gave it (relative to the model folder when inside it)."""
        if path is None:
            return self.source
        return str(path)


def open_checkpoint(source: str | os.PathLike, *, read_weights: bool = True, read_side_files: bool = True) -> Checkpoint:
    """Open a model folder, a config.json, or a hub id. Raises InputError (exit 2) when unusable.

    read_side_files=False skips generation / tokenizer files (a tokenizer.json can take seconds to parse).
    """
    text = os.fspath(source)
    path = Path(text)
    try:
        exists = path.exists()
    except OSError as exc:
        raise InputError(_os_message(exc), file=text) from None
    if not exists:
        if _is_symlink_loop(path):
            raise InputError("symlink loop", file=text)
        if HUB_ID.match(text) and not text.startswith((".", "/")):
            return _open_hub(text)
        raise InputError("no such file or folder", file=text)
    try:
        if path.is_dir():
            return _open_folder(text, path, read_weights, read_side_files)
        return _open_config_file(text, path)
    except OSError as exc:
        raise InputError(_os_message(exc), file=text) from None


def _open_config_file(text: str, path: Path) -> Checkpoint:
    doc = load_json_object(path, what="config")
    return Checkpoint(source=text, root=None, config_doc=doc)


def _open_folder(text: str, root: Path, read_weights: bool, read_side_files: bool = True) -> Checkpoint:
    cfg = root / "config.json"
    if _is_symlink_loop(cfg):
        raise InputError("symlink loop", file=str(cfg))
    if not cfg.exists() and not cfg.is_symlink():
        raise InputError("no config.json in the model folder", file=str(cfg))
    from kvtool.io.model_files import check_model_files

    # before any file is read: every file kvtool or transformers may open (config.json, the index,
    # tokenizer files, chat templates...) that leads outside the folder or exceeds its size limit is refused
    check_model_files(root)
    # a config.json that is a folder, FIFO or device: load_json_object names what it is
    ckpt = Checkpoint(source=text, root=root, config_doc=load_json_object(cfg, what="config"))
    if read_side_files:
        ckpt.generation_config = _optional_json(root / "generation_config.json")
        ckpt.tokenizer_config = _optional_json(root / "tokenizer_config.json")
        ckpt.tokenizer_vocab_size = _tokenizer_size(root / "tokenizer.json")
    ckpt.pickle_files = sorted(p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES and p.is_file())
    from kvtool.io.lfs import folder_pointers

    # Git LFS pointers first: read as safetensors they look corrupt and would hide the real cause
    # (stat only, so commands that let transformers read the weights can say so too)
    ckpt.lfs_pointers = folder_pointers(root)
    if read_weights and not ckpt.lfs_pointers:  # no header is read from a partial set
        _read_weights(ckpt, root)
    return ckpt


def _read_weights(ckpt: Checkpoint, root: Path) -> None:
    scan = scan_weights(root)  # the one locator and validator every reader shares
    ckpt.index_doc, ckpt.headers, ckpt.problems = scan.index_doc, scan.headers, scan.problems


def _optional_json(path: Path) -> dict | None:
    if not is_inside(path.parent, path.name) or not path.is_file():  # outside the folder: refused before
        return None
    try:
        return load_json_object(path).data
    except InputError:
        return None


def _tokenizer_size(path: Path) -> int | None:
    """Vocabulary size of a fast tokenizer (model vocab plus added tokens), or None."""
    if not is_inside(path.parent, path.name) or not path.is_file():  # outside the folder: never read
        return None
    with collector_paused():  # _vocab_size has dropped the document when the collector resumes
        return _vocab_size(path)


def _vocab_size(path: Path) -> int | None:
    try:
        data = load_json_object(path, what="tokenizer").data
    except InputError:
        return None
    model = data.get("model") or {}
    vocab = model.get("vocab")
    ids = [t["id"] for t in data.get("added_tokens") or [] if isinstance(t, dict) and isinstance(t.get("id"), int)]
    if isinstance(vocab, dict):
        values = vocab.values()
        if not set(map(type, values)) <= {int, bool}:  # a malformed vocabulary: its integer ids only
            values = [v for v in values if isinstance(v, int)]
        if values:
            ids.append(max(values))  # at C speed: a Python set of the ids cost ~20 ms on a 49k vocabulary
    elif isinstance(vocab, list) and vocab:  # unigram: list of [piece, score]
        ids.append(len(vocab) - 1)
    return (max(ids) + 1) if ids else None


def _is_symlink_loop(path: Path) -> bool:
    try:
        path.resolve(strict=True)
    except RuntimeError:
        return True
    except OSError as exc:
        return exc.errno == errno.ELOOP
    return False


def _os_message(exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return "symlink loop"
    return exc.strerror or str(exc)


def _open_hub(repo_id: str) -> Checkpoint:
    """Config and safetensors header metadata from the hub; never the weights. Without a network (or with
    HF_HUB_OFFLINE) only the local cache is read: one line and no retries when it misses (kvtool.io.hub)."""
    try:
        import huggingface_hub as hf
    except ImportError:
        raise InputError("is not a local path, and reading from the hub needs `pip install huggingface_hub`", file=repo_id) from None
    from kvtool.io.hub import ETAG_TIMEOUT_S, offline_reason, quiet_hub, stay_offline

    offline = offline_reason()
    if offline:
        stay_offline()
    try:
        with quiet_hub():
            if offline:
                cfg_file = hf.hf_hub_download(repo_id, "config.json", local_files_only=True)
            else:
                cfg_file = hf.hf_hub_download(repo_id, "config.json", etag_timeout=ETAG_TIMEOUT_S)
    except Exception as exc:  # offline, missing repo, gated: all one line for the user
        if offline:
            raise InputError(f"is not a local folder or file, and its config.json is not in the local Hugging Face "
                             f"cache ({offline})", file=repo_id) from None
        raise InputError(f"cannot fetch config.json from the Hugging Face hub ({type(exc).__name__}); "
                         "check the id, your network, or HF_HUB_OFFLINE", file=repo_id) from None
    ckpt = Checkpoint(source=repo_id, root=None, config_doc=load_json_object(Path(cfg_file), what="config"), hub=True)
    if offline:
        return ckpt  # header metadata needs the hub: config-only checks still run
    try:
        with quiet_hub():
            meta = hf.get_safetensors_metadata(repo_id)
    except Exception:
        return ckpt  # no safetensors on the hub: config-only checks still run
    for fname, fmeta in meta.files_metadata.items():
        h = SafetensorsHeader(fname, Path(fname), 0)
        for tname, ti in fmeta.tensors.items():
            begin, end = ti.data_offsets
            h.tensors[tname] = TensorInfo(tname, ti.dtype, tuple(ti.shape), fname, (begin, end))
        h.metadata = dict(fmeta.metadata or {})
        ckpt.headers.append(h)
    return ckpt
