"""kvtool/budget/batch_defaults.json against vLLM's own EngineArgs.get_batch_defaults, release by release.

Each release's function (verbatim, tests/data/vllm/batch/<release>/, copied by tests/data/vllm/extract.py --batch)
runs here with vLLM's platform stubbed by one GPU of kvtool/budget/gpus.json at a time (its memory, device name,
capability, CUDA or ROCm) and by the CPU platform; kvtool's table must give the same step and sequence cap for
`vllm serve` and the LLM class. The clamp of _set_default_max_num_seqs_and_batched_tokens_args is checked the
same way.
"""

from __future__ import annotations

import enum
import sys
import types
from pathlib import Path

import pytest

from kvtool.budget import batch, gpus
from kvtool.budget.budget import BudgetOptions, compute
from kvtool.model.checkpoint import open_checkpoint
from kvtool.model.spec import build_spec

DATA = Path(__file__).resolve().parents[1] / "data" / "vllm" / "batch"
RELEASES = sorted((p.name for p in DATA.iterdir() if p.is_dir()), key=lambda v: tuple(map(int, v.split("."))))
GPUS = sorted({g.name: g for g in gpus.table().values()}.values(), key=lambda g: g.name)


class UsageContext(enum.Enum):
    LLM_CLASS = "LLM_CLASS"
    OPENAI_API_SERVER = "OPENAI_API_SERVER"


USAGE = {"serve": UsageContext.OPENAI_API_SERVER, "llm": UsageContext.LLM_CLASS}


def _excerpt(version: str, name: str) -> str:
    text = (DATA / version / "vllm__engine__arg_utils.py.txt").read_text(encoding="utf-8")
    code = text.split(f"\n# --- {name} (lines", 1)[1].split("\n", 1)[1]
    return code.split("\n# --- ", 1)[0]


def _platform(gpu: gpus.Gpu | None, platform: str):
    cap = tuple(map(int, gpu.capability.split("."))) if gpu is not None and gpu.capability else None
    return types.SimpleNamespace(
        get_device_total_memory=lambda: gpu.memory_bytes, get_device_name=lambda: gpu.device_name,
        is_device_capability=lambda c: c == cap, is_tpu=lambda: False, is_cpu=lambda: platform == "cpu",
        is_rocm=lambda: platform == "rocm", is_cuda=lambda: platform == "cuda")


@pytest.fixture
def usage_lib(monkeypatch):
    """`from vllm.usage.usage_lib import UsageContext` inside the function, without vLLM installed."""
    mod = types.ModuleType("vllm.usage.usage_lib")
    mod.UsageContext = UsageContext
    for name, m in (("vllm", types.ModuleType("vllm")), ("vllm.usage", types.ModuleType("vllm.usage")),
                    ("vllm.usage.usage_lib", mod)):
        monkeypatch.setitem(sys.modules, name, m)


def vllm_defaults(version: str, gpu: gpus.Gpu, platform: str, world_size: int = 1):
    ns = {"current_platform": _platform(gpu, platform), "GiB_bytes": 1 << 30, "UsageContext": UsageContext}
    exec(compile(_excerpt(version, "EngineArgs.get_batch_defaults"), f"vllm-{version}", "exec"), ns)  # noqa: S102
    return ns["get_batch_defaults"].__func__(None, world_size)


@pytest.mark.parametrize("version", RELEASES)
def test_every_gpu_gets_vllms_defaults(version, usage_lib):
    for gpu in GPUS:
        tokens, seqs = vllm_defaults(version, gpu, gpu.platform)
        for usage, ctx in USAGE.items():
            d = batch.defaults(gpu, version, usage)
            assert (d.max_num_batched_tokens, d.max_num_seqs) == (tokens[ctx], seqs[ctx]), (version, gpu.name, usage)
    for tp in (1, 4):  # the CPU platform: per worker
        cpu = gpus.Gpu("cpu", 32 << 30, "user", "cpu")
        tokens, seqs = vllm_defaults(version, cpu, "cpu", tp)
        for usage, ctx in USAGE.items():
            d = batch.defaults(cpu, version, usage, tp)
            assert (d.max_num_batched_tokens, d.max_num_seqs) == (tokens[ctx], seqs[ctx]), (version, tp, usage)


