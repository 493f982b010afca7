"""Python entry points: `evaluate` (one model, optional baseline) and `evaluate_many` (several
candidates against one baseline, the baseline run once per window).

Other commands call these (convert --eval, quantize-kv, recipes). Every model runs window by
window on the identical token stream; only running sums are kept, never the logits of the
stream. A candidate that is the same checkpoint (or the same loaded module) as the baseline
shares its weights in memory: FP8-KV variants of one model cost one load.

How the weights are held: model folders are evaluated one decoder layer at a time
(kvtool.eval.layerwise: memory bounded by one layer, not the model); `device_map` loads the whole
model with accelerate (sharded over the GPUs, the rest on the CPU or offloaded to disk, within
`max_memory`); an already loaded module runs whole. Before anything heavy, kvtool.eval.memory
refuses an evaluation that cannot fit, naming the option that makes it fit.

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
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from kvtool import progress as kv_progress
from kvtool.errors import InputError, UsageError
from kvtool.eval.gate import GateResult, check
from kvtool.eval.windows import batches, windows

from kvtool.options.eval import EvalOptions
from kvtool.options.fields import check_fields


@dataclass
class Candidate:
    """One model to score. model: folder / hub id, or an already loaded transformers model.

    kv_cache_dtype: "auto" (fp8_e4m3 emulation when the checkpoint declares a KV-cache scheme or has
    scale tensors), "off" (never), or a dtype of kvtool/model/kv_emulations.json ("fp8", "fp8_e5m2",
    "int8_per_token_head", ...: always; refused for a model whose attention vLLM cannot serve with it).
    kv_scales: "checkpoint" (its scale tensors; 1.0
    for layers without one), "one" (1.0 everywhere, vLLM's default), {layer: (k, v)} / {layer: (k, v, q)}
    or KVScales (used by dtypes whose row loads checkpoint scales). fp8_attention: what else the FP8 path rounds,
    as a vLLM backend does (kvtool.eval.fp8_backends.CHOICES: "cache-only", "flash-attn", "flashinfer", "triton",
    "cpu"; with fp8 / fp8_e4m3 only).
    """

    model: Any
    kv_cache_dtype: str = "auto"
    kv_scales: Any = "checkpoint"
    label: str | None = None
    fp8_attention: str = "cache-only"


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
    kv_cache_dtype: str  # the emulated dtype (fp8 as fp8_e4m3), else the model dtype name
    kv_scales: dict | None  # {source, layers, min_scale, max_scale} when emulated
    seconds: float
    gates: list[GateResult] = field(default_factory=list)
    forwards_per_window: int = 1  # models run on each window in this evaluation (baseline included)
    memory: dict | None = None  # how the weights were held: {"mode": "layerwise" | "whole_model" | "device_map", ...}
    fp8_attention: dict | None = None  # the vLLM backend emulated and its q scales (kvtool.eval.fp8.Fp8Attention)
    kv_cache: dict | None = None  # the emulation: its row, scales, match, what is read back (kv_cache_info)

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
            "kv_scales": self.kv_scales, "kv_cache": self.kv_cache, "fp8_attention": self.fp8_attention,
            "seconds": round(self.seconds, 3),
            "forwards_per_window": self.forwards_per_window, "memory": self.memory,
            "tokens_per_s": round(self.tokens / self.seconds, 1) if self.seconds > 0 else None,
            "gates": [g.as_dict() for g in self.gates], "passed": self.passed,
        })
        return d


def evaluate(model, baseline=None, *, texts: str | Sequence[str] | None = None, max_length: int = 1024,
             stride: int | None = None, max_tokens: int | None = None, device: str = "auto", dtype: str = "auto",
             kv_cache_dtype: str = "auto", kv_scales: Any = "checkpoint", fp8_attention: str = "cache-only",
             batch_size: int | None = None,
             device_map: str | Mapping | None = None, max_memory: Mapping | None = None,
             gates: Mapping[str, float] | None = None, tokenizer=None, text_name: str | None = None,
             progress: bool | None = None, layerwise: bool | None = None) -> EvalReport:
    """Score `model` (folder, hub id or loaded model) on `texts`, against `baseline` when given.

    texts: the evaluation text(s), joined with blank lines into one token stream (default: the
    built-in pydoc evaluation text). max_length / stride: window length L and step S (S < L;
    default L // 2). max_tokens: cut the stream to its first N tokens. gates: {"max_ppl_increase":
    0.02, "max_kld": 0.01, "min_top1": 0.95} (any subset; the fields of kvtool/options/eval.py). progress: None follows the command's
    `--progress` session (kvtool.progress; silent outside one), True / False force it. device_map:
    "auto" (or a {module: device} dict, "disk" allowed) loads the whole model with accelerate within
    max_memory ({0: "70GiB", "cpu": "100GiB"}). layerwise: None (the default) evaluates model folders one
    decoder layer at a time unless device_map is given; False loads them whole. Raises InputError /
    UsageError.
    """
    return evaluate_many([Candidate(model, kv_cache_dtype, kv_scales, fp8_attention=fp8_attention)], baseline, texts=texts,
                         max_length=max_length, stride=stride, max_tokens=max_tokens, device=device, dtype=dtype,
                         batch_size=batch_size, device_map=device_map, max_memory=max_memory, gates=gates,
                         tokenizer=tokenizer, text_name=text_name, progress=progress, layerwise=layerwise)[0]


def evaluate_many(candidates: Sequence[Candidate | Any], baseline=None, *, texts: str | Sequence[str] | None = None,
                  max_length: int = 1024, stride: int | None = None, max_tokens: int | None = None,
                  device: str = "auto", dtype: str = "auto", batch_size: int | None = None,
                  device_map: str | Mapping | None = None, max_memory: Mapping | None = None,
                  gates: Mapping[str, float] | None = None, tokenizer=None, text_name: str | None = None,
                  progress: bool | None = None, layerwise: bool | None = None) -> list[EvalReport]:
    """Score several candidates against one baseline on one token stream; one report per candidate.

    Each window: the baseline once, then every candidate, so nothing is recomputed and no logits
    are stored. Layer by layer (model folders, the default), one decoder layer of one model is in
    memory at a time; otherwise all distinct models are held together.
    """
    from kvtool.runtime.torch_utils import pick_device, pick_dtype

    cands = [c if isinstance(c, Candidate) else Candidate(c) for c in candidates]
    if not cands:
        raise UsageError("no model to evaluate")
    for c in cands:
        # the declaration is the validator: the same line as the command and a recipe (a mapping of scales passes)
        check_fields(EvalOptions, kv_cache_dtype=c.kv_cache_dtype,
                     kv_scales=c.kv_scales if isinstance(c.kv_scales, str) else None,
                     fp8_attention=c.fp8_attention)
        check_fp8_attention(c.fp8_attention, c.kv_cache_dtype)
        _refuse_fp8_attention_without_fp8(c)
        if isinstance(c.model, (str, os.PathLike)) and Path(c.model).is_dir():
            refuse_unserved(os.fspath(c.model), c.kv_cache_dtype)  # before any model loads
    from kvtool.eval.windows import check_settings  # the command's plan makes the same checks

    stride = check_settings(max_length=max_length, stride=stride, max_tokens=max_tokens, batch_size=batch_size,
                            max_memory=max_memory, device_map=device_map)
    specs = ([baseline] if baseline is not None else []) + [c.model for c in cands]
    use_layerwise = _layerwise(layerwise, specs, device_map)
    dev = pick_device(device) if not device_map else None
    torch_dtype = pick_dtype(dtype, dev if dev is not None else pick_device("auto"))
    with contextlib.ExitStack() as stack:
        if use_layerwise:
            pool = stack.enter_context(_LayerwisePool(dev, torch_dtype, progress))
        else:
            pool = stack.enter_context(_ModelPool(dev, torch_dtype, device_map, progress, max_memory))
        return _evaluate(pool, cands, baseline, texts=texts, max_length=max_length, stride=stride,
                         max_tokens=max_tokens, batch_size=batch_size, gates=gates, tokenizer=tokenizer,
                         text_name=text_name, progress=progress, torch_dtype=torch_dtype)


def _evaluate(pool, cands, baseline, *, texts, max_length, stride, max_tokens, batch_size, gates, tokenizer,
              text_name, progress, torch_dtype) -> list[EvalReport]:
    import torch

    base = pool.get(baseline, tokenizer) if baseline is not None else None
    runs = [(c, pool.get(c.model, tokenizer)) for c in cands]

    # One token stream, identical for every model: refuse models whose tokenizers disagree. Only the text
    # max_tokens needs is read and tokenized (kvtool.tokenstream), a window at a time.
    sources = _sources(texts)
    first = base or runs[0][1]
    ids = _encode(first, sources, max_tokens)
    for m in {id(m): m for m in [base] + [r for _, r in runs] if m is not None}.values():
        if m is not first:
            _same_tokenizer(first, m, sources, ids, max_tokens)
    if len(ids) < 2:
        raise InputError(f"the evaluation text has {len(ids)} token(s); at least 2 are needed", option="text")
    ws = windows(len(ids), max_length, stride)
    device_name = pool.device_name(first)
    bs = batch_size or (max(1, min(16, 8192 // max_length)) if device_name.startswith("cuda") else 1)

    emulation = [_emulation(c, m) for c, m in runs]
    accs = [_new_acc() for _ in runs]
    stream = torch.frombuffer(ids, dtype=torch.long)  # the int64 array's memory, not a copy
    forwards = len(runs) + (base is not None)
    if isinstance(pool, _LayerwisePool):
        t0 = time.perf_counter()
        forwards, memory = pool.score(base, runs, emulation, accs, ws, bs, stream, progress)
    else:
        memory = pool.memory()
        t0 = time.perf_counter()
        _score_whole(base, runs, emulation, accs, ws, bs, stream, len(ids), progress)
    seconds = time.perf_counter() - t0

    reports = []
    for (c, m), emu, acc in zip(runs, emulation, accs):
        r = EvalReport(
            model=m.name, label=c.label, baseline=base.name if base is not None else None, metrics=acc.summary(),
            windows=len(ws), device=device_name, dtype=str(torch_dtype).replace("torch.", ""), window=max_length,
            stride=stride, batch_size=bs, text=text_name or ("pydoc (built-in evaluation text)" if texts is None else "text"),
            kv_cache_dtype=emu.kv["dtype"] if emu else str(torch_dtype).replace("torch.", ""),
            kv_scales=emu.scales.describe() if emu else None, seconds=seconds, forwards_per_window=forwards,
            memory=memory, fp8_attention=_fp8_attention_info(emu),
            kv_cache=emu.kv if emu else None)
        if gates:
            r.apply_gates(gates)
        reports.append(r)
    return reports


def _score_whole(base, runs, emulation, accs, ws, bs, stream, n_ids: int, progress) -> None:
    """Whole models, window batch by window batch."""
    import torch

    with kv_progress.task("eval", total=n_ids - 1, unit="tok", enabled=progress, rate=True) as bar, \
            torch.inference_mode():
        for group in batches(ws, bs):
            batch = torch.stack([stream[w.begin:w.end] for w in group])
            keep = group[0].n_scored
            targets = batch[:, -keep:]
            base_logits = base.logits(batch, keep) if base is not None else None
            for (_c, m), emu, acc in zip(runs, emulation, accs):
                with (_hooked(m, emu.hook) if emu else contextlib.nullcontext()):
                    logits = m.logits(batch, keep)
                acc.add(logits, targets, base_logits)
                del logits
            del base_logits
            bar.update(keep * len(group))


# --- models -------------------------------------------------------------------------------------


class _Loaded:
    """A model with its tokenizer, and how to run one batch of windows on it."""

    def __init__(self, name: str, model, tokenizer, folder: Path | None, config: dict):
        self.name, self.model, self.tokenizer, self.folder, self.config = name, model, tokenizer, folder, config
        params = inspect.signature(model.forward).parameters
        self._keep_arg = "logits_to_keep" in params
        emb = model.get_input_embeddings()
        # an embedding accelerate offloaded sits on "meta"; its hook moves the ids to the execution device
        self.input_device = emb.weight.device if emb.weight.device.type != "meta" else "cpu"

    def logits(self, batch, keep: int):
        """Logits predicting the last `keep` tokens of each window: [B, keep, V]."""
        ids = batch.to(self.input_device)
        if self._keep_arg:  # the LM head runs only where tokens are scored
            out = self.model(input_ids=ids, use_cache=False, logits_to_keep=keep + 1)
            return out.logits[:, -keep - 1:-1]
        out = self.model(input_ids=ids, use_cache=False)
        return out.logits[:, -keep - 1:-1]


class _ModelPool:
    """Loads each distinct checkpoint once, whole (with accelerate when device_map is given)."""

    def __init__(self, device, dtype, device_map, progress: bool | None = None, max_memory=None):
        self.device, self.dtype, self.device_map, self.progress = device, dtype, device_map, progress
        self.max_memory = max_memory
        self._by_key: dict[Any, _Loaded] = {}
        self._offload: Any = None  # a temporary folder for what accelerate offloads to disk
        self._sizes: list = []  # weight sizes of the folders loaded so far (the memory check adds them up)

    def __enter__(self) -> "_ModelPool":
        return self

    def __exit__(self, *exc) -> None:
        self._by_key.clear()
        if self._offload is not None:
            self._offload.cleanup()

    def memory(self) -> dict:
        if self.device_map:
            # a model that accelerate left on one device has no hf_device_map
            maps = [m.model.hf_device_map if isinstance(getattr(m.model, "hf_device_map", None), dict)
                    else {"": str(m.input_device)} for m in self._by_key.values()]
            placed: dict[str, int] = {}
            for dm in maps:
                for dev in dm.values():
                    placed[str(dev)] = placed.get(str(dev), 0) + 1
            return {"mode": "device_map", "modules_per_device": dict(sorted(placed.items()))}
        return {"mode": "whole_model"}

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
        offload = None
        if self.device_map:
            import tempfile

            if self._offload is None:
                self._offload = tempfile.TemporaryDirectory(prefix="kvtool-offload-")
            offload = self._offload.name
        elif ckpt.root is not None:  # the whole model must fit (a device map may offload, so it is not checked)
            from kvtool.eval import memory

            elem = _elem_bytes(self.dtype)
            sizes = [memory.weight_sizes(ckpt.tensors, elem)] + [s for s in self._sizes]
            memory.refuse_if_too_big(memory.whole_need(sizes, 0), file=spec, elem_bytes=elem, layerwise_possible=True)
            self._sizes.append(sizes[0])
        with kv_progress.task(f"loading {spec}", enabled=self.progress):
            model = load_model(spec, device=self.device, dtype=self.dtype, device_map=self.device_map,
                               max_memory=_device_budget(self.max_memory) if self.device_map else None,
                               offload_folder=offload)
            tok = load_tokenizer(spec)
        _unbounded(tok)
        return _Loaded(spec, model, tok, ckpt.root, ckpt.config)

    def device_name(self, m: _Loaded) -> str:
        if not self.device_map:
            return str(m.input_device)
        dm = getattr(m.model, "hf_device_map", None)
        devs = sorted({str(d) for d in dm.values()}) if isinstance(dm, dict) else [str(m.input_device)]
        kind = self.device_map if isinstance(self.device_map, str) else "map"
        return f"{kind}({','.join(devs)})"


class _LayerwisePool:
    """Opens each distinct model folder once for layer-by-layer replay (kvtool.eval.layerwise)."""

    def __init__(self, device, dtype, progress: bool | None = None):
        self.device, self.dtype, self.progress = device, dtype, progress
        self._by_key: dict[str, Any] = {}
        self._sizes: dict[str, Any] = {}

    def __enter__(self) -> "_LayerwisePool":
        return self

    def __exit__(self, *exc) -> None:
        for m in self._by_key.values():
            m.close()
        self._by_key.clear()

    def get(self, spec, tokenizer):
        key = str(Path(str(spec)).resolve())
        if key not in self._by_key:
            self._by_key[key] = self._open(str(spec), tokenizer)
        return self._by_key[key]

    def _open(self, spec: str, tokenizer):
        from kvtool.eval import memory
        from kvtool.eval.layerwise import LayerwiseLoaded
        from kvtool.model.preflight import preflight
        from kvtool.model.numbers import require_valid_numbers
        from kvtool.model.spec import build_spec
        from kvtool.runtime.layerwise import open_layerwise
        from kvtool.runtime.torch_utils import load_tokenizer

        ckpt = preflight(spec, model_code=True, read_side_files=False)  # before transformers sees the folder
        require_valid_numbers(build_spec(ckpt.config), str(ckpt.config_path))
        elem = _elem_bytes(self.dtype)
        sizes = memory.weight_sizes(ckpt.tensors, elem)

        def whole_instead(reason: str) -> None:  # the checkpoint must be loaded whole: will it fit?
            others = [s for k, s in self._sizes.items()]
            need = memory.whole_need([sizes] + others, 0)
            memory.refuse_if_too_big(need, file=spec, elem_bytes=elem, layerwise_possible=False)

        with kv_progress.task(f"opening {spec} (one decoder layer at a time)", enabled=self.progress):
            lm = open_layerwise(spec, device=self.device, dtype=self.dtype, attn="sdpa", before_whole=whole_instead)
            try:
                tok = tokenizer if tokenizer is not None else load_tokenizer(spec)
            except BaseException:
                lm.close()
                raise
        _unbounded(tok)
        self._sizes[spec] = sizes
        return LayerwiseLoaded(spec, lm, tok, ckpt.root, ckpt.config)

    def device_name(self, m) -> str:
        return str(self.device)

    def score(self, base, runs, emulation, accs, ws, bs, stream, progress) -> tuple[int, dict]:
        """Run every window through every forward path; (forward paths, how the weights were held)."""
        from kvtool.eval import layerwise as lw
        from kvtool.eval import memory

        paths: list = []
        index: dict[tuple, int] = {}

        def path(m, emu) -> int:
            key = (id(m), id(emu.hook) if emu else None)  # one path per FP8 emulation (its backend too)
            if key not in index:
                index[key] = len(paths)
                paths.append(lw.ForwardPath(m, emu.hook if emu else None))
            return index[key]

        base_i = path(base, None) if base is not None else None
        scored = [lw.Scored(path(m, emu), base_i, acc) for (c, m), emu, acc in zip(runs, emulation, accs)]
        elem = _elem_bytes(self.dtype)
        groups = list(batches(ws, bs))
        hidden = max(int(_text_config(p.model.config).get("hidden_size") or 0) for p in paths)
        segs = lw.segments(groups, hidden, len(paths), elem)
        seg_tokens = max(sum(len(g) * g[0].length for g in seg) for seg in segs)
        config = max((p.model.config for p in paths), key=lambda c: int(_text_config(c).get("hidden_size") or 0))
        acts = memory.activation_bytes(config, batch=bs, length=max(w.length for w in ws), paths=len(paths),
                                       segment_tokens=seg_tokens, elem_bytes=elem, chunk_elements=lw.CHUNK_ELEMENTS)
        layerwise_models = [p.model for p in paths if p.model.lm.mode == "layerwise"]
        sizes = [self._sizes[m.name] for m in {id(m): m for m in layerwise_models}.values()]
        if sizes:
            memory.refuse_if_too_big(memory.layerwise_need(sizes, acts), file=layerwise_models[0].name,
                                     elem_bytes=elem, layerwise_possible=True)
        total_layers = len(segs) * sum(m.lm.num_layers for m in {id(p.model): p.model for p in paths}.values())
        with kv_progress.task("eval (layer by layer)", total=len(stream) - 1, unit="tok", enabled=progress,
                              rate=True) as bar:
            lw.run(paths, scored, segs, stream, bar)
        modes = sorted({p.model.lm.mode for p in paths})
        held = {"mode": modes[0] if len(modes) == 1 else "+".join(modes), "segments": len(segs),
                "layer_reads": total_layers}
        notes = sorted({p.model.lm.note for p in paths if p.model.lm.note})
        if notes:
            held["note"] = "; ".join(notes)
        return len(paths), held


def _layerwise(flag: bool | None, specs, device_map) -> bool:
    """Layer by layer: every model is a local folder (not a loaded module or hub id) and no device map."""
    folders = all(isinstance(s, (str, Path)) and Path(str(s)).is_dir() for s in specs)
    if flag and device_map:
        raise UsageError("a device map loads the whole model with accelerate; it does not go with layer-by-layer "
                         "evaluation", option="device_map")
    if flag and not folders:
        raise UsageError("layer-by-layer evaluation reads model folders (not loaded modules or hub ids)",
                         option="layerwise")
    return folders and not device_map if flag is None else bool(flag)


def _elem_bytes(dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


def _text_config(config: dict) -> dict:
    return config["text_config"] if isinstance(config.get("text_config"), dict) else config


def _max_memory(spec):
    """accelerate's max_memory from {device: bytes or "70GiB"} (GPU indices as int)."""
    if not spec:
        return None
    from kvtool.units import parse_size, plain_int

    out = {}
    for dev, size in spec.items():
        key = dev if isinstance(dev, int) else plain_int(str(dev), max_digits=6)
        key = str(dev) if key is None else key
        try:
            out[key] = size if isinstance(size, int) else parse_size(str(size))
        except ValueError as exc:
            raise UsageError(str(exc), option="max_memory") from None
    return out


def _device_budget(spec):
    """max_memory for accelerate: the user's, else None (accelerate measures the GPUs and MemAvailable)
    unless a cgroup limit or KVTOOL_MEMORY_LIMIT is lower than MemAvailable, which accelerate does not see:
    then the CPU gets 90% of that and the GPUs their free memory."""
    if spec:
        return _max_memory(spec)
    from kvtool.eval import memory

    have, source = memory.available_bytes()
    if source == "MemAvailable":
        return None
    import torch

    out: dict = {i: torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())}
    out["cpu"] = int(have * 0.9)
    return out


