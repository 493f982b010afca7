"""kvtool.model.kv_scale_names.vllm_target against vLLM's own maybe_remap_kv_scale_name (issue 39, class 5).

vLLM's function is executed from its verbatim excerpt (tests/data/vllm/<release>/, 0.32.0 and 0.33.0: vLLM cannot be
installed here) on generated checkpoint names, with the parameters an MHA / GQA layer (`<attention>.attn.*_scale`)
and a DeepSeek MLA layer (`<attention>.mla_attn.mla_attn.*_scale`) register (BaseKVCacheMethod.create_weights). The
loaders call it on every name and drop a None (`continue`). kvtool's one function must answer the same for each:
which parameter, or dropped."""

from __future__ import annotations

import itertools
import re
import types
from pathlib import Path

import pytest

from kvtool.model import kv_scale_names as ksn
from kvtool.model.engine_tables import newest_read, observed

pytestmark = pytest.mark.oracle
pytest.importorskip("regex")  # vLLM's function imports it

DATA = Path(__file__).resolve().parents[1] / "data" / "vllm"
RELEASES = (observed("vllm"), newest_read("vllm"))  # the lane's and the newest read (REMAP_CITATION)
SOURCE = "vllm/model_executor/model_loader/weight_utils.py"


def _vllm_remap(release: str):
    text = (DATA / release / (SOURCE.replace("/", "__") + ".txt")).read_text(encoding="utf-8")
    assert text.startswith(f"# vLLM {release}, {SOURCE}")
    code = text.split("# --- maybe_remap_kv_scale_name", 1)[1].partition("\n")[2]
    quiet = types.SimpleNamespace(**{m: (lambda *a, **k: None) for m in ("warning_once", "debug_once", "warning")})
    ns = {"re": re, "logger": quiet}
    exec(compile(code, f"vllm-{release}/{SOURCE}", "exec"), ns)  # noqa: S102 - vLLM's own code, vendored
    return ns["maybe_remap_kv_scale_name"]


def _names(prefixes):
    mids = ["", "attn.", "mla_attn.mla_attn.", "mla_attn.", "k_proj.", "v_proj.", "q_proj.", "qkv_proj.",
            "qkqkv_proj.", "kv_b_proj."]
    ends = ["k_scale", "v_scale", "q_scale", "kv_scale", "prob_scale", "output_scale", "k_cache.scale", "q.scale",
            "weight"]
    out = [f"{p}.{m}{e}" for p in prefixes for m, e in itertools.product(mids, ends)]
    out += [f"{p.rsplit('.', 1)[0]}.mlp.{e}" for p in prefixes for e in ("k_scale", "v_scale", "kv_scale")]
    out += [f"{p.rsplit('.', 1)[0]}.mixer.{kv}_proj.{kv}_scale" for p in prefixes for kv in "kv"]
    return out


PREFIXES = {"llama": ["model.layers.0.self_attn", "model.layers.7.self_attn"],
            "nemotron_h": ["backbone.layers.3.mixer"]}


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("attention", ["mha", "mla"])
@pytest.mark.parametrize("family", sorted(PREFIXES))
def test_kvtool_loads_what_vllm_loads(release, attention, family):
    remap = _vllm_remap(release)
    params = ksn.scale_params(PREFIXES[family], attention)
    names = _names(PREFIXES[family])
    checked = loaded = 0
    for name in names:
        theirs = remap(name, {p: None for p in params})
        theirs = theirs if theirs in params else None  # the loader indexes params_dict: anything else is dropped
        ours = ksn.vllm_target(name, params)
        assert ours == (params[theirs] if theirs else None), (release, attention, name, theirs, ours)
        checked += 1
        loaded += ours is not None
    assert checked == len(names) and 0 < loaded < checked  # both answers occur


def test_the_issues_examples():
    mha = ksn.scale_params(["model.layers.0.self_attn"], "mha")
    mla = ksn.scale_params(["model.layers.0.self_attn"], "mla")
    assert ksn.vllm_target("model.layers.0.mlp.k_scale", mha) is None  # dropped: eval must not emulate it
    assert ksn.vllm_target("model.layers.0.self_attn.mla_attn.mla_attn.k_scale", mla) == ("model.layers.0.self_attn",
                                                                                             "k")
    assert ksn.vllm_target("model.layers.0.self_attn.k_scale", mla) is None  # dropped on MLA: lint must say so
    assert ksn.vllm_target("model.layers.0.self_attn.k_proj.k_scale", mla) == ("model.layers.0.self_attn", "k")


def test_the_shapes_the_loader_takes():
    kw = {"heads": 8, "kv_heads": 2}
    for role in ("k", "v", "q", "prob"):
        assert ksn.shape_problem(role, 1, attention="mha", per_head=False, **kw) is None
    assert ksn.shape_problem("k", 2, attention="mha", per_head=False, **kw)  # per-tensor scheme: one value
    assert ksn.shape_problem("k", 2, attention="mha", per_head=True, **kw) is None
    assert ksn.shape_problem("k", 3, attention="mha", per_head=True, **kw)
    assert ksn.shape_problem("q", 8, attention="mha", per_head=True, **kw) is None
    assert ksn.shape_problem("prob", 8, attention="mha", per_head=True, **kw)
    assert ksn.shape_problem("k", 2, attention="mla", per_head=True, **kw)  # one latent
