"""Caches vLLM keeps beside K/V (kvtool/budget/aux_caches.json): the DSA lightning indexer's key cache.

vLLM 0.33.0's own code (verbatim, tests/data/vllm/aux/0.33.0/, extract.py --aux) fixes the row: the cache's
width and dtype, its spec (one head, not split over GPUs, no V half), which layers build an indexer (the skip
rule, executed here as vLLM wrote it) and that DeepSeek-V3.2 and GLM-5 are served by that code. kv-budget adds
the rows to the KV figures of the real configs (tests/data/configs).
"""

from __future__ import annotations

import json
import textwrap
import types
from pathlib import Path

import pytest

from kvtool.budget import aux_caches
from kvtool.budget.budget import BudgetOptions, compute
from kvtool.budget.gpus import resolve
from kvtool.model.checkpoint import open_checkpoint
from kvtool.model.spec import build_spec

AUX = Path(__file__).resolve().parents[1] / "data" / "vllm" / "aux" / "0.33.0"
CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"  # copies of /work/shared/configs


def _src(file: str, name: str) -> str:
    text = (AUX / file).read_text(encoding="utf-8")
    return text.split(f"\n# --- {name} (lines", 1)[1].split("\n", 1)[1].split("\n# --- ", 1)[0]


def _config(name: str, tmp_path: Path, **edits) -> Path:
    src = CONFIGS / f"{name}.json"
    cfg = {**json.loads(src.read_text(encoding="utf-8")), **edits}
    out = tmp_path / name / "config.json"
    out.parent.mkdir()
    out.write_text(json.dumps(cfg), encoding="utf-8")
    return out


def _budget(path: Path, **opts):
    ckpt = open_checkpoint(str(path), read_side_files=False)
    return compute(ckpt, build_spec(ckpt.config), BudgetOptions(**opts))


def test_the_row_is_what_vllm_builds():
    row = aux_caches.table()["caches"][0]
    indexer = _src("vllm__models__deepseek_v32__attention.py.txt", "DeepseekV32Indexer.__init__")
    assert "self.head_dim = config.index_head_dim" in indexer and "self.quant_block_size = 128" in indexer
    assert "head_dim=self.head_dim + self.head_dim // self.quant_block_size * 4" in indexer
    assert "dtype=torch.uint8" in indexer
    assert (row["dim"], row["scale_block"], row["scale_bytes"], row["dtype"], row["dtype_bytes"]) == (
        "index_head_dim", 128, 4, "uint8", 1)
    spec = _src("vllm__model_executor__models__deepseek_v2.py.txt", "DeepseekV32IndexerCache.get_kv_cache_spec")
    assert "MLAAttentionSpec(" in spec and "num_kv_heads=1" in spec and "max_tp_shards=1" in spec
    assert row["replicated"]
    kv = (AUX / "vllm__v1__kv_cache_interface.py.txt").read_text(encoding="utf-8")
    assert "head_size_v: int = 0" in kv  # MLA specs: no V half, so 132 B, not 264
    assert "return sum(spec.page_size_bytes for spec in self.kv_cache_specs.values())" in kv
    reg = _src("vllm__model_executor__models__registry.py.txt", "_TEXT_GENERATION_MODELS")
    assert '"GlmMoeDsaForCausalLM": ("vllm.models.deepseek_v32"' in reg and '"DeepseekV32ForCausalLM"' in reg


def _vllm_indexer_layers(config: dict, n: int) -> list[int]:
    """The layers vLLM 0.33.0 builds an indexer in: DeepseekV32Attention.__init__'s skip rule, run as written."""
    body = _src("vllm__models__deepseek_v32__attention.py.txt", "DeepseekV32Attention.__init__")
    start = body.index("    index_topk_freq = getattr(config")
    end = body.index("    num_hidden_layers = getattr(config")
    rule = textwrap.dedent(body[start:end])
    out = []
    for layer_id in range(n):
        ns = {"config": types.SimpleNamespace(**config), "layer_id": layer_id, "getattr": getattr}
        exec(compile(rule, "vllm-0.33.0", "exec"), ns)  # noqa: S102
        if not ns["skip_topk"]:
            out.append(layer_id)
    return out


@pytest.mark.parametrize("edits", [{}, {"index_topk_freq": 4, "index_skip_topk_offset": 3},
                                   {"index_topk_freq": 3}, {"index_topk_pattern": "FSSFSF" * 2}])
def test_indexer_layers_follow_vllms_skip_rule(edits):
    cfg = {"model_type": "deepseek_v32", "index_topk": 2048, "index_head_dim": 64, **edits}
    spec = types.SimpleNamespace(model_type="deepseek_v32", config=cfg, layer_types=["full_attention"] * 12)
    (cache,) = aux_caches.caches(spec, "0.33.0")
    assert list(cache.layers) == _vllm_indexer_layers(cfg, 12)
    assert cache.bytes_per_token == 64 + 0  # 64 // 128 scale blocks
    # before 0.24 every layer kept an indexer; before 0.12 there was none
    assert len(aux_caches.caches(spec, "0.20.2")[0].layers) == 12
    assert aux_caches.caches(spec, "0.10.2") == []


def test_deepseek_v32_pays_the_indexer_in_every_layer(tmp_path):
    b = _budget(_config("deepseek-v3.2", tmp_path), max_model_len=131072, tensor_parallel_size=8,
                gpu=resolve("B200"))
    assert b.current.kv_bytes_per_token_per_gpu == 61 * (1152 + 132)
    assert b.current.kv_bytes_per_sequence_per_gpu == 61 * (1152 + 132) * 131072
    assert b.current.kv_pool_tokens == int(b.kv_pool_per_gpu // (61 * 1284 * 16)) * 16
    assert any("lightning-indexer" in n for n in b.notes)


def test_glm5_indexer_layers_match_transformers_indexer_types(tmp_path):
    """GLM-5.2 shares the indexer's top-k over 3 of 4 layers; its config's indexer_types (transformers') names
    the layers that keep one, which must be the layers vLLM's rule builds."""
    path = _config("glm-5.2", tmp_path)
    cfg = json.loads(path.read_text(encoding="utf-8"))
    b = _budget(path, max_model_len=8192)
    (row,) = b.current.aux
    assert list(row.cache.layers) == [i for i, t in enumerate(cfg["indexer_types"]) if t == "full"]
    assert list(row.cache.layers) == _vllm_indexer_layers(cfg, cfg["num_hidden_layers"])
    assert row.bytes_per_sequence_per_gpu == len(row.cache.layers) * 132 * 8192


def test_models_without_an_indexer_have_no_aux_cache(tmp_path):
    for name in ("deepseek-v3", "kimi-k2.5", "llama-3.1-8b"):
        b = _budget(_config(name, tmp_path), max_model_len=4096)
        assert b.current.aux == []
    # a DeepSeek-V3.2 config without index_topk is served without an indexer (vLLM's is_v32 = hasattr)
    (tmp_path / "x").mkdir()
    cfg = _config("deepseek-v3.2", tmp_path / "x")
    data = json.loads(cfg.read_text(encoding="utf-8"))
    data.pop("index_topk")
    cfg.write_text(json.dumps(data), encoding="utf-8")
    assert _budget(cfg, max_model_len=4096).current.aux == []
