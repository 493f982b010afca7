"""A live transformers attention module's projections as the calibrated merge sees them.

The merge works on separate q/k/v/o tensors (`Proj`). Which submodules hold them comes from the
architecture table (`weights.q/k/v/o`, or a fused `weights.qkv` with its `qkv_layout`, split and
re-fused by kvtool.convert.fused): `read_proj` reads them, `install_proj` writes merged ones back
into the module (K/V with fewer rows) so the layer runs converted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvtool.convert.aware.attention import Proj
from kvtool.errors import UsageError

# Attributes in which transformers' attention modules keep the KV-head count (phi3 slices its fused
# qkv_proj by num_key_value_heads, falcon reshapes query_key_value by num_kv_heads) and the query
# heads per KV head (repeat_kv in the attention interface). Whichever a module has is updated.
KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads")
GROUP_ATTRS = ("num_key_value_groups",)
# The softmax scale: `scaling` in most modules, `inv_norm_factor` in falcon's.
SCALING_ATTRS = ("scaling", "inv_norm_factor")


@dataclass(frozen=True)
class ModuleLayout:
    """Where one attention module keeps its projections (submodule paths relative to it)."""

    model_type: str
    separate: dict  # role (q, k, v, o) -> submodule path; q/k/v absent when fused
    qkv: str | None  # fused q/k/v submodule
    qkv_layout: str | None
    num_heads: int
    head_dim: int
    rope_layout: str = "rotate_half"  # the table's attention.rope_layout


def module_layout(module: nn.Module) -> ModuleLayout:
    """The table's layout for the module's model type (read from module.config)."""
    from kvtool.model.spec import build_spec

    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise UsageError(f"method 'aware': {type(module).__name__} carries no config, so its projections cannot be "
                         "located (use --method mean)", option="method")
    spec = build_spec(config.to_dict())
    w = spec.arch.weights
    head_dim = getattr(module, "head_dim", None) or spec.head_dim
    if not spec.num_heads or not head_dim:
        raise UsageError(f"method 'aware': cannot read the head counts of {type(module).__name__}", option="method")
    roles = ("o",) if w.get("qkv") else ("q", "k", "v", "o")
    return ModuleLayout(spec.arch.model_type, {r: w[r] for r in roles if w.get(r)}, w.get("qkv") or None,
                        w.get("qkv_layout"), int(spec.num_heads), int(head_dim),
                        spec.arch.attention.get("rope_layout", "rotate_half"))


def _linear(module: nn.Module, path: str | None) -> nn.Linear:
    try:
        m = module.get_submodule(path) if path else None
    except AttributeError:
        m = None
    if not isinstance(m, nn.Linear):
        raise UsageError(f"method 'aware' needs the attention projections as linear layers; "
                         f"{type(module).__name__} has no linear {path or '<projection>'} (use --method mean)",
                         option="method")
    return m


def _param(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()


def read_proj(module: nn.Module, layout: ModuleLayout | None = None, *, grads: bool = False) -> Proj:
    """The module's q/k/v/o weights and biases (views, not copies), fused qkv split per the table;
    grads: their gradients instead (None where a tensor has none)."""
    lay = layout or module_layout(module)
    t = (lambda p: None if p is None else p.grad) if grads else _param
    o = _linear(module, lay.separate.get("o"))
    if lay.qkv is None:
        q, k, v = (_linear(module, lay.separate.get(r)) for r in "qkv")
        return Proj(t(q.weight), t(k.weight), t(v.weight), t(o.weight), t(q.bias), t(k.bias), t(v.bias), t(o.bias))
    from kvtool.convert.fused import split_qkv

    fused = _linear(module, lay.qkv)
    H, hd = lay.num_heads, lay.head_dim
    # the KV count from the rows (not the config): a module may already hold merged projections
    kv = (fused.weight.shape[0] // hd - H) // 2
    try:
        q, k, v = split_qkv(lay.qkv_layout, t(fused.weight), H, kv, hd)
        qb, kb, vb = (None, None, None) if t(fused.bias) is None else split_qkv(lay.qkv_layout, t(fused.bias),
                                                                                 H, kv, hd)
    except ValueError as exc:
        raise UsageError(f"method 'aware': {lay.model_type} {lay.qkv}: {exc}", option="method") from None
    return Proj(q, k, v, t(o.weight), qb, kb, vb, t(o.bias))


def trainable_params(module: nn.Module, layout: ModuleLayout | None = None) -> list[nn.Parameter]:
    """The parameters read_proj reads: the q/k/v (or fused qkv) and o linears' weights and biases."""
    lay = layout or module_layout(module)
    paths = [lay.qkv, lay.separate.get("o")] if lay.qkv else [lay.separate.get(r) for r in "qkvo"]
    return [p for path in paths for p in (_linear(module, path).weight, _linear(module, path).bias) if p is not None]


