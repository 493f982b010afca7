"""`kvtool kv-budget`: what the KV cache costs and how much fits on a GPU (config + headers, no torch)."""

from __future__ import annotations

from typing import Optional

import typer

from kvtool.errors import EXIT_FINDINGS, EXIT_OK, UsageError
from kvtool.model.numbers import QUANTITY_BOUNDS, show


def register(app: typer.Typer) -> None:
    @app.command("kv-budget", help=(
        "KV-cache bytes per layer, token and sequence, and how many sequences fit on a GPU, as vLLM's paged "
        "allocator sizes them. Exit 1 when the model or the asked batch does not fit, or vLLM would refuse the "
        "tensor-parallel size; 2 on bad input."))
    def kv_budget(
        model: str = typer.Argument(..., help="Model folder, config.json or hub id."),
        max_model_len: Optional[int] = typer.Option(None, "--max-model-len", help="Tokens per sequence (default: the config's maximum)."),
        batch: Optional[int] = typer.Option(None, "--batch", "--concurrency", help="Concurrent sequences (default 1; when given with a GPU, exit 1 if they do not fit)."),
        kv_cache_dtype: str = typer.Option("auto", "--kv-cache-dtype", help="auto | fp16 | bf16 | fp32 | fp8 | fp8_e4m3 | fp8_e5m2 | int8 (auto = the model dtype)."),
        block_size: int = typer.Option(16, "--block-size", help="Paged-attention block size in tokens (vLLM's default 16)."),
        tensor_parallel_size: int = typer.Option(1, "--tensor-parallel-size", "-tp", help="GPUs the model is split over."),
        gpu_memory: Optional[str] = typer.Option(None, "--gpu-memory", "--gpu", help="Memory per GPU (80GiB, 24GB) or a GPU name (H100-80GB, H200, A100-40GB, L40S, RTX-4090, ...)."),
        gpu_memory_utilization: float = typer.Option(0.9, "--gpu-memory-utilization", help="Fraction of GPU memory vLLM may use."),
        reserve: Optional[str] = typer.Option(None, "--reserve", help="Memory per GPU held back for activations / CUDA graphs (e.g. 2GiB; default 0)."),
        max_num_batched_tokens: Optional[int] = typer.Option(None, "--max-num-batched-tokens", help="Scheduler step for sliding-window sizing (default: vLLM's, 8192 on >=70 GiB non-A100 GPUs, else 2048)."),
        disable_hybrid: bool = typer.Option(False, "--disable-hybrid-kv-cache-manager", help="Size sliding-window and chunked layers like full ones, as vLLM does with this flag (or with KV connectors that lack hybrid support)."),
        what_if: Optional[str] = typer.Option(None, "--what-if", help="Variants side by side: gqa:N, mqa, mha, a KV dtype, or +-joined, e.g. gqa:8,mqa,fp8,gqa:4+fp8."),
        output_format: str = typer.Option("text", "--format", help="text | json"),
        plot: Optional[str] = typer.Option(None, "--plot", help="Write KV GiB vs context length to this .png (needs matplotlib)."),
    ) -> int:
        from kvtool.budget import variants
        from kvtool.budget.budget import BudgetOptions, compute
        from kvtool.budget.gpus import resolve
        from kvtool.budget.report import render_json, render_text
        from pathlib import Path

        from kvtool.model.checkpoint import open_checkpoint
        from kvtool.model.kvcache import KV_CACHE_DTYPES
        from kvtool.model.numbers import require_valid_numbers
        from kvtool.model.spec import build_spec
        from kvtool.units import parse_size

        if output_format not in ("text", "json"):
            raise UsageError(f"unknown format {output_format!r}; choose text or json", field="--format")
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise UsageError(f"unknown KV-cache dtype {kv_cache_dtype!r}; choose from {', '.join(KV_CACHE_DTYPES)}",
                             field="--kv-cache-dtype")
        tokens = QUANTITY_BOUNDS["max_position"].high  # the config bound on a context length
        _positive(max_model_len, "--max-model-len", tokens)
        _positive(batch, "--batch", 1 << 30)
        _positive(block_size, "--block-size", 1 << 20)
        _positive(tensor_parallel_size, "--tensor-parallel-size", QUANTITY_BOUNDS["num_heads"].high)
        _positive(max_num_batched_tokens, "--max-num-batched-tokens", tokens)
        if not 0 < gpu_memory_utilization <= 1:
            raise UsageError(f"{gpu_memory_utilization:g} is not in (0, 1]", field="--gpu-memory-utilization")
        reserve_bytes = 0
        if reserve is not None:
            try:
                reserve_bytes = parse_size(reserve)
            except ValueError as exc:
                raise UsageError(str(exc), field="--reserve") from None
        gpu = resolve(gpu_memory) if gpu_memory is not None else None
        if (reserve is not None or gpu_memory_utilization != 0.9) and gpu is None:
            raise UsageError("--reserve and --gpu-memory-utilization need --gpu-memory", field="--gpu-memory")

        if Path(model).is_dir():  # header sizes come from the weights: refuse any a reader would refuse
            from kvtool.model.preflight import preflight

            ckpt = preflight(model, read_side_files=False, require_weights=False)
        else:
            ckpt = open_checkpoint(model, read_side_files=False)
        spec = build_spec(ckpt.config)
        require_valid_numbers(spec, str(ckpt.config_path))
        opts = BudgetOptions(
            max_model_len=max_model_len, batch=batch or 1, batch_given=batch is not None,
            kv_cache_dtype=kv_cache_dtype, block_size=block_size, tensor_parallel_size=tensor_parallel_size,
            gpu=gpu, gpu_memory_utilization=gpu_memory_utilization, reserve_bytes=reserve_bytes,
            max_num_batched_tokens=max_num_batched_tokens, hybrid_kv_cache=not disable_hybrid,
            what_if=tuple(variants.parse(what_if, num_heads=spec.num_heads, is_mla=spec.is_mla)),
        )
        b = compute(ckpt, spec, opts)
        if plot:
            from kvtool.budget.plot import write_plot

            write_plot(spec, b, plot)
        typer.echo(render_json(b) if output_format == "json" else render_text(b), nl=False)
        return EXIT_FINDINGS if b.problems else EXIT_OK


def _positive(value: int | None, name: str, high: int) -> None:
    if value is not None and value < 1:
        raise UsageError(f"must be at least 1, got {value}", field=name)
    if value is not None and value > high:
        raise UsageError(f"must be at most {high:,}, got {show(value)}", field=name)
