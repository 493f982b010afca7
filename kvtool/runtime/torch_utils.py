"""Device and dtype choice, and model loading, for the commands that need torch.

CUDA when present (bf16 by default there), CPU otherwise (fp32 by default). Imported only by
commands that run models; never by lint, kv-budget or rope.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvtool.errors import InputError, UsageError

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}


def pick_device(name: str = "auto") -> torch.device:
    name = (name or "auto").lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device cuda was asked for but no CUDA GPU is available", option="device")
    if name not in ("cpu",) and not name.startswith("cuda"):
        raise UsageError(f"unknown device {name!r}; use auto, cuda, cuda:N or cpu", option="device")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    name = (name or "auto").lower()
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise UsageError(f"unknown dtype {name!r}; use auto, bf16, fp16 or fp32", option="dtype")
    return DTYPES[name]


def load_model(path: str | Path, *, device: torch.device, dtype: torch.dtype, attn: str = "sdpa",
               device_map=None, max_memory: dict | None = None, offload_folder: str | None = None):
    """Load a causal LM for inference; one-line InputError on failure. device_map ("auto", or a
    {module: device} dict with "disk" allowed), max_memory and offload_folder go to accelerate
    through from_pretrained."""
    from transformers import AutoConfig, AutoModelForCausalLM

    quiet_transformers()
    kwargs = {"dtype": dtype, "attn_implementation": attn, "trust_remote_code": False}
    if device_map:
        kwargs["device_map"] = device_map
        if max_memory:
            kwargs["max_memory"] = max_memory
        if offload_folder:
            kwargs["offload_folder"] = offload_folder
    from kvtool.model.preflight import check_loadable

    check_loadable(path)
    try:
        config = AutoConfig.from_pretrained(str(path), trust_remote_code=False)
        if kv_cache_only_quantization(getattr(config, "quantization_config", None)):
            # weights are plain: don't make transformers load a quantizer (compressed-tensors) for
            # a scheme that only describes the KV cache; kvtool.eval.fp8 reads the scales itself
            del config.quantization_config
            kwargs["config"] = config
        model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise load_error(exc, path, "cannot load the model with transformers") from None
    if not device_map:
        model.to(device)
    model.eval()
    return model


def quiet_transformers() -> None:
    """No 'Loading weights' bars of transformers on stderr: kvtool shows its own progress (kvtool.progress)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def kv_cache_only_quantization(qc) -> bool:
    """A quantization_config that quantizes only the KV cache (no weight or activation groups)."""
    if qc is None:
        return False
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else {}
    if qc.get("quant_method") == "compressed-tensors":
        return bool(qc.get("kv_cache_scheme")) and not qc.get("config_groups")
    if qc.get("kv_cache_quant_algo"):  # modelopt
        return not qc.get("quant_algo")
    return False


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    from kvtool.model.preflight import check_loadable

    check_loadable(path)
    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except (OSError, ValueError, KeyError) as exc:
        raise load_error(exc, path, "cannot load the tokenizer") from None


def load_error(exc: Exception, path: str | Path, what: str) -> InputError:
    """One line for a transformers loading failure; remote code is named by its auto_map entry."""
    text = str(exc).strip()
    if "trust_remote_code" in text or "custom code" in text:  # transformers refused (trust_remote_code=False)
        from kvtool.model.preflight import refuse_auto_map

        try:
            refuse_auto_map(Path(path))
        except InputError as named:
            return named
        return InputError(f"{what}: the checkpoint needs its own Python code; kvtool never runs it "
                          "(trust_remote_code=False)", file=str(path))
    first = text.splitlines()[0] if text else type(exc).__name__
    return InputError(f"{what}: {first}", file=str(path))