def parse_max_memory(text: str) -> dict:
    """'0=70GiB,1=70GiB,cpu=200GiB' -> {0: "70GiB", 1: "70GiB", "cpu": "200GiB"} (checked by _max_memory)."""
    from kvtool.units import plain_int

    out: dict = {}
    for item in (text or "").split(","):
        dev, sep, size = item.strip().partition("=")
        dev = dev.strip()
        index = plain_int(dev, max_digits=6)
        if not sep or not dev or not ((index is not None and index >= 0) or dev in ("cpu", "mps")):
            raise UsageError(f"expected DEVICE=SIZE items (0=70GiB,cpu=100GiB), got {item.strip()!r}",
                             option="max_memory")
        out[dev if index is None else index] = size.strip()
    _max_memory(out)
    return out


def _unbounded(tok) -> None:
    if tok is not None:
        tok.model_max_length = 10**12  # the stream is windowed later; silence the too-long warning


def _encode(m, sources: list, max_tokens: int | None):
    """The token stream: the first max_tokens tokens (with BOS) of the sources, as an int64 array."""
    if m.tokenizer is None:
        raise UsageError(f"{m.name}: no tokenizer; pass tokenizer=")
    from kvtool.tokenstream import first_tokens

    return first_tokens(m.tokenizer, sources, max_tokens, special_tokens=True).ids


