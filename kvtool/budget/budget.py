"""The kv-budget figures: KV bytes per layer / token / sequence, weights, the KV pool and what fits.

Sizes follow vLLM's paged allocator: every layer reserves whole blocks; a sliding-window layer
reserves window-1 tokens plus the tokens in flight plus one block; a chunked-local layer the chunk plus
the tokens in flight (per release: kvtool/budget/paging.py); MLA one latent per token replicated on every tensor-parallel GPU; models that mix kinds
get the padding slots of vLLM's equal-size layer groups. The KV pool is
GPU memory x utilization - weights per GPU - --reserve (vLLM also subtracts the activation peak
and CUDA-graph memory it profiles at start-up; kvtool cannot know those, --reserve stands in).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvtool.model import kvcache
from kvtool.budget.estimate import estimate
from kvtool.budget.gpus import Gpu
from kvtool.budget.paging import Paging, mixed_kinds
from kvtool.budget import aux_caches, batch, recurrent
from kvtool.engines.releases import default, known
from kvtool.budget.variants import Variant
from kvtool.errors import InputError, UsageError
from kvtool.units import fmt_bytes



@dataclass(frozen=True)
class BudgetOptions:
    max_model_len: int | None = None
    batch: int = 1
    batch_given: bool = False
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    tensor_parallel_size: int = 1
    gpu: Gpu | None = None
    gpu_memory_utilization: float = 0.9
    reserve_bytes: int = 0
    max_num_batched_tokens: int | None = None
    entrypoint: str = "serve"  # whose batch defaults: `vllm serve` (serve) or the offline LLM class (llm)
    hybrid_kv_cache: bool = True  # False: vLLM's --disable-hybrid-kv-cache-manager (windows not exploited)
    what_if: tuple[Variant, ...] = ()
    # --engine vllm==X: the release whose max_model_len derivation sizes the default sequence, and its switches
    # (schemas/engines/facts.json "arithmetic" rows: kvtool.engines.releases.vllm_max_len_switches)
    vllm_release: str | None = None
    vllm_switches: frozenset = frozenset()
    # the vLLM release every default is read at (aux caches, batch defaults, MLA rows): vllm_release, else the
    # installed release, else the newest known (kvtool.engines.releases.default); compute() resolves it once
    release: str = ""
    # --platform: "gpu" or a kvtool/budget/platforms.json row (vLLM's CPU build: its pool, block size and step)
    platform: str = "gpu"
    cpu_kvcache_bytes: int | None = None  # --cpu-kvcache-space (VLLM_CPU_KVCACHE_SPACE) in bytes
    platform_notes: tuple[str, ...] = ()
    dtype: str = "auto"  # vLLM's --dtype (kvcache.SERVED_DTYPES): what `--kv-cache-dtype auto` caches in


@dataclass
class LayerRow:
    layer: kvcache.LayerKV
    per_gpu: kvcache.LayerKV
    bytes_per_token: float
    bytes_per_token_per_gpu: float
    tokens_allocated: int
    bytes_per_sequence: float
    bytes_per_sequence_per_gpu: float


@dataclass(frozen=True)
class Padding:
    """Layer slots vLLM's hybrid allocator adds so every KV-cache group has the same number of layers."""

    layer_type: str
    count: int
    bytes_per_sequence: float
    bytes_per_sequence_per_gpu: float


@dataclass
class Figures:
    """One model variant (the checkpoint as it is, or a --what-if)."""

    name: str
    kv_heads: int | None
    kv_dtype: str
    elem_bytes: float
    layers: list[LayerRow]
    tp_refusal: str | None
    kv_bytes_per_token: float = 0
    kv_bytes_per_token_per_gpu: float = 0
    kv_bytes_per_sequence: float = 0
    kv_bytes_per_sequence_per_gpu: float = 0
    kv_bytes_total: float = 0
    kv_bytes_total_per_gpu: float = 0
    max_concurrency: float | None = None  # vLLM's "Maximum concurrency for N tokens per request"
    max_concurrent_sequences: int | None = None
    kv_pool_tokens: int | None = None  # tokens the pool holds when every KV layer keeps every token
    padding: list[Padding] = field(default_factory=list)
    cache: kvcache.CacheFormat | None = None  # how vLLM stores the KV-cache dtype (scales, packing)
    block_size: int = 16  # the attention block size vLLM uses (raised for Mamba / linear-attention hybrids)
    state: "State | None" = None  # recurrent state of Mamba / linear-attention layers (kvtool.budget.recurrent)
    aux: list["AuxRow"] = field(default_factory=list)  # caches beside K/V (kvtool.budget.aux_caches)


