"""The token ids `--method aware` calibrates on, and where they came from: built from the calibration sources
(--calib-text or the parts of --calib-dataset, text the model writes itself included) and the model's
tokenizer, before any model weights are loaded; built and inspected on its own
(tests/convert/test_aware_calibration_data.py)."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from kvtool.convert.aware.calibration import Source, text_sha256


@dataclass
class CalibrationData:
    ids: torch.Tensor  # [sequences, seq_len] token ids, the sources interleaved
    sources: list[Source]  # the sources that gave sequences (a short calibration may not reach all of them)
    written: dict = field(default_factory=dict)  # text the model wrote: rows, seconds, sampling (empty: none)
    used: list = field(default_factory=list)  # each text source's kvtool.tokenstream.Tokens (the used text's sha256)

    @classmethod
    def build(cls, src: str | Path, calib_text: str | None, calib_dataset: str | None, tokens: int, seq_len: int,
              *, device: torch.device | str = "cpu", note: Callable[[str], None] = lambda _text: None):
        """`tokens` calibration tokens in sequences of `seq_len` from --calib-text, else --calib-dataset (a name
        kvtool.datasets.CALIBRATION_MIXES knows; the method resolves its default); the tokenizer of `src`, and
        its model when a source is model-written (kvtool.convert.aware.selftext)."""
        from kvtool.convert.aware.calibration import calibration_batch, calibration_shares, calibration_sources
        from kvtool.runtime.layerwise import release_free_memory
        from kvtool.runtime.torch_utils import load_tokenizer

        note("reading the calibration text")
        sources = calibration_sources(calib_text, calib_dataset)
        tokenizer = load_tokenizer(src)
        written: dict = {}

        def write(rows: int, length: int) -> torch.Tensor:
            from kvtool.convert.aware.selftext import Sampling, write_calibration

            note(f"the model writes {rows} calibration sequences of {length} tokens")
            t0 = time.perf_counter()
            out = write_calibration(src, tokenizer, rows, length, device=torch.device(device), sampling=Sampling(),
                                    on_batch=lambda done: note(f"written {done}/{rows} sequences"))
            written.update(rows=rows, seconds=round(time.perf_counter() - t0, 2), sampling=vars(Sampling()))
            return out

        used_tokens: list = []  # only the text the tokens need is read: its sha256 is what is recorded
        ids = calibration_batch(tokenizer, sources, tokens, seq_len, write, used_tokens)
        used = [s for s, n in zip(sources, calibration_shares(len(sources), tokens, seq_len)) if n]
        tokenizer = None  # noqa: F841 (freed, not reused)
        release_free_memory()  # the tokenizer (~100 MB for a 49k vocabulary) is gone before the model comes
        return cls(ids=ids, sources=used, written=written, used=used_tokens)

    @property
    def label(self) -> str:
        return " + ".join(s.label for s in self.sources)

    def provenance(self) -> dict:
        """What kvtool.json records of the calibration data: sources, hashes of the text and of the ids, shape."""
        return {"calib_text": self.label,
                "calib_text_sha256": text_sha256(self.used) if self.used else None,
                "calib_ids_sha256": hashlib.sha256(self.ids.numpy().astype("<i8").tobytes()).hexdigest(),
                "calib_tokens": int(self.ids.numel()), "seq_len": int(self.ids.shape[1]),
                **({"self_written": self.written} if self.written else {})}
