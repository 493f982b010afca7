"""Built-in text: CPython's `pydoc_data.topics` (~465 KB of English prose), split for calibration and evaluation.

Offline and always installed (it ships with Python), so `quantize-kv`, `convert --method aware` and `eval`
work without a text file (`--calib-dataset pydoc`, `--dataset pydoc`, the defaults). The topics are split into
two disjoint parts by a fixed rule (sorted topic names; every fourth topic is evaluation text, the rest
calibration), so no topic is in both. Some topics repeat paragraphs of others (~3.4% of the evaluation topics'
text); those paragraphs are dropped from the evaluation text, so no evaluated paragraph was ever seen in
calibration. `python -m kvtool.datasets FOLDER` writes both parts as calib.txt and eval.txt.
"""

from __future__ import annotations

import sys
from functools import lru_cache
from pathlib import Path

from kvtool.errors import UsageError

BUILTIN = "pydoc"
# --calib-dataset choices: the built-in text, or a `datasets` corpus's train split (network, `pip install datasets`)
CALIBRATION_DATASETS = ("pydoc", "wikitext2", "wikitext103")
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
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    calib, ev = folder / "calib.txt", folder / "eval.txt"
    if not calib.exists():
        calib.write_text(calibration_text(), encoding="utf-8")
    if not ev.exists():
        ev.write_text(evaluation_text(), encoding="utf-8")
    return calib, ev


def check_calibration_source(files, dataset: str | None) -> None:
    """--calib-text and --calib-dataset exclude each other; the dataset must be one kvtool knows."""
    if files and dataset:
        raise UsageError("give --calib-text or --calib-dataset, not both", option="calib_dataset")
    if dataset is not None and dataset not in CALIBRATION_DATASETS:
        raise UsageError(f"unknown dataset {dataset!r}; known: {', '.join(CALIBRATION_DATASETS)}",
                         option="calib_dataset")


def calibration_texts(dataset: str | None, option: str = "calib_dataset") -> tuple[list[str], str]:
    """([text], label) of a --calib-dataset (None: the built-in pydoc calibration part)."""
    name = dataset or BUILTIN
    if name == BUILTIN:
        return [calibration_text()], CALIBRATION_LABEL
    if name not in CALIBRATION_DATASETS:
        raise UsageError(f"unknown dataset {name!r}; known: {', '.join(CALIBRATION_DATASETS)}", option=option)
    from dataclasses import replace

    from kvtool.eval.texts import DATASETS, load_hub

    return [load_hub(replace(DATASETS[name], split="train"), name, option)], f"{name} (train split)"


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
