"""`kvtool convert --to mla`, planning: every refusal, the MLA dimensions, the write plan, the KV bytes, the
backends that serve it (config and headers only). The target (kvtool/convert/mla/target.py) calls `plan_mla`;
the plan's `write` is kvtool/convert/mla/write.py's `write_mla`.

The maths is imported when a conversion runs, never here: kvtool.convert.mla.stats.collect_stats(model, ids,
convert=...) runs the source model once over the calibration ids and, as the forward reaches each attention layer,
hands its statistics to `convert`, which solves it (kvtool.convert.mla.solve.solve_layer(weights, stats, shape,
rope) -> the MLA tensors by MlaShape.weight_shapes() name, rope rows in DeepSeek's interleaved order; rope:
kvtool.convert.mla.rope.SourceRope of the source config) and returns the converted attention
(solve.mla_output), so later layers calibrate on the converted stream (kvtool/convert/mla/write.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from kvtool.convert import defaults
from kvtool.convert.mla.shape import MlaShape
from kvtool.errors import InputError, UsageError
from kvtool.io.writer import PlannedTensor
from kvtool.model.engine_tables import newest_read

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
    engine: str | None = None  # the vLLM release the rows are written for; None: --engine transformers (any size)
    requirements: tuple[str, ...] = ()  # --engine as the user gave it (every engine): what the output is linted for
    warnings: list[str] = field(default_factory=list)
    source_hash: str = ""

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

    # what every target's plan answers (kvtool.convert.targets.ConversionPlan)
    def render(self, dst, eval_tokens: int | None = None):
        from kvtool.convert.mla.report import render_plan

        return render_plan(self, dst, eval_tokens)

    needs_torch = "--to mla"  # the calibrated solve runs the source model

    def check_kwargs(self) -> dict:
        """The output check's arguments beyond source= (kvtool.rules.output_check.verify_output): lint for the
        releases the user named (--engine, every one of them), else for the vLLM release written for; an MLA row no
        vLLM serves (KV404) is what the user asked for when no vLLM release is named (--engine transformers...)."""
        from kvtool.engines.releases import parse

        # a bare engine name ("transformers") says which engine, not which releases: lint would check every one
        # kvtool knows (those before deepseek_v3 too), so it is checked at its default release, as lint does
        named = tuple(r for r in self.requirements if str(parse(r, option="engine")[1]))
        vllm = any(parse(r, option="engine")[0] == "vllm" for r in named)
        engines = named + ((f"vllm=={self.engine}",) if self.engine and not vllm else ())
        return {"engines": engines, **({"accept": ("KV404",)} if self.engine is None else {})}

    def write(self, dst, *, verify, force: bool = False, progress: bool | None = None, device: str = "cpu"):
        from kvtool.convert.mla.write import write_mla

        return write_mla(self, dst, verify=verify, force=force, progress=progress, device=device)

    def render_result(self, result):
        from kvtool.convert.mla.report import render_result

        return render_result(result)

    def provenance(self, solve_info: dict | None = None) -> dict:
        """kvtool.json's record; solve_info: what the calibration measured (MlaPlan.write adds it)."""
        from kvtool import __version__
        from kvtool.convert.source import jsonable, with_source_provenance

        s = self.shape
        prov = {"kvtool_version": __version__, "command": "convert", "source": str(self.src),
                "source_hash": self.source_hash, "model_type": self.arch.model_type, "to": "mla",
                "from_kv_heads": self.source_kv_heads, "num_heads": self.num_heads,
                "mla": {"kv_lora_rank": s.kv_lora_rank, "qk_rope_head_dim": s.qk_rope_head_dim,
                        "qk_nope_head_dim": s.qk_nope_head_dim, "v_head_dim": s.v_head_dim,
                        "rope_source_pairs": list(self.rope_pairs), "rope_theta": self.rope_theta},
                "calibration": {k: v for k, v in self.settings.items() if v is not None and jsonable(v)},
                "dtype": self.new_config.get("dtype", self.new_config.get("torch_dtype", "keep")), "exact": False}
        if solve_info:
            prov["solve"] = solve_info
        return with_source_provenance(prov, self.src)

    def details(self) -> dict:
        """A recipe report's step details: the latent, not a KV-head count."""
        s = self.shape
        return {"kv_heads": f"{self.source_kv_heads}->mla", "method": f"{self.settings['mla_solve']} solve",
                "mla": {"kv_lora_rank": s.kv_lora_rank, "qk_rope_head_dim": s.qk_rope_head_dim}}


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


