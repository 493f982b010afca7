"""schemas/engines/mla_backends.json against each vLLM release's own source (tests/data/vllm/<release>/mla/,
copied by `tests/data/vllm/extract.py SRC RELEASE --mla` / `--mla-backends`).

Every `common` row: for each release read inside its range, MLACommonBackend.get_supported_head_sizes returns the
row's sizes and MLACommonMetadata.__post_init__ raises for any other head size (0.7.3: TRITON_MLA's own). Every
`backends` row: for each release read inside its range, the class that vLLM names so declares those sizes (or
inherits MLACommonBackend's) and its kernel limits are in the code.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvtool.engines import mla
from kvtool.engines.ranges import contains, specifier

pytestmark = pytest.mark.oracle
DATA = Path(__file__).resolve().parents[1] / "data" / "vllm"
READ = sorted((p.name for p in DATA.iterdir() if p.is_dir() and any(p.glob("mla/*.txt"))),
              key=lambda v: tuple(int(x) for x in v.split(".")))
COMMON, BACKENDS = mla.table()


def segments(version: str) -> dict[str, str]:
    """qualified name -> code, over every excerpt in the release's mla/ folder."""
    out = {}
    for path in sorted((DATA / version / "mla").glob("*.txt")):
        text = path.read_text(encoding="utf-8")
        assert text.startswith(f"# vLLM {version}, vllm/")
        for block in text.split("\n# --- ")[1:]:
            head, _, code = block.partition("\n")
            out[head.split(" (lines")[0]] = code
    return out


def _methods(code: str) -> tuple[ast.ClassDef, dict[str, ast.FunctionDef]]:
    cls = ast.parse(code).body[0]
    assert isinstance(cls, ast.ClassDef)
    return cls, {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}


def _returned(fn: ast.FunctionDef):
    ret = next(n for n in ast.walk(fn) if isinstance(n, ast.Return))
    return ast.literal_eval(ret.value)


def served_sizes(version: str) -> tuple[int, ...]:
    """The row sizes the release's metadata check admits, read from its source."""
    seg = segments(version)
    if "MLACommonBackend" in seg:
        _, methods = _methods(seg["MLACommonBackend"])
        post = seg["MLACommonMetadata.__post_init__"]
        # the check every dense backend's metadata passes, whatever the backend declares
        assert "MLACommonBackend" in post and "raise ValueError" in post or "validate_head_size" in post, version
        if "validate_head_size" in post:
            check = ast.unparse(methods["validate_head_size"])
            assert "get_supported_head_sizes()" in check and "raise ValueError" in check
    else:  # 0.7.x: TRITON_MLA was the one MLA backend and checked its own sizes
        _, methods = _methods(seg["TritonMLABackend"])
        post = seg["TritonMLAMetadata.__post_init__"]
        assert "TritonMLABackend.get_supported_head_sizes()" in post and "raise ValueError" in post
    return tuple(_returned(methods["get_supported_head_sizes"]))


def test_releases_read_span_every_row():
    for r in COMMON:
        inside = [v for v in READ if contains(r.releases, v)]
        assert r.citation.release in inside, (r.releases, inside)
        ends = {s.version for s in specifier(r.releases)}  # >=first, <=last
        assert ends <= set(inside), f"{r.releases}: both ends must be read ({inside})"


@pytest.mark.parametrize("version", READ)
def test_common_rows_are_the_release_source(version):
    row = mla.rows(version)
    assert row is not None, f"{version} was read but no row covers it"
    assert served_sizes(version) == row.head_sizes


def test_rows_do_not_overlap_and_unread_releases_have_none():
    for v in ("0.7.0", "0.7.2", "0.6.3"):
        assert mla.rows(v) is None
    for v in mla.read_releases():
        assert sum(contains(r.releases, v) for r in COMMON) == 1


def _backend_class(seg: dict[str, str], b) -> tuple[str, ast.ClassDef, dict]:
    """The excerpted class whose get_name (own or its base's) is the row's name, on the row's GPUs."""
    candidates = []
    for name, code in seg.items():
        if "." in name or not name.endswith("Backend") or name == "MLACommonBackend":
            continue
        cls, methods = _methods(code)
        own = methods.get("get_name")
        base = ast.unparse(cls.bases[0]) if cls.bases else ""
        got = _returned(own) if own else _returned(_methods(seg[base])[1]["get_name"]) if base in seg else None
        if got == b.name:
            candidates.append((name, cls, methods))
    assert candidates, b.name
    if len(candidates) == 1:
        return candidates[0]
    return next(c for c in candidates if (c[0].startswith("XPU")) == ("XPU" in b.gpus))