def _same_tokenizer(a, b, sources: list, ids, max_tokens: int | None) -> None:
    va = a.tokenizer.get_vocab() if a.tokenizer is not None else None
    vb = b.tokenizer.get_vocab() if b.tokenizer is not None else None
    if va != vb or _encode(b, sources, max_tokens) != ids:
        raise UsageError(f"{b.name} and {a.name} have different tokenizers; they cannot be compared on the same "
                         "token stream", field="tokenizer")


def _sources(texts) -> list:
    """The texts evaluate() takes (None: the built-in evaluation text; a str; strs or TextFiles) as a list."""
    if texts is None:
        from kvtool.datasets import evaluation_text

        return [evaluation_text()]
    if isinstance(texts, str):
        return [texts]
    return list(texts)


# --- FP8 emulation ------------------------------------------------------------------------------


def check_fp8_attention(name: str, kv_cache_dtype: str) -> None:
    """--fp8-attention other than cache-only needs an FP8 cache whose row takes that backend (vLLM rounds queries
    only when the KV cache is fp8: Attention.__init__; kv_emulations.json fp8_attention: true, or a list naming it,
    e.g. fp8_e5m2 with cpu). The name itself is a declared choice (kvtool/options/eval.py), checked there."""
    from kvtool.eval.fp8_backends import DEFAULT
    from kvtool.model import kv_emulations

    if name == DEFAULT:
        return
    if kv_cache_dtype == "off":
        raise UsageError(f"{name} quantizes attention only with an FP8 KV cache; not with kv_cache_dtype off",
                         option="fp8_attention")
    row = kv_emulations.get(kv_cache_dtype)
    if row is not None and not kv_emulations.takes_fp8_attention(row, name):
        with_it = ", ".join(n for n, r in kv_emulations.table().items() if kv_emulations.takes_fp8_attention(r, name))
        raise UsageError(f"{name} is emulated with an {with_it} KV cache only; not with kv_cache_dtype "
                         f"{kv_cache_dtype}", option="fp8_attention")


