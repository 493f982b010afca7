"""English text for calibration and evaluation: CPython's `pydoc_data.topics` (~465 KB of prose).

The topics are split into two disjoint parts by a fixed rule (sorted topic names; every fourth
topic is evaluation text, the rest calibration), so no topic is in both. Some topics repeat
paragraphs of others (~3.4% of the evaluation topics' text); those paragraphs are dropped from the
evaluation text, so no evaluated paragraph was ever seen in calibration.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path


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


def write_text_files(folder: Path) -> tuple[Path, Path]:
    """Write calib.txt and eval.txt into folder (for CLI runs) and return their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    calib, ev = folder / "calib.txt", folder / "eval.txt"
    if not calib.exists():
        calib.write_text(calibration_text(), encoding="utf-8")
    if not ev.exists():
        ev.write_text(evaluation_text(), encoding="utf-8")
    return calib, ev
