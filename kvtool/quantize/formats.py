"""The KV-cache formats quantize-kv calibrates scales for, as a table (the CLI's --format choices).

Every `--kv-cache-dtype` of vLLM 0.33 that loads a checkpoint's k_scale / v_scale (the rows of
kvtool/model/kv_emulations.json whose `scales` is "checkpoint"; tests/quantize/test_quantize_formats.py checks
that each has a format here) is served by one of them:

- e4m3 / e5m2: vLLM stores fp8 = saturate(x / scale) and reads fp8 * scale; a calibrated scale maps the observed
  maximum onto the format's largest finite value (448, 57344).
- nvfp4 (served as nvfp4 or nvfp4_4over6): the layer's k_scale / v_scale is NVFP4's second-level global scale
  (kvtool/eval/codecs/nvfp4.py): one e4m3 block scale per 16 values times the global scale, e2m1 values up to 6;
  a calibrated global scale is amax / (448 * 6) = amax / 2688, which puts the largest block scale at 448.
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
    max: float  # what a calibrated scale maps the observed maximum onto (the largest value the cache holds, scale 1)
    vllm_cache_dtype: str  # what to pass as --kv-cache-dtype
    also_serves: tuple[str, ...] = ()  # other --kv-cache-dtype values that read the same scales
    default_observer: str = "absmax-pow2:2"
    kind: str = "fp8"  # "fp8": x / scale cast to torch_dtype; "nvfp4": block-scaled e2m1 (kvtool/eval/codecs/nvfp4.py)
    per_head: bool = True  # --strategy attn_head: vLLM's kernels take one scale per KV head for this format
    eval_dtype: str = ""  # the --kv-cache-dtype `kvtool eval` emulates it as (quality report)

    @property
    def dtype(self):
        import torch

        return getattr(torch, self.torch_dtype)

    @property
    def serves(self) -> tuple[str, ...]:
        return (self.vllm_cache_dtype, *self.also_serves)


FORMATS: dict[str, Fp8Format] = {
    "e4m3": Fp8Format("e4m3", "float8_e4m3fn", 448.0, "fp8_e4m3", also_serves=("fp8",), eval_dtype="fp8"),
    "e5m2": Fp8Format("e5m2", "float8_e5m2", 57344.0, "fp8_e5m2", eval_dtype="fp8_e5m2"),
    # vLLM's NVFP4 stores take layer._k_scale as one float per layer (FlashInferImpl.do_kv_cache_update): no
    # per-head form; the default observer is the plain maximum, amax / 2688 (block scales adapt within it)
    "nvfp4": Fp8Format("nvfp4", "float8_e4m3fn", 448.0 * 6.0, "nvfp4", also_serves=("nvfp4_4over6",),
                       default_observer="absmax", kind="nvfp4", per_head=False, eval_dtype="nvfp4"),
}
OBSERVER_FREE = ("absmax", "absmax-pow2", "percentile")  # observers that never round through the format


def get_format(name: str) -> Fp8Format:
    try:
        return FORMATS[name.lower()]
    except KeyError:
        raise UsageError(f"unknown FP8 format {name!r}; choose from {', '.join(FORMATS)}", option="format") from None


def roundtrip(x: torch.Tensor, scale: torch.Tensor | float, fmt: Fp8Format) -> torch.Tensor:
    """x stored in an FP8 cache with `scale` and read back (float32 math, saturating), in float32. Only the FP8
    formats round trip here: check_combination refuses the observers that would need another format's."""
    if fmt.kind != "fp8":
        raise ValueError(f"{fmt.name} is not an FP8 format")
    q = (x.float() / scale).clamp(-fmt.max, fmt.max).to(fmt.dtype)
    return q.float() * scale


def check_combination(fmt: Fp8Format, strategy: str, observer_name: str) -> None:
    """Refuse (UsageError) a strategy or observer the format cannot take, in one line."""
    if strategy == "attn_head" and not fmt.per_head:
        raise UsageError(f"--format {fmt.name} takes one scale per layer (vLLM's {fmt.vllm_cache_dtype} store reads "
                         "layer._k_scale as one value); use --strategy tensor", option="strategy")
    if fmt.kind != "fp8" and observer_name not in OBSERVER_FREE:
        raise UsageError(f"observer {observer_name!r} rounds candidates through an FP8 cache; with --format "
                         f"{fmt.name} use one of {', '.join(OBSERVER_FREE)}", option="observer")
