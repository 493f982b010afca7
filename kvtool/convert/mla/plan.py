"""`kvtool convert --to mla`: the plan (every refusal, the MLA dimensions, the write plan, the KV bytes, the
backends that serve it; config and headers only) and the streaming write. kvtool/convert/run.py's
`plan(options)` / `apply(plan, dst)` call `plan_mla` / `write_mla`.

The maths is imported when a conversion runs, never here: kvtool.convert.mla.stats.collect_stats(model, ids,
convert=...) runs the source model once over the calibration ids and, as the forward reaches each attention layer,
hands its statistics to `convert`, which solves it (kvtool.convert.mla.solve.solve_layer(weights, stats, shape,
rope) -> the MLA tensors by MlaShape.weight_shapes() name, rope rows in DeepSeek's interleaved order; rope:
kvtool.convert.mla.rope.SourceRope of the source config) and returns the converted attention
(solve.mla_output), so later layers calibrate on the converted stream. The solved layers wait on disk
(kvtool.convert.aware.spill) until the streaming write reaches them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from kvtool.convert import defaults
from kvtool.convert.mla.shape import MlaShape
from kvtool.errors import InputError, UsageError
from kvtool.io.writer import PlannedTensor

# Source model types whose decoder block outside attention is DeepSeek-V3's dense layer: RMSNorm weight * x
# (input_layernorm, post_attention_layernorm, model.norm), a SiLU-gated MLP (gate_proj / up_proj / down_proj),
# unscaled embeddings (transformers LlamaDecoderLayer / MistralDecoderLayer / Qwen2DecoderLayer against
# DeepseekV3DecoderLayer with DeepseekV3MLP). Others differ there (gemma: (1 + w) norms and scaled embeddings;
# olmo2: norms after the blocks; qwen3 / cohere: q/k norms; phi3: fused gate_up) and are refused.
SOURCES = ("llama", "mistral", "qwen2")
# Every tensor of a source outside attention must be one of these: the names DeepSeek-V3's dense layer reads
# (vLLM DeepseekV2Model.load_weights stacks gate_proj / up_proj into gate_up_proj; the rest load by name).
DENSE_NAMES = re.compile(r"model\.embed_tokens\.weight|model\.norm\.weight|lm_head\.weight"
                         r"|model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight"
                         r"|model\.layers\.\d+\.mlp\.(gate_proj|up_proj|down_proj)\.weight")
EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
SOURCE_ATTENTION = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")  # solve_layer's `weights`
SOURCE_BIASES = ("q_proj.bias", "k_proj.bias", "v_proj.bias")  # folded by the solve (none in DeepSeek's layout)


@dataclass
class MlaPlan:
    src: Path
    ckpt: object  # kvtool.model.checkpoint.Checkpoint
    spec: object  # the source ModelSpec
    arch: object  # the source's architecture table
    out_arch: object  # deepseek_v3's
    shape: MlaShape
    rope_theta: float  # the written config's (kvtool.convert.mla.config.rope_theta)
    out_dtype: str | None
    max_shard_size: int
    settings: dict  # calibration: calib_text, calib_dataset, calib_tokens, seq_len, refine_steps, distill_steps
    layers: dict[int, dict[str, str]]  # attention layer -> source key (q_proj.weight ...) -> tensor name
    out_layers: dict[int, dict[str, str]]  # attention layer -> solve key -> output tensor name
    outputs: list[PlannedTensor] = field(default_factory=list)
    touched: list[tuple[str, tuple, tuple]] = field(default_factory=list)
    copies: dict[str, str] = field(default_factory=dict)  # output name -> source name it is copied from
    new_config: dict = field(default_factory=dict)
    kv_bytes_before: float = 0.0
    kv_bytes_after: float = 0.0
    kv_dtype: str = ""
    warnings: list[str] = field(default_factory=list)
    source_hash: str = ""

    # what recipes and the report read of any convert plan
    target = "mla"
    method = None

    @property
    def num_heads(self) -> int:
        return self.shape.num_heads

    @property
    def source_kv_heads(self) -> int:
        return int(self.spec.num_kv_heads)

    @property
    def target_kv_heads(self) -> int:
        return 1  # vLLM's ModelConfig.get_num_kv_heads: 1 with MLA (one latent row per token)

    @property
    def rope_pairs(self) -> tuple[int, ...]:
        """The source RoPE pairs the shared rope key keeps turning: the fastest qk_rope_head_dim / 2
        (kvtool.convert.mla.rope.rope_pairs)."""
        return tuple(range(self.shape.qk_rope_head_dim // 2))

    @property
    def output_bytes(self) -> int:
        return sum(t.nbytes for t in self.outputs)

    @property
    def headline(self) -> str:
        """One line of what the conversion does (a recipe's plan line)."""
        s, st = self.shape, self.settings
        trained = ", ".join(f"{st[k]} {what}" for k, what in (("refine_steps", "refinement steps per layer"),
                                                              ("distill_steps", "distillation steps")) if st[k])
        return (f"{self.source_kv_heads} KV heads -> MLA latent {s.kv_lora_rank} + rope {s.qk_rope_head_dim} "
                f"({st['mla_solve']} solve, {trained or 'training-free'})")

    def estimate(self, eval_tokens: int | None = None):
        """Peak memory and time (kvtool.model.costs): the calibration replay and the write, as the aware merge's
        cost model with no grouping search (the solve's own terms are not measured yet)."""
        from kvtool.model import costs

        s = self.settings
        shape = costs.shape_of(self.spec, self.ckpt.tensors)
        est = costs.convert_aware(shape, s["calib_tokens"], s["seq_len"], s["refine_steps"], s["distill_steps"])
        if eval_tokens:
            est = costs.combine(est, costs.evaluate(shape, eval_tokens, models=2))
        return est


def refuse_options_for_other_targets(o) -> None:
    """--kv-rank / --rope-dim / --kv-budget / --preset / --mla-solve belong to --to mla."""
    for name in defaults.MLA_FIELDS:
        if o.to != "mla" and getattr(o, name) is not None:
            raise UsageError(f"only --to mla takes it (--to {o.to} converts KV heads)", option=name)


def _budget_bytes(text: str, source_bytes: float) -> float:
    """--kv-budget: bytes with a unit (7.5KiB, 7680B), or a fraction of the source's KV bytes (0.33, 33%)."""
    from kvtool.units import ValueRefused, parse_kv_budget

    try:
        kind, value = parse_kv_budget(text)
    except ValueRefused as exc:
        raise UsageError(str(exc), option="kv_budget") from None
    return value if kind == "bytes" else value * source_bytes


def default_rope_dim(solve: str, head_dim: int, theta: float, horizon: int) -> int:
    """--rope-dim when not given. joint: half the head. mqa-seed: the head less the pairs whose per-head keys the
    latent carries instead, those turning less than the strategy's residual_angle over the served context
    (kvtool.convert.mla.rope.static_pairs, in plain floats: the plan imports no torch; measured on SmolLM2 in
    docs/convert-mla.md)."""
    angle = defaults.MLA_SOLVES[solve].get("residual_angle")
    if not angle:
        return head_dim // 2
    static = sum(1 for p in range(head_dim // 2) if theta ** (-2 * p / head_dim) * horizon < angle)
    return head_dim - 2 * max(static, 1)  # qk_nope_head_dim >= 1 (resolve_shape)


def served_horizon(settings: dict, spec) -> int:
    """The served context the static pairs are judged over (--serve-context, as the aware merge)."""
    return int(settings["serve_context"] or spec.max_position or 8192)


def resolve_shape(o, spec, source_bytes: float, elem: float, attn_layers: int, default_rope: int) -> MlaShape:
    """The MLA dimensions from --kv-rank / --rope-dim, --kv-budget or --preset (one of them), checked;
    default_rope: --rope-dim when not given (`default_rope_dim`)."""
    H, KV, hd, hidden = int(spec.num_heads), int(spec.num_kv_heads), int(spec.head_dim), int(spec.hidden_size)
    given = [n for n in ("kv_rank", "kv_budget", "preset") if getattr(o, n) is not None]
    if not given:
        raise UsageError("--to mla needs the latent size: --kv-rank R, --kv-budget BYTES|FRACTION or --preset "
                         f"{' | '.join(defaults.MLA_PRESETS)}", option="kv_rank")
    if len(given) > 1:
        raise UsageError(f"give one of --kv-rank, --kv-budget, --preset (got {', '.join('--' + n.replace('_', '-') for n in given)})",
                         option=given[1])
    rope = o.rope_dim
    if o.preset is not None:
        if rope is not None:
            raise UsageError(f"--preset {o.preset} fixes the rope dimensions; drop --rope-dim", option="rope_dim")
        rank, rope = defaults.MLA_PRESETS[o.preset]
    else:
        rope = rope if rope is not None else default_rope
    if o.kv_budget is not None:
        dims = int(_budget_bytes(o.kv_budget, source_bytes) // (elem * attn_layers))
        rank = dims - rope
        if rank < 1:
            raise UsageError(f"{o.kv_budget!r} gives {dims} cached dimensions per layer ({attn_layers} layers, "
                             f"{elem:g} bytes each), not enough for {rope} rope dimensions and a latent",
                             option="kv_budget")
    elif o.kv_rank is not None:
        rank = o.kv_rank
    source_dims = 2 * KV * hd
    if rank + rope >= source_dims:
        what = f"{o.preset}: " if o.preset else ""
        raise UsageError(f"{what}{rank} latent + {rope} rope dimensions per layer cache no less than the source's "
                         f"{source_dims} (2 x {KV} KV heads x head_dim {hd}); MLA would save nothing",
                         option="preset" if o.preset else ("kv_budget" if o.kv_budget else "kv_rank"))
    if rope % 2 or not 2 <= rope <= hd - 2:
        # qk_rope_head_dim 0 or qk_nope_head_dim 0 is what lint's KV401 refuses (MLA needs positive dimensions)
        # named as the user gave it: the option (the line's field), a preset, or the value kvtool derived
        named = "" if o.rope_dim is not None else (f"{o.preset}'s rope dimensions " if o.preset else
                                                   "the rope dimensions derived from the model (no --rope-dim given) ")
        raise UsageError(f"{named}{rope} must be even, at least 2 and at most head_dim - 2 = {hd - 2} (the rope "
                         f"part keeps the fastest rope / 2 of the source's {hd // 2} pairs; qk_nope_head_dim, the rest "
                         "of each key head, comes from the latent and must be at least 1: lint's KV401)",
                         option="preset" if o.preset else "rope_dim" if o.rope_dim is not None else None)
    # q/k heads keep the source's width (nope + rope = head_dim: the softmax scale is unchanged), v heads theirs
    return MlaShape(hidden_size=hidden, num_heads=H, kv_lora_rank=rank, qk_rope_head_dim=rope,
                    qk_nope_head_dim=hd - rope, v_head_dim=hd)


def _refuse_source(o, arch, spec, config: dict, tensors: dict, layers: dict, where: str, weights_file: str) -> float:
    """The source refusals --to mla adds to convert's own; returns the source's RoPE theta."""
    from kvtool.model.rope.params import rope_for_layer

    mt = arch.model_type
    if mt not in SOURCES:
        raise UsageError(f"--to mla converts {' / '.join(SOURCES)} blocks (RMSNorm, SiLU MLP, plain q/k/v/o with "
                         f"RoPE: DeepSeek-V3's dense layer around the attention); {mt} differs", file=where,
                         field="model_type")
    if o.method not in ("mean", "aware") or o.grouping is not None or o.groups is not None:
        which = "groups" if o.groups is not None else "grouping" if o.grouping is not None else "method"
        raise UsageError("--to mla solves each layer from calibration (kvtool.convert.mla.solve); it takes no merge "
                         "method, grouping or KV-head count", option=which)
    if spec.number("num_experts"):
        raise UsageError("mixture-of-experts MLP: --to mla copies dense MLPs only", file=where,
                         field=spec.key("num_experts") or "num_experts")
    kinds = spec.layer_types or ["full_attention"] * int(spec.num_layers)
    if any(k != "full_attention" for k in kinds) or spec.sliding_window:
        field_name = spec.key("sliding_window") or "layer_types"
        raise UsageError("sliding-window or non-attention layers: vLLM's DeepSeek MLA layers attend to the whole "
                         "context", file=where, field=field_name)
    if spec.position != "rope" or spec.rotary_dim != spec.head_dim:
        raise UsageError("--to mla needs RoPE over the whole head (the shared rope key is cut from it)", file=where,
                         field=spec.key("rotary_dim") or "partial_rotary_factor")
    rp = rope_for_layer(spec, "full_attention")
    if rp is None or rp.rope_type != "default" or not rp.theta:
        kind = rp.rope_type if rp is not None else "none"
        raise UsageError(f"RoPE type {kind!r}: vLLM 0.33's DeepseekV2MLAAttention turns any non-default rope_type "
                         "into deepseek_yarn (vllm/model_executor/models/deepseek_v2.py); only default RoPE converts",
                         file=where, field=rp.path if rp is not None else "rope_theta")
    act = spec.get("hidden_act") or config.get("hidden_act", "silu")
    if act != "silu":
        raise UsageError(f"hidden_act {act!r}: vLLM's DeepseekV2MLP takes silu only", file=where, field="hidden_act")
    for names in layers.values():
        extra = sorted(set(names) - set(SOURCE_ATTENTION) - set(SOURCE_BIASES))
        if extra:
            raise InputError("o_proj bias or q/k norm: vLLM 0.33's DeepseekV2MLAAttention has neither (its o_proj "
                             "has no bias; q/k biases are folded into the weights)",
                             file=getattr(tensors[names[extra[0]]], "file", weights_file), field=names[extra[0]])
        for n in names.values():
            if tensors[n].dtype not in ("F16", "BF16", "F32", "F64"):
                raise InputError(f"tensor {n!r} is {tensors[n].dtype}: quantized weights cannot be converted",
                                 file=getattr(tensors[n], "file", weights_file))
    attn = {n for names in layers.values() for n in names.values()}
    for n in tensors:
        if n not in attn and not DENSE_NAMES.fullmatch(n):
            raise InputError("not a tensor of DeepSeek-V3's dense layer (embeddings, RMSNorms, gate/up/down MLP), "
                             "so the converted checkpoint would not load it", file=getattr(tensors[n], "file",
                                                                                             weights_file), field=n)
    return float(rp.theta)


def _source_layers(arch, spec, tensors: dict, where: str) -> dict[int, dict[str, str]]:
    """Attention layer -> q_proj.weight / ... / bias names present -> tensor name."""
    out = {}
    for i in range(int(spec.num_layers)):
        names = {}
        for role in ("q", "k", "v", "o"):
            for suffix in ("weight", "bias"):
                n = arch.tensor_name(role, i, suffix)
                if n and n in tensors:
                    names[f"{role}_proj.{suffix}"] = n
        for role in ("q_norm", "k_norm"):
            n = arch.tensor_name(role, i)
            if n and n in tensors:
                names[f"{role}.weight"] = n
        for key in SOURCE_ATTENTION:
            if key not in names:
                want = arch.tensor_name(key[0], i) or f"{arch.attn_prefix(i)}.{key}"
                raise InputError(f"missing: the {arch.model_type} table expects this tensor", file=where, field=want)
        out[i] = names
    return out


def plan_mla(o, ckpt, *, max_shard_size: int, config: dict | None = None, tensors: dict | None = None) -> MlaPlan:
    """The `--to mla` conversion of an opened checkpoint (kvtool.convert.run.plan checked the options)."""
    from kvtool.convert.driver import (CONFIG_DTYPE_NAMES, FLOAT_DTYPES, OUT_DTYPES, _refuse_unsupported,
                                       _weights_file, source_fingerprint)
    from kvtool.convert.mla import backends
    from kvtool.convert.mla.config import mla_config, rope_theta
    from kvtool.convert.mla.layout import output_names
    from kvtool.model import kvcache
    from kvtool.model.architectures import lookup
    from kvtool.model.spec import build_spec

    out_dtype = OUT_DTYPES[o.dtype]
    config, tensors, spec = ckpt.planned(config, tensors)
    where = str(ckpt.config_path)
    arch = spec.arch
    _refuse_unsupported(arch, spec, config, where)
    for name in ("num_heads", "num_kv_heads", "head_dim", "num_layers", "hidden_size"):
        val = getattr(spec, name)
        if not val or val <= 0:
            raise InputError(f"cannot read {name} from the config", file=where, field=spec.key(name))
    if spec.head_dim < 4:
        # qk_rope_head_dim and qk_nope_head_dim must both be positive (lint's KV401) and the rope part even (KV402):
        # a key head of fewer than two pairs cannot be split, whatever the options say
        raise UsageError(f"{spec.head_dim} is too small for --to mla: the rope part (qk_rope_head_dim, even) and the "
                         "latent's part of each key head (qk_nope_head_dim) need at least one pair each, so head_dim "
                         "must be at least 4 (lint's KV401)", file=where, field=spec.key("head_dim") or "head_dim")
    weights_file = _weights_file(ckpt)
    layers = _source_layers(arch, spec, tensors, weights_file)
    theta = _refuse_source(o, arch, spec, config, tensors, layers, where, weights_file)

    kv_dtype, elem, _ = kvcache.serving_kv_dtype(spec)  # --dtype keeps it: vLLM serves float32 in 16 bits
    before = kvcache.bytes_per_token(spec, elem)
    s = {k: getattr(o, k) for k in defaults.AWARE_FIELDS if k != "grouping"}
    s["refine_steps"], s["distill_steps"] = s["refine_steps"] or 0, s["distill_steps"] or 0
    s["calib_tokens"] = s["calib_tokens"] or defaults.calib_tokens(s["refine_steps"], s["distill_steps"])
    s["seq_len"] = s["seq_len"] or defaults.seq_len(s["refine_steps"], s["distill_steps"])
    s["mla_solve"] = o.mla_solve or defaults.MLA_SOLVE
    shape = resolve_shape(o, spec, before, elem, len(layers),
                          default_rope_dim(s["mla_solve"], int(spec.head_dim), theta, served_horizon(s, spec)))
    theta_out = rope_theta(theta, shape.qk_rope_head_dim, int(spec.rotary_dim))
    out_arch = lookup("deepseek_v3")
    p = MlaPlan(src=ckpt.root or ckpt.config_path.parent, ckpt=ckpt, spec=spec, arch=arch, out_arch=out_arch,
                shape=shape, rope_theta=theta_out, out_dtype=out_dtype, max_shard_size=max_shard_size, settings=s,
                layers=layers, out_layers={i: output_names(out_arch, i) for i in layers}, kv_dtype=kv_dtype)
    # the write plan, source order: each layer's MLA block where its q_proj was, lm_head after the rest when tied
    wanted = shape.weight_shapes()
    first = {names["q_proj.weight"]: i for i, names in layers.items()}
    attn = {n for names in layers.values() for n in names.values()}
    for name, info in tensors.items():
        dt = out_dtype if out_dtype and info.dtype in FLOAT_DTYPES else info.dtype
        if name in first:
            i = first[name]
            for key, out_name in p.out_layers[i].items():
                p.outputs.append(PlannedTensor(out_name, dt, tuple(wanted[key])))
            for key, src_name in layers[i].items():
                old = tuple(tensors[src_name].shape)
                new = tuple(wanted.get(key, ()))
                p.touched.append((src_name, old, new))
            p.touched += [(p.out_layers[i][k], (), tuple(wanted[k])) for k in wanted if k not in layers[i]]
        elif name not in attn:
            p.outputs.append(PlannedTensor(name, dt, tuple(info.shape)))
    if LM_HEAD not in tensors:
        if EMBED not in tensors:
            raise InputError("missing: the embeddings (needed for lm_head)", file=weights_file, field=EMBED)
        info = tensors[EMBED]
        dt = out_dtype if out_dtype and info.dtype in FLOAT_DTYPES else info.dtype
        p.outputs.append(PlannedTensor(LM_HEAD, dt, tuple(info.shape)))
        p.copies[LM_HEAD] = EMBED
        p.warnings.append("tied embeddings: lm_head.weight is written as a copy of the embeddings (vLLM's "
                          f"DeepseekV2ForCausalLM never ties them), {info.nbytes / 2**20:.1f} MiB more")
    p.new_config = mla_config(config, spec, shape, rope_theta=theta_out,
                              dtype_name=CONFIG_DTYPE_NAMES.get(out_dtype) if out_dtype else None)
    out_spec = build_spec(p.new_config)
    p.kv_bytes_before, p.kv_bytes_after = before, kvcache.bytes_per_token(out_spec, elem)
    if not any(why is None and b.name != "TRITON_MLA" for b, why in backends.serving(shape)):
        p.warnings.append(f"only vLLM's TRITON_MLA backend serves kv_lora_rank + qk_rope_head_dim = "
                          f"{shape.cached_dims}; FlashMLA / CUTLASS MLA take 512 + 64 (--preset flashmla)")
    if ckpt.root is not None:
        from kvtool.model.preflight import refuse_auto_map

        refuse_auto_map(ckpt.root)  # the calibration runs the model with transformers
    p.source_hash = source_fingerprint(ckpt)
    return p


# --- writing -----------------------------------------------------------------------------------
def provenance(p: MlaPlan, solve_info: dict) -> dict:
    from kvtool import __version__
    from kvtool.convert.driver import jsonable, source_provenance

    s = p.shape
    prov = {"kvtool_version": __version__, "command": "convert", "source": str(p.src), "source_hash": p.source_hash,
            "model_type": p.arch.model_type, "to": "mla", "from_kv_heads": p.source_kv_heads,
            "num_heads": p.num_heads,
            "mla": {"kv_lora_rank": s.kv_lora_rank, "qk_rope_head_dim": s.qk_rope_head_dim,
                    "qk_nope_head_dim": s.qk_nope_head_dim, "v_head_dim": s.v_head_dim,
                    "rope_source_pairs": list(p.rope_pairs), "rope_theta": p.rope_theta},
            "calibration": {k: v for k, v in p.settings.items() if v is not None and jsonable(v)},
            "dtype": p.new_config.get("dtype", p.new_config.get("torch_dtype", "keep")), "exact": False}
    if solve_info:
        prov["solve"] = solve_info
    previous = source_provenance(p.src)
    if previous is not None:
        prov["source_provenance"] = previous
    return prov


@dataclass
class MlaResult:
    plan: MlaPlan
    dst: Path
    files: list[str]
    side_files: list[str]
    provenance: dict


def write_mla(p: MlaPlan, dst: str | Path, *, verify, force: bool = False, progress: bool | None = None,
              device: str = "cpu") -> MlaResult:
    """Calibrate, then stream the source once: each attention layer solved into its MLA block, every other tensor
    copied file to file (cast when --dtype asks), written to a staged folder renamed to `dst` when complete."""
    from kvtool import __version__
    from kvtool import progress as kv_progress
    from kvtool.convert.config_edit import dump_config
    from kvtool.io.outputfile import identities, write_new
    from kvtool.io.reader import CheckpointReader, st_to_torch_dtype
    from kvtool.io.staging import check_destination, copy_side_files, staged_output
    from kvtool.io.writer import ShardWriter

    dst = Path(dst)
    check_destination(dst, force=force, protect=[p.src])
    with CheckpointReader(p.src, expect=identities(p.ckpt.headers)) as reader:
        solved = calibrate(p, reader, device)

        out_dtypes = {t.name: t.dtype for t in p.outputs}
        layer_of = {names["q_proj.weight"]: i for i, names in p.layers.items()}
        attn = {n for names in p.layers.values() for n in names.values()}
        meta = {"kvtool_version": __version__, "kvtool_source_hash": p.source_hash, "kvtool_method": "mla",
                "kvtool_kv_heads": f"{p.source_kv_heads}->mla{p.shape.kv_lora_rank}+{p.shape.qk_rope_head_dim}"}
        with staged_output(dst, force=force, protect=[p.src], verify=verify) as tmp:
            bar = kv_progress.task("convert", total=len(p.outputs), unit="tensors", enabled=progress)
            try:
                with ShardWriter(tmp, p.max_shard_size, meta, plan=p.outputs, background_copies=True,
                                 sources=reader.identities) as writer:
                    def copy(out_name: str, src_name: str) -> None:
                        if out_dtypes[out_name] == reader.info(src_name).dtype:
                            writer.copy_from(out_name, *reader.byte_range(src_name))
                        else:
                            t = reader.get(src_name).to(st_to_torch_dtype(out_dtypes[out_name]))
                            writer.add(out_name, t)
                        bar.update(1)

                    for name in reader.names():
                        if name in layer_of:
                            i = layer_of[name]
                            new = solved.take(i)
                            for key, out_name in p.out_layers[i].items():
                                writer.add(out_name, new[key].detach().to("cpu").contiguous().to(
                                    st_to_torch_dtype(out_dtypes[out_name])))
                                bar.update(1, note=f"layer {i}")
                        elif name not in attn:
                            copy(name, name)
                    for out_name, src_name in p.copies.items():
                        copy(out_name, src_name)
                    result = writer.finalize()
            finally:
                bar.close()
                solved.close()
            write_new(tmp / "config.json", dump_config(p.new_config))
            side = copy_side_files(p.src, tmp)
            prov = provenance(p, solved.info)
            prov["files"] = result.files
            write_new(tmp / "kvtool.json", json.dumps(prov, indent=2) + "\n")
    return MlaResult(plan=p, dst=dst, files=result.files, side_files=side, provenance=prov)


class SolvedLayers:
    """The solved MLA blocks waiting on disk for the writer (kvtool.convert.aware.spill: all layers' attention in
    float32 can exceed a decoder layer many times over); each is read back once. info: kvtool.json's record."""

    def __init__(self) -> None:
        from kvtool.convert.aware.spill import LayerFiles

        self._files = LayerFiles("kvtool-mla-", "the solved layer {layer}")
        self.layers: set[int] = set()
        self.info: dict = {}

    def put(self, layer: int, tensors: dict) -> None:
        self._files.save(layer, tensors)
        self.layers.add(layer)

    def peek(self, layer: int) -> dict:
        """The layer's tensors, left in place."""
        return self._files.load(layer)

    def take(self, layer: int) -> dict:
        out = self._files.load(layer)
        self._files.path(layer).unlink()
        self.layers.discard(layer)
        return out

    def close(self) -> None:
        self._files.close()


def calibrate(p: MlaPlan, reader, device: str = "cpu") -> SolvedLayers:
    """The calibration ids (kvtool.convert.aware.calibration_data: --calib-text / --calib-dataset, the aware
    merge's default mix), then one forward of the source model (kvtool.convert.mla.stats.collect_stats) that
    solves each attention layer as it reaches it (and refines it, --refine-steps) and goes on with the converted
    layer's output; then --distill-steps (kvtool.convert.mla.train)."""
    import torch

    from kvtool import progress as kv_progress
    from kvtool.convert.aware.calibration_data import CalibrationData
    from kvtool.convert.aware.method import DISTILL_LR, REFINE_TARGETS
    from kvtool.convert.mla import solve
    from kvtool.convert.mla.layout import check_solved
    from kvtool.convert.mla.rope import SourceRope
    from kvtool.convert.mla.stats import collect_stats
    from kvtool.datasets import MERGE_CALIBRATION, check_calibration_source
    from kvtool.io.staging import sigterm_as_interrupt
    from kvtool.runtime.layerwise import open_layerwise

    s = p.settings
    check_calibration_source(s["calib_text"], s["calib_dataset"])
    dataset = s["calib_dataset"] or (None if s["calib_text"] else MERGE_CALIBRATION)
    rope = SourceRope.of_config(p.spec.config)
    solved = SolvedLayers()
    refine_steps, distill_steps = s["refine_steps"], s["distill_steps"]
    if refine_steps or distill_steps:
        from kvtool.convert.mla import train
    # refinement fits the source attention on the converted stream: the aware merge's `layer` target and step
    refine_lr = REFINE_TARGETS["layer"]
    per_layer = 1 + refine_steps  # one unit per layer: its solve and each refinement step equal parts
    bar = kv_progress.task("calibrate", total=len(p.layers), unit="layers")
    refined: dict[int, dict] = {}
    distilled: dict = {}
    try:
        data = CalibrationData.build(p.src, s["calib_text"], dataset, s["calib_tokens"], s["seq_len"],
                                     device=torch.device(device), note=bar.set_note)

        options = solve.SolveOptions(horizon=served_horizon(s, p.spec), **defaults.MLA_SOLVES[s["mla_solve"]])

        def convert(layer: int, stats):
            weights = {k: reader.get(n).float() for k, n in p.layers[layer].items()}
            tensors = solve.solve_layer(weights, stats, p.shape, rope, options)
            bar.update(1 / per_layer, note=f"layer {layer} solved")
            if refine_steps:
                step = [0]

                def on_step():
                    step[0] += 1
                    bar.update(1 / per_layer, note=f"layer {layer}, refinement step {step[0]}/{refine_steps}")

                tensors, refined[layer] = train.refine_layer(
                    tensors, stats, p.shape, rope, steps=refine_steps, lr=refine_lr, norm=options.norm,
                    o_ridge=options.o_ridge, device=device, on_step=on_step)
            check_solved(tensors, p.shape, layer)
            solved.put(layer, tensors)
            return lambda x: solve.mla_output(x, tensors, p.shape, rope)

        with sigterm_as_interrupt(), open_layerwise(p.src, device=device, dtype=torch.float32, reader=reader,
                                                     layerwise=False) as lm:
            teacher = None
            if distill_steps:
                from kvtool.convert.aware.distill import teacher_targets

                bar.set_note("the source model's next-token distributions")
                teacher = teacher_targets(lm, train.source_hidden(lm, data.ids))
            bar.set_note(f"the source model over {data.ids.numel()} calibration tokens")
            collect_stats(lm.model, data.ids, convert=convert)
            if distill_steps:
                bar.close()
                from kvtool.convert.aware.distill import distill_with_progress

                # the layers kept in `solved` are replaced when the KL fell
                distilled = distill_with_progress(lm, data.ids, teacher, solved.peek, solved.put,
                                                  block=train.MlaBlock(p.shape, rope, options.norm),
                                                  steps=distill_steps, lr=DISTILL_LR)
    except BaseException:
        solved.close()
        raise
    finally:
        bar.close()
    missing = sorted(set(p.layers) - solved.layers)
    if missing:
        solved.close()
        raise InputError(f"layer {missing[0]}: not solved (the calibration forward did not reach its attention "
                         "module)", field="architectures")
    solved.info = {**data.provenance(), "horizon": options.horizon, "options": dict(vars(options)),
                   **getattr(solve, "provenance", lambda: {})()}
    if refine_steps:
        solved.info["refine"] = {"steps": refine_steps, "lr": refine_lr, "target": "layer",
                                 "loss_start": [round(refined[i]["loss_start"], 6) for i in sorted(refined)],
                                 "loss_end": [round(refined[i]["loss_end"], 6) for i in sorted(refined)]}
    if distilled:
        solved.info["distill"] = {"steps": distill_steps, "lr": DISTILL_LR, **distilled}
    return solved
