"""The convert driver: `plan_checkpoint` (what will change, from config and headers only) and `write`, behind
the front door kvtool/convert/run.py (`plan(options)` / `apply(plan, dst)`).

write streams the source tensor by tensor (kvtool.io.reader), hands each layer's attention
projections to the merge method as unfused `AttentionWeights` (splitting and re-fusing fused QKV
tensors per the table's `qkv_layout`), passes every other tensor through unchanged (cast when
--dtype asks), and writes shards straight to their final place in a staged folder
(kvtool.io.writer, kvtool.io.staging). Which tensors are attention and how they are laid out
comes from the architecture table, never from branches on model_type.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from kvtool import __version__
from kvtool import progress as kv_progress
from kvtool.model.architectures import Architecture
from kvtool.model.checkpoint import Checkpoint
from kvtool.convert.config_edit import dump_config, kv_field_is_boolean, rewrite_config
from kvtool.convert.methods import MergeMethod
from kvtool.convert.targets import ConversionResult
from kvtool.errors import InputError, UsageError, listed
from kvtool.io.writer import PlannedTensor
from kvtool.model.spec import ModelSpec, build_spec
from kvtool.convert.source import (CONFIG_DTYPE_NAMES, FLOAT_DTYPES, OUT_DTYPES, jsonable, refuse_unsupported,
                                   source_fingerprint, weights_file, with_source_provenance)

# Per-layer roles: (AttentionWeights field, table role, tensor suffix).
ROLES = (
    ("q", "q", "weight"), ("q_bias", "q", "bias"),
    ("k", "k", "weight"), ("k_bias", "k", "bias"),
    ("v", "v", "weight"), ("v_bias", "v", "bias"),
    ("o", "o", "weight"), ("o_bias", "o", "bias"),
    ("qkv", "qkv", "weight"), ("qkv_bias", "qkv", "bias"),
    ("q_norm", "q_norm", "weight"), ("k_norm", "k_norm", "weight"),
)


@dataclass
class ConvertPlan:
    src: Path
    ckpt: Checkpoint
    spec: ModelSpec
    arch: Architecture
    num_heads: int
    head_dim: int
    source_kv_heads: int
    target_kv_heads: int
    method: MergeMethod  # the merge method, built with its options (its name: method.name)
    out_dtype: str | None  # safetensors dtype, None = keep
    max_shard_size: int
    layers: dict[int, dict[str, str]]  # attention layer -> (AttentionWeights field -> tensor name)
    outputs: list[PlannedTensor] = field(default_factory=list)  # write plan, source order
    touched: list[tuple[str, tuple, tuple]] = field(default_factory=list)  # name, old shape, new shape
    warnings: list[str] = field(default_factory=list)
    kv_bytes_before: float = 0.0
    kv_bytes_after: float = 0.0
    new_config: dict = field(default_factory=dict)
    source_hash: str = ""

    @property
    def direction(self) -> str:
        if self.target_kv_heads == self.source_kv_heads:
            return "unchanged"
        return "pool" if self.target_kv_heads < self.source_kv_heads else "expand"

    @property
    def output_bytes(self) -> int:
        return sum(t.nbytes for t in self.outputs)

    @property
    def headline(self) -> str:
        """One line of what the conversion does (a recipe's plan line)."""
        return f"{self.source_kv_heads} -> {self.target_kv_heads} KV heads ({self.method.name})"

    # what every target's plan answers (kvtool.convert.targets.ConversionPlan)
    def estimate(self, eval_tokens: int | None = None):
        """Peak memory and time of the run (kvtool.model.costs): streaming alone when nothing is pooled, else the
        merge method's own estimate; None for a method with no cost model."""
        from kvtool.model import costs

        shape = costs.shape_of(self.spec, self.ckpt.tensors)
        est = costs.convert_mean(shape) if self.direction != "pool" else self.method.estimate(self, shape)
        if est is not None and eval_tokens:  # source and output
            est = costs.combine(est, costs.evaluate(shape, eval_tokens, models=2))
        return est

    def render(self, dst, eval_tokens: int | None = None):
        from kvtool.convert.report import render_plan

        return render_plan(self, dst, eval_tokens)

    @property
    def needs_torch(self) -> str | None:
        return "--method " + self.method.name if self.method.array_api == "torch" else None

    def check_kwargs(self) -> dict:
        """The output check's arguments beyond source= (kvtool.rules.output_check.verify_output): none, the heads
        targets take no --engine, so the output is linted as the source is, for the default releases."""
        return {}

    def write(self, dst: str | Path, *, verify, force: bool = False, progress: bool | None = None,
              device: str = "cpu") -> ConversionResult:
        return write(self, dst, verify=verify, force=force, progress=progress, device=device)

    def render_result(self, result):
        from kvtool.convert.report import render_result

        return render_result(result)

    def provenance(self) -> dict:
        return provenance(self)

    def details(self) -> dict:
        return {"kv_heads": f"{self.source_kv_heads}->{self.target_kv_heads}", "method": self.method.name}


# --- planning ----------------------------------------------------------------------------------
def kind_name(heads: int, kv: int) -> str:
    return "MHA" if kv == heads else "MQA" if kv == 1 else "GQA"


def valid_groups(num_heads: int, kv_heads: int, *, flag_field: bool = False) -> list[int]:
    """KV-head counts reachable exactly by pooling contiguous groups or repeating heads."""
    if flag_field:
        return sorted({1, num_heads})
    return [g for g in range(1, num_heads + 1)
            if num_heads % g == 0 and (kv_heads % g == 0 or g % kv_heads == 0)]


def resolve_target(kv_heads: int, num_heads: int, source_kv_heads: int, *, flag_field: bool) -> int:
    """The target's KV-head count (kvtool.convert.heads: HeadsTarget.kv_heads), if pooling or repeating reaches it."""
    g = kv_heads
    ok = valid_groups(num_heads, source_kv_heads, flag_field=flag_field)
    if g not in ok:
        why = (f"G must divide the {num_heads} query heads and divide (pool) or be a multiple of (expand) "
               f"the current {source_kv_heads} KV heads")
        if flag_field:
            why = "this architecture's config can express only MQA or MHA"
        raise UsageError(f"cannot convert to {g} KV heads: {why}; valid choices: {', '.join(map(str, ok))}",
                         option="groups")
    return g


def _layer_names(arch: Architecture, layer: int, tensors: dict, where: str) -> dict[str, str]:
    names: dict[str, str] = {}
    for fld, role, suffix in ROLES:
        n = arch.tensor_name(role, layer, suffix)
        if n and n in tensors:
            names[fld] = n
    required = ("qkv", "o") if arch.fused_qkv else ("q", "k", "v", "o")
    for fld in required:
        if fld not in names:
            want = arch.tensor_name(fld, layer) or f"{arch.attn_prefix(layer)}.<{fld}>"
            raise InputError(f"missing: the {arch.model_type} table expects this tensor",
                             file=where, field=want)
    return names


def plan_checkpoint(ckpt: Checkpoint, *, target, method: MergeMethod, dtype: str,
                    max_shard_size: int, config: dict | None = None, tensors: dict | None = None) -> ConvertPlan:
    """The conversion of an opened checkpoint to `target`'s KV heads (a kvtool.convert.heads.HeadsTarget, which
    checked the options): the model's refusals.

    A recipe plans a step on the model as its earlier steps leave it: `config` (default: the checkpoint's)
    and `tensors` (name -> dtype / shape; default: the checkpoint's headers)."""
    out_dtype = OUT_DTYPES[dtype]  # a declared choice (kvtool/options/convert.py)
    config, tensors, spec = ckpt.planned(config, tensors)
    config_file = str(ckpt.config_path)
    arch = spec.arch
    refuse_unsupported(arch, spec, config, config_file)
    H, KV, hd, L = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.num_layers
    for name, val in (("num_heads", H), ("num_kv_heads", KV), ("head_dim", hd), ("num_layers", L)):
        if not val or val <= 0:
            raise InputError(f"cannot read {name} from the config", file=config_file, field=spec.key(name))
    flag = kv_field_is_boolean(arch, spec.config)
    target_kv_heads = resolve_target(target.kv_heads(H), H, KV, flag_field=flag)
    from kvtool.model.layer_types import KV_CACHE_TYPES

    # Layers without attention (Mamba, linear attention) have no KV heads: streamed through as they are.
    kinds = spec.layer_types if len(spec.layer_types) == L else ["full_attention"] * L
    where = weights_file(ckpt)
    layers = {i: _layer_names(arch, i, tensors, where) for i in range(L) if kinds[i] in KV_CACHE_TYPES}
    for names in layers.values():
        for fld, n in names.items():
            if fld not in ("q_norm", "k_norm") and tensors[n].dtype not in FLOAT_DTYPES:
                raise InputError(f"tensor {n!r} is {tensors[n].dtype}: quantized weights cannot be pooled",
                                 file=getattr(tensors[n], "file", where))
    p = ConvertPlan(src=ckpt.root or ckpt.config_path.parent, ckpt=ckpt, spec=spec, arch=arch, num_heads=H,
                    head_dim=hd, source_kv_heads=KV, target_kv_heads=target_kv_heads, method=method,
                    out_dtype=out_dtype,
                    max_shard_size=max_shard_size, layers=layers)
    _plan_tensors(p, tensors)
    from kvtool.model import kvcache

    p.new_config = rewrite_config(config, arch, num_heads=H, target_kv_heads=target_kv_heads,
                                  dtype_name=CONFIG_DTYPE_NAMES.get(out_dtype) if out_dtype else None)
    # the figure lint and kv-budget print: the cache vLLM allocates for the written checkpoint
    _, elem, _ = kvcache.serving_kv_dtype(build_spec(p.new_config))
    p.kv_bytes_before = kvcache.bytes_per_token(spec, elem)
    p.kv_bytes_after = kvcache.bytes_per_token(spec, elem, kv_heads=target_kv_heads)
    if target_kv_heads < KV and arch.weights.get("k_norm") and arch.weights.get("k_norm_scope") == "all" and any(
            "k_norm" in n for n in layers.values()):
        p.warnings.append("k_norm spans all KV heads (one weight per channel): it is pooled like the K rows; "
                          "the RMS it divides by now covers fewer heads, so the result is approximate")
    if method.array_api == "torch" and ckpt.root is not None:
        from kvtool.model.preflight import refuse_auto_map

        refuse_auto_map(ckpt.root)  # the method runs the model with transformers: checkpoint code is refused
    p.source_hash = source_fingerprint(ckpt)
    return p


def _planned_shape(plan: ConvertPlan, fld: str, shape: tuple) -> tuple:
    """Output shape of one attention tensor: merge methods keep q / o and give K/V the target's heads."""
    H, target_kv_heads, hd = plan.num_heads, plan.target_kv_heads, plan.head_dim
    if fld in ("k", "v", "k_bias", "v_bias"):
        return (target_kv_heads * hd, *shape[1:])
    if fld in ("qkv", "qkv_bias"):
        return ((H + 2 * target_kv_heads) * hd, *shape[1:])
    if fld == "k_norm" and plan.arch.weights.get("k_norm_scope", "head") == "all":
        return (target_kv_heads * hd,) if len(shape) == 1 else (target_kv_heads, *shape[1:])
    return tuple(shape)


def _plan_tensors(plan: ConvertPlan, tensors: dict) -> None:
    """The write plan: every tensor in source order, with its output shape and dtype."""
    new_shapes = {n: _planned_shape(plan, f, tensors[n].shape) for names in plan.layers.values() for f, n in names.items()}
    for name, info in tensors.items():
        shape = new_shapes.get(name, info.shape)
        dt = info.dtype
        if plan.out_dtype and dt in FLOAT_DTYPES:
            dt = plan.out_dtype
        plan.outputs.append(PlannedTensor(name, dt, tuple(shape)))
        if tuple(shape) != tuple(info.shape):
            plan.touched.append((name, tuple(info.shape), tuple(shape)))


# --- one layer ---------------------------------------------------------------------------------
def _merge_layer(plan: ConvertPlan, layer: int, t: dict, merge, storage: str | None = None) -> dict:
    """Split (if fused), merge with `merge(layer, AttentionWeights)`, re-fuse; field -> tensor."""
    from kvtool.convert.fused import fuse_qkv, split_qkv
    from kvtool.convert.layout import AttentionWeights

    arch, H, KV, hd = plan.arch, plan.num_heads, plan.source_kv_heads, plan.head_dim
    target_kv_heads = plan.target_kv_heads
    layout = arch.weights.get("qkv_layout", "concat")
    parts = dict(t)
    if "qkv" in t:
        parts["q"], parts["k"], parts["v"] = split_qkv(layout, t["qkv"], H, KV, hd)
        if "qkv_bias" in t:
            parts["q_bias"], parts["k_bias"], parts["v_bias"] = split_qkv(layout, t["qkv_bias"], H, KV, hd)
    scope = arch.weights.get("k_norm_scope", "head")
    k_norm = parts.get("k_norm")
    norm_shape = None
    if k_norm is not None and scope == "all":
        norm_shape = tuple(k_norm.shape)
        k_norm = k_norm.reshape(-1)  # [KV, hd] (cohere) and [KV*hd] (olmo2) are the same channels
    w = AttentionWeights(
        layer=layer, q=parts["q"], k=parts["k"], v=parts["v"], o=parts["o"], num_heads=H, num_kv_heads=KV,
        head_dim=hd, target_kv_heads=target_kv_heads, q_bias=parts.get("q_bias"), k_bias=parts.get("k_bias"),
        v_bias=parts.get("v_bias"), o_bias=parts.get("o_bias"), q_norm=parts.get("q_norm"), k_norm=k_norm,
        norm_scope=scope, storage=storage,
    )
    w.check()
    new = merge(layer, w)
    _check_merged(w, new, plan)
    out: dict = {}
    if "qkv" in t:
        out["qkv"] = fuse_qkv(layout, new.q, new.k, new.v, H, target_kv_heads, hd)
        if "qkv_bias" in t:
            out["qkv_bias"] = fuse_qkv(layout, new.q_bias, new.k_bias, new.v_bias, H, target_kv_heads, hd)
    for f in ("q", "k", "v", "q_bias", "k_bias", "v_bias"):
        if f in t:
            out[f] = getattr(new, f)
    for f in ("o", "o_bias", "q_norm"):
        if f in t:
            out[f] = getattr(new, f)
    if "k_norm" in t:
        kn = new.k_norm
        if norm_shape is not None and len(norm_shape) > 1:
            kn = kn.reshape(target_kv_heads, *norm_shape[1:])
        out["k_norm"] = kn
    return out


def _check_merged(before, after, plan: ConvertPlan) -> None:
    target_kv_heads, hd = plan.target_kv_heads, plan.head_dim
    problems = []
    if after.num_kv_heads != target_kv_heads:
        problems.append(f"num_kv_heads is {after.num_kv_heads}, expected {target_kv_heads}")
    for f in ("q", "o", "q_bias", "o_bias", "q_norm"):
        a, b = getattr(before, f), getattr(after, f)
        if (a is None) != (b is None) or (a is not None and tuple(a.shape) != tuple(b.shape)):
            problems.append(f"{f} changed shape")
    for f in ("k", "v", "k_bias", "v_bias"):
        a, b = getattr(before, f), getattr(after, f)
        if (a is None) != (b is None) or (b is not None and b.shape[0] != target_kv_heads * hd):
            problems.append(f"{f} does not have {target_kv_heads}*{hd} rows")
    if problems:
        raise RuntimeError(f"merge method {plan.method.name!r} returned bad tensors for layer {before.layer}: "
                           + listed(problems, sep="; "))


# --- running -----------------------------------------------------------------------------------
def provenance(plan: ConvertPlan) -> dict:
    prov = {
        "kvtool_version": __version__,
        "command": "convert",
        "source": str(plan.src),
        "source_hash": plan.source_hash,
        "model_type": plan.arch.model_type,
        "method": plan.method.name,
        "from_kv_heads": plan.source_kv_heads,
        "to_kv_heads": plan.target_kv_heads,
        "num_heads": plan.num_heads,
        "dtype": CONFIG_DTYPE_NAMES.get(plan.out_dtype, "keep") if plan.out_dtype else "keep",
        "exact": plan.direction != "pool",
    }
    method = plan.method
    if method.options:
        prov["method_options"] = {k: v for k, v in method.options.items() if jsonable(v)}
    extra = method.provenance()
    if extra:
        prov["method_details"] = extra
    return with_source_provenance(prov, plan.src)


def _torch_dtype(st: str):
    import torch

    return {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}[st]


def write(plan: ConvertPlan, dst: str | Path, *, verify, force: bool = False, progress: bool | None = None,
          device: str = "cpu") -> ConversionResult:
    """Write the converted checkpoint to `dst` (staged; the source is only read)."""
    from kvtool.convert.methods import MergeJob
    from kvtool.io.reader import CheckpointReader
    from kvtool.io.outputfile import identities, write_new
    from kvtool.io.staging import check_destination, copy_side_files, staged_output
    from kvtool.io.writer import ShardWriter

    dst = Path(dst)
    check_destination(dst, force=force, protect=[plan.src])
    method_obj = plan.method
    torch_api = method_obj.array_api == "torch"
    out_dtype = _torch_dtype(plan.out_dtype) if plan.out_dtype and torch_api else None
    prov = None
    with CheckpointReader(plan.src, expect=identities(plan.ckpt.headers)) as reader:  # the shards the plan checked
        job = MergeJob(src=plan.src, spec=plan.spec, arch=plan.arch, target_kv_heads=plan.target_kv_heads,
                       device=device, dtype=out_dtype, options=dict(method_obj.options), reader=reader)
        method_obj.prepare(job)
        prov = provenance(plan)
        meta = {"kvtool_version": __version__, "kvtool_source_hash": plan.source_hash, "kvtool_method": method_obj.name,
                "kvtool_kv_heads": f"{plan.source_kv_heads}->{plan.target_kv_heads}"}
        layer_of = {n: i for i, names in plan.layers.items() for n in names.values()}
        io = _NumpyIO(reader, plan) if not torch_api else _TorchIO(reader, plan)
        with staged_output(dst, force=force, protect=[plan.src], verify=verify) as tmp:
            bar = kv_progress.task("convert", total=reader.total_bytes, scale="bytes", enabled=progress)
            try:
                kept = {t.name: reader.byte_range(t.name)[1] for t in plan.outputs
                        if (t.dtype, t.shape) == (reader.info(t.name).dtype, tuple(reader.info(t.name).shape))}
                with ShardWriter(tmp, plan.max_shard_size, meta, plan=plan.outputs, background_copies=True,
                                 copy_offsets=kept, sources=reader.identities) as writer:
                    done: set[str] = set()

                    def wrote(n: str) -> None:
                        done.add(n)
                        bar.update(reader.info(n).nbytes, note=f"{len(done)}/{len(plan.outputs)} tensors")

                    for name in reader.names():
                        if name in done:
                            continue
                        if name in layer_of:
                            i = layer_of[name]
                            names = plan.layers[i]
                            read = _fields_read(method_obj, names)
                            storage = io.storage(method_obj, [names[f] for f in read])
                            raw = {f: io.read(n, storage) if f in read else io.placeholder(n, storage)
                                   for f, n in names.items()}
                            out = _merge_layer(plan, i, raw, method_obj.merge_layer, storage)
                            for f, n in names.items():
                                if out[f] is raw[f]:  # untouched by the method: never loaded, or not again
                                    if io.out_dtype(n) == reader.info(n).dtype:
                                        writer.copy_from(n, *reader.byte_range(n))
                                    else:
                                        io.cast_through(writer, n)
                                elif f not in read:
                                    raise RuntimeError(f"merge method {method_obj.name!r} changed {f}, which it "
                                                       f"declares it does not read")
                                else:
                                    io.write(writer, n, out[f], storage)
                                wrote(n)
                            continue
                        if io.out_dtype(name) == reader.info(name).dtype:  # unchanged: file to file, never loaded
                            writer.copy_from(name, *reader.byte_range(name))
                        else:
                            io.cast_through(writer, name)
                        wrote(name)
                    result = writer.finalize()
            finally:
                bar.close()
            write_new(tmp / "config.json", dump_config(plan.new_config))
            side = copy_side_files(plan.src, tmp)
            prov["files"] = result.files
            from kvtool.engines.compat import read_as_written

            prov["engines_read_as_written"] = read_as_written(plan.new_config)  # `kvtool lint --compat DST`: why
            write_new(tmp / "kvtool.json", json.dumps(prov, indent=2) + "\n")
    return ConversionResult(plan=plan, dst=dst, files=result.files, side_files=side, provenance=prov)


_FUSED_PARTS = {"qkv": ("q", "k", "v"), "qkv_bias": ("q_bias", "k_bias", "v_bias")}


def _fields_read(method_obj, names: dict) -> set[str]:
    """The layer's fields to load: those the method reads, and fused tensors holding one of them."""
    reads = getattr(method_obj, "reads", None)
    if reads is None:
        return set(names)
    return {f for f in names if f in reads or any(p in reads for p in _FUSED_PARTS.get(f, ()))}


class _TensorIO:
    """How the streaming run reads, writes and casts one tensor; `dtypes` are the planned output dtypes."""

    def __init__(self, reader, plan: ConvertPlan):
        self.reader, self.dtypes = reader, {t.name: t.dtype for t in plan.outputs}

    def out_dtype(self, name: str) -> str:
        return self.dtypes[name]

    def storage(self, method_obj, names: list[str]) -> str | None:
        """The storage dtype the method gets these tensors in (None: float / torch tensors)."""
        return None

    def placeholder(self, name: str, storage: str | None):
        return self.read(name, storage)


class _NumpyIO(_TensorIO):
    """Attention tensors as float numpy arrays, or storage arrays (kvtool.io.arrays) for methods that take them."""

    def storage(self, method_obj, names: list[str]) -> str | None:
        # Storage arrays only where the dtype stays: the float path rounds a cast once, from float32.
        dts = {self.reader.info(n).dtype for n in names} | {self.dtypes[n] for n in names}
        if len(dts) == 1 and next(iter(dts)) in getattr(method_obj, "storage_dtypes", ()):
            return next(iter(dts))
        return None

    def read(self, name: str, storage: str | None = None):
        from kvtool.io.arrays import to_float

        a = self.reader.get_array(name)
        return a if storage else to_float(a, self.reader.info(name).dtype)

    def placeholder(self, name: str, storage: str | None):
        """A shape-only, read-only array (no memory, no read) for a field the method does not read."""
        import numpy as np

        from kvtool.io.arrays import storage_dtype

        info = self.reader.info(name)
        dt = storage_dtype(info.dtype) if storage else (np.float64 if info.dtype == "F64" else np.float32)
        return np.broadcast_to(np.zeros((), dt), tuple(info.shape))

    def write(self, writer, name: str, array, storage: str | None = None) -> None:
        from kvtool.io.arrays import from_float

        st = self.dtypes[name]
        writer.add_array(name, array if storage else from_float(array, st), st)

    def cast_through(self, writer, name: str) -> None:
        from kvtool.io.arrays import cast

        st_in, st_out = self.reader.info(name).dtype, self.dtypes[name]
        writer.add_array(name, cast(self.reader.get_array(name), st_in, st_out), st_out)


class _TorchIO(_TensorIO):
    """Attention tensors as CPU torch tensors in their stored dtype (methods that compute with torch)."""

    def read(self, name: str, storage: str | None = None):
        return self.reader.get(name)

    def write(self, writer, name: str, tensor, storage: str | None = None) -> None:
        from kvtool.io.reader import st_to_torch_dtype

        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")
        want = st_to_torch_dtype(self.dtypes[name])
        writer.add(name, t.to(want) if t.dtype != want else t)

    def cast_through(self, writer, name: str) -> None:
        self.write(writer, name, self.reader.get(name))
