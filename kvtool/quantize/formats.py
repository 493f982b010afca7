"""FP8 formats for the KV cache, as a table (the CLI's --format choices).

vLLM stores fp8 = saturate(x / scale) and reads fp8 * scale; the largest finite value of the
format is what a calibrated scale maps the observed maximum onto.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtool.errors import UsageError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Fp8Format:
    name: str
    torch_dtype: str  # the torch dtype's name: the table is read before torch is imported (--dry-run checks)
    max: float  # largest finite value
    vllm_cache_dtype: str  # what to pass as --kv-cache-dtype

    @property
    def dtype(self):
        import torch

        return getattr(torch, self.torch_dtype)


FORMATS: dict[str, Fp8Format] = {
    "e4m3": Fp8Format("e4m3", "float8_e4m3fn", 448.0, "fp8_e4m3"),
}


def get_format(name: str) -> Fp8Format:
    try:
        return FORMATS[name.lower()]
    except KeyError:
        raise UsageError(f"unknown FP8 format {name!r}; choose from {', '.join(FORMATS)}", option="format") from None


def roundtrip(x: torch.Tensor, scale: torch.Tensor | float, fmt: Fp8Format) -> torch.Tensor:
    """x stored in the cache with `scale` and read back (float32 math, saturating), in float32."""
    q = (x.float() / scale).clamp(-fmt.max, fmt.max).to(fmt.dtype)
    return q.float() * scale