@pytest.mark.parametrize("b", BACKENDS, ids=lambda b: f"{b.name}-{b.gpus}")
def test_backend_rows_are_the_release_source(b):
    read = [v for v in READ if contains(b.releases, v)]
    assert b.citation.release in read
    for version in read:
        seg = segments(version)
        name, cls, methods = _backend_class(seg, b)
        declared = methods.get("get_supported_head_sizes")
        base = ast.unparse(cls.bases[0])
        if declared is None and base in seg and base != "MLACommonBackend":
            declared = _methods(seg[base])[1].get("get_supported_head_sizes")
        if b.declares is None:
            assert declared is None and base in ("MLACommonBackend",), (version, name)
        else:
            assert tuple(_returned(declared)) == b.declares, (version, name)
        code = seg[name]
        if b.kv_lora_rank is not None:
            if b.name == "CUTLASS_MLA":
                impl = seg["CutlassMLAImpl._sm100_cutlass_mla_decode"]
                assert f"D_latent = {b.kv_lora_rank}" in impl and f"D_rope = {b.qk_rope_head_dim}" in impl
            else:  # FlashMLA: dense FlashMLA runs on Hopper only, its kernel reads 512 + 64
                assert "is_flashmla_dense_supported" in code
                assert "is_device_capability_family(90)" in seg["is_flashmla_dense_supported"]
        if b.qk_nope_head_dims is not None and b.name == "FLASHINFER_MLA":
            assert f"qk_nope_head_dim not in {list(b.qk_nope_head_dims)}" in code
        if b.name == "TOKENSPEED_MLA":
            assert ("qk_nope_head_dim != 128 or qk_rope_head_dim != 64 or v_head_dim != 128" in code
                    and b.qk_nope_head_dims == (128,) and b.qk_rope_head_dim == 64 and b.v_head_dims == (128,))
        gpus = {"Hopper": "major == 9", "Blackwell": "major == 10"}.get(b.gpus)
        if gpus and b.name != "FLASHMLA":
            assert gpus in code, (version, name, gpus)


@pytest.mark.parametrize("version", [v for v in READ if mla.backends(v)])
def test_every_backend_class_read_has_a_row(version):
    named = {(b.name, "XPU" in b.gpus) for b in mla.backends(version)}
    for name, code in segments(version).items():
        if "." in name or not name.endswith("Backend") or name == "MLACommonBackend":
            continue
        b = next(b for b in mla.backends(version) if _backend_class(segments(version), b)[0] == name)
        assert (b.name, name.startswith("XPU")) in named


def test_servable_is_what_triton_mla_serves():
    """TRITON_MLA declares any size: a release serves exactly the metadata check's sizes."""
    for v in READ:
        row = mla.rows(v)
        triton = [b for b in mla.backends(v) if b.name == "TRITON_MLA"]
        for b in triton:
            assert b.sizes(row.head_sizes) == row.head_sizes


def test_cpu_backend_serves_576_only():
    assert [b.sizes(mla.rows("0.32.0").head_sizes) for b in mla.backends("0.32.0") if b.name == "CPU_MLA"] == [(576,)]


def _excerpt_033(source: str, name: str) -> str:
    text = (DATA / "0.33.0" / (source.replace("/", "__") + ".txt")).read_text(encoding="utf-8")
    body = text.split(f"\n# --- {name} (lines", 1)[1].split("\n", 1)[1]
    return body.split("\n# --- ", 1)[0]


def test_deepseek_mla_layers_take_no_sliding_window():
    """KV405's citation: the wrapper builds MLAAttention without sliding_window (so it stays None: full attention),
    and TRITON_MLA refuses one outright."""
    wrapper = _excerpt_033("vllm/model_executor/layers/mla.py", "MultiHeadLatentAttentionWrapper.__init__")
    call = wrapper[wrapper.index("self.mla_attn = MLAAttention("):]
    call = call[:call.index("\n        )")]
    assert "num_heads=self.num_heads" in call and "sliding_window" not in call
    triton = _excerpt_033("vllm/v1/attention/backends/mla/triton_mla.py", "TritonMLAImpl.__init__")
    assert "unsupported_features = [alibi_slopes, sliding_window, logits_soft_cap]" in triton
    assert "raise NotImplementedError" in triton