@dataclass(frozen=True)
class AuxRow:
    """A cache vLLM keeps beside K/V in some layers (the DSA indexer's keys), in the same block pool."""

    cache: aux_caches.AuxCache
    bytes_per_token: int  # all its layers, one GPU (replicated: the same on every GPU)
    bytes_per_sequence: float  # all its layers (replicated caches counted once, like the MLA latent)
    bytes_per_sequence_per_gpu: float


@dataclass(frozen=True)
class State:
    """Mamba / linear-attention state: one page per sequence per state layer, padded to the attention page."""

    layout: recurrent.StateLayout  # one layer's page on one GPU, before padding
    layers: int
    page_bytes_per_gpu: int  # padded to the attention page (Platform._align_hybrid_block_size)
    tensor_parallel_size: int

    @property
    def bytes_per_sequence_per_gpu(self) -> int:
        return self.layers * self.page_bytes_per_gpu

    @property
    def bytes_per_sequence(self) -> int:
        return self.bytes_per_sequence_per_gpu * self.tensor_parallel_size


@dataclass
class Budget:
    model: str
    model_type: str | None
    position: str  # rope | alibi | learned | none (the architecture table's, or alibi from the config)
    options: BudgetOptions
    max_model_len: int
    max_model_len_source: str
    batched_tokens: int
    batch_defaults: batch.BatchDefaults  # vLLM's default step and sequence cap on this GPU at this release
    weight_bytes: int | None
    weight_source: str | None  # "safetensors" | "estimate" | None
    weight_params: int | None
    kv_budget_per_gpu: int | None  # memory x utilization - reserve
    kv_pool_per_gpu: int | None  # what is left after the weights
    current: Figures
    variants: list[Figures]
    notes: list[str] = field(default_factory=list)
    mla_refusal: str | None = None  # the vLLM release serves no MLA row of this size (lint's KV404)
    platform_refusal: str | None = None  # --platform's vLLM does not serve this --kv-cache-dtype

    @property
    def weight_bytes_per_gpu(self) -> int | None:
        """Weights split evenly over the tensor-parallel GPUs (rounded up)."""
        if self.weight_bytes is None:
            return None
        return kvcache.cdiv(self.weight_bytes, self.options.tensor_parallel_size)

    @property
    def weights_fit(self) -> bool | None:
        if self.kv_pool_per_gpu is None:
            return None
        return self.kv_pool_per_gpu > 0

    @property
    def problems(self) -> list[str]:
        """Reasons the deployment as asked would fail (exit 1)."""
        out: list[str] = []
        if self.mla_refusal:
            out.append(f"vLLM refuses the model at its first forward pass: {self.mla_refusal}")
        if self.platform_refusal:
            out.append(self.platform_refusal)
        if self.current.tp_refusal:
            out.append(f"vLLM refuses --tensor-parallel-size {self.options.tensor_parallel_size}: {self.current.tp_refusal}")
        if self.weights_fit is False:
            out.append("does not fit: the weights alone exceed the GPU budget")
        elif self.current.max_concurrent_sequences == 0:
            out.append(f"does not fit: not one sequence of {self.max_model_len:,} tokens fits in the KV pool")
        elif (self.options.batch_given and self.current.max_concurrent_sequences is not None
              and self.current.max_concurrent_sequences < self.options.batch):
            out.append(f"does not fit: {self.options.batch} sequences of {self.max_model_len:,} tokens asked, "
                       f"at most {self.current.max_concurrent_sequences} fit")
        return out