def mla_target(o) -> tuple[str | None, tuple[int, ...] | None]:
    """(the vLLM release the result is written for, the MLA rows it serves): --engine vllm==X, else the installed
    vLLM (kvtool.engines.releases.one_release_of: the release lint and kv-budget default to), which must be one
    whose MLA backends kvtool has read (kvtool.engines.mla), else the newest read; (None, None) for --engine
    transformers alone, whose DeepseekV3 attention takes any size. Every other requirement must name a release
    kvtool knows (the output check lints for it)."""
    from kvtool.engines import mla as engine_mla
    from kvtool.engines.releases import one_release_of, parse, select

    read = engine_mla.read_releases()
    reqs = [o.engine] if isinstance(o.engine, str) else list(o.engine or ())  # a lone string from the API
    named = [(req, *parse(req, option="engine")) for req in reqs]
    for req, name, spec in named:
        if name != "vllm":  # a release kvtool knows, as lint checks it (the output check lints for it)
            select(name, spec, req, option="engine")
    vllm = [req for req, name, _ in named if name == "vllm"]
    if named and not vllm:  # transformers alone: any size its DeepseekV3 attention takes
        return None, None
    release = one_release_of(vllm, "vllm", option="engine")
    version = release.versions[0]
    if release.source == "newest known" and version not in read:
        version = read[-1]  # no vLLM installed or named: the newest release whose MLA rows kvtool has read
    rows = engine_mla.rows(version)
    if rows is None:
        which = repr(release.requirement) if release.requirement else f"vLLM {version} ({release.source}, the default)"
        raise UsageError(f"{which}: kvtool has not read which MLA rows vLLM {version} serves (it has read "
                         f"{read[0]}..{read[-1]}: schemas/engines/mla_backends.json); pin one of those, or "
                         "--engine transformers", option="engine")
    return version, rows.head_sizes


def _kv_bytes(values: int, elem: float, layers: int) -> str:
    b = values * elem * layers
    return f"{b / 1024:g}KiB" if (b * 100) % 1024 == 0 else f"{int(b)}B"  # 18.75KiB, else exact bytes