def _set_linear(lin: nn.Linear, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """Give lin new weights in place (keeps its class, e.g. falcon's FalconLinear, and its device / dtype)."""
    like = lin.weight
    lin.weight = nn.Parameter(w.detach().to(device=like.device, dtype=like.dtype).clone(),
                              requires_grad=like.requires_grad)
    if b is None:
        lin.bias = None
    else:
        lin.bias = nn.Parameter(b.detach().to(device=like.device, dtype=like.dtype).clone(),
                                requires_grad=like.requires_grad)
    lin.out_features, lin.in_features = w.shape


def install_proj(module: nn.Module, p: Proj, num_heads: int | None = None, layout: ModuleLayout | None = None) -> None:
    """Put merged projections into the live module and set its KV-head attributes to the new count."""
    lay = layout or module_layout(module)
    H, hd = num_heads or lay.num_heads, lay.head_dim
    kv = p.k.shape[0] // hd
    if lay.qkv is None:
        for role, w, b in (("q", p.q, p.q_bias), ("k", p.k, p.k_bias), ("v", p.v, p.v_bias)):
            _set_linear(_linear(module, lay.separate.get(role)), w, b)
    else:
        from kvtool.convert.fused import fuse_qkv

        biases = (p.q_bias, p.k_bias, p.v_bias)
        if any(b is None for b in biases) and any(b is not None for b in biases):
            raise ValueError("a fused qkv needs biases for all of q, k, v or none")
        w = fuse_qkv(lay.qkv_layout, p.q, p.k, p.v, H, kv, hd)
        b = None if p.q_bias is None else fuse_qkv(lay.qkv_layout, p.q_bias, p.k_bias, p.v_bias, H, kv, hd)
        _set_linear(_linear(module, lay.qkv), w, b)
    _set_linear(_linear(module, lay.separate.get("o")), p.o, p.o_bias)
    for name in KV_HEAD_ATTRS:
        if isinstance(getattr(module, name, None), int):
            setattr(module, name, kv)
    for name in GROUP_ATTRS:
        if isinstance(getattr(module, name, None), int):
            setattr(module, name, H // kv)


def attention_scale(module: nn.Module) -> float:
    """The module's softmax scale (1/sqrt(head_dim) unless the model sets another)."""
    for name in SCALING_ATTRS:
        s = getattr(module, name, None)
        if isinstance(s, (int, float)):
            return float(s)
    raise UsageError(f"method 'aware': {type(module).__name__} has no attention scale attribute "
                     f"({', '.join(SCALING_ATTRS)}) (use --method mean)", option="method")


# --- RoPE pair order ------------------------------------------------------------------------------
# The merge pairs dims (i, i + r/2) of a head (rotate_half). Reordering the q and k rows of every
# head identically keeps every q.k score, and rotate_half RoPE on the reordered dims equals the
# model's own RoPE on the original dims when cos/sin are reordered the same way.
def _interleaved(rotary_dim: int, head_dim: int) -> torch.Tensor:
    """Pairs (2i, 2i + 1) -> (i, i + r/2); dims past the rotary part stay in place."""
    return torch.cat([torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2),
                      torch.arange(rotary_dim, head_dim)])


ROPE_ORDERS = {"interleaved": _interleaved}


def rope_order(layout: ModuleLayout, rotary_dim: int) -> torch.Tensor | None:
    """Dim order of one head in rotate_half layout (dim j of the result is dim order[j] of the
    module's head), or None when the module already uses rotate_half."""
    if layout.rope_layout == "rotate_half":
        return None
    fn = ROPE_ORDERS.get(layout.rope_layout)
    if fn is None:
        raise UsageError(f"method 'aware': {layout.model_type} has {layout.rope_layout} RoPE, which the merge cannot "
                         "reorder (use --method mean)", option="method")
    return fn(rotary_dim, layout.head_dim)


def reorder_qk(p: Proj, order: torch.Tensor, head_dim: int) -> Proj:
    """p with the q and k rows (and biases) of every head reordered by order; v and o as they are."""
    def rows(t):
        n = t.shape[0] // head_dim
        return (order.to(t.device)[None, :] + head_dim * torch.arange(n, device=t.device)[:, None]).reshape(-1)

    def take(t):
        return None if t is None else t[rows(t)]

    return Proj(take(p.q), take(p.k), p.v, p.o, take(p.q_bias), take(p.k_bias), p.v_bias, p.o_bias)
