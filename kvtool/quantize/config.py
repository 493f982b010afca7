"""The config.json `quantization_config` that declares an FP8 KV cache, as llm-compressor writes it.

compressed-tensors serialises `QuantizationConfig` (config_groups, format, global_compression_ratio,
ignore, kv_cache_scheme, quantization_status) plus quant_method, sparsity_config, transform_config
and version; vLLM's CompressedTensorsConfig reads `kv_cache_scheme` (type "float", num_bits 8,
symmetric, strategy "tensor" or "attn_head") and loads `<attention>.k_scale` / `.v_scale`.
A KV-cache-only checkpoint has no config groups and "dense" weights.

An existing compressed-tensors config (quantized weights) gains a kv_cache_scheme and keeps the rest;
any other quantization method is refused with the reason, as is a config that already declares
a KV-cache scheme.
"""

from __future__ import annotations

import copy

from kvtool.errors import InputError

QUANT_METHOD = "compressed-tensors"
# The compressed-tensors release whose serialised format this matches (checked against its
# QuantizationConfig / QuantizationArgs models; the `version` key is informational for loaders).
CT_FORMAT_VERSION = "0.20.0"
# kvtool observer -> the llm-compressor observer computing the same statistic, if any (its "minmax"
# is an exponential moving average; "static_minmax" is the running maximum kvtool keeps)
# (compressed-tensors' QuantizationArgs forbids unknown keys, so kvtool's details go to kvtool.json).
CT_OBSERVER = {"absmax": "static_minmax", "absmax-pow2": "static_minmax", "mse": "mse"}

# Why other quantization methods are refused (anything not listed gets the generic reason).
REFUSALS = {
    "gguf": "GGUF weights are not what vLLM serves from safetensors; dequantize the checkpoint first",
    "bitsandbytes": "bitsandbytes configs have no KV-cache scheme vLLM reads",
    "fp8": "vLLM's fp8 method declares its KV cache through --kv-cache-dtype, not kv_cache_scheme; "
           "export with llm-compressor (compressed-tensors) to combine weight and KV quantization",
    "modelopt": "ModelOpt declares its KV cache with kv_cache_quant_algo and its own scale names",
}


def kv_cache_scheme(strategy: str, observer_name: str) -> dict:
    """compressed-tensors QuantizationArgs for a static symmetric FP8 (e4m3) KV cache."""
    return {
        "actorder": None,
        "block_structure": None,
        "dynamic": False,
        "group_size": None,
        "num_bits": 8,
        "observer": CT_OBSERVER.get(observer_name),
        "observer_kwargs": {},
        "strategy": strategy,
        "symmetric": True,
        "type": "float",
    }


def new_quantization_config(strategy: str, observer_name: str) -> dict:
    return {
        "config_groups": {},
        "format": "dense",
        "global_compression_ratio": None,
        "ignore": [],
        "kv_cache_scheme": kv_cache_scheme(strategy, observer_name),
        "quant_method": QUANT_METHOD,
        "quantization_status": "frozen",
        "sparsity_config": {},
        "transform_config": {},
        "version": CT_FORMAT_VERSION,
    }


def check_mergeable(config: dict, config_file: str) -> None:
    """Refuse (InputError, exit 2) a config whose quantization_config cannot take a kv_cache_scheme."""
    qc = config.get("quantization_config")
    if qc is None:
        return
    if not isinstance(qc, dict):
        raise InputError(f"is a {type(qc).__name__}, not an object", file=config_file, field="quantization_config")
    method = str(qc.get("quant_method", "")).lower().replace("_", "-")
    if method != QUANT_METHOD:
        reason = REFUSALS.get(method, "kvtool can only add a kv_cache_scheme to a compressed-tensors config")
        raise InputError(f"quant_method {qc.get('quant_method')!r} is refused: {reason}",
                         file=config_file, field="quantization_config.quant_method")
    if qc.get("kv_cache_scheme") is not None:
        raise InputError("already declares a kv_cache_scheme; start from the checkpoint without KV scales",
                         file=config_file, field="quantization_config.kv_cache_scheme")


def with_kv_cache_scheme(config: dict, *, strategy: str, observer_name: str, config_file: str = "config.json") -> dict:
    """A copy of config.json's dict declaring the FP8 KV cache (the input dict is not modified)."""
    check_mergeable(config, config_file)
    out = copy.deepcopy(config)
    qc = out.get("quantization_config")
    if qc is None:
        out["quantization_config"] = new_quantization_config(strategy, observer_name)
    else:
        qc["kv_cache_scheme"] = kv_cache_scheme(strategy, observer_name)
    return out