def resolve_shape(o, spec, source_bytes: float, elem: float, attn_layers: int, default_rope: int,
                  target: tuple[str | None, tuple[int, ...] | None] = (None, None)) -> MlaShape:
    """The MLA dimensions from --kv-rank / --rope-dim, --kv-budget or --preset (one of them), checked;
    default_rope: --rope-dim when not given (`default_rope_dim`); target: (release, the MLA rows it serves) from
    `mla_target`, None for any size. --kv-budget takes the largest servable row within the budget; any other
    size is refused, naming the ones the release serves."""
    from kvtool.engines.mla import or_list, sizes_text

    H, KV, hd, hidden = int(spec.num_heads), int(spec.num_kv_heads), int(spec.head_dim), int(spec.hidden_size)
    version, sizes = target
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
    option = "preset" if o.preset else ("kv_budget" if o.kv_budget else "kv_rank")
    source_dims = 2 * KV * hd
    saving = tuple(s for s in sizes if s < source_dims and s - rope >= 1) if sizes is not None else None
    served = sizes_text(version, sizes) if sizes is not None else ""
    if saving == ():
        raise UsageError(f"{served}; none caches less than the source's {source_dims} (2 x {KV} KV heads x head_dim "
                         f"{hd}) with {rope} rope dimensions, so MLA saves nothing there (--engine transformers "
                         "writes rows vLLM does not serve)", option=option)
    if o.kv_budget is not None:
        dims = int(_budget_bytes(o.kv_budget, source_bytes) // (elem * attn_layers))
        if saving is not None:
            fits = [s for s in saving if s <= dims]
            if not fits:
                raise UsageError(f"{o.kv_budget!r} gives {dims} cached values per layer ({attn_layers} layers, "
                                 f"{elem:g} bytes each); {served}: the smallest that saves, {saving[0]}, needs "
                                 f"--kv-budget {_kv_bytes(saving[0], elem, attn_layers)}", option="kv_budget")
            dims = fits[-1]  # the largest servable row within the budget
        rank = dims - rope
        if rank < 1:
            raise UsageError(f"{o.kv_budget!r} gives {dims} cached dimensions per layer ({attn_layers} layers, "
                             f"{elem:g} bytes each), not enough for {rope} rope dimensions and a latent",
                             option="kv_budget")
    elif o.kv_rank is not None:
        rank = o.kv_rank
    if rank + rope >= source_dims:
        what = f"{o.preset}: " if o.preset else ""
        raise UsageError(f"{what}{rank} latent + {rope} rope dimensions per layer cache no less than the source's "
                         f"{source_dims} (2 x {KV} KV heads x head_dim {hd}); MLA would save nothing", option=option)
    if rope % 2 or not 2 <= rope <= hd - 2:
        # qk_rope_head_dim 0 or qk_nope_head_dim 0 is what lint's KV401 refuses (MLA needs positive dimensions)
        # named as the user gave it: the option (the line's field), a preset, or the value kvtool derived
        named = "" if o.rope_dim is not None else (f"{o.preset}'s rope dimensions " if o.preset else
                                                   "the rope dimensions derived from the model (no --rope-dim given) ")
        raise UsageError(f"{named}{rope} must be even, at least 2 and at most head_dim - 2 = {hd - 2} (the rope "
                         f"part keeps the fastest rope / 2 of the source's {hd // 2} pairs; qk_nope_head_dim, the rest "
                         "of each key head, comes from the latent and must be at least 1: lint's KV401)",
                         option="preset" if o.preset else "rope_dim" if o.rope_dim is not None else None)
    if sizes is not None and saving is not None and rank + rope not in sizes:
        ranks = " / ".join(str(s - rope) for s in saving)
        raise UsageError(f"{served}; {rank} + {rope} = {rank + rope} is not one of them: --kv-rank {ranks} with "
                         f"{rope} rope dimensions writes {or_list(saving)} (--engine transformers writes any size, "
                         "which vLLM refuses at the first forward pass)", option=option)
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
        raise UsageError(f"RoPE type {kind!r}: vLLM {newest_read('vllm')}'s DeepseekV2MLAAttention turns any non-default rope_type "
                         "into deepseek_yarn (vllm/model_executor/models/deepseek_v2.py); only default RoPE converts",
                         file=where, field=rp.path if rp is not None else "rope_theta")
    act = spec.get("hidden_act") or config.get("hidden_act", "silu")
    if act != "silu":
        raise UsageError(f"hidden_act {act!r}: vLLM's DeepseekV2MLP takes silu only", file=where, field="hidden_act")
    for names in layers.values():
        extra = sorted(set(names) - set(SOURCE_ATTENTION) - set(SOURCE_BIASES))
        if extra:
            raise InputError(f"o_proj bias or q/k norm: vLLM {newest_read('vllm')}'s DeepseekV2MLAAttention has neither (its o_proj "
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
    from kvtool.convert.source import (CONFIG_DTYPE_NAMES, FLOAT_DTYPES, OUT_DTYPES, refuse_unsupported,
                                   source_fingerprint, weights_file)
    from kvtool.convert.mla.config import mla_config, rope_theta
    from kvtool.engines import mla as engine_mla
    from kvtool.convert.mla.layout import output_names
    from kvtool.model import kvcache
    from kvtool.model.architectures import lookup
    from kvtool.model.spec import build_spec

    out_dtype = OUT_DTYPES[o.dtype]
    config, tensors, spec = ckpt.planned(config, tensors)
    where = str(ckpt.config_path)
    arch = spec.arch
    refuse_unsupported(arch, spec, config, where)
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
    weights_path = weights_file(ckpt)
    layers = _source_layers(arch, spec, tensors, weights_path)
    theta = _refuse_source(o, arch, spec, config, tensors, layers, where, weights_path)

    kv_dtype, elem, _ = kvcache.serving_kv_dtype(spec)  # --dtype keeps it: vLLM serves float32 in 16 bits
    before = kvcache.bytes_per_token(spec, elem)
    s = {k: getattr(o, k) for k in defaults.AWARE_FIELDS if k != "grouping"}
    s["refine_steps"], s["distill_steps"] = s["refine_steps"] or 0, s["distill_steps"] or 0
    s["calib_tokens"] = s["calib_tokens"] or defaults.calib_tokens(s["refine_steps"], s["distill_steps"])
    s["seq_len"] = s["seq_len"] or defaults.seq_len(s["refine_steps"], s["distill_steps"])
    s["mla_solve"] = o.mla_solve or defaults.MLA_SOLVE
    target = mla_target(o)
    shape = resolve_shape(o, spec, before, elem, len(layers),
                          default_rope_dim(s["mla_solve"], int(spec.head_dim), theta, served_horizon(s, spec)), target)
    theta_out = rope_theta(theta, shape.qk_rope_head_dim, int(spec.rotary_dim))
    out_arch = lookup("deepseek_v3")
    p = MlaPlan(src=ckpt.root or ckpt.config_path.parent, ckpt=ckpt, spec=spec, arch=arch, out_arch=out_arch,
                shape=shape, rope_theta=theta_out, out_dtype=out_dtype, max_shard_size=max_shard_size, settings=s,
                layers=layers, out_layers={i: output_names(out_arch, i) for i in layers}, kv_dtype=kv_dtype,
                engine=target[0], requirements=tuple([o.engine] if isinstance(o.engine, str) else o.engine or ()))
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
            raise InputError("missing: the embeddings (needed for lm_head)", file=weights_path, field=EMBED)
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
    if target[0] is None:
        newest = engine_mla.read_releases()[-1]
        rows = engine_mla.rows(newest)
        served = rows.head_sizes if rows is not None else ()
        if shape.cached_dims not in served:
            p.warnings.append(f"written for transformers (--engine transformers): "
                              f"{engine_mla.sizes_text(newest, served)}, so vLLM refuses this {shape.cached_dims} at "
                              "the first forward pass")
    if ckpt.root is not None:
        from kvtool.model.preflight import refuse_auto_map

        refuse_auto_map(ckpt.root)  # the calibration runs the model with transformers
    p.source_hash = source_fingerprint(ckpt)
    return p
