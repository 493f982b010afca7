"""Python entry points: `evaluate` (one model, optional baseline) and `evaluate_many` (several
candidates against one baseline, the baseline run once per window).

Other commands call these (convert --eval, quantize-kv, recipes). Every model runs window by
window on the identical token stream; only running sums are kept, never the logits of the
stream. A candidate that is the same checkpoint (or the same loaded module) as the baseline
shares its weights in memory: FP8-KV variants of one model cost one load.

    from kvtool.eval.api import evaluate, evaluate_many, Candidate
    r = evaluate("out/model-gqa", baseline="meta/model", max_tokens=4096)
    print(r.ppl_ratio, r.kld_mean, r.passed)
    rows = evaluate_many([Candidate("m", kv_cache_dtype="off", label="original"),
                          Candidate("m", kv_cache_dtype="fp8", kv_scales="one", label="fp8 scale 1.0"),
                          Candidate("m", kv_cache_dtype="fp8", kv_scales={0: (0.1, 0.05), ...}, label="fp8 calibrated")],
                         baseline="m")
"""

from __future__ import annotations

import contextlib
import inspect
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from kvtool import progress as kv_progress
from kvtool.errors import InputError, UsageError
from kvtool.eval.gate import GateResult, check
from kvtool.eval.windows import batches, check_window, windows

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "off")
KV_SCALE_SOURCES = ("checkpoint", "one")


@dataclass
class Candidate:
    """One model to score. model: folder / hub id, or an already loaded transformers model.

    kv_cache_dtype: "auto" (FP8 emulation when the checkpoint declares a KV-cache scheme or has
    scale tensors), "fp8" (always), "off" (never). kv_scales: "checkpoint" (its scale tensors; 1.0
    for layers without one), "one" (1.0 everywhere, vLLM's default), {layer: (k, v)} or KVScales.
    """

    model: Any
    kv_cache_dtype: str = "auto"
    kv_scales: Any = "checkpoint"
    label: str | None = None


@dataclass
class EvalReport:
    model: str
    label: str | None
    baseline: str | None
    metrics: dict
    windows: int
    device: str
    dtype: str
    window: int
    stride: int
    batch_size: int
    text: str
    kv_cache_dtype: str  # "fp8_e4m3" when emulated, else the model dtype name
    kv_scales: dict | None  # {source, layers, min_scale, max_scale} when emulated
    seconds: float
    gates: list[GateResult] = field(default_factory=list)
    forwards_per_window: int = 1  # models run on each window in this evaluation (baseline included)

    def __getattr__(self, name: str):  # r.ppl, r.kld_mean ... read through to the metrics
        metrics = self.__dict__.get("metrics") or {}
        if name in metrics:
            return metrics[name]
        if name in ("baseline_ppl", "ppl_ratio", "log_ppl_ratio", "kld_mean", "top1_agreement", "dp_mean", "dp_rms"):
            return None
        raise AttributeError(name)

    @property
    def tokens(self) -> int:
        return self.metrics["tokens"]

    @property
    def passed(self) -> bool:
        return all(g.passed for g in self.gates)

    @property
    def failed_gates(self) -> list[GateResult]:
        return [g for g in self.gates if not g.passed]

    def apply_gates(self, limits: Mapping[str, float]) -> "EvalReport":
        self.gates = check(self.metrics, dict(limits))
        return self

    def as_dict(self) -> dict:
        d = {k: None for k in ("baseline_ppl", "ppl_ratio", "kld_mean", "top1_agreement")}
        d.update(self.metrics)
        d.update({
            "model": self.model, "label": self.label, "baseline": self.baseline, "windows": self.windows,
            "device": self.device, "dtype": self.dtype, "window": self.window, "stride": self.stride,
            "batch_size": self.batch_size, "text": self.text, "kv_cache_dtype": self.kv_cache_dtype,
            "kv_scales": self.kv_scales, "seconds": round(self.seconds, 3),
            "forwards_per_window": self.forwards_per_window,
            "tokens_per_s": round(self.tokens / self.seconds, 1) if self.seconds > 0 else None,
            "gates": [g.as_dict() for g in self.gates], "passed": self.passed,
        })
        return d


