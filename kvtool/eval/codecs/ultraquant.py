"""UltraQuant KV cache (ultraquant_4bit), as vLLM 0.33's PyTorch reference stores and reads it
(vllm/v1/attention/ops/ultraquant/reference.py `ultraquant_encode` / `ultraquant_dequant`, "the bit-comparison
ground truth for the kernels").

Per (token, head) and per group of 32 values (kv_dtypes.json `group_size`): absmax, s = c * absmax with
c = 0.156 (params `constant_c`, format.py `DEFAULT_CONSTANT_C`), snapped to a power of two
(2^floor(log2 s + 0.5), one UE8M0 byte; a zero group stores byte 0 and reads 0); each value x / s is rounded
to the nearest FP4 E2M1 level (+-{0, 0.5, 1, 1.5, 2, 3, 4, 6}, bucketize on the midpoints); it reads back as
level * s. K is rotated first by the Sylvester Hadamard (x @ H.T, no random signs) and stays rotated in the
cache; the query is rotated by the same H at decode, so the scores equal those of the raw query against the
dequantized K rotated back (k_rot @ H): that is what this codec returns. V is not rotated.

Not emulated: vLLM also casts the rotated query to float8 e4m3 (scale 1) before Q.K
(reference_ultraquant_attention; triton_unified_attention.py `ultraquant_unified_attention`); the codec sees
only K and V, so eval's query keeps the model dtype. The emulation row says so in its assumption.
Boundary layers: vLLM keeps the first and last 2 at the model dtype, as for TurboQuant (engine/arg_utils.py).
"""

from __future__ import annotations

import torch

from kvtool.errors import InputError
from kvtool.eval.codecs.rotation import hadamard_f64, need_power_of_two

# format.py: FP4_LEVELS_SORTED and the E2M1 dequant of each sorted index (the bit pattern round trip)
LEVELS = (-6.0, -4.0, -3.0, -2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
MIDPOINTS = tuple((LEVELS[i] + LEVELS[i + 1]) / 2.0 for i in range(len(LEVELS) - 1))
UE8M0_BIAS = 127


def snap_scale(s_raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(power-of-two scale float32, UE8M0 byte uint8): `_ue8m0_snap_tensor` (round half up in log2; zero or
    non-finite -> byte 0, scale 0; exponent clamped to [-126, 127])."""
    is_zero = (s_raw <= 0) | ~torch.isfinite(s_raw)
    log2_s = torch.log2(torch.where(is_zero, torch.ones_like(s_raw), s_raw))
    exp = torch.floor(log2_s + 0.5).to(torch.int32).clamp(-126, 127)
    byte = torch.where(is_zero, torch.zeros_like(exp), exp + UE8M0_BIAS).to(torch.uint8)
    return torch.where(is_zero, torch.zeros_like(s_raw), torch.exp2(exp.to(torch.float32))), byte


def encode(x: torch.Tensor, *, rotate: bool, group: int, c: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted level index int64 [..., G, group], scale float32 [..., G, 1]) of x [..., D]."""
    d = x.shape[-1]
    xf = x.to(torch.float32)
    if rotate:
        xf = xf @ hadamard_f64(d).to(x.device).T
    xg = xf.reshape(*x.shape[:-1], d // group, group)
    s, _ = snap_scale(xg.abs().amax(dim=-1, keepdim=True).squeeze(-1) * c)
    s = s.unsqueeze(-1)
    mid = torch.tensor(MIDPOINTS, dtype=torch.float32, device=x.device)
    idx = torch.bucketize(xg / torch.where(s == 0, torch.ones_like(s), s), mid)
    return torch.where(s == 0, torch.full_like(idx, 7), idx), s  # sorted index 7 is +0.0


def decode(idx: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """float32 [..., D] from `encode`'s output, in the basis it was encoded in."""
    levels = torch.tensor(LEVELS, dtype=torch.float32, device=idx.device)
    out = levels[idx] * s
    return out.reshape(*out.shape[:-2], -1)


def roundtrip(x: torch.Tensor, *, role: str, params: dict, row, scale: torch.Tensor | None = None) -> torch.Tensor:
    """The codec (kvtool.eval.codecs): K or V of one layer through the UltraQuant cache (row.group_size values
    per scale, params constant_c). Checkpoint scales play no part."""
    if role not in ("k", "v"):
        raise ValueError(f"{row.name}: no {role!r} role (UltraQuant stores K and V of standard attention)")
    d = x.shape[-1]
    if d % row.group_size:
        raise InputError(f"{row.name} needs head_dim a multiple of {row.group_size} (this model's is {d})",
                         option="kv_cache_dtype")
    if role == "k":
        need_power_of_two(row.name, d, role)
    out = decode(*encode(x, rotate=role == "k", group=row.group_size, c=float(params["constant_c"])))
    if role == "k":
        out = out @ hadamard_f64(d).to(x.device)  # back from x @ H.T: H is orthonormal
    return out.to(x.dtype)
