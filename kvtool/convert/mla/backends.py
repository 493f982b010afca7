"""Which of vLLM's MLA decode backends accept a converted model's dimensions: engine facts as data.

vLLM sizes an MLA layer's cache row as `head_size = kv_lora_rank + qk_rope_head_dim`
(vllm/transformers_utils/model_arch_config_convertor.py, ModelArchConfigConvertorBase.get_head_size, 0.33.0) and
picks a backend whose `supports_head_size(head_size)` holds (vllm/v1/attention/backend.py,
AttentionBackend.validate_configuration); `MLACommonBackend.get_supported_head_sizes` is [320, 512, 576]
(vllm/model_executor/layers/attention/mla_attention.py, 0.33.0) and every backend below inherits it unless it says
otherwise. Each row: the backend's name as vLLM spells it (`--attention-backend`), the GPUs it runs on, the
dimensions it takes (None: any), and where each fact is read. `serving(shape)` applies them.
"""

from __future__ import annotations

from dataclasses import dataclass

RELEASE = "0.33.0"
COMMON_HEAD_SIZES = (320, 512, 576)  # MLACommonBackend.get_supported_head_sizes


@dataclass(frozen=True)
class MlaBackend:
    name: str  # vLLM's --attention-backend value
    gpus: str  # compute capabilities, in words
    head_sizes: tuple[int, ...] | None  # kv_lora_rank + qk_rope_head_dim; None: any
    kv_lora_rank: int | None = None  # fixed by the kernel
    qk_rope_head_dim: int | None = None
    qk_nope_head_dims: tuple[int, ...] | None = None
    citation: str = ""

    def refusal(self, shape) -> str | None:
        """Why this backend does not serve `shape` (a kvtool.convert.mla.shape.MlaShape), None when it does."""
        if self.head_sizes is not None and shape.cached_dims not in self.head_sizes:
            return (f"head size kv_lora_rank + qk_rope_head_dim = {shape.cached_dims} is not one of "
                    f"{', '.join(map(str, self.head_sizes))}")
        if self.kv_lora_rank is not None and shape.kv_lora_rank != self.kv_lora_rank:
            return f"the kernel fixes kv_lora_rank {self.kv_lora_rank} (got {shape.kv_lora_rank})"
        if self.qk_rope_head_dim is not None and shape.qk_rope_head_dim != self.qk_rope_head_dim:
            return f"the kernel fixes qk_rope_head_dim {self.qk_rope_head_dim} (got {shape.qk_rope_head_dim})"
        if self.qk_nope_head_dims is not None and shape.qk_nope_head_dim not in self.qk_nope_head_dims:
            return (f"qk_nope_head_dim must be one of {', '.join(map(str, self.qk_nope_head_dims))} "
                    f"(got {shape.qk_nope_head_dim})")
        return None


_MLA = "vllm/v1/attention/backends/mla"
BACKENDS: tuple[MlaBackend, ...] = (
    MlaBackend("TRITON_MLA", "any", None,
               citation=f"{_MLA}/triton_mla.py TritonMLABackend.get_supported_head_sizes (returns [], any size) and "
                        "supports_compute_capability (True), vLLM 0.33.0"),
    MlaBackend("FLASHMLA", "Hopper (SM90)", COMMON_HEAD_SIZES, kv_lora_rank=512, qk_rope_head_dim=64,
               citation=f"{_MLA}/flashmla.py FlashMLABackend.supports_combination (is_flashmla_dense_supported: "
                        "Hopper only); vllm/third_party/flashmla/flash_mla_interface.py flash_mla_with_kvcache "
                        "('head_dim_v: Head_dim of v. Must be 512'; 'head_dim should be 576'), vLLM 0.33.0"),
    MlaBackend("CUTLASS_MLA", "Blackwell (SM100)", COMMON_HEAD_SIZES, kv_lora_rank=512, qk_rope_head_dim=64,
               citation=f"{_MLA}/cutlass_mla.py CutlassMLAImpl._sm100_cutlass_mla_decode (D_latent = 512, D_rope = 64, "
                        "asserted) and CutlassMLABackend.supports_compute_capability (major == 10), vLLM 0.33.0"),
    MlaBackend("FLASHINFER_MLA", "Blackwell (SM100)", COMMON_HEAD_SIZES, qk_nope_head_dims=(64, 128, 192),
               citation=f"{_MLA}/flashinfer_mla.py FlashInferMLABackend.supports_combination ('FlashInfer MLA "
                        "kernel requires qk_nope_head_dim in [64, 128, 192]') and supports_compute_capability "
                        "(major == 10), vLLM 0.33.0"),
    MlaBackend("FLASH_ATTN_MLA", "Hopper (SM90)", COMMON_HEAD_SIZES,
               citation=f"{_MLA}/flashattn_mla.py FlashAttnMLABackend (inherits MLACommonBackend's head sizes; "
                        "supports_compute_capability: major == 9), vLLM 0.33.0"),
)


def serving(shape) -> list[tuple[MlaBackend, str | None]]:
    """Every backend with why it refuses `shape` (None: it serves it), in the table's order."""
    return [(b, b.refusal(shape)) for b in BACKENDS]


def summary(shape) -> str:
    """One line: the backends that serve `shape`, then those that do not, grouped by reason."""
    rows = serving(shape)
    ok = [f"{b.name} ({b.gpus})" for b, why in rows if why is None]
    why_not: dict[str, list[str]] = {}
    for b, why in rows:
        if why is not None:
            why_not.setdefault(why, []).append(b.name)
    line = f"vLLM {RELEASE}: " + (", ".join(ok) if ok else "no MLA backend")
    return line + "".join(f"; not {', '.join(names)} ({why})" for why, names in why_not.items())