def evaluate(model, baseline=None, *, texts: str | Sequence[str] | None = None, max_length: int = 1024,
             stride: int | None = None, max_tokens: int | None = None, device: str = "auto", dtype: str = "auto",
             kv_cache_dtype: str = "auto", kv_scales: Any = "checkpoint", batch_size: int | None = None,
             device_map: str | None = None, gates: Mapping[str, float] | None = None, tokenizer=None,
             text_name: str | None = None, progress: bool | None = None) -> EvalReport:
    """Score `model` (folder, hub id or loaded model) on `texts`, against `baseline` when given.

    texts: the evaluation text(s), joined with blank lines into one token stream (default: the
    built-in pydoc evaluation text). max_length / stride: window length L and step S (S < L;
    default L // 2). max_tokens: cut the stream to its first N tokens. gates: {"max_ppl_increase":
    0.02, "max_kld": 0.01, "min_top1": 0.95} (any subset; the fields of kvtool/options/eval.py). progress: None follows the command's
    `--progress` session (kvtool.progress; silent outside one), True / False force it. Raises InputError /
    UsageError.
    """
    return evaluate_many([Candidate(model, kv_cache_dtype, kv_scales)], baseline, texts=texts,
                         max_length=max_length, stride=stride, max_tokens=max_tokens, device=device, dtype=dtype,
                         batch_size=batch_size, device_map=device_map, gates=gates, tokenizer=tokenizer,
                         text_name=text_name, progress=progress)[0]