def served_weight_bytes(ckpt, dtype: str = "auto") -> int:
    """Bytes the weights take on the GPU: as stored, except float32/64 tensors, which vLLM loads in 16 bits
    (in 32 with --dtype float32)."""
    wide = 4 if dtype == "float32" else 2
    total = 0
    for h in ckpt.headers:
        for t in h.tensors.values():
            total += t.numel * wide if t.dtype in ("F32", "F64") else t.nbytes
    return total


def kv_elem(spec, kv_cache_dtype: str, served: str = "auto") -> tuple[str, kvcache.CacheFormat, str | None]:
    """(dtype name, vLLM's layout for it, note) for --kv-cache-dtype; auto follows vLLM (served: its --dtype); a
    dtype vLLM would refuse for this model is one UsageError line (kvcache.cache_format)."""
    fmt, note = kvcache.cache_format(spec, kv_cache_dtype, served=served)
    return fmt.name, fmt, note


def figures(spec, name: str, kv_heads: int | None, kv_dtype: str, eb: "float | kvcache.CacheFormat",
            opts: BudgetOptions, seq_len: int, step: int) -> Figures:
    tp = opts.tensor_parallel_size
    refusal = kvcache.tp_refusal(spec.num_heads, kv_heads if kv_heads is not None else spec.num_kv_heads, tp,
                                 mla=spec.is_mla)
    rows: list[LayerRow] = []
    paging = Paging(opts.vllm_switches, opts.hybrid_kv_cache)
    kv_layers = kvcache.layers(spec, kv_heads=kv_heads)
    mixed = mixed_kinds(kv_layers)
    block, state = hybrid_state(spec, kv_layers, (kv_dtype, eb), tp, opts.block_size, opts.vllm_switches)
    for layer in kv_layers:
        per_gpu = layer.on_gpu(tp)
        tokens = paging.tokens(layer, seq_len, block, step, mixed=mixed)
        rows.append(LayerRow(layer, per_gpu, layer.bytes_per_token(eb), per_gpu.bytes_per_token(eb), tokens,
                             tokens * layer.bytes_per_token(eb), tokens * per_gpu.bytes_per_token(eb)))
    elements = sum(r.layer.elements_per_token for r in rows)
    per_token = sum(r.bytes_per_token for r in rows)
    aux = aux_rows(spec, rows, opts)
    fmt = eb if isinstance(eb, kvcache.CacheFormat) else None
    # per cached element, scales included; a model of state layers only caches none: the dtype's own width
    bits = fmt.dtype.element_bits if fmt is not None else None
    elem = eb if fmt is None else per_token / elements if elements else (bits or 0) / 8
    f = Figures(name, kv_heads, kv_dtype, elem, rows, refusal,
                padding=group_padding(rows, paging.keeps_windows(mixed), paging, state), cache=fmt,
                block_size=block, state=state, aux=aux)
    tokens_aux = sum(a.bytes_per_token for a in aux)
    f.kv_bytes_per_token = per_token + tokens_aux  # replicated, like the MLA latent: counted once
    f.kv_bytes_per_token_per_gpu = sum(r.bytes_per_token_per_gpu for r in rows) + tokens_aux
    own: float = state.bytes_per_sequence if state else 0
    own_gpu: float = state.bytes_per_sequence_per_gpu if state else 0
    own += sum(a.bytes_per_sequence for a in aux)
    own_gpu += sum(a.bytes_per_sequence_per_gpu for a in aux)
    f.kv_bytes_per_sequence = (sum(r.bytes_per_sequence for r in rows) + own
                               + sum(p.bytes_per_sequence for p in f.padding))
    f.kv_bytes_per_sequence_per_gpu = (sum(r.bytes_per_sequence_per_gpu for r in rows) + own_gpu
                                       + sum(p.bytes_per_sequence_per_gpu for p in f.padding))
    f.kv_bytes_total = f.kv_bytes_per_sequence * opts.batch
    f.kv_bytes_total_per_gpu = f.kv_bytes_per_sequence_per_gpu * opts.batch
    return f


