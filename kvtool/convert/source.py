"""The source side of every conversion target (kvtool/convert/targets.py), public for the targets to share:
the model refusals any conversion makes (`refuse_unsupported`), where a missing tensor should be
(`weights_file`), the source's identity and earlier provenance (`source_fingerprint`, `source_provenance`),
`--dtype`'s names, and the report's tensor-name templates. Config and headers only; no torch."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from kvtool.errors import InputError, UsageError
from kvtool.io.jsonfile import load_json_object
from kvtool.model.architectures import Architecture
from kvtool.model.checkpoint import Checkpoint
from kvtool.model.spec import ModelSpec, get_path

# --dtype choices -> safetensors dtype (None: keep what is stored) and the config's dtype name.
OUT_DTYPES = {"keep": None, "bf16": "BF16", "fp16": "F16", "fp32": "F32"}
CONFIG_DTYPE_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


def refuse_unsupported(arch: Architecture, spec: ModelSpec, config: dict, where: str) -> None:
    if arch.generic:
        mt = spec.model_type if spec.model_type is not None else spec.full_config.get("model_type")  # as written
        raise UsageError(f"model_type {mt!r:.60} has no architecture table; its weight layout is unknown, "
                         "so it cannot be converted", file=where, field="model_type")
    conv = arch.convert
    if not conv.get("supported"):
        msg = f"{arch.model_type} cannot be converted: {conv.get('reason', 'not supported')}"
        if conv.get("alternative"):
            msg += f"; alternative: {conv['alternative']}"
        raise UsageError(msg, file=where, field="model_type")
    only = conv.get("only")
    if only and not get_path(spec.config, only, arch.defaults.get(only)):
        raise UsageError(f"{arch.model_type} checkpoints convert only when {only} is true", file=where, field=only)
    if spec.wrapper_key:
        raise UsageError(f"multimodal wrapper ({spec.wrapper_key}): converting the text model inside is not supported",
                         file=where, field=spec.wrapper_key)
    if spec.is_mla or arch.attention.get("kind") == "mla":
        raise UsageError("MLA caches a compressed latent, not KV heads: nothing to pool", file=where, field="model_type")
    if arch.weights.get("transposed"):
        raise UsageError(f"{arch.model_type} stores transposed (Conv1D) projections, which convert does not handle",
                         file=where, field="model_type")
    if isinstance(config.get("quantization_config"), dict):
        raise UsageError("quantized checkpoint: pool the unquantized weights, then quantize", file=where,
                         field="quantization_config")
    when = arch.weights.get("qk_norm_when") or {}
    if when and not arch.weights.get("k_norm") and all(
            get_path(spec.config, k, arch.defaults.get(k)) == v for k, v in when.items()):
        # per-head K norms whose weights the table does not name would be left at the old head count
        flag = next(iter(when))
        raise UsageError(f"{arch.model_type} with {flag}: {str(when[flag]).lower()} normalises K per head with weights "
                         "convert does not know how to pool", file=where, field=flag)


def weights_file(ckpt: Checkpoint) -> str:
    """The file a missing tensor should be in: the index, the one safetensors file, or the folder."""
    if ckpt.index_doc is not None:
        return str(ckpt.index_doc.path)
    return str(ckpt.headers[0].path) if len(ckpt.headers) == 1 else str(ckpt.root)


def source_fingerprint(ckpt: Checkpoint) -> str:
    """sha256 of the index and every safetensors header: identifies the source without hashing data."""
    h = hashlib.sha256()
    if ckpt.index_doc is not None:
        h.update(ckpt.index_doc.text.encode("utf-8"))
    for hdr in ckpt.headers:
        with hdr.path.open("rb") as fh:
            h.update(hdr.file.encode("utf-8", "surrogateescape"))  # a name's bytes as on disk, UTF-8 or not
            h.update(fh.read(8 + hdr.header_size))
    return "sha256:" + h.hexdigest()


def source_provenance(src: Path) -> dict | None:
    """The source's own kvtool.json (an earlier kvtool step), None when it has none or it does not parse."""
    previous = src / "kvtool.json"
    if previous.is_file():
        try:
            return load_json_object(previous, what="kvtool.json").data
        except InputError:
            pass
    return None


def with_source_provenance(prov: dict, src: Path) -> dict:
    """kvtool.json's record `prov`, with the source's own record (an earlier kvtool step) under source_provenance."""
    previous = source_provenance(src)
    if previous is not None:
        prov["source_provenance"] = previous
    return prov


def jsonable(v) -> bool:
    try:
        json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False


def template_of(name: str) -> str:
    """model.layers.12.self_attn.k_proj.weight -> model.layers.{i}.self_attn.k_proj.weight"""
    return re.sub(r"\.(\d+)\.", ".{i}.", name, count=1)
