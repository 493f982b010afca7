"""Layer-by-layer calibration of FP8 KV-cache scales.

1. `LayerwiseModel.capture` (kvtool.runtime.layerwise) runs the model once with every decoder layer
   replaced by a recorder: this yields the hidden states entering layer 0 and, per layer, the exact
   arguments the model passes it (position embeddings of that layer's type, that layer's mask),
   without running any layer.
2. Each decoder layer then gets its weights on the device (`materialised(i)`: read from the
   safetensors files, freed after), runs on the cached hidden states of every calibration batch,
   and kvtool.runtime.kv_hooks hands its K (after RoPE and any k_norm) and V, where they enter the cache and
   before GQA repetition, to that layer's K and V observers. The layer's outputs become the next
   layer's inputs; its observers are reduced to scales and freed.
3. Output-aware observers (`attn-out`) also get the layer's attention module rerun on the same
   inputs once per candidate scale, K/V stored through the FP8 round trip, and keep the candidate
   whose attention output is closest to the unquantized one (errors kept in `result.search`).

Memory (host and device): one decoder layer's weights, the non-layer parameters except the input
embedding (of which only the calibration tokens' rows are read), and the calibration hidden states
(tokens x hidden_size). When the checkpoint cannot be read layer by layer (kvtool.runtime.layerwise:
renamed or stacked tensors, quantized weights) the whole model is loaded and the same replay runs
on it. `calibrate(model, ...)` runs the replay on a model the caller has loaded.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from kvtool.runtime.layerwise import LayerwiseModel, find_layers, run_layer
from kvtool.quantize.formats import FORMATS, Fp8Format, roundtrip
from kvtool.quantize.observers import DEFAULT_OBSERVER, make_observer, parse_spec

# vLLM rounds queries to e4m3 whatever the cache (Attention.__init__ query_quant: QuantFP8 with
# current_platform.fp8_dtype(), for fp8 and nvfp4 caches): q_scale is an e4m3 scale for every --format
QUERY_FORMAT = FORMATS["e4m3"]

STRATEGIES = ("tensor", "attn_head")


@dataclass
class CalibrationResult:
    k: dict[int, torch.Tensor]  # layer -> float32 scale, [1] or [kv_heads]
    v: dict[int, torch.Tensor]
    k_amax: dict[int, torch.Tensor]  # observed max |K| (same shape as the scale)
    v_amax: dict[int, torch.Tensor]
    observer: str
    strategy: str
    format: str
    tokens: int
    sequences: int
    device: str
    seconds: float
    peak_device_bytes: int | None = None
    notes: list[str] = field(default_factory=list)
    # output-aware observers: (layer, "k" | "v") -> (candidate scales [n, groups], attention output error [n])
    search: dict = field(default_factory=dict)
    # FP8 attention's query scales (q_scales=True): layer -> [1] or [heads]; queries seen post-RoPE
    q: dict[int, torch.Tensor] = field(default_factory=dict)
    q_amax: dict[int, torch.Tensor] = field(default_factory=dict)


def place_except(module: torch.nn.Module, keep: torch.nn.Module, device) -> None:
    """Move every parameter and buffer of `module` to `device` except those under `keep`
    (never the whole model at once: it may not fit on the device)."""
    for child in module.children():
        if child is keep:
            continue
        if any(m is keep for m in child.modules()):
            place_except(child, keep, device)
        else:
            child.to(device)
    for p in module.parameters(recurse=False):
        p.data = p.data.to(device)
    for name, b in module.named_buffers(recurse=False):
        module._buffers[name] = b.to(device)


def _stored(x: torch.Tensor, scale: torch.Tensor | None, fmt: Fp8Format) -> torch.Tensor:
    """x after an FP8 cache round trip with `scale` ([1] or [kv_heads]); x itself when scale is None."""
    if scale is None:
        return x
    s = scale.to(x.device, torch.float32)
    s = s.reshape(()) if s.numel() == 1 else s.reshape(1, -1, 1, 1)
    return roundtrip(x, s, fmt).to(x.dtype)


@contextlib.contextmanager
def _capture_attention(attn: torch.nn.Module | None, calls: list, outputs: list):
    """Record each call of the attention module: its arguments in `calls`, its output (the first
    element: what is added to the residual stream) in `outputs`."""
    if attn is None:
        yield
        return

    def pre(_mod, args, kwargs):
        calls.append((args, kwargs))

    def post(_mod, _args, out):
        outputs.append((out[0] if isinstance(out, tuple) else out).detach().float())

    handles = [attn.register_forward_pre_hook(pre, with_kwargs=True), attn.register_forward_hook(post)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _search_scales(attn, calls, reference, obs, current) -> dict:
    """Output-aware observers: rerun the layer's attention module on its calibration inputs with each
    candidate scale and keep the one whose output is closest (squared error) to the unquantized one.
    K is chosen with V unquantized, then V with K at its chosen scale."""
    chosen: dict[str, torch.Tensor | None] = {"k": None, "v": None}
    found = {}
    for role in ("k", "v"):
        o = obs.get(role)
        if o is None or not o.output_aware:
            continue
        errors = []
        cands = o.candidates()
        for cand in cands:
            current["quant"] = (cand, chosen["v"]) if role == "k" else (chosen["k"], cand)
            err = 0.0
            try:
                for (args, kwargs), ref in zip(calls, reference):
                    out = attn(*args, **kwargs)
                    out = out[0] if isinstance(out, tuple) else out
                    err += float((out.float() - ref).double().pow(2).sum())
            finally:
                current["quant"] = None
            errors.append(err)
        o.choose(torch.tensor(errors, dtype=torch.float64))
        chosen[role] = o.scale()
        found[role] = (cands, torch.tensor(errors, dtype=torch.float64))
    return found


class _LoadedModel(LayerwiseModel):
    """A model the caller loaded, seen through the LayerwiseModel interface. With a device other than
    the CPU, everything but the decoder layers goes there and the layers visit it one at a time (the
    model may not fit on it); the model is left on the CPU."""

    def __init__(self, model, layers_path: str, device: torch.device):
        _, layers = find_layers(model, layers_path)
        dtype = next(model.parameters()).dtype
        super().__init__(model, layers_path, layers, device, dtype, mode="whole_model", note="loaded by the caller")
        self.offload = device.type != "cpu"
        if self.offload:
            model.to("cpu")
            place_except(model, layers, device)

    @contextlib.contextmanager
    def materialised(self, i: int):
        layer = self.layers[i]
        if not self.offload:
            yield layer
            return
        layer.to(self.device)
        try:
            yield layer
        finally:
            layer.to("cpu")

    def close(self) -> None:
        if self.offload:
            self.model.to("cpu")


def calibrate(model, batches: list[torch.Tensor], *, layers_path: str, observer: str, strategy: str,
              fmt: Fp8Format, device: torch.device, num_kv_heads: int, q_scales: bool = False) -> CalibrationResult:
    """calibrate_layers on a model already loaded (on the CPU when `device` is not: its decoder
    layers visit the device one at a time, the model is on the CPU again after)."""
    lm = _LoadedModel(model, layers_path, device)
    try:
        return calibrate_layers(lm, batches, observer=observer, strategy=strategy, fmt=fmt, num_kv_heads=num_kv_heads,
                                q_scales=q_scales)
    finally:
        lm.close()


def calibrate_layers(lm: LayerwiseModel, batches: list[torch.Tensor], *, observer: str, strategy: str,
                     fmt: Fp8Format, num_kv_heads: int, bar=None, q_scales: bool = False) -> CalibrationResult:
    """Scales for every attention layer of `lm` (kvtool.runtime.layerwise, on its device) from the
    calibration batches (each [batch, seq] token ids). bar: a kvtool.progress task counting layers
    (else one is opened for the call). q_scales: also the queries' scales (FP8 attention), with the same
    observer (an output-aware one: the default observer) over the query heads."""
    from kvtool import progress as kv_progress

    with (contextlib.nullcontext(bar) if bar is not None
          else kv_progress.task("calibrate", total=lm.num_layers, unit="layers")) as bar:
        return _calibrate_layers(lm, batches, observer=observer, strategy=strategy, fmt=fmt,
                                 num_kv_heads=num_kv_heads, bar=bar, q_scales=q_scales)


def _calibrate_layers(lm: LayerwiseModel, batches: list[torch.Tensor], *, observer: str, strategy: str,
                      fmt: Fp8Format, num_kv_heads: int, bar, q_scales: bool = False) -> CalibrationResult:
    from kvtool.runtime.kv_hooks import attention_modules, kv_hook

    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}")
    per_head = strategy == "attn_head"
    t0 = time.perf_counter()
    device = lm.device
    on_cuda = device.type == "cuda"
    if on_cuda:
        torch.cuda.reset_peak_memory_stats(device)

    observers: dict[tuple[int, str], object] = {}
    current: dict = {"layer": -1, "quant": None}
    searching = parse_spec(observer)[0].cls.output_aware
    attn_by_layer = {m.layer_idx: m for m in attention_modules(lm.model)}

    def observe(layer_idx: int, key: torch.Tensor, value: torch.Tensor):
        if current["quant"] is not None:  # a candidate search pass: K/V as the cache would store them
            ks, vs = current["quant"]
            return _stored(key, ks, fmt), _stored(value, vs, fmt)
        if layer_idx == current["layer"]:
            for role, x in (("k", key), ("v", value)):
                obs = observers.get((layer_idx, role))
                if obs is None:
                    obs = observers[(layer_idx, role)] = make_observer(
                        observer, num_heads=x.shape[1], per_head=per_head, fmt=fmt)
                obs.update(x)
        return key, value

    q_observer = DEFAULT_OBSERVER if searching else observer

    def observe_query(layer_idx: int, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        if current["quant"] is None and layer_idx == current["layer"]:
            obs = observers.get((layer_idx, "q"))
            if obs is None:
                obs = observers[(layer_idx, "q")] = make_observer(q_observer, num_heads=query.shape[1],
                                                                  per_head=per_head, fmt=QUERY_FORMAT)
            obs.update(query)
        return query

    if q_scales:
        observe.query = observe_query  # kv_hooks hands it the post-RoPE query

    result = CalibrationResult({}, {}, {}, {}, observer, strategy, fmt.name,
                               tokens=sum(b.numel() for b in batches), sequences=sum(b.shape[0] for b in batches),
                               device=str(device), seconds=0.0)
    if lm.mode == "whole_model" and not isinstance(lm, _LoadedModel):
        result.notes.append(f"the whole model was loaded, not one layer at a time: {lm.note}")
    with torch.inference_mode(), kv_hook(lm.model, observe):
        hidden: list[torch.Tensor] = []
        layer_args: list[list] = []
        bar.set_note("recording the inputs of layer 0")
        for ids in batches:
            h, per_layer = lm.capture(ids)
            hidden.append(h)
            layer_args.append(per_layer)
        for i in range(lm.num_layers):
            with lm.materialised(i) as layer:
                current["layer"] = i
                attn = attn_by_layer.get(i) if searching else None
                calls: list[tuple] = []
                reference: list[torch.Tensor] = []
                with _capture_attention(attn, calls, reference):
                    for b in range(len(batches)):
                        hidden[b] = run_layer(layer, hidden[b], layer_args[b][i])
                        bar.update(1 / len(batches), note=f"layer {i}, batch {b + 1}/{len(batches)}")
                current["layer"] = -1
                if reference:  # the candidates rerun this layer's attention: its weights are still here
                    bar.set_note(f"layer {i}, searching scales")
                    found = _search_scales(attn, calls, reference, {r: observers.get((i, r)) for r in ("k", "v")},
                                           current)
                    result.search.update({(i, role): v for role, v in found.items()})
                del calls, reference
            for b in range(len(batches)):
                layer_args[b][i] = None  # free this layer's mask / embeddings references
            for role, scales, amaxes in (("k", result.k, result.k_amax), ("v", result.v, result.v_amax)):
                obs = observers.pop((i, role), None)
                if obs is None:
                    continue
                if obs.num_heads != num_kv_heads:
                    raise RuntimeError(f"layer {i} writes {obs.num_heads} KV heads to the cache; the config says "
                                       f"{num_kv_heads}")
                scales[i] = obs.scale()
                amaxes[i] = obs.amax().detach().float().cpu()
            q_obs = observers.pop((i, "q"), None)
            if q_obs is not None:
                result.q[i] = q_obs.scale()
                result.q_amax[i] = q_obs.amax().detach().float().cpu()
            if i in attn_by_layer and i not in result.k:
                result.notes.append(f"layer {i}: attention never called during calibration")
    if on_cuda:
        result.peak_device_bytes = int(torch.cuda.max_memory_allocated(device))
    result.seconds = time.perf_counter() - t0
    return result