@pytest.mark.parametrize("version", RELEASES)
def test_failed_device_query_is_the_no_gpu_default(version, usage_lib):
    """No --gpu-memory: vLLM's path when the device query fails (memory 0), which kvtool's no-GPU answer is."""
    def fail():
        raise RuntimeError("no device")

    plat = types.SimpleNamespace(get_device_total_memory=fail, get_device_name=fail, is_device_capability=fail,
                                 is_tpu=lambda: False, is_cpu=lambda: False)
    ns = {"current_platform": plat, "GiB_bytes": 1 << 30}
    exec(compile(_excerpt(version, "EngineArgs.get_batch_defaults"), f"vllm-{version}", "exec"), ns)  # noqa: S102
    tokens, seqs = ns["get_batch_defaults"].__func__(None, 1)
    for usage, ctx in USAGE.items():
        d = batch.defaults(None, version, usage)
        assert (d.max_num_batched_tokens, d.max_num_seqs) == (tokens[ctx], seqs[ctx])


@pytest.mark.parametrize("version", RELEASES)
def test_default_step_is_clamped_like_vllm(version):
    """The clamp: min(step, max_num_seqs x max_model_len), read from the release's own setter."""
    src = _excerpt(version, "EngineArgs._set_default_max_num_seqs_and_batched_tokens_args")
    assert "self.max_num_seqs * model_config.max_model_len" in src
    d = batch.defaults(gpus.resolve("B200"), version)
    assert batch.step(d, 4) == min(d.max_num_batched_tokens, 4 * d.max_num_seqs)


def test_the_160_gib_tier_holds_from_0_28():
    b200 = gpus.resolve("B200")
    assert [batch.defaults(b200, v).max_num_batched_tokens for v in ("0.27.1", "0.28.0", "0.33.0")] == [
        8192, 16384, 16384]
    assert batch.defaults(b200, "0.8.5").read is False  # before any release read: the oldest read rules stand in


def test_kv_budget_steps_16384_on_b200(tmp_path):
    """A sliding-window model on a B200: the window reserves two 16,384-token steps under vLLM 0.33 (was 8192)."""
    cfg = tmp_path / "config.json"
    cfg.write_text('{"model_type": "mistral", "architectures": ["MistralForCausalLM"], "hidden_size": 4096, '
                   '"num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 2, '
                   '"vocab_size": 32000, "max_position_embeddings": 131072, "sliding_window": 4096, '
                   '"intermediate_size": 14336, "torch_dtype": "bfloat16"}', encoding="utf-8")
    ckpt = open_checkpoint(str(cfg), read_side_files=False)
    spec = build_spec(ckpt.config)
    held = {}
    for gpu in ("B200", "H200"):
        b = compute(ckpt, spec, BudgetOptions(max_model_len=131072, gpu=gpus.resolve(gpu)))
        held[gpu] = (b.batched_tokens, b.current.layers[0].tokens_allocated)
        assert any("max_num_batched_tokens" in n and "EngineArgs.get_batch_defaults" in n for n in b.notes)
    # in flight: two steps under async scheduling (kvtool/budget/paging.py); window - 1 + 2 x step, + one block
    assert held == {"B200": (16384, (-(-(4095 + 2 * 16384) // 16)) * 16 + 16),
                    "H200": (8192, (-(-(4095 + 2 * 8192) // 16)) * 16 + 16)}
    llm = compute(ckpt, spec, BudgetOptions(max_model_len=131072, gpu=gpus.resolve("H200"), entrypoint="llm"))
    assert llm.batched_tokens == 16384


def test_every_default_is_read_at_one_release_the_installed_one(tmp_path, monkeypatch):
    """No --engine: the batch defaults, the aux caches and the MLA rows are all read at the installed vLLM (as
    lint and the MLA refusal read it), never the newest known for some and the installed for others."""
    import json

    from kvtool.engines import releases

    monkeypatch.setattr(releases, "installed", lambda engine: "0.27.0" if engine == "vllm" else None)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
                               "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 2,
                               "vocab_size": 32000, "max_position_embeddings": 131072, "intermediate_size": 14336,
                               "torch_dtype": "bfloat16"}), encoding="utf-8")
    ckpt = open_checkpoint(str(cfg), read_side_files=False)
    b = compute(ckpt, build_spec(ckpt.config), BudgetOptions(max_model_len=131072, gpu=gpus.resolve("B200")))
    # 0.27.0 predates the 160 GiB tier (>=0.28.0): 8192, not 0.33.0's 16384
    assert (b.options.release, b.batched_tokens) == ("0.27.0", batch.defaults(gpus.resolve("B200"), "0.27.0")
                                                     .max_num_batched_tokens) == ("0.27.0", 8192)
    named = compute(ckpt, build_spec(ckpt.config), BudgetOptions(max_model_len=131072, gpu=gpus.resolve("B200"),
                                                                 vllm_release="0.33.0"))
    assert (named.options.release, named.batched_tokens) == ("0.33.0", 16384)  # --engine vllm==0.33.0 wins