def refuse_unserved(model: str, kv_cache_dtype: str, config: dict | None = None) -> None:
    """A KV-cache dtype vLLM cannot serve this model's attention with (kv_dtypes.json `attention`, its packing's
    head sizes): the UsageError kv-budget gives (kvtool.model.kvcache.cache_format), before anything loads.
    model: a folder or hub id (its config is read), or config given."""
    from kvtool.model import kv_emulations, kvcache
    from kvtool.model.spec import build_spec

    if kv_emulations.get(kv_cache_dtype) is None:  # auto / off
        return
    if config is None:
        from kvtool.model.checkpoint import open_checkpoint

        config = open_checkpoint(model, read_side_files=False).config
    kvcache.cache_format(build_spec(config), kv_cache_dtype, refuse=True)


def _no_fp8_cache(name: str) -> UsageError:
    return UsageError(f"{name} quantizes attention only with an FP8 KV cache; this checkpoint declares none: give "
                      "kv_cache_dtype fp8", option="fp8_attention")


def _refuse_fp8_attention_without_fp8(c: Candidate) -> None:
    """_emulation's refusal, made before any model loads (a large one takes minutes): from the config and the
    safetensors headers, for a candidate given as a folder or hub id."""
    from kvtool.eval.fp8 import declares_fp8_kv
    from kvtool.eval.fp8_backends import DEFAULT
    from kvtool.model import kv_scale_names
    from kvtool.model.preflight import preflight

    if c.fp8_attention == DEFAULT or c.kv_cache_dtype == "off" or not isinstance(c.model, (str, os.PathLike)):
        return
    by_options = _fp8_by_options(c)
    if by_options and not Path(c.model).is_dir():  # a hub id: _mla_emulation refuses MLA once it is loaded
        return
    ckpt = preflight(os.fspath(c.model), model_code=True, read_side_files=False)
    if isinstance(ckpt.config.get("kv_lora_rank"), int):  # MLA (the load-time check: _mla_emulation)
        from kvtool.eval.fp8_mla import refuse_fp8_attention

        raise refuse_fp8_attention(c.fp8_attention)
    if by_options:
        return
    if declares_fp8_kv(ckpt.config, str(ckpt.config_path)):
        return
    if c.kv_scales == "checkpoint" and any(kv_scale_names.is_kv_scale(n) for h in ckpt.headers for n in h.tensors):
        return
    raise _no_fp8_cache(c.fp8_attention)