def evaluate_many(candidates: Sequence[Candidate | Any], baseline=None, *, texts: str | Sequence[str] | None = None,
                  max_length: int = 1024, stride: int | None = None, max_tokens: int | None = None,
                  device: str = "auto", dtype: str = "auto", batch_size: int | None = None,
                  device_map: str | None = None, gates: Mapping[str, float] | None = None, tokenizer=None,
                  text_name: str | None = None, progress: bool | None = None) -> list[EvalReport]:
    """Score several candidates against one baseline on one token stream; one report per candidate.

    All distinct models are held in memory together (each window: baseline once, then every
    candidate), so nothing is recomputed and no logits are stored.
    """
    import torch

    from kvtool.runtime.torch_utils import pick_device, pick_dtype

    cands = [c if isinstance(c, Candidate) else Candidate(c) for c in candidates]
    if not cands:
        raise UsageError("no model to evaluate")
    for c in cands:
        if c.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise UsageError(f"unknown value {c.kv_cache_dtype!r}; use {', '.join(KV_CACHE_DTYPES)}",
                             option="kv_cache_dtype")
        if isinstance(c.kv_scales, str) and c.kv_scales not in KV_SCALE_SOURCES:
            raise UsageError(f"unknown value {c.kv_scales!r}; use {' or '.join(KV_SCALE_SOURCES)}", option="kv_scales")
    stride = stride if stride is not None else max(1, max_length // 2)
    check_window(max_length, stride)
    if max_tokens is not None and max_tokens < 2:
        raise UsageError(f"must be at least 2, got {max_tokens}", option="max_tokens")
    if batch_size is not None and batch_size < 1:
        raise UsageError(f"must be at least 1, got {batch_size}", option="batch_size")

    dev = pick_device(device) if not device_map else None
    torch_dtype = pick_dtype(dtype, dev if dev is not None else pick_device("auto"))
    pool = _ModelPool(dev, torch_dtype, device_map, progress)
    base = pool.get(baseline, tokenizer) if baseline is not None else None
    runs = [(c, pool.get(c.model, tokenizer)) for c in cands]

    # One token stream, identical for every model: refuse models whose tokenizers disagree.
    text = _join(texts)
    first = base or runs[0][1]
    ids = first.encode(text)
    for m in {id(m): m for m in [base] + [r for _, r in runs] if m is not None}.values():
        if m is not first:
            _same_tokenizer(first, m, text, ids)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if len(ids) < 2:
        raise InputError(f"the evaluation text has {len(ids)} token(s); at least 2 are needed", option="text")
    ws = windows(len(ids), max_length, stride)
    device_name = pool.device_name(first)
    bs = batch_size or (max(1, min(16, 8192 // max_length)) if device_name.startswith("cuda") else 1)

    emulation = [_emulation(c, m) for c, m in runs]
    accs = [_new_acc() for _ in runs]
    stream = torch.tensor(ids, dtype=torch.long)
    t0 = time.perf_counter()
    with kv_progress.task("eval", total=len(ids) - 1, unit="tok", enabled=progress, rate=True) as bar, \
            torch.inference_mode():
        for group in batches(ws, bs):
            batch = torch.stack([stream[w.begin:w.end] for w in group])
            keep = group[0].n_scored
            targets = batch[:, -keep:]
            base_logits = base.logits(batch, keep) if base is not None else None
            for (c, m), emu, acc in zip(runs, emulation, accs):
                with (_hooked(m, emu[0]) if emu else contextlib.nullcontext()):
                    logits = m.logits(batch, keep)
                acc.add(logits, targets, base_logits)
                del logits
            del base_logits
            bar.update(keep * len(group))
    seconds = time.perf_counter() - t0

    reports = []
    for (c, m), emu, acc in zip(runs, emulation, accs):
        r = EvalReport(
            model=m.name, label=c.label, baseline=base.name if base is not None else None, metrics=acc.summary(),
            windows=len(ws), device=device_name, dtype=str(torch_dtype).replace("torch.", ""), window=max_length,
            stride=stride, batch_size=bs, text=text_name or ("pydoc (built-in evaluation text)" if texts is None else "text"),
            kv_cache_dtype="fp8_e4m3" if emu else str(torch_dtype).replace("torch.", ""),
            kv_scales=emu[1].describe() if emu else None, seconds=seconds,
            forwards_per_window=len(runs) + (base is not None))
        if gates:
            r.apply_gates(gates)
        reports.append(r)
    return reports


# --- models -------------------------------------------------------------------------------------


class _Loaded:
    """A model with its tokenizer, and how to run one batch of windows on it."""

    def __init__(self, name: str, model, tokenizer, folder: Path | None, config: dict):
        self.name, self.model, self.tokenizer, self.folder, self.config = name, model, tokenizer, folder, config
        params = inspect.signature(model.forward).parameters
        self._keep_arg = "logits_to_keep" in params
        emb = model.get_input_embeddings()
        self.input_device = emb.weight.device

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise UsageError(f"{self.name}: no tokenizer; pass tokenizer=")
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def logits(self, batch, keep: int):
        """Logits predicting the last `keep` tokens of each window: [B, keep, V]."""
        ids = batch.to(self.input_device)
        if self._keep_arg:  # the LM head runs only where tokens are scored
            out = self.model(input_ids=ids, use_cache=False, logits_to_keep=keep + 1)
            return out.logits[:, -keep - 1:-1]
        out = self.model(input_ids=ids, use_cache=False)
        return out.logits[:, -keep - 1:-1]


class _ModelPool:
    """Loads each distinct checkpoint once."""

    def __init__(self, device, dtype, device_map, progress: bool | None = None):
        self.device, self.dtype, self.device_map, self.progress = device, dtype, device_map, progress
        self._by_key: dict[Any, _Loaded] = {}

    def get(self, spec, tokenizer) -> _Loaded:
        if isinstance(spec, _Loaded):
            return spec
        if hasattr(spec, "forward") and hasattr(spec, "config"):
            key = id(spec)
            if key not in self._by_key:
                self._by_key[key] = self._wrap_module(spec, tokenizer)
            return self._by_key[key]
        path = Path(str(spec))
        key = str(path.resolve()) if path.exists() else str(spec)
        if key not in self._by_key:
            self._by_key[key] = self._load(str(spec))
        return self._by_key[key]

    def _wrap_module(self, module, tokenizer) -> _Loaded:
        from kvtool.runtime.torch_utils import load_tokenizer

        src = getattr(module.config, "_name_or_path", "") or getattr(module, "name_or_path", "")
        folder = Path(src) if src and Path(src).is_dir() else None
        tok = tokenizer if tokenizer is not None else (load_tokenizer(src) if src else None)
        _unbounded(tok)
        module.eval()
        return _Loaded(src or type(module).__name__, module, tok, folder, module.config.to_dict())

    def _load(self, spec: str) -> _Loaded:
        from kvtool.model.preflight import preflight
        from kvtool.model.numbers import require_valid_numbers
        from kvtool.model.spec import build_spec
        from kvtool.runtime.torch_utils import load_model, load_tokenizer

        ckpt = preflight(spec, model_code=True, read_side_files=False)  # before transformers sees the folder
        require_valid_numbers(build_spec(ckpt.config), str(ckpt.config_path))
        with kv_progress.task(f"loading {spec}", enabled=self.progress):
            model = load_model(spec, device=self.device, dtype=self.dtype, device_map=self.device_map)
            tok = load_tokenizer(spec)
        _unbounded(tok)
        return _Loaded(spec, model, tok, ckpt.root, ckpt.config)

    def device_name(self, m: _Loaded) -> str:
        if not self.device_map:
            return str(m.input_device)
        dm = getattr(m.model, "hf_device_map", None)
        devs = sorted({str(d) for d in dm.values()}) if isinstance(dm, dict) else [str(m.input_device)]
        return f"{self.device_map}({','.join(devs)})"


def _unbounded(tok) -> None:
    if tok is not None:
        tok.model_max_length = 10**12  # the stream is windowed later; silence the too-long warning


def _same_tokenizer(a: _Loaded, b: _Loaded, text: str, ids: list[int]) -> None:
    va = a.tokenizer.get_vocab() if a.tokenizer is not None else None
    vb = b.tokenizer.get_vocab() if b.tokenizer is not None else None
    if va != vb or b.encode(text) != ids:
        raise UsageError(f"{b.name} and {a.name} have different tokenizers; they cannot be compared on the same "
                         "token stream", field="tokenizer")


def _join(texts) -> str:
    if texts is None:
        from kvtool.datasets import evaluation_text

        return evaluation_text()
    if isinstance(texts, str):
        return texts
    return "\n\n".join(texts)


# --- FP8 emulation ------------------------------------------------------------------------------


def _emulation(c: Candidate, m: _Loaded):
    """(hook fn, KVScales) when this candidate's K/V go through FP8, else None."""
    from kvtool.eval.fp8 import KVScales, declares_fp8_kv, read_checkpoint_scales

    if c.kv_cache_dtype == "off":
        return None
    given = not isinstance(c.kv_scales, str)
    stored = None
    if c.kv_scales == "checkpoint" and m.folder is not None:
        stored = read_checkpoint_scales(m.folder)
    wants = c.kv_cache_dtype in ("fp8", "fp8_e4m3") or given or declares_fp8_kv(m.config) or bool(stored and len(stored))
    if not wants:
        return None
    if isinstance(c.kv_scales, KVScales):
        scales = c.kv_scales
    elif given:
        scales = KVScales.from_mapping(c.kv_scales)
    elif c.kv_scales == "one" or not stored or not len(stored):
        scales = KVScales(source="one")  # vLLM: no scale in the checkpoint -> 1.0
    else:
        scales = stored
    return scales.hook(), scales


@contextlib.contextmanager
def _hooked(m: _Loaded, fn):
    from kvtool.runtime.kv_hooks import kv_hook

    with kv_hook(m.model, fn):
        yield


def _new_acc():
    from kvtool.eval.metrics import Accumulator

    return Accumulator()
