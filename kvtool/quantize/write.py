"""The quantize-kv output folder: the source shards unchanged, one new scale shard, an index.

The source's safetensors files are copied into the staging folder (a reflink where the file
system can: no extra disk, yet a separate file), so every original tensor is byte-for-byte the
source's and editing DST never changes SRC; `--link` hard-links them instead. The scales
go into `model-kv-scales.safetensors`; `model.safetensors.index.json` maps every tensor to its file
(transformers and vLLM both read shard names from the index, so the extra shard needs no renaming).
The folder is staged and renamed into place only when complete; the source is never written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from kvtool.model import kv_scale_names
from kvtool.errors import InputError
from kvtool.io.jsonfile import load_json_object
from kvtool.io.outputfile import copy_source, make_subdirs, write_new

SCALE_SHARD = "model-kv-scales.safetensors"
INDEX_NAME = "model.safetensors.index.json"


@dataclass
class WriteSummary:
    dst: Path
    linked: list[str]
    copied: list[str]
    scale_shard: str
    scale_tensors: dict[str, tuple[int, ...]]  # name -> shape
    side_files: list[str]


def existing_scales(names) -> list[str]:
    return [n for n in names if kv_scale_names.is_kv_scale(n)]


def scale_tensors(result, attn_prefix, per_head: bool) -> dict[str, torch.Tensor]:
    """name -> float32 tensor: [1] per tensor, [heads, 1, 1] per head (compressed-tensors' attn_head shape; KV
    heads for k/v, attention heads for q, which vLLM reduces to one per KV group)."""
    out: dict[str, torch.Tensor] = {}
    for layer, s in sorted(getattr(result, "q", {}).items()):
        t = s.detach().to(torch.float32).cpu().reshape(-1)
        out[kv_scale_names.q_canonical_name(attn_prefix(layer))] = (t.reshape(-1, 1, 1) if per_head
                                                                     else t.reshape(1)).contiguous()
    for role, table in (("k", result.k), ("v", result.v)):
        for layer, s in sorted(table.items()):
            t = s.detach().to(torch.float32).cpu().reshape(-1)
            t = t.reshape(-1, 1, 1) if per_head else t.reshape(1)
            out[kv_scale_names.canonical_name(attn_prefix(layer), role)] = t.contiguous()
    # every name written is one vLLM loads as the scale it is meant as (the one answer lint and eval ask too)
    layers = {layer for table in (result.k, result.v, getattr(result, "q", {})) for layer in table}
    params = kv_scale_names.scale_params([attn_prefix(layer) for layer in layers], "mha")
    for name in out:
        target = kv_scale_names.vllm_target(name, params)
        if target is None or not name.endswith(f"{target[1]}_scale"):
            raise RuntimeError(f"quantize-kv would write {name}, which vLLM does not load as that scale")
    return dict(sorted(out.items()))


def write_output(src: Path, tmp: Path, *, config: dict, scales: dict[str, torch.Tensor], metadata: dict[str, str],
                 provenance: dict, link: bool = False, validated: dict | None = None) -> WriteSummary:
    """Fill the staging folder `tmp` (created by kvtool.io.staging.staged_output). `validated` (file name ->
    kvtool.io.outputfile.Identity): the shards as the plan checked them; each is copied only if it is still
    that file, before and after its copy."""
    from safetensors.torch import save

    from kvtool.io.reader import CheckpointReader
    from kvtool.io.staging import copy_side_files

    with CheckpointReader(src, expect=validated) as reader:
        expect = {f: reader.identities[str(reader.folder / f)] for f in reader.files}
        files = reader.files
        weight_map = {name: reader.info(name).file for name in reader.names()}
        total_size = reader.total_bytes
        old_meta: dict = {}
        if reader.index_path is not None:
            try:
                old_meta = dict(load_json_object(reader.index_path, what="safetensors index").data.get("metadata") or {})
            except (InputError, ValueError, TypeError, AttributeError):
                old_meta = {}
    clash = [n for n in scales if n in weight_map]
    if clash:
        raise InputError(f"tensor {clash[0]!r} already exists in the checkpoint", file=str(src))
    if SCALE_SHARD in files:
        raise InputError(f"already has a {SCALE_SHARD}; start from the checkpoint without KV scales", file=str(src / SCALE_SHARD))
    linked, copied = [], []
    for f in files:
        make_subdirs(tmp, Path(f).parent)
        how = copy_source(src / f, tmp / f, expect=expect[f], link=link)
        (linked if how == "link" else copied).append(f)
    write_new(tmp / SCALE_SHARD, save(scales, metadata={"format": "pt", **metadata}))
    for name in scales:
        weight_map[name] = SCALE_SHARD
    scale_bytes = sum(t.numel() * t.element_size() for t in scales.values())
    meta = {**old_meta, "total_size": total_size + scale_bytes}
    if "total_parameters" in meta:
        meta["total_parameters"] = int(meta["total_parameters"]) + sum(t.numel() for t in scales.values())
    index = {"metadata": meta, "weight_map": dict(sorted(weight_map.items()))}
    write_new(tmp / INDEX_NAME, json.dumps(index, indent=2, sort_keys=True) + "\n")
    write_new(tmp / "config.json", json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    side = copy_side_files(src, tmp)
    from kvtool.engines.compat import read_as_written

    provenance = {**provenance, "engines_read_as_written": read_as_written(config)}  # `kvtool lint --compat DST`: why
    write_new(tmp / "kvtool.json", json.dumps(provenance, indent=2) + "\n")
    return WriteSummary(dst=tmp, linked=linked, copied=copied, scale_shard=SCALE_SHARD,
                        scale_tensors={n: tuple(t.shape) for n, t in scales.items()}, side_files=side)