def _fp8_by_options(c: Candidate) -> bool:
    """The candidate's own options put its K/V through FP8, whatever the checkpoint declares: a KV-cache dtype eval
    emulates, or scales given (a mapping or KVScales)."""
    from kvtool.model import kv_dtypes

    return c.kv_cache_dtype in kv_dtypes.emulated() or not isinstance(c.kv_scales, str)


@dataclass
class Emulated:
    """A candidate's KV-cache emulation: the hook kv_hooks runs, the scales it was given, and what the report
    says of it (kv_cache_info)."""

    hook: Any
    scales: Any
    kv: dict


def _emulation(c: Candidate, m: _Loaded) -> Emulated | None:
    """How this candidate's K/V go through vLLM's cache, else None (kv_cache_dtype off, or auto without FP8 in the
    checkpoint). The dtype's row of kvtool/model/kv_emulations.json says everything eval needs of it."""
    from kvtool.eval import kv_emulation
    from kvtool.eval.fp8 import Fp8Attention, KVScales, declares_fp8_kv, read_checkpoint_scales
    from kvtool.eval.fp8_backends import DEFAULT, backend
    from kvtool.model.spec import build_spec

    if c.kv_cache_dtype == "off":
        return None
    given = not isinstance(c.kv_scales, str)
    stored = None
    if c.kv_scales == "checkpoint" and m.folder is not None:
        stored = read_checkpoint_scales(m.folder)
    config_file = str(m.folder / "config.json") if m.folder is not None else None
    wants = _fp8_by_options(c) or declares_fp8_kv(m.config, config_file) or bool(stored and len(stored))
    if not wants:
        if c.fp8_attention != DEFAULT:  # a model given loaded: _refuse_fp8_attention_without_fp8 could not read it
            raise _no_fp8_cache(c.fp8_attention)
        return None
    name = AUTO_EMULATION if c.kv_cache_dtype == "auto" else c.kv_cache_dtype
    row = kv_emulation.row(name)
    refuse_unserved(m.name, name, m.config)
    from kvtool.runtime.kv_hooks import mla_modules

    if mla_modules(m.model):
        hook, mla_scales = _mla_emulation(c, m, row)
        return Emulated(hook, mla_scales, kv_cache_info(row, mla_scales.describe(), "per layer (MLA latent)"))
    if isinstance(c.kv_scales, KVScales):
        scales = c.kv_scales
    elif given:
        scales = KVScales.from_mapping(c.kv_scales)
    elif c.kv_scales == "one" or not stored or not len(stored):
        scales = KVScales(source="one")  # vLLM: no scale in the checkpoint -> 1.0
    else:
        scales = stored
    # the e4m3 rows, or a row that lists the backend asked (fp8_e5m2 with cpu): vLLM's backends, their rounding of K/V
    # (toward zero on its CPU build) and of queries / probabilities included; otherwise the row's codec
    if row.fp8_attention is True or (row.fp8_attention and c.fp8_attention != DEFAULT):
        hook = Fp8Attention(scales, backend(c.fp8_attention), row.params["format"])
        kept: frozenset = frozenset()
    else:
        spec = build_spec(m.config)
        hook = kv_emulation.build(name, scales, spec.layer_types, kv_emulation.model_params(spec))
        kept = hook.kept_layers
    return Emulated(hook, scales, kv_cache_info(row, scales.describe(), _granularity(scales), kept))


