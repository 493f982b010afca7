"""Where evaluation text comes from: local UTF-8 files, the built-in pydoc text, or a `datasets` corpus."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvtool.io import inputfile
from kvtool.errors import InputError, UsageError


@dataclass(frozen=True)
class HubDataset:
    path: str
    name: str | None
    split: str
    column: str


# Names for --dataset. "pydoc" is offline; the others need `pip install datasets` and the network.
DATASETS: dict[str, HubDataset | None] = {
    "pydoc": None,
    "wikitext2": HubDataset("wikitext", "wikitext-2-raw-v1", "test", "text"),
    "wikitext103": HubDataset("wikitext", "wikitext-103-raw-v1", "test", "text"),
}


def read_texts(files: Sequence[str] | None, dataset: str | None) -> tuple[list[str] | None, str]:
    """(texts, description); texts None means the built-in pydoc evaluation text."""
    if files and dataset:
        raise UsageError("give --text or --dataset, not both", option="dataset")
    if files:
        return [_read_file(f) for f in files], ", ".join(files)
    if not dataset or dataset == "pydoc":
        return None, "pydoc (built-in evaluation text)"
    if dataset not in DATASETS:
        raise UsageError(f"unknown dataset {dataset!r}; known: {', '.join(DATASETS)}", option="dataset")
    return [load_hub(DATASETS[dataset], dataset)], dataset


def read_text_file(name: str, option: str) -> str:
    """A regular UTF-8 text file given as option `option` (at most inputfile.TEXT_LIMIT bytes; FIFOs and
    devices are refused); one-line InputError naming the file and option."""
    try:
        return inputfile.read_text(name, what="text file", limit=inputfile.TEXT_LIMIT)
    except InputError as exc:
        exc.option = option
        exc.args = (exc.line(),)
        raise


def _read_file(name: str) -> str:
    text = read_text_file(name, "text")
    if not text.strip():
        raise InputError("is empty", file=name, option="text")
    return text


def load_hub(ds: HubDataset, label: str, option: str = "dataset") -> str:
    try:
        import datasets
    except ImportError:
        flag = "--" + option.replace("_", "-")
        alt = "--text FILE or --dataset pydoc" if option == "dataset" else f"--calib-text FILE or {flag} pydoc"
        raise InputError(f"needs the `datasets` package (pip install datasets) and network access; or use {alt}",
                         option=option) from None
    try:
        data = datasets.load_dataset(ds.path, ds.name, split=ds.split)
    except Exception as exc:  # offline, renamed, gated: one line for the user
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(f"cannot load {label} ({ds.path}/{ds.name}, split {ds.split}): {first}",
                         option=option) from None
    return "\n\n".join(t for t in data[ds.column] if t)
