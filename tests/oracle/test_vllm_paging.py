"""kv-budget's per-release paging rules (schemas/engines/facts.json `kv_*` arithmetic rows, kvtool/budget/paging.py)
and the Qwen3.5 KV-scale fact, against each release's own source (verbatim excerpts under tests/data/vllm/<release>/,
tests/data/vllm/extract.py OPTIONAL_RELEASE_EXCERPTS). Where the function is pure it runs as vLLM wrote it."""

from __future__ import annotations

import ast
import math
import types
from dataclasses import dataclass

import pytest
from test_vllm_releases import DATA, RELEASES, _excerpt, _quiet

from kvtool.budget import paging as P
from kvtool.engines.facts import arithmetic, facts
from kvtool.model.kvcache import LayerKV


def _has(version: str, name: str) -> bool:
    try:
        _excerpt(version, name)
    except LookupError:
        return False
    return True


def _with(name: str) -> list[str]:
    return [v for v in RELEASES if _has(v, name)]


def _exec(version: str, *names: str, **ns) -> dict:
    ns = {"cdiv": lambda a, b: -(-a // b), "logger": _quiet(), "math": math, **ns}
    for name in names:
        exec(compile(_excerpt(version, name), f"vllm-{version}-{name}", "exec"), ns)  # noqa: S102
    return ns


def _v(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


def _sliding(window: int) -> LayerKV:
    return LayerKV(0, "sliding_attention", "GQA", 1, 1, window, 2, 1)


CASES = [(4096, 32_768, 2048), (512, 32_768, 2048), (128, 131_072, 8192), (4096, 5000, 2048), (512, 32_768, 1)]


@pytest.mark.parametrize("version", _with("SlidingWindowSpec.max_memory_usage_bytes"))
@pytest.mark.parametrize("window,max_len,step", CASES)
def test_v1_sliding_reservation_is_that_release(version, window, max_len, step) -> None:
    """SlidingWindowSpec.max_memory_usage_bytes of the release (with VllmConfig.max_in_flight_tokens where it has
    one, async scheduling on as by default) gives the tokens kvtool reserves under that release's switches."""
    ns = _exec(version, *[n for n in ("SlidingWindowSpec.max_admission_blocks_per_request",
                                      "SlidingWindowSpec.max_memory_usage_bytes") if _has(version, n)])
    spec_cls = type("SlidingWindowSpec", (), {k: ns[k] for k in ("max_admission_blocks_per_request",
                                                                 "max_memory_usage_bytes") if k in ns})
    spec = spec_cls()
    spec.__dict__.update(sliding_window=window, block_size=16, page_size_bytes=1, extra_retained_tokens=0,
                         dcp_sharded=True, use_mla=False)
    base = dict(model_config=types.SimpleNamespace(max_model_len=max_len),
                scheduler_config=types.SimpleNamespace(max_num_batched_tokens=step, async_scheduling=True),
                parallel_config=types.SimpleNamespace(decode_context_parallel_size=1, pipeline_parallel_size=1),
                use_v2_model_runner=False)
    if _has(version, "VllmConfig.max_in_flight_tokens"):
        vc = _exec(version, "VllmConfig.max_concurrent_batches", "VllmConfig.max_in_flight_tokens")
        cfg = type("VllmConfig", (), {k: vc[k] for k in ("max_concurrent_batches", "max_in_flight_tokens")})()
        cfg.__dict__.update(base)
    else:
        cfg = types.SimpleNamespace(**base)
    want = spec.max_memory_usage_bytes(cfg) * 16  # blocks x block_size (page of 1 byte)
    paging = P.Paging(arithmetic("vllm", version))
    assert paging.tokens(_sliding(window), max_len, 16, step, mixed=False) == want, (version, want)


V0 = [v for v in RELEASES if _v(v) < (0, 8)]


def _default_v0_manager(version: str) -> str:
    if _has(version, "SelfAttnBlockSpaceManager.__init__"):
        return "SelfAttnBlockSpaceManager.__init__"
    field = _excerpt(version, "EngineArgs.use_v2_block_manager")
    return "BlockSpaceManagerV2.__init__" if "= True" in field else "BlockSpaceManagerV1.__init__"


@pytest.mark.parametrize("version", V0)
@pytest.mark.parametrize("window", [4096, 4100, 3, 512])
def test_v0_sliding_cap_is_the_default_block_managers(version, window) -> None:
    """V0: one block table for all layers; the default block manager's __init__ caps a windowed sequence's blocks
    (its `if sliding_window is not None:` block, run as written)."""
    tree = ast.parse(_excerpt(version, _default_v0_manager(version)))
    block = next(n for n in ast.walk(tree) if isinstance(n, ast.If) and ast.unparse(n.test) == "sliding_window is not None")
    ns = {"self": types.SimpleNamespace(), "sliding_window": window, "block_size": 16, "math": math}
    exec(compile(ast.Module(body=[block], type_ignores=[]), version, "exec"), ns)  # noqa: S102
    cap = getattr(ns["self"], "block_sliding_window", None) or ns["self"].max_block_sliding_window
    paging = P.Paging(arithmetic("vllm", version))
    assert paging.tokens(_sliding(window), 1_000_000, 16, 2048, mixed=False) == cap * 16, version
    # interleaved models are scheduled as full attention in V0 (vllm-v0-interleaved-window-full)
    assert not paging.keeps_windows(mixed=True)


# the releases whose model runner builds each layer's spec itself (later ones ask the attention layer)
RUNNER_BUILT = [v for v in _with("GPUModelRunner.get_kv_cache_spec") if _v(v) >= (0, 8)
                and "FullAttentionSpec(" in _excerpt(v, "GPUModelRunner.get_kv_cache_spec")]


@pytest.mark.parametrize("version", RUNNER_BUILT)
def test_v1_sliding_spec_exists_where_windows_are_kept(version) -> None:
    has_spec = "SlidingWindowSpec(" in _excerpt(version, "GPUModelRunner.get_kv_cache_spec")
    assert (P.ALL_FULL not in arithmetic("vllm", version)) == has_spec, version


@pytest.mark.parametrize("version", [v for v in _with("get_kv_cache_config") if _v(v) >= (0, 8)
                                     and P.ALL_FULL not in arithmetic("vllm", v)])
def test_mixed_models_sized_full_without_the_hybrid_allocator(version) -> None:
    """Before 0.9.1 get_kv_cache_config converts sliding specs to full always; from 0.9.1 only under
    --disable-hybrid-kv-cache-manager."""
    fn = ast.parse(_excerpt(version, "get_kv_cache_config")).body[0]
    always = any(isinstance(n, ast.Expr) and "unify_hybrid_kv_cache_specs" in ast.unparse(n) for n in fn.body)
    assert (P.MIXED_FULL in arithmetic("vllm", version)) == always, version


@pytest.mark.parametrize("version", _with("_get_kv_cache_config_uniform_page_size"))
def test_first_hybrid_groups_take_the_smallest_kind(version) -> None:
    """0.9.1 .. 0.10.2: `group_size = min(...)` with no threshold for the largest kind."""
    code = _excerpt(version, "_get_kv_cache_config_uniform_page_size")
    assert "group_size = min(" in code and "min_num_layers *" not in code
    assert P.GROUP_MIN in arithmetic("vllm", version), version


@dataclass(frozen=True)
class _Spec:
    kind: str

    @classmethod
    def merge(cls, specs):
        assert all(s == specs[0] for s in specs)
        return specs[0]


@pytest.mark.parametrize("version", _with("_get_kv_cache_groups_uniform_page_size"))
@pytest.mark.parametrize("full,sliding", [(4, 22), (13, 12), (12, 13), (8, 40), (10, 14)])
def test_group_size_is_that_releases(version, full, sliding) -> None:
    ns = _exec(version, "_get_kv_cache_groups_uniform_page_size", defaultdict=__import__("collections").defaultdict,
               create_kv_cache_group_specs=lambda spec, groups: groups, KVCacheSpec=object, KVCacheGroupSpec=list)
    layers = {f"full.{i}": _Spec("full") for i in range(full)} | {f"sw.{i}": _Spec("sw") for i in range(sliding)}
    groups = ns["_get_kv_cache_groups_uniform_page_size"](layers)
    assert max(len(g) for g in groups) == P.Paging(arithmetic("vllm", version)).group_size([full, sliding]), version


KV_ROWS = [f for f in facts() if f.engine == "vllm" and f.arithmetic in P.SWITCHES]


@pytest.mark.parametrize("fact", KV_ROWS, ids=lambda f: f.id)
def test_each_paging_row_cites_a_release_read_here(fact) -> None:
    """The cited release has committed excerpts and lies in the row's range (its last release, for rows whose
    rule a later release changed)."""
    from packaging.specifiers import SpecifierSet

    assert fact.citation.release in RELEASES and fact.applies_to(fact.citation.release), fact.id
    upper = [s.version for s in SpecifierSet(fact.releases) if s.operator == "<="]
    assert upper == [fact.citation.release], fact.id


def test_every_switch_has_a_row_and_the_newest_release_none() -> None:
    assert {f.arithmetic for f in KV_ROWS} == set(P.SWITCHES)
    assert not arithmetic("vllm", RELEASES[-1]) & set(P.SWITCHES)


@pytest.mark.parametrize("version", _with("Qwen3_5Model.load_weights"))
def test_qwen3_5_kv_scales_fact_is_where_the_remap_is_missing(version) -> None:
    """vllm#54623: Qwen3_5Model.load_weights remaps k_scale / v_scale names (maybe_remap_kv_scale_name) up to
    0.24.0; 0.25.1 .. 0.33.0 hand the weights to AutoWeightsLoader bare, and the row holds exactly there."""
    (row,) = [f for f in facts() if f.id == "vllm-qwen3-5-kv-scales-dropped"]
    remaps = "maybe_remap_kv_scale_name" in _excerpt(version, "Qwen3_5Model.load_weights")
    assert row.applies_to(version) == (not remaps), version


def test_excerpts_cover_both_sides_of_each_change() -> None:
    assert {"0.6.2", "0.6.3", "0.8.2", "0.8.3", "0.9.0", "0.9.1", "0.17.0", "0.18.0", "0.24.0", "0.25.1",
            "0.26.0"} <= set(RELEASES), sorted(p.name for p in DATA.iterdir())


@pytest.mark.parametrize("version", _with("unify_hybrid_kv_cache_specs"))
def test_windows_become_full_only_beside_full_layers(version) -> None:
    """Without the hybrid manager (before 0.9.1, or --disable-hybrid-kv-cache-manager) vLLM converts windowed specs
    to full only when full-attention layers are present too: a model whose layers all slide keeps its window."""
    code = _excerpt(version, "unify_hybrid_kv_cache_specs")
    if "_promote_local_kv_cache_specs(" in code:
        code += _excerpt(version, "_promote_local_kv_cache_specs")
    assert "if has_full_attention and" in code, version
    layers = [_sliding(4096)] * 4
    assert not P.mixed_kinds(layers) and P.mixed_kinds(layers + [LayerKV(4, "full_attention", "GQA", 1, 1, None, 2, 1)])
    for hybrid in (True, False):
        assert P.Paging(arithmetic("vllm", version), hybrid).keeps_windows(P.mixed_kinds(layers)) == \
            (P.ALL_FULL not in arithmetic("vllm", version)), version


# --- Mamba / linear-attention hybrids (kvtool/budget/recurrent.py `mamba_*` rows) ---------------------------------
from kvtool.budget import recurrent as R  # noqa: E402

STATE_ROWS = [f for f in facts() if f.engine == "vllm" and f.arithmetic in R.SWITCHES]
_HYBRID_CODE = ("HybridAttentionMambaModelConfig.verify_and_update_config", "Platform._align_hybrid_block_size")


def _hybrid_code(version: str) -> str:
    """The release's hybrid block-size code, whitespace collapsed ('' where none was read)."""
    return " ".join(" ".join(_excerpt(version, n).split()) for n in _HYBRID_CODE if _has(version, n))


HYBRID_RELEASES = [v for v in RELEASES if "mamba_page_size" in _hybrid_code(v)]


def test_hybrid_rows_span_releases_either_side() -> None:
    """The Mamba rows were read from 0.10.0 (the first release with HybridAttentionMambaModelConfig), 0.12.0 and
    0.33.0; every switch has a row, and the newest release holds none."""
    assert {"0.10.0", "0.12.0", "0.33.0"} <= set(HYBRID_RELEASES)
    assert {f.arithmetic for f in STATE_ROWS} == set(R.SWITCHES)
    assert not arithmetic("vllm", RELEASES[-1]) & set(R.SWITCHES)
    for f in STATE_ROWS:
        assert f.citation.release in HYBRID_RELEASES and f.applies_to(f.citation.release), f.id


@pytest.mark.parametrize("version", HYBRID_RELEASES)
def test_state_dtype_rows_are_that_releases(version) -> None:
    """STATE_IN_KV_DTYPE where the state page is built with the KV-cache dtype (MambaSpec(dtype=kv_cache_dtype));
    SSM_NO_MODEL_DEFAULT where the release has no NemotronHForCausalLMConfig setting a float32 SSM default."""
    code, rows = _hybrid_code(version), arithmetic("vllm", version)
    assert ("dtype=kv_cache_dtype, block_size" in code) == (R.STATE_IN_KV_DTYPE in rows)
    if R.STATE_IN_KV_DTYPE not in rows and "MambaSpec(" in code:
        assert "dtypes=model_cls.get_mamba_state_dtype_from_config(vllm_config)" in code
    nemotron = _has(version, "NemotronHForCausalLMConfig")
    assert nemotron == (R.SSM_NO_MODEL_DEFAULT not in rows)
    if nemotron:
        assert 'DEFAULT_MAMBA_SSM_CACHE_DTYPE: "MambaDType" = "float32"' in _excerpt(version, "NemotronHForCausalLMConfig")


@pytest.mark.parametrize("version", HYBRID_RELEASES)
def test_block_rows_are_that_releases(version) -> None:
    """BLOCK_MULTIPLE_OF_16 where the attention block is 16 x cdiv(...) (or a kernel alignment fixed at 16) and the
    user's block size only wins when larger; the newest release aligns to max(kernel block, --block-size)."""
    code, rows = _hybrid_code(version), arithmetic("vllm", version)
    sixteen = ("16 * cdiv(mamba_page_size, 16 * attn_page_size_1_token)" in code
               or "kernel_block_alignment_size = 16 " in code)
    follows_block = "cache_config.block_size, )" in code
    assert (sixteen and not follows_block) == (R.BLOCK_MULTIPLE_OF_16 in rows)
    # the figure both rules give for Nemotron-H-56B (16,900,096 B state page, 4,096 B per attention token)
    switches = rows & {R.BLOCK_MULTIPLE_OF_16}
    assert R.attention_block_size(16_900_096, 4096, 16, switches) == 4128
    assert R.attention_block_size(16_900_096, 4096, 100, switches) == (4128 if switches else 4200)
