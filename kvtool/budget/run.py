"""`kvtool kv-budget` as a library: `plan` checks the options and opens the checkpoint (config + headers, no
torch), `apply` computes the budget. The command only parses, calls and prints."""

from __future__ import annotations

from dataclasses import dataclass

from kvtool.errors import UsageError
from kvtool.options.kv_budget import KvBudgetOptions


@dataclass(frozen=True)
class BudgetPlan:
    ckpt: object  # kvtool.model.checkpoint.Checkpoint
    spec: object  # kvtool.model.spec.ModelSpec
    options: object  # kvtool.budget.budget.BudgetOptions


def plan(o: KvBudgetOptions) -> BudgetPlan:
    """Every refusal (exit 2) before anything is computed: the options, then the checkpoint."""
    from pathlib import Path

    from kvtool.budget import variants
    from kvtool.budget.budget import BudgetOptions
    from kvtool.budget.gpus import resolve
    from kvtool.model.checkpoint import open_checkpoint
    from kvtool.model.numbers import require_valid_numbers
    from kvtool.model.spec import build_spec
    from kvtool.units import parse_size

    o.check()  # the declared choices and bounds (kvtool/options/kv_budget.py), again after a caller's edits
    reserve_bytes = 0
    if o.reserve is not None:
        try:
            reserve_bytes = parse_size(o.reserve)
        except ValueError as exc:
            raise UsageError(str(exc), option="reserve") from None
    gpu = resolve(o.gpu_memory) if o.gpu_memory is not None else None
    from kvtool.budget.platforms import GIB, platform

    row = platform(o.platform)
    if row is not None and o.gpu_memory is not None:
        raise UsageError(f"--platform {o.platform} has no GPU memory: its KV pool is --cpu-kvcache-space "
                         f"({row.pool_env})", option="gpu_memory")
    if row is None and o.cpu_kvcache_space is not None:
        raise UsageError("--cpu-kvcache-space sizes vLLM's CPU pool: it needs --platform cpu",
                         option="cpu_kvcache_space")
    if (o.reserve is not None or o.gpu_memory_utilization != 0.9) and gpu is None:
        raise UsageError("--reserve and --gpu-memory-utilization need --gpu-memory", option="gpu_memory")

    if Path(o.model).is_dir():  # header sizes come from the weights: refuse any a reader would refuse
        from kvtool.model.preflight import preflight

        ckpt = preflight(o.model, read_side_files=False, require_weights=False)
    else:
        ckpt = open_checkpoint(o.model, read_side_files=False)
    spec = build_spec(ckpt.config)
    require_valid_numbers(spec, str(ckpt.config_path))
    vllm, switches = (None, frozenset())
    if o.engine:
        from kvtool.engines.releases import vllm_max_len_switches

        vllm, switches = vllm_max_len_switches(o.engine)
    block_size, platform_notes = o.block_size or 16, []
    if row is not None:
        block_size = o.block_size or row.default_block_size(spec.is_mla)
        if spec.is_mla and block_size != row.mla_block_size:
            platform_notes.append(f"vLLM {row.release} on CPU serves MLA with block size {row.mla_block_size} "
                                  f"whatever --block-size says (on x86 with AMX tiles it keeps the block size)")
            block_size = row.mla_block_size
    opts = BudgetOptions(
        max_model_len=o.max_model_len, batch=o.batch or 1, batch_given=o.batch is not None,
        kv_cache_dtype=o.kv_cache_dtype, block_size=block_size, tensor_parallel_size=o.tensor_parallel_size,
        gpu=gpu, gpu_memory_utilization=o.gpu_memory_utilization, reserve_bytes=reserve_bytes,
        max_num_batched_tokens=o.max_num_batched_tokens, entrypoint=o.entrypoint, hybrid_kv_cache=not o.disable_hybrid_kv_cache_manager,
        what_if=tuple(variants.parse(o.what_if, num_heads=spec.num_heads, is_mla=spec.is_mla)),
        vllm_release=vllm.versions[0] if vllm else None, vllm_switches=switches,
        platform=o.platform, cpu_kvcache_bytes=(o.cpu_kvcache_space * GIB if o.cpu_kvcache_space else None),
        platform_notes=tuple(platform_notes), dtype=o.dtype,
    )
    return BudgetPlan(ckpt=ckpt, spec=spec, options=opts)


def apply(p: BudgetPlan):
    """The kvtool.budget.budget.Budget of a plan (its `problems`: what does not fit or vLLM would refuse)."""
    from kvtool.budget.budget import compute

    return compute(p.ckpt, p.spec, p.options)

