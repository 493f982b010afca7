"""What `kvtool convert --to mla` writes, against vLLM 0.33.0's own source (verbatim excerpts under
tests/data/vllm/0.33.0/, refreshed by tests/data/vllm/extract.py): the parameter names its DeepSeek MLA attention
registers and loads, the RoPE pair order it rotates, the dense-layer switch, the untied lm_head, and which MLA
backends serve a converted shape (schemas/engines/mla_backends.json, kvtool.engines.mla; each of its rows against
each release read: tests/oracle/test_vllm_mla_backends.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvtool.convert.mla.config import mla_config
from kvtool.convert.mla.layout import output_names
from kvtool.convert.mla.shape import MlaShape
from kvtool.engines import mla as engine_mla
from kvtool.model.architectures import lookup
from kvtool.model.spec import build_spec

DATA = Path(__file__).resolve().parents[2] / "data" / "vllm" / "0.33.0"


def excerpt(source: str, name: str) -> str:
    """The excerpt of `name` (a qualified name) from the file of vLLM's `source`."""
    text = (DATA / (source.replace("/", "__") + ".txt")).read_text()
    head = f"# --- {name} (lines "
    start = text.index(head)
    body = text[text.index("\n", start) + 1:]
    return body[: body.index("\n# --- ")] if "\n# --- " in body else body


def flat(code: str) -> str:
    """Whitespace runs as one space: the excerpts are dedented, so line breaks' indents differ from the source."""
    return " ".join(code.split())


def calls(code: str, func: str) -> list[ast.Call]:
    tree = ast.parse(code)
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)
            and (getattr(n.func, "id", None) == func or getattr(n.func, "attr", None) == func)]


def keyword(call: ast.Call, name: str):
    return next((k.value for k in call.keywords if k.arg == name), None)


DEEPSEEK = "vllm/model_executor/models/deepseek_v2.py"
SHAPE = MlaShape(hidden_size=64, num_heads=4, kv_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)


def test_attention_parameter_names_are_the_ones_vllm_registers_without_bias():
    init = excerpt(DEEPSEEK, "DeepseekV2MLAAttention.__init__")
    registered = {}
    for cls in ("ReplicatedLinear", "ColumnParallelLinear", "RowParallelLinear", "q_proj_cls"):
        for c in calls(init, cls):
            prefix = keyword(c, "prefix")
            if isinstance(prefix, ast.JoinedStr):
                module = "".join(v.value for v in prefix.values if isinstance(v, ast.Constant)).lstrip(".")
                registered[module] = keyword(c, "bias")
    written = {name.split(".")[-2] for name in output_names(lookup("deepseek_v3"), 0).values()}
    # q_lora_rank null: q_proj, not q_a_proj / q_b_proj (those the plan never writes)
    assert written - {"kv_a_layernorm"} <= set(registered), (written, registered)
    assert all(isinstance(registered[m], ast.Constant) and registered[m].value is False
               for m in written - {"kv_a_layernorm"})
    assert "self.kv_a_layernorm = RMSNorm(self.kv_lora_rank" in init
    assert output_names(lookup("deepseek_v3"), 3)["kv_b_proj.weight"] == "model.layers.3.self_attn.kv_b_proj.weight"


def test_rope_is_gpt_j_pairs_so_the_config_says_interleave():
    init = excerpt(DEEPSEEK, "DeepseekV2MLAAttention.__init__")
    rope_call = calls(init, "get_rope")[0]  # self.rotary_emb (the second is V3.2's indexer)
    assert "self.rotary_emb = get_rope(" in init and init.index("self.rotary_emb = get_rope(") < init.index("indexer_rope_emb")
    assert keyword(rope_call, "is_neox_style").value is False
    spec = build_spec({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                       "num_key_value_heads": 2, "intermediate_size": 64, "rope_theta": 10000.0})
    assert mla_config({}, spec, SHAPE, rope_theta=10000.0)["rope_interleave"] is True
    # any other rope_type is rewritten to DeepSeek's own scalings: the plan converts default RoPE only
    assert 'config.rope_parameters["rope_type"] != "default"' in init and '"deepseek_yarn"' in init


