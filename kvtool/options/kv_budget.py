"""`kvtool kv-budget`: every option, declared once (no recipe step)."""

from __future__ import annotations

from kvtool.model.kvcache import KV_CACHE_DTYPES, SERVED_DTYPES
from kvtool.model.numbers import QUANTITY_BOUNDS
from kvtool.options.fields import argument, engine_option, operation, option

FORMATS = ("text", "json")
PLATFORMS = ("gpu", "cpu")  # "gpu" and the rows of kvtool/budget/platforms.json (a test checks)
ENTRYPOINTS = ("serve", "llm")  # kvtool.budget.batch.USAGES
TOKENS = QUANTITY_BOUNDS["max_position"].high  # the config bound on a context length


@operation("kv-budget", recipe=False)
class KvBudgetOptions:
    model: str = argument(help="Model folder, config.json or hub id.")
    max_model_len: int | None = option(None, minimum=1, maximum=TOKENS,
                                       help="Tokens per sequence (default: the config's maximum).")
    batch: int | None = option(None, flags=("--batch", "--concurrency"), minimum=1, maximum=1 << 30,
                               help="Concurrent sequences (default 1; when given with a GPU, exit 1 if they do not fit).")
    kv_cache_dtype: str = option("auto", choices=KV_CACHE_DTYPES,
                                 help="A KV-cache dtype vLLM accepts (the release kvtool/model/kv_dtypes.json was read from), "
                                      "sized with its scales and packing (auto = the model dtype; the table: "
                                      "docs/kv-budget.md).")
    dtype: str = option("auto", choices=SERVED_DTYPES,
                        help="The model dtype vLLM serves with (its --dtype), which --kv-cache-dtype auto caches "
                             "in (auto: the config's, a float32 one in bfloat16).")
    block_size: int | None = option(None, minimum=1, maximum=1 << 20,
                                    help="Paged-attention block size in tokens (default: vLLM's, 16 on a GPU, 128 "
                                         "on --platform cpu, where MLA is always 16).")
    tensor_parallel_size: int = option(1, short="-tp", minimum=1, maximum=QUANTITY_BOUNDS["num_heads"].high,
                                       help="GPUs the model is split over.")
    platform: str = option("gpu", choices=PLATFORMS,
                           help="Size as vLLM on this platform: gpu, or cpu (vLLM's CPU build: block size 128, 16 "
                                "for MLA; the pool is --cpu-kvcache-space; 2048 batched tokens per worker).")
    cpu_kvcache_space: int | None = option(None, minimum=1, maximum=1 << 20, metavar="GIB",
                                           help="--platform cpu: the KV pool in GiB, as VLLM_CPU_KVCACHE_SPACE sets "
                                                "it (an integer).")
    gpu_memory: str | None = option(None, flags=("--gpu-memory", "--gpu"),
                                    help="Memory per GPU (80GiB, 24GB) or a GPU name (H100-80GB, H200, A100-40GB, "
                                         "L40S, RTX-4090, ...).")
    gpu_memory_utilization: float = option(0.9, exclusive_minimum=0, maximum=1,
                                           help="Fraction of GPU memory vLLM may use.")
    reserve: str | None = option(None, help="Memory per GPU held back for activations / CUDA graphs (e.g. 2GiB; "
                                            "default 0).")
    max_num_batched_tokens: int | None = option(None, minimum=1, maximum=TOKENS,
                                                help="Scheduler step for sliding-window sizing (default: vLLM's for "
                                                     "the GPU, release and --entrypoint: `vllm serve` 16384 on "
                                                     ">=160 GiB, 8192 on other >=70 GiB non-A100 GPUs, else 2048).")
    entrypoint: str = option("serve", choices=ENTRYPOINTS,
                             help="Whose batch defaults: serve (`vllm serve`, the API server) or llm (the offline "
                                  "LLM class).")
    disable_hybrid_kv_cache_manager: bool = option(False, help="Size sliding-window and chunked layers like full "
                                                               "ones beside full-attention layers, as vLLM does with "
                                                               "this flag (or with KV connectors that lack hybrid "
                                                               "support); a model whose layers all slide keeps its "
                                                               "window.")
    engine: list[str] = engine_option("kv-budget sizes as the one vLLM release named (its max_model_len derivation: yarn "
                                      "is original x factor before 0.30; its paging rules); a range or a second vLLM "
                                      "release is refused. Default: the installed vLLM, else the newest known.")
    what_if: str | None = option(None, help="Variants side by side: gqa:N, mqa, mha, a KV dtype, or +-joined, e.g. "
                                            "gqa:8,mqa,fp8,gqa:4+fp8.")
    format: str = option("text", choices=FORMATS, help="text | json")
    plot: str | None = option(None, help="Write KV GiB vs context length to this .png (needs matplotlib).")