def aux_rows(spec, rows: list[LayerRow], opts: BudgetOptions) -> list[AuxRow]:
    """The caches vLLM keeps beside K/V (aux_caches.json) for this model, each layer holding the tokens its
    attention holds (the same group and block size)."""
    out = []
    for c in aux_caches.caches(spec, sized_release(opts)):
        held = [rows[i].tokens_allocated for i in c.layers if i < len(rows)]
        per_gpu = sum(held) * c.bytes_per_token
        out.append(AuxRow(c, len(held) * c.bytes_per_token, per_gpu, per_gpu))  # counted once, like MLA
    return out


def hybrid_state(spec, kv_layers: list[kvcache.LayerKV], kv: tuple, tp: int, block_size: int,
                 switches: frozenset = frozenset()) -> tuple[int, State | None]:
    """(attention block size, recurrent state) for a model with Mamba / linear-attention layers that
    recurrent_state.json knows; (block_size, None) otherwise.

    vLLM sizes the attention page from the model's KV heads and head size per GPU (one attention layout per
    model) and raises the block size until that page holds a state page, then pads the state page to it."""
    kv_dtype, eb = kv  # (KV-cache dtype name, bytes per element or its CacheFormat)
    n = sum(1 for lay in kv_layers if lay.layer_type in recurrent.STATE_TYPES)
    bits = eb.dtype.element_bits if isinstance(eb, kvcache.CacheFormat) else eb * 8
    layout = recurrent.layout(spec, tp, switches, (kv_dtype, bits / 8) if bits else None) if n else None
    if layout is None:
        return block_size, None
    attn = next((lay.on_gpu(tp).bytes_per_token(eb) for lay in kv_layers if lay.kind != "none"), 0)
    block = recurrent.attention_block_size(layout.page_bytes, attn, block_size, switches)
    page = max(layout.page_bytes, int(block * attn)) if attn else layout.page_bytes
    return block, State(layout, n, page, tp)


def group_padding(rows: list[LayerRow], hybrid: bool, paging: Paging = Paging(),
                  state: State | None = None) -> list[Padding]:
    """Padding layers of vLLM's hybrid KV-cache groups (kv_cache_utils._get_kv_cache_groups_uniform_page_size).

    With more than one kind of KV layer, vLLM splits each kind into groups of equal size (Paging.group_size:
    the smallest kind's layer count, or, from 0.18, the largest's when it is under 1.5x the smallest). A kind
    whose count is not a
    multiple is padded, and a padding slot reserves memory like a real layer of that kind (Gemma-3-1B:
    4 global layers, so the 22 sliding layers fill 6 groups of 4 and 2 slots are padding).
    """
    kinds: dict[tuple, list[LayerRow]] = {}
    for r in rows:
        if r.layer.kind == "none":
            continue
        windowed = hybrid and r.layer.window is not None
        key = (r.layer.layer_type if windowed else "full_attention", r.layer.window if windowed else None,
               r.per_gpu.elements_per_token)
        kinds.setdefault(key, []).append(r)
    counts = [len(v) for v in kinds.values()] + ([state.layers] if state else [])
    if len(counts) <= 1:
        return []
    group = paging.group_size(counts)
    out = []
    for members in kinds.values():
        extra = kvcache.cdiv(len(members), group) * group - len(members)
        if extra:
            r = members[0]
            out.append(Padding(r.layer.layer_type, extra, extra * r.bytes_per_sequence,
                               extra * r.bytes_per_sequence_per_gpu))
    if state:  # the state layers are one more kind (MambaSpec), padded like the others
        extra = kvcache.cdiv(state.layers, group) * group - state.layers
        if extra:
            t = next(r.layer.layer_type for r in rows if r.layer.layer_type in recurrent.STATE_TYPES)
            out.append(Padding(t, extra, extra * state.bytes_per_sequence / state.layers,
                               extra * state.page_bytes_per_gpu))
    return out