def test_every_layer_dense_and_the_expert_count_an_integer():
    layer = excerpt(DEEPSEEK, "DeepseekV2DecoderLayer.__init__")
    assert "config.n_routed_experts is not None and layer_idx >= config.first_k_dense_replace" in flat(layer)
    load = excerpt(DEEPSEEK, "DeepseekV2Model.load_weights")
    assert "num_experts=self.config.n_routed_experts + (" in flat(load)  # None + int would raise
    spec = build_spec({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                       "num_key_value_heads": 2, "intermediate_size": 64})
    cfg = mla_config({}, spec, SHAPE, rope_theta=10000.0)
    assert cfg["first_k_dense_replace"] == cfg["num_hidden_layers"] == 2
    assert isinstance(cfg["n_routed_experts"], int) and cfg["q_lora_rank"] is None
    # kv_a_proj_with_mqa is fused with q_a_proj only when q_lora_rank is set (name_mapped in params_dict)
    assert '("fused_qkv_a_proj", "kv_a_proj_with_mqa", 1)' in load
    assert 'param_name == "fused_qkv_a_proj" ) and name_mapped not in params_dict' in flat(load)


def test_lm_head_is_never_tied_so_it_is_written():
    init = excerpt(DEEPSEEK, "DeepseekV2ForCausalLM.__init__")
    assert "ParallelLMHead(" in init and "tie_word_embeddings" not in init
    assert "tie_word_embeddings" not in excerpt(DEEPSEEK, "DeepseekV2Model.load_weights")


def literal_return(code: str):
    ret = next(n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Return))
    return ast.literal_eval(ret.value)


def test_head_size_is_latent_plus_rope():
    code = excerpt("vllm/transformers_utils/model_arch_config_convertor.py", "ModelArchConfigConvertorBase.get_head_size")
    assert "return self.hf_text_config.kv_lora_rank + qk_rope_head_dim" in code
    assert SHAPE.cached_dims == SHAPE.kv_lora_rank + SHAPE.qk_rope_head_dim


def test_every_backend_is_held_to_the_common_head_sizes():
    """MLACommonMetadata.__post_init__ checks MLACommonBackend's head sizes whatever the backend declares (the
    metadata builder passes head_dim = get_head_size(), kv_lora_rank + qk_rope_head_dim): TRITON_MLA's [] is no
    'any size'. vLLM 0.32.0 CPU refused a 128-value row this way (issue 38)."""
    common = excerpt("vllm/model_executor/layers/attention/mla_attention.py", "MLACommonBackend.get_supported_head_sizes")
    assert tuple(literal_return(common)) == engine_mla.rows("0.33.0").head_sizes
    built = (DATA / "mla" / "vllm__model_executor__layers__attention__mla_attention.py.txt").read_text()
    build = built.split("# --- MLACommonMetadataBuilder.build (lines", 1)[1]
    assert "attn_metadata = self.metadata_cls(" in build and "head_dim=self.model_config.get_head_size()," in build
    triton = excerpt("vllm/v1/attention/backends/mla/triton_mla.py", "TritonMLABackend.get_supported_head_sizes")
    assert literal_return(triton) == []
    triton_row = next(b for b in engine_mla.backends("0.33.0") if b.name == "TRITON_MLA")
    assert triton_row.declares == () and triton_row.sizes(engine_mla.rows("0.33.0").head_sizes) == (320, 512, 576)


GPU = {"TRITON_MLA", "ROCM_AITER_MLA", "AITER_TRITON_MLA", "FLASH_ATTN_MLA"}  # any size the metadata check takes


@pytest.mark.parametrize("dims, served", [
    ((512, 64, 128), GPU | {"FLASHMLA", "CUTLASS_MLA", "FLASHINFER_MLA", "TOKENSPEED_MLA", "CPU_MLA", "AMX_MLA"}),
    ((512, 64, 96), GPU | {"FLASHMLA", "CUTLASS_MLA", "CPU_MLA", "AMX_MLA"}),  # FlashInfer: nope 64/128/192
    ((448, 64, 128), GPU | {"FLASHINFER_MLA", "TOKENSPEED_MLA"}),  # 512 cached, not the fixed 512 + 64
    ((268, 52, 12), GPU),  # 320: SmolLM2's servable saving
    ((96, 32, 64), set()),  # 128: no backend (MLACommonMetadata.__post_init__ raises)
])
def test_which_backends_serve(dims, served):
    rank, rope, nope = dims
    shape = MlaShape(hidden_size=1024, num_heads=8, kv_lora_rank=rank, qk_rope_head_dim=rope, qk_nope_head_dim=nope,
                     v_head_dim=128 if nope == 128 else nope)
    common = engine_mla.rows("0.33.0").head_sizes
    assert {b.name for b in engine_mla.backends("0.33.0") if b.refusal(shape, common) is None} == served
