"""Where calibration and evaluation text comes from: local UTF-8 files, the built-in text, or a `datasets` corpus.

Built-in text: CPython's `pydoc_data.topics` (~465 KB of English prose), split for calibration and evaluation.

Offline and always installed (it ships with Python), so `quantize-kv`, `convert --method aware` and `eval`
work without a text file (`--calib-dataset pydoc`, `--dataset pydoc`, the defaults). The topics are split into
two disjoint parts by a fixed rule (sorted topic names; every fourth topic is evaluation text, the rest
calibration), so no topic is in both. Some topics repeat paragraphs of others (~3.4% of the evaluation topics'
text); those paragraphs are dropped from the evaluation text, so no evaluated paragraph was ever seen in
calibration. `python -m kvtool.datasets FOLDER` writes both parts as calib.txt and eval.txt.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Sequence

from kvtool.errors import InputError, UsageError
from kvtool.io import inputfile

BUILTIN = "pydoc"
# Text the model being converted writes itself (kvtool.convert.aware.selftext); only a command that has the
# model loaded can produce it (convert --method aware), so the others refuse it.
MODEL_WRITTEN = "self"
# --calib-dataset choices: name -> the sources it mixes, in equal shares of the calibration tokens. A source is
# the built-in text, a `datasets` corpus's train split (network, `pip install datasets`) or MODEL_WRITTEN.
CALIBRATION_MIXES = {
    "mixed": ("pydoc", "devil", "jargon"),
    "pydoc": ("pydoc",),
    "self": (MODEL_WRITTEN,),
    "pydoc+self": ("pydoc", MODEL_WRITTEN),
    "wikitext2": ("wikitext2",),
    "wikitext103": ("wikitext103",),
}
CALIBRATION_DATASETS = tuple(CALIBRATION_MIXES)
# --method aware's --calib-dataset when none is given: of the sources measured it generalizes best to text
# unlike its own (issue 17, docs/convert-quality.md). quantize-kv and eval keep pydoc.
MERGE_CALIBRATION = "mixed"
CALIBRATION_LABEL = "builtin:pydoc_data.topics (calibration part)"


@lru_cache(maxsize=None)
def _topics() -> list[tuple[str, str]]:
    from pydoc_data.topics import topics

    return sorted(topics.items())


def calibration_text() -> str:
    return "\n\n".join(text for i, (_, text) in enumerate(_topics()) if i % 4 != 0)


@lru_cache(maxsize=None)
def evaluation_text() -> str:
    seen = {p.strip() for p in calibration_text().split("\n\n") if len(p.strip()) > 40}
    kept = []
    for i, (_, text) in enumerate(_topics()):
        if i % 4 == 0:
            paras = [p for p in text.split("\n\n") if p.strip() not in seen]
            kept.append("\n\n".join(paras))
    return "\n\n".join(kept)


def write_text_files(folder: str | Path) -> tuple[Path, Path]:
    """Write calib.txt and eval.txt into folder (created if needed) and return their paths."""
    from kvtool.io.outputfile import make_parents, write_new

    folder = make_parents(folder)
    calib, ev = folder / "calib.txt", folder / "eval.txt"
    for path, text in ((calib, calibration_text), (ev, evaluation_text)):
        if not path.exists() or path.is_symlink():  # an existing link is refused by write_new, never followed
            write_new(path, text())
    return calib, ev


def check_calibration_source(files, dataset: str | None) -> None:
    """--calib-text and --calib-dataset exclude each other; the dataset must be one kvtool knows."""
    if files and dataset:
        raise UsageError("give --calib-text or --calib-dataset, not both", option="calib_dataset")
    if dataset is not None and dataset not in CALIBRATION_DATASETS:
        raise UsageError(f"unknown dataset {dataset!r}; known: {', '.join(CALIBRATION_DATASETS)}",
                         option="calib_dataset")


def calibration_parts(dataset: str | None, option: str = "calib_dataset") -> tuple[str, ...]:
    """The sources a --calib-dataset mixes (None: the built-in pydoc calibration part)."""
    name = dataset or BUILTIN
    if name not in CALIBRATION_MIXES:
        raise UsageError(f"unknown dataset {name!r}; known: {', '.join(CALIBRATION_DATASETS)}", option=option)
    return CALIBRATION_MIXES[name]


# Public-domain prose of other genres than pydoc, shipped in kvtool/data/calibration (gzip, ~90 KB of text each):
# 253 entries of Ambrose Bierce's The Devil's Dictionary (1911) and 134 prose entries of the Jargon File 4.4.7
# (2003), from Debian's dict-devil and dict-jargon, a seeded sample reflowed into paragraphs (how: docs/
# convert-quality.md). Calibrating on them with pydoc generalizes better to text unlike any of the three (issue 17).
PACKAGED_TEXTS = {
    "devil": ("devils_dictionary.txt.gz", "builtin:The Devil's Dictionary (Ambrose Bierce, 1911; sample)"),
    "jargon": ("jargon_file.txt.gz", "builtin:The Jargon File 4.4.7 (sample)"),
}


# mixes that need neither the network nor the model: what a recipe's convert step may name
OFFLINE_MIXES = tuple(name for name, parts in CALIBRATION_MIXES.items() if set(parts) <= {BUILTIN, *PACKAGED_TEXTS})


@lru_cache(maxsize=None)
def packaged_text(source: str) -> str:
    import gzip

    name = PACKAGED_TEXTS[source][0]
    return gzip.decompress((Path(__file__).parent / "data" / "calibration" / name).read_bytes()).decode("utf-8")


def source_text(source: str, option: str = "calib_dataset") -> tuple[str, str]:
    """(text, label) of one text source of a mix (not MODEL_WRITTEN, which needs the model)."""
    if source == BUILTIN:
        return calibration_text(), CALIBRATION_LABEL
    if source in PACKAGED_TEXTS:
        return packaged_text(source), PACKAGED_TEXTS[source][1]
    from dataclasses import replace

    return load_hub(replace(DATASETS[source], split="train"), source, option), f"{source} (train split)"


def calibration_texts(dataset: str | None, option: str = "calib_dataset") -> tuple[list[str], str]:
    """([text], label) of a --calib-dataset made of texts only (None: the built-in pydoc calibration part);
    a mix with model-written text is refused (the caller has no model to write it)."""
    parts = calibration_parts(dataset, option)
    if MODEL_WRITTEN in parts:
        raise UsageError(f"dataset {dataset!r} is text the model writes itself, which only convert --method aware "
                         "can produce; use --calib-dataset pydoc or --calib-text FILE", option=option)
    texts, labels = zip(*(source_text(p, option) for p in parts))
    return list(texts), " + ".join(labels)


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


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 1:
        print("usage: python -m kvtool.datasets FOLDER   (writes FOLDER/calib.txt and FOLDER/eval.txt)", file=sys.stderr)
        return 2
    for path in write_text_files(args[0]):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
