"""Runs inside the vLLM venv (scripts/vllm_cpu.sh), never in kvtool's Python: builds one vllm.LLM after another
in this one process (a shared start: torch and vLLM import once) and writes what each engine did as JSON.

    python tests/oracle/vllm_driver.py jobs.json out.json

A job: {"name", "model", "dtype", "kv_cache_dtype", "eager", "max_model_len", "prompts": [[ids...], ...]}, and
optionally the scheduler's "max_num_batched_tokens", "enable_chunked_prefill", "enable_prefix_caching".
Per job it records the observed engine facts (block size, batched tokens, KV blocks and the logged
"KV cache size" line, the KV-cache tensors' bytes), the prompt log-probabilities of each prompt's tokens,
or the error that stopped the engine. A job {"probe": "fp8_store", ...} runs vLLM's CPU cache op
(`cpu_attn_reshape_and_cache`, kv_cache_dtype fp8 or the job's) on given values and returns the stored bytes; {"probe": "cpu_backend"} the KV-cache
dtypes the CPU attention backend lists."""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import sys
import time
import traceback

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process: one start
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

KV_LINE = re.compile(r"KV cache size: ([\d,]+) tokens")


class Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        try:
            self.lines.append(record.getMessage())
        except Exception:  # noqa: BLE001 - a log record that does not format is not ours to fix
            pass


def fp8_store(job: dict) -> dict:
    import torch

    vals = torch.tensor(job["values"], dtype=torch.float32)
    head_dim, block = 32, 32
    n = vals.numel() // head_dim
    key = vals[: n * head_dim].reshape(n, 1, head_dim).contiguous()
    value = key.clone()
    blocks = (n + block - 1) // block
    kc = torch.zeros(blocks, 1, block, head_dim, dtype=torch.uint8)
    vc = torch.zeros_like(kc)
    slots = torch.arange(n, dtype=torch.int64)
    torch.ops._C.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, "vec", job["scale"], job["scale"],
                                            job.get("kv_cache_dtype", "fp8"))
    # value cache is row-major per token: [block, head, token, dim]
    stored = vc.reshape(-1, head_dim)[:n].reshape(-1).tolist()
    return {"name": job["name"], "stored": stored}


def batch_defaults(job: dict) -> dict:
    """vLLM's own EngineArgs.get_batch_defaults on this (CPU) platform, for `vllm serve` and vllm.LLM."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    tokens, seqs = EngineArgs.get_batch_defaults(1)
    return {"name": job["name"], "serve": tokens[UsageContext.OPENAI_API_SERVER], "llm": tokens[UsageContext.LLM_CLASS],
            "serve_seqs": seqs[UsageContext.OPENAI_API_SERVER], "llm_seqs": seqs[UsageContext.LLM_CLASS]}


def cpu_backend(job: dict) -> dict:
    """The KV-cache dtypes vLLM's CPU attention backend lists (CPUAttentionBackend.supported_kv_cache_dtypes)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return {"name": job["name"], "supported_kv_cache_dtypes": list(CPUAttentionBackend.supported_kv_cache_dtypes)}


def run(job: dict, capture: Capture) -> dict:
    from vllm import LLM, SamplingParams

    capture.lines.clear()
    out = {"name": job["name"], "model": job["model"]}
    t0 = time.time()
    llm = None
    try:
        kw = dict(model=job["model"], dtype=job.get("dtype", "auto"), enforce_eager=job.get("eager", True),
                  max_model_len=job.get("max_model_len"), seed=0, kv_cache_dtype=job.get("kv_cache_dtype", "auto"),
                  max_num_batched_tokens=job.get("max_num_batched_tokens"),
                  enable_chunked_prefill=job.get("enable_chunked_prefill"),
                  enable_prefix_caching=job.get("enable_prefix_caching"))
        llm = LLM(**{k: v for k, v in kw.items() if v is not None})
        cfg = llm.llm_engine.vllm_config
        out["block_size"] = cfg.cache_config.block_size
        out["num_blocks"] = cfg.cache_config.num_gpu_blocks
        out["max_num_batched_tokens"] = cfg.scheduler_config.max_num_batched_tokens
        out["max_num_seqs"] = cfg.scheduler_config.max_num_seqs
        out["chunked_prefill"] = cfg.scheduler_config.enable_chunked_prefill
        out["prefix_caching"] = cfg.cache_config.enable_prefix_caching
        out["max_model_len"] = cfg.model_config.max_model_len
        out["cache_dtype"] = str(cfg.cache_config.cache_dtype)
        out["model_dtype"] = str(cfg.model_config.dtype)
        out["kv_cache_memory_bytes"] = cfg.cache_config.kv_cache_memory_bytes
        out["started_s"] = round(time.time() - t0, 1)
        sp = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
        res = llm.generate([{"prompt_token_ids": ids} for ids in job["prompts"]], sp, use_tqdm=False)
        out["prompt_logprobs"] = [[None if d is None else d[tok].logprob for d, tok in zip(r.prompt_logprobs, ids)]
                                  for r, ids in zip(res, job["prompts"])]
        out["loads"] = True
    except Exception as exc:  # noqa: BLE001 - the lane reports what stopped the engine
        out["loads"] = False
        out["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
        out["traceback"] = traceback.format_exc()[-3000:]
    finally:
        out["kv_cache_log"] = [ln for ln in capture.lines if "KV cache size" in ln]
        m = [KV_LINE.search(ln) for ln in out["kv_cache_log"]]
        out["kv_cache_tokens_logged"] = [int(x.group(1).replace(",", "")) for x in m if x]
        out["errors_logged"] = [ln[:500] for ln in capture.lines if "not supported" in ln or "Error" in ln][:5]
        out["seconds"] = round(time.time() - t0, 1)
        del llm
        gc.collect()
        try:
            from vllm.distributed import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
        except Exception:  # noqa: BLE001
            pass
    return out


def main() -> None:
    jobs = json.load(open(sys.argv[1], encoding="utf-8"))
    capture = Capture()
    logging.getLogger("vllm").addHandler(capture)
    results = []
    for job in jobs:
        probe = {"fp8_store": fp8_store, "batch_defaults": batch_defaults, "cpu_backend": cpu_backend}.get(job.get("probe"))
        results.append(probe(job) if probe else run(job, capture))
        print(json.dumps({k: v for k, v in results[-1].items() if k not in ("prompt_logprobs", "traceback", "stored")}),
              file=sys.stderr, flush=True)
        with open(sys.argv[2], "w", encoding="utf-8") as f:  # after each job: a crash keeps the earlier ones
            json.dump(results, f)


if __name__ == "__main__":
    main()
