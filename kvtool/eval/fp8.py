"""FP8 (e4m3) KV-cache emulation, done the way vLLM writes its fp8 cache.

vLLM's cache kernels store x as fp8 = saturate(x / scale) (float32 math, round to nearest even,
finite saturation at +-448 for e4m3fn) and read it back as fp8 * scale. Here each post-RoPE key
and value, exactly where it enters the cache (kvtool.runtime.kv_hooks), goes through the same round
trip: x.float() / scale, clamp to +-448, cast to float8_e4m3fn, cast back, * scale, cast to the
model dtype.

FP8 attention (`Fp8Attention`, the --fp8-attention backend of kvtool.eval.fp8_backends): backends
that quantize the query get the same round trip on it (post-RoPE, before Q.K) with the layer's
checkpoint q_scale, else 1.0 (vLLM 0.33's value without one); the Triton backend also rounds the
softmax probabilities to e4m3 as P * 256 for the P.V product (the normaliser from unrounded P).
The kernel's online softmax rounds P relative to the running row maximum of each tile; this
emulation rounds it relative to the final row maximum, which is what a single tile computes.

Scales: one per layer (shape [] or [1]) or one per KV head (shape [kv_heads]), read from the
checkpoint's scale tensors in any spelling vLLM loads (kvtool.model.kv_scale_names); a layer
without one (or with only a spelling vLLM drops) uses 1.0, as vLLM does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import torch

from kvtool.errors import InputError
# the arithmetic lives in the codec (kvtool/eval/codecs/fp8.py); its names stay importable from here
from kvtool.eval.codecs.fp8 import (FP8_DTYPE, FP8_MAX, ROUNDINGS, broadcast_scale, fp8_roundtrip,  # noqa: F401
                                    fp8_roundtrip_toward_zero)
from kvtool.model import kv_scale_names

_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks|block)\.(\d+)(?:\.|$)")

# how an engine's cache kernel rounds -> the name of its round trip here (the codec's ROUNDINGS, one table; looked
# up by name when called, so a test's patch of this module's function takes effect)
ROUNDTRIPS = {rounding: fn.__name__ for rounding, fn in ROUNDINGS.items()}


@dataclass
class KVScales:
    """Per-layer K and V scales: layer index -> tensor of shape [] or [kv_heads]."""

    k: dict[int, torch.Tensor] = field(default_factory=dict)
    v: dict[int, torch.Tensor] = field(default_factory=dict)
    q: dict[int, torch.Tensor] = field(default_factory=dict)  # FP8 attention's query scales ([] or [heads])
    source: str = "one"  # "checkpoint" | "one" | "given"
    _rank: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_mapping(cls, scales: Mapping[int, tuple], source: str = "given") -> "KVScales":
        """{layer: (k_scale, v_scale)} or {layer: (k_scale, v_scale, q_scale)} with floats or tensors."""
        out = cls(source=source)
        for layer, vals in scales.items():
            out.k[int(layer)] = torch.as_tensor(vals[0], dtype=torch.float32).reshape(-1)
            out.v[int(layer)] = torch.as_tensor(vals[1], dtype=torch.float32).reshape(-1)
            if len(vals) > 2 and vals[2] is not None:
                out.q[int(layer)] = torch.as_tensor(vals[2], dtype=torch.float32).reshape(-1)
        return out

    def __len__(self) -> int:
        return len(set(self.k) | set(self.v))

    def hook(self, device: torch.device | None = None, rounding: str = "nearest", fmt: str = "float8_e4m3fn"):
        """fn(layer, key, value) for kvtool.runtime.kv_hooks.kv_hook: the fp8 round trip of K and V in `fmt`
        (kvtool.eval.codecs.fp8.FORMATS; rounding: a ROUNDTRIPS key, how the engine's cache kernel rounds)."""
        name = ROUNDTRIPS[rounding]
        cache: dict[tuple[str, int, torch.device], torch.Tensor] = {}

        def scale_for(role: str, table: dict, layer: int, x: torch.Tensor) -> torch.Tensor | float:
            s = table.get(layer)
            if s is None:
                return 1.0
            key = (role, layer, x.device)
            if key not in cache:
                cache[key] = broadcast_scale(s, x, role, layer)
            return cache[key]

        def fn(layer: int, key: torch.Tensor, value: torch.Tensor):
            roundtrip = globals()[name]
            return (roundtrip(key, scale_for("k", self.k, layer, key), fmt),
                    roundtrip(value, scale_for("v", self.v, layer, value), fmt))

        return fn

    def describe(self) -> dict:
        vals = [float(t.float().max()) for t in list(self.k.values()) + list(self.v.values())]
        return {"source": self.source, "layers": len(self),
                "max_scale": max(vals) if vals else 1.0, "min_scale": min(vals) if vals else 1.0}


def layer_index(prefix: str) -> int | None:
    """The decoder-layer number in an attention module prefix ('model.layers.3.self_attn' -> 3)."""
    m = _LAYER_RE.findall(prefix)
    return int(m[-1]) if m else None


def declares_fp8_kv(config: dict, file: str | None = None) -> bool:
    """The config asks for an FP8 KV cache (compressed-tensors kv_cache_scheme or modelopt kv_cache_quant_algo).
    A num_bits that is no integer is an InputError naming it (file: the config's path)."""
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        return False
    scheme = qc.get("kv_cache_scheme")
    if isinstance(scheme, dict):
        bits = scheme.get("num_bits", 8)
        if isinstance(bits, float) and bits.is_integer():
            bits = int(bits)
        if not isinstance(bits, int) or isinstance(bits, bool):
            from kvtool.errors import InputError
            from kvtool.model.numbers import show

            raise InputError(f"got {show(bits)}; it must be an integer (bits per cached element)", file=file,
                             field="quantization_config.kv_cache_scheme.num_bits")
        return scheme.get("type", "float") == "float" and bits == 8
    algo = qc.get("kv_cache_quant_algo")
    return isinstance(algo, str) and algo.upper().startswith("FP8")


def read_checkpoint_scales(folder: str | Path) -> KVScales:
    """The KV scales stored in a model folder's safetensors (only those tensors are read)."""
    from safetensors import SafetensorError, safe_open

    from kvtool.io.weight_files import raise_first_error, scan_weights

    root = Path(folder)
    scan = scan_weights(root)  # the shared checks: no path outside the folder, no file the library refuses
    raise_first_error(scan, root)
    out = KVScales(source="checkpoint")
    params = _scale_params(root, [n for h in scan.headers for n in h.tensors])  # what vLLM loads, and as which scale: kvtool.model.kv_scale_names.vllm_target
    for h in scan.headers:
        path = root / h.file
        targets = {n: t for n in h.tensors if (t := kv_scale_names.vllm_target(n, params)) is not None}
        names = [n for n, (_, role) in targets.items() if role in ("k", "v")]
        q_names = [n for n, (_, role) in targets.items() if role == "q"]
        if not names and not q_names:
            continue
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in names:
                    _store(out, name, targets[name], f.get_tensor(name), str(path))
                for name in q_names:
                    _store_q(out, name, targets[name], f.get_tensor(name), str(path))
        except (OSError, RuntimeError, ValueError, SafetensorError) as exc:
            raise InputError(f"cannot read KV scales: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
                             file=str(path)) from None
    return out


def _checked_scale(tensor: torch.Tensor, file: str, name: str) -> torch.Tensor:
    t = tensor.detach().to(torch.float32).reshape(-1)
    if t.numel() == 0 or not torch.isfinite(t).all() or (t <= 0).any():
        raise InputError("scale is not a positive finite number", file=file, field=name)
    return t


def _layer_of(prefix: str, file: str, name: str) -> int:
    layer = layer_index(prefix)
    if layer is None:
        raise InputError("scale tensor name has no layer number", file=file, field=name)
    return layer


def _scale_params(root: Path, names=()) -> dict:
    """The scale parameters vLLM gives the model in `root` (its config's attention layers). A folder of scales
    without a config.json (the API's kv_scales from a calibration folder) is read as a llama's layers."""
    from kvtool.model.checkpoint import open_checkpoint
    from kvtool.model.spec import build_spec

    if not (root / "config.json").is_file():
        layers = {i for n in names if (i := layer_index(n)) is not None}
        return kv_scale_names.scale_params([f"model.layers.{i}.self_attn" for i in sorted(layers)], "mha")
    return kv_scale_names.model_params(build_spec(open_checkpoint(str(root), read_side_files=False).config))


def _store_q(out: KVScales, name: str, target: tuple[str, str], tensor: torch.Tensor, file: str) -> None:
    out.q[_layer_of(target[0], file, name)] = _checked_scale(tensor, file, name)


def _store(out: KVScales, name: str, target: tuple[str, str], tensor: torch.Tensor, file: str) -> None:
    """A tensor vLLM loads as a k / v scale (kv_scale_names.vllm_target; a dropped one never reaches here)."""
    prefix, role_loaded = target
    layer = _layer_of(prefix, file, name)
    t = _checked_scale(tensor, file, name)
    m = kv_scale_names.match(name)
    spelling = m[1] if m else None
    rank = kv_scale_names.SPELLINGS.index(spelling) if spelling else len(kv_scale_names.SPELLINGS) - 1
    for role in ("k", "v") if name.endswith(".kv_scale") else (role_loaded,):
        table = out.k if role == "k" else out.v
        # several spellings for one layer: the first in SPELLINGS order (the post-RoPE ones) wins
        if out._rank.get((role, layer), len(kv_scale_names.SPELLINGS)) > rank:
            table[layer] = t
            out._rank[(role, layer)] = rank


class Fp8Attention:
    """The hook for kvtool.runtime.kv_hooks.kv_hook: K/V round trip (`__call__`), and as the backend does,
    the query round trip (`query`) and attention with e4m3 probabilities (`attention`); None where it does not."""

    def __init__(self, scales: KVScales, backend, fmt: str = "float8_e4m3fn"):
        self.scales = scales
        self.backend = backend  # kvtool.eval.fp8_backends.Fp8Backend
        self.format = fmt  # the cache's format (the kv_emulations row's params.format); queries and P stay e4m3
        self._kv = scales.hook(rounding=getattr(backend, "kv_rounding", "nearest"), fmt=fmt)
        self._q_cache: dict[tuple[int, torch.device, int], torch.Tensor | float] = {}
        self.query = self._query if backend.queries else None
        self.attention = self._attention if backend.prob_scale else None

    def __call__(self, layer: int, key: torch.Tensor, value: torch.Tensor):
        return self._kv(layer, key, value)

    def q_scale(self, layer: int, query: torch.Tensor, kv_heads: int) -> torch.Tensor | float:
        """The layer's q scale as vLLM 0.33 applies it: the checkpoint's, else 1.0. Per head ([heads]):
        vLLM keeps the max of each KV group (compressed-tensors' attn_head loader) and quantizes each
        group with it."""
        from kvtool.eval.fp8_backends import Q_SCALE_FALLBACK

        s = self.scales.q.get(layer)
        if s is None:
            return Q_SCALE_FALLBACK
        key = (layer, query.device, kv_heads)
        if key not in self._q_cache:
            t = s.to(query.device, torch.float32)
            heads = query.shape[1]
            if t.numel() == 1:
                t = t.reshape(())
            elif t.numel() == heads and heads % kv_heads == 0:
                group = heads // kv_heads
                t = t.view(kv_heads, group).amax(1).repeat_interleave(group).reshape(1, heads, 1, 1)
            else:
                raise InputError(f"layer {layer} q_scale has {t.numel()} values; expected 1 or one per attention "
                                 f"head ({heads})", field="q_scale")
            self._q_cache[key] = t
        return self._q_cache[key]

    def _query(self, layer: int, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        return fp8_roundtrip(query, self.q_scale(layer, query, key.shape[1]))

    def _attention(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None,
                   **kwargs):
        """Attention with the probabilities of the P.V product rounded to e4m3 as P * prob_scale (the Triton
        kernel's), the normaliser summed from unrounded P; shapes as transformers' eager attention."""
        group = query.shape[1] // key.shape[1]
        k = key.repeat_interleave(group, dim=1).float()
        v = value.repeat_interleave(group, dim=1).float()
        scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
        s = torch.matmul(query.float(), k.transpose(2, 3)) * scaling
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        q_len, k_len = s.shape[-2], s.shape[-1]
        if attention_mask is None:  # sdpa's mask skips plain causal: the query rows end at the last key
            mask = torch.ones(q_len, k_len, dtype=torch.bool, device=s.device).tril(k_len - q_len)
            s = s.masked_fill(~mask, float("-inf"))
        elif attention_mask.dtype == torch.bool:
            s = s.masked_fill(~attention_mask[..., :k_len], float("-inf"))
        else:
            s = s + attention_mask[..., :k_len].float()
        p = torch.exp(s - s.amax(-1, keepdim=True))
        norm = p.sum(-1, keepdim=True)
        inv = 1.0 / self.backend.prob_scale
        out = torch.matmul(fp8_roundtrip(p, inv), v) / norm
        return out.to(query.dtype).transpose(1, 2).contiguous(), None

    def describe(self) -> dict:
        from kvtool.eval.fp8_backends import Q_SCALE_FALLBACK

        d = self.backend.describe()
        d["kv_format"] = self.format
        if self.backend.queries:
            vals = [float(t.max()) for t in self.scales.q.values()]
            d["q_scales"] = {"checkpoint_layers": len(self.scales.q), "fallback": Q_SCALE_FALLBACK,
                             "min_scale": min(vals) if vals else None, "max_scale": max(vals) if vals else None}
        return d