def _fill_pool(f: Figures, pool: float | None) -> None:
    if pool is None:
        return
    if pool <= 0:
        f.max_concurrency, f.max_concurrent_sequences, f.kv_pool_tokens = 0.0, 0, 0
        return
    if f.kv_bytes_per_sequence_per_gpu > 0:
        f.max_concurrency = pool / f.kv_bytes_per_sequence_per_gpu
        f.max_concurrent_sequences = int(f.max_concurrency)
    if f.kv_bytes_per_token_per_gpu > 0:
        bs = max(1, f.block_size)
        f.kv_pool_tokens = int(pool // (f.kv_bytes_per_token_per_gpu * bs)) * bs


def _served(spec, switches: frozenset) -> int | None:
    """The max_model_len a vLLM release derives (kvtool.model.rope.types.served_context), None without RoPE."""
    from kvtool.model.rope.params import raw_dict, rope_dict
    from kvtool.model.rope.types import served_context

    if spec.position != "rope" or not spec.rope:
        return None
    key = "full_attention" if "full_attention" in spec.rope else "default"
    rp = spec.rope.get(key) or next(iter(spec.rope.values()))
    params = {k: v for k, v in {**raw_dict(spec, rp, key), **rope_dict(rp, spec)}.items() if k != "type"}
    return served_context(params, spec.max_position, spec.model_type,
                          yarn_from_original="yarn_from_original" in switches)


def _paging_notes(opts: BudgetOptions, switches: frozenset[str]) -> list[str]:
    """The --engine release's paging rules that differ from the newest's and change this model's figures
    (facts.json `arithmetic` rows, with their citations)."""
    from kvtool.engines.facts import facts

    return [f"vLLM {opts.vllm_release}: {f.says} ({f.citation})" for f in facts()
            if f.engine == "vllm" and f.arithmetic in switches and f.applies_to(opts.vllm_release)]


def _state_notes(f: Figures, opts: BudgetOptions, missing: list[str]) -> list[str]:
    """What kv-budget says about Mamba / linear-attention state: how it was sized, or that it was not
    (missing: the state row's config keys the config lacks)."""
    stateful = sum(1 for r in f.layers if r.layer.layer_type in recurrent.STATE_TYPES)
    if not stateful:
        return []
    st = f.state
    if st is None and missing:
        return [f"{stateful} Mamba / linear-attention layers keep a fixed-size state per sequence, but the config "
                f"lacks {', '.join(missing)} (transformers' defaults, which vLLM reads, are not in kvtool's tables), "
                "so that state is not counted and the attention block size is not raised"]
    if st is None:
        return [f"{stateful} Mamba / linear-attention layers keep a fixed-size state per sequence instead of a KV "
                "cache; kvtool has no state-shape row for this model type (kvtool/budget/recurrent_state.json), so "
                "that state is not counted and the attention block size is not raised"]
    lay = st.layout
    out = [f"{st.layers} {lay.kind} state layers: {lay.conv_elements:,} conv elements x {lay.conv_bytes:g} B + "
           f"{lay.ssm_elements:,} SSM elements x {lay.ssm_bytes:g} B ({lay.ssm_dtype}) = {lay.page_bytes:,} B per "
           f"layer per sequence{' per GPU' if st.tensor_parallel_size > 1 else ''}, one page each "
           f"(mamba_cache_mode none, no speculative decoding; {lay.citation})"]
    if f.block_size != opts.block_size:
        out.append(f"vLLM raises the attention block size from {opts.block_size} to {f.block_size} so an attention "
                   f"page holds a state page, and pads the state page to {st.page_bytes_per_gpu:,} B "
                   f"({recurrent.table()['block_size']['citation']})")
    if opts.vllm_release is not None:
        out.extend(_paging_notes(opts, opts.vllm_switches & frozenset(recurrent.SWITCHES)))
    return out


def _batch_notes(d: batch.BatchDefaults, opts: BudgetOptions, f: Figures, windowed: bool, step: int) -> list[str]:
    """Where the scheduler step sliding layers are sized with comes from, and vLLM's default sequence cap when the
    pool holds more sequences than it runs."""
    who = "`vllm serve`" if opts.entrypoint == "serve" else "the LLM class"
    gpu = f"{opts.gpu.name}, " if opts.gpu is not None else "no --gpu-memory, "
    out = []
    if windowed and opts.max_num_batched_tokens is None:
        unread = "" if d.read else f"; before {batch.OLDEST_READ}, not read: its rules stand in"
        out.append(f"max_num_batched_tokens {step:,}: vLLM {d.release}'s {who} default for {gpu}{d.tier} "
                   f"(EngineArgs.get_batch_defaults{unread}; kvtool/budget/batch_defaults.json)")
    if f.max_concurrent_sequences is not None and f.max_concurrent_sequences > d.max_num_seqs:
        out.append(f"vLLM {d.release} runs at most {d.max_num_seqs:,} sequences at once by default (max_num_seqs, "
                   f"{who} on this GPU; --max-num-seqs raises it), though the pool holds "
                   f"{f.max_concurrent_sequences:,}")
    return out


def _require_head_size(spec, where: str) -> None:
    """Refuse a config whose attention layers have no KV head count or head size kvtool can tell (a null
    head_dim with hidden_size not a multiple of the heads): their KV bytes would be 0, not a figure."""
    if not spec.num_kv_heads:
        raise InputError("the KV head count is unknown (neither it nor the query head count is a positive "
                         "integer), so the KV cache cannot be sized", file=where,
                         field=spec.key("num_kv_heads") or spec.prefixed("num_key_value_heads"))
    if not spec.head_dim:
        h, n = spec.hidden_size, spec.num_heads
        why = (f"hidden_size {h:,} does not split into {n} heads" if h and n
               else "hidden_size or the query head count is missing")
        raise InputError(f"the head size is unknown: head_dim is not set and {why}, so the KV cache cannot be "
                         "sized", file=where, field=spec.key("head_dim") or spec.prefixed("head_dim"))


def sized_release(opts: BudgetOptions) -> str:
    """The vLLM release kv-budget sizes for: --engine vllm==X, else the installed release, else the newest known
    (the same default lint and convert --to mla take); resolved once by compute() into opts.release."""
    return opts.release or opts.vllm_release or default("vllm").versions[0]


def _mla_refusal(spec, opts: BudgetOptions) -> str | None:
    """Why the vLLM release sized for (--engine, else the installed or newest) serves no MLA row of this model's
    size, as lint's KV404 says it (schemas/engines/mla_backends.json); None when it does or was not read."""
    from kvtool.model.kv_dtypes import attention_kind

    if attention_kind(spec) != "mla":
        return None
    rank, rope = spec.get("kv_lora_rank"), spec.get("qk_rope_head_dim")
    if not (isinstance(rank, int) and isinstance(rope, int)):
        return None
    from kvtool.engines import mla

    release = sized_release(opts)
    rows = mla.rows(release)
    if rows is None or rank + rope in rows.head_sizes:
        return None
    return (f"kv_lora_rank + qk_rope_head_dim = {rank} + {rope} = {rank + rope}: "
            f"{mla.sizes_text(release, rows.head_sizes)} (lint KV404; {rows.citation})")


def compute(ckpt, spec, opts: BudgetOptions) -> Budget:
    opts = replace(opts, release=sized_release(opts))  # one release for every default below
    notes: list[str] = []
    where = str(ckpt.config_path)  # the file the missing value should be in
    if not spec.layer_types:
        raise UsageError("cannot tell the number of layers (num_hidden_layers or its equivalent is missing)",
                         file=where, field=spec.key("num_layers") or spec.prefixed("num_hidden_layers"))
    seq_len, source = opts.max_model_len, "--max-model-len"
    if seq_len is None and opts.vllm_release is not None:
        seq_len = _served(spec, opts.vllm_switches)
        source = f"vLLM {opts.vllm_release}'s max_model_len from the config"
    if seq_len is None:
        seq_len, source = spec.max_position, f"config {spec.key('max_position') or 'max_position_embeddings'}"
        if not seq_len:
            raise UsageError("the config gives no maximum length; pass --max-model-len", file=where,
                             field=spec.prefixed("max_position_embeddings"))
    elif spec.max_position and seq_len > spec.max_position:
        notes.append(f"--max-model-len {seq_len:,} exceeds the config's {spec.max_position:,}: vLLM refuses it "
                     "unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (or RoPE scaling raises the limit)")
    if not spec.is_mla and any(lt in kvcache.KV_CACHE_TYPES for lt in spec.layer_types):
        _require_head_size(spec, where)
    missing = []
    if any(lt in recurrent.STATE_TYPES for lt in spec.layer_types):
        for key, what in recurrent.key_problems(spec):
            if what is not None:
                raise InputError(what, file=where, field=key)
            missing.append(key)
    from kvtool.budget.platforms import platform

    row = platform(opts.platform)
    defaults = batch.defaults(opts.gpu, opts.release, opts.entrypoint,
                              opts.tensor_parallel_size)
    step = opts.max_num_batched_tokens or batch.step(defaults, seq_len)
    if row is not None and opts.max_num_batched_tokens is None:
        step = row.batched_tokens(is_mla=spec.is_mla, max_model_len=seq_len, world_size=opts.tensor_parallel_size,
                                  llm=opts.entrypoint == "llm")
    if row is not None:
        notes.extend(opts.platform_notes)
        notes.append(f"--platform {row.name}: vLLM {row.release}'s CPU defaults (block size {row.block_size}, "
                     f"{row.mla_block_size} for MLA; {step:,} batched tokens as the {opts.entrypoint} entry point steps"
                     + ("; MLA: chunked prefill off, max(max_model_len, 2048)" if spec.is_mla else "")
                     + f"; the pool is {row.pool_env}"
                     + ("" if opts.cpu_kvcache_bytes else ", not given: vLLM then takes memory x "
                        "--gpu-memory-utilization less its own resident memory, which kvtool cannot know") + ")")
    kv_dtype, eb, dnote = kv_elem(spec, opts.kv_cache_dtype, opts.dtype)
    if dnote:
        notes.append(dnote)
    if eb.skip:
        notes.append(f"{kv_dtype}: vLLM keeps the first and last {eb.dtype.boundary_layers} attention layers in "
                     f"the model dtype (TurboQuantConfig.get_boundary_skip_layers: layers "
                     f"{', '.join(map(str, sorted(eb.skip)))}); the block-size alignment it then applies "
                     "(Platform._align_heterogeneous_kv_block_size) is not modelled")
    if eb.dtype.platform:
        notes.append(f"{kv_dtype}: {eb.dtype.platform}")
    table_release = kvcache.kv_dtypes.release()
    k = known()["vllm"]
    if opts.vllm_release is not None and opts.vllm_release not in k:
        notes.append(f"vLLM {opts.vllm_release} is not a release kvtool has read ({k[0]}..{k[-1]}): its paging and "
                     "max_model_len follow the ranges of schemas/engines/facts.json as they stand")
    if opts.vllm_release is not None and opts.vllm_release != table_release and opts.kv_cache_dtype != "auto":
        notes.append(f"--kv-cache-dtype {opts.kv_cache_dtype} is sized as vLLM {table_release} stores it "
                     f"(kvtool/model/kv_dtypes.json); vLLM {opts.vllm_release} was not read for it")

    mla_refusal = _mla_refusal(spec, opts)
    platform_refusal = (row.kv_dtype_refusal(opts.kv_cache_dtype, kv_elem(spec, "auto", opts.dtype)[0])
                        if row is not None else None)

    weight_bytes = weight_params = None
    weight_source = None
    if ckpt.has_weights:
        stored = ckpt.weight_bytes
        weight_bytes, weight_source = served_weight_bytes(ckpt, opts.dtype), "safetensors"
        if ckpt.problems:
            notes.append(f"{len(ckpt.problems)} problem(s) reading the safetensors files or index (first: "
                         f"{ckpt.problems[0].message}); the weight total may be short, run `kvtool lint`")
        if weight_bytes < stored:
            notes.append(f"float32 tensors counted at 2 bytes: vLLM (--dtype auto) serves a float32 checkpoint "
                         f"in 16 bits ({fmt_bytes(stored)} on disk, {fmt_bytes(weight_bytes)} on the GPU)")
    else:
        est = estimate(spec)
        if est is not None:
            weight_bytes, weight_params, weight_source = est.bytes, est.params, "estimate"
            notes.extend(est.notes)

    budget = pool = None
    if row is not None and opts.cpu_kvcache_bytes is not None:
        budget = pool = opts.cpu_kvcache_bytes  # VLLM_CPU_KVCACHE_SPACE: the pool itself, weights apart
    elif opts.gpu is not None:
        budget = int(opts.gpu.memory_bytes * opts.gpu_memory_utilization) - opts.reserve_bytes
        if weight_bytes is None:
            raise UsageError("cannot size the weights: no safetensors and the config lacks hidden_size, "
                             "num_hidden_layers or vocab_size", option="gpu_memory")
        pool = budget - kvcache.cdiv(weight_bytes, opts.tensor_parallel_size)  # = Budget.weight_bytes_per_gpu

    current = figures(spec, "current", None, kv_dtype, eb, opts, seq_len, step)
    _fill_pool(current, pool)
    variants: list[Figures] = []
    for v in opts.what_if:
        v_dtype, v_fmt = (kv_elem(spec, v.kv_dtype, opts.dtype)[:2] if v.kv_dtype else (kv_dtype, eb))
        f = figures(spec, v.name, v.kv_heads, v_dtype, v_fmt, opts, seq_len, step)
        _fill_pool(f, pool)
        variants.append(f)

    if spec.arch.generic:
        notes.append(f"kvtool has no architecture table for model_type {spec.model_type!r}: read with generic "
                     "field names, so per-layer differences the config encodes its own way are not seen")
    windowed = {r.layer.layer_type for r in current.layers if r.layer.window is not None}
    notes.extend(_batch_notes(defaults, opts, current, bool(windowed), step))
    mixed = mixed_kinds([r.layer for r in current.layers])
    if windowed and opts.vllm_release is not None:
        notes.extend(_paging_notes(opts, Paging(opts.vllm_switches, opts.hybrid_kv_cache).shaping(mixed)))
    if windowed and mixed and not opts.hybrid_kv_cache:
        notes.append("--disable-hybrid-kv-cache-manager: sliding-window / chunked layers are sized like full ones")
    elif "chunked_attention" in windowed:
        notes.append("some vLLM versions turn the hybrid KV-cache manager off for chunked local attention unless "
                     "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1; --disable-hybrid-kv-cache-manager "
                     "sizes that case")
    for pad in current.padding:
        notes.append(f"vLLM groups KV layers by kind in groups of equal size: {pad.count} padding "
                     f"{pad.layer_type} slot{'s' if pad.count != 1 else ''} reserve memory like real layers")
    notes.extend(_state_notes(current, opts, missing))
    for a in current.aux:
        c = a.cache
        notes.append(f"{c.what}: {c.bytes_per_token} B per token in {len(c.layers)} of {len(spec.layer_types)} "
                     f"layers{', on every GPU' if c.replicated and opts.tensor_parallel_size > 1 else ''}, "
                     f"counted in the KV figures ({c.citation})")
    if current.tp_refusal:
        notes.append("per-GPU figures for a refused tensor-parallel size assume the heads are split as evenly as possible")
    return Budget(
        model=ckpt.source, model_type=spec.model_type, position=spec.position, options=opts, max_model_len=seq_len,
        max_model_len_source=source, batched_tokens=step, batch_defaults=defaults, weight_bytes=weight_bytes, weight_source=weight_source,
        weight_params=weight_params, kv_budget_per_gpu=budget, kv_pool_per_gpu=pool, current=current,
        variants=variants, notes=notes, mla_refusal=mla_refusal, platform_refusal=platform_refusal,
    )