def _fp8_attention_info(emu) -> dict | None:
    """The --fp8-attention backend emulated (kvtool.eval.fp8.Fp8Attention / fp8_mla.Fp8Latent describe), else None
    (a row's codec: fp8_e5m2 without --fp8-attention, though its row lists the backends it takes)."""
    describe = getattr(emu.hook, "describe", None) if emu and emu.kv.get("fp8_attention") else None
    return describe() if callable(describe) else None


AUTO_EMULATION = "fp8_e4m3"  # what auto emulates when the checkpoint asks for an FP8 cache (vLLM: kv_cache_scheme)
READS = "K/V read back from the cache for every token, as decoding reads them"


def _granularity(scales) -> str:
    sizes = {int(t.numel()) for t in list(scales.k.values()) + list(scales.v.values())}
    if not sizes or sizes == {1}:
        return "per tensor"
    return "per head" if 1 not in sizes else "per tensor and per head"


def kv_cache_info(row, scales: dict, granularity: str, kept=frozenset()) -> dict:
    """What the report says of an emulation: the dtype (an alias as the row it names), the codec, where its scales
    come from and at which granularity, whether it matches vLLM exactly or under an assumption, what is read back."""
    from kvtool.model import kv_dtypes, kv_emulations

    dtype = row.alias_of or row.name
    d = kv_dtypes.get(dtype)
    info = {
        "dtype": dtype, "codec": row.codec, "params": dict(row.params),
        "scales": row.scales,
        "scales_used": (f"{scales['source']} ({granularity})" if row.scales == "checkpoint"
                        else kv_emulations.SCALES_WORDS[row.scales]),
        "match": row.match, "assumption": row.assumption, "oracle": row.oracle,
        "reads": READS, "first_prefill": row.first_prefill,
        "kept_layers": sorted(kept), "fp8_attention": row.fp8_attention,
        "note": (f"vLLM {kv_dtypes.release()} serves {dtype} on one platform only: {d.platform}"
                 if d is not None and d.platform else None),
        "cited": row.cite,
    }
    return info


def _mla_emulation(c: Candidate, m: _Loaded, row):
    """(kvtool.eval.fp8_mla.Fp8Latent, MLAScales): vLLM's FP8 latent cache in the row's format, one k_scale per
    layer."""
    from kvtool.eval.fp8_backends import DEFAULT
    from kvtool.eval.fp8_mla import Fp8Latent, MLAScales, read_mla_scales, refuse_fp8_attention

    if c.fp8_attention != DEFAULT:
        raise refuse_fp8_attention(c.fp8_attention)
    if "index_topk" in m.config:  # DeepSeek-V3.2: the sparse backends' fp8_ds_mla, per-tile scales
        raise UsageError("the sparse MLA backends store fp8_ds_mla (per-tile scales), which eval does not emulate",
                         option="kv_cache_dtype")
    if row.codec != "fp8":  # the latent path rounds through an fp8 format (kv_dtypes.json: no other row serves MLA)
        raise UsageError(f"eval emulates MLA's latent cache in fp8 formats only, not {row.name}",
                         option="kv_cache_dtype")
    if not isinstance(c.kv_scales, str):
        scales = MLAScales.from_given(c.kv_scales)
    elif c.kv_scales == "checkpoint" and m.folder is not None:
        scales = read_mla_scales(m.folder)
        if not len(scales):
            scales = MLAScales(source="one")
    else:
        scales = MLAScales(source="one")
    return Fp8Latent(scales, row.params["format"]), scales


@contextlib.contextmanager
def _hooked(m: _Loaded, fn):
    from kvtool.runtime.kv_hooks import kv_hook

    with kv_hook(m.model, fn):
        yield


def _new_acc():
    from kvtool.eval.metrics import Accumulator

    return Accumulator()
