"""The engine lane: kvtool's verdict for each transformers release against that release itself.

For every release of tests/oracle/engine_releases.py (4.38 .. the newest), every real config under
tests/data/configs, the generated mutation set (tests/oracle/oracle_cases.py), the engine-fact fixtures
(tests/data/rules/KV010, KV011, KV213) and kvtool's own outputs (`kvtool rope --type T --layout both` on the tiny
bases) are loaded by the release in a subprocess (tests/oracle/engine_probe.py: AutoConfig, a tiny from_config
model, one forward, the RoPE inverse frequencies). kvtool's verdict for that release is the engine facts
(kvtool/engines/facts.py) that hold there plus lint's errors. They must agree:
- a fact that says the release refuses: the release refuses (config or forward);
- the release refuses: a fact says so, or lint reports an error;
- the release's RoPE frequencies, attention scaling (cos at position 0) and theta are kvtool's for the config as the facts say the release reads it (the
  keys a `reads-differently` row `drops` removed): as written where no fact holds;
- `dtype` written alone: the release's torch_dtype is None exactly where the dtype fact says so;
- an explicit head_dim: the attention module uses it exactly where no head_dim fact says otherwise;
unless tests/oracle/release_differences.py lists the disagreement with the engine's reason.

Run: `bash scripts/engine_lane.sh` (installs the releases once into ~/.cache/kvtool/engines, then
`pytest -m engines tests/oracle/test_engine_releases.py`). Deselected from the default run (tests/conftest.py).
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from engine_releases import RELEASES, is_ready, run_probe  # noqa: E402
from oracle_cases import BASES, ROPE_BASES, mutation_cases, real_cases  # noqa: E402
from release_differences import RELEASE_DIFFERENCES, covering  # noqa: E402

pytestmark = [pytest.mark.engines, pytest.mark.oracle, pytest.mark.torch]
REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "tests" / "data" / "rules"


def _own_outputs() -> list[dict]:
    """kvtool rope's output config (layout both, the default) for each tiny RoPE base and type."""
    from kvtool.options.rope import RopeOptions
    from kvtool.rope.command import plan_change

    out = []
    for name in ROPE_BASES:
        for rope_type, factor in (("linear", 2.0), ("dynamic", 2.0), ("yarn", 4.0), ("llama3", 8.0)):
            try:
                plan = plan_change(json.loads(json.dumps(BASES[name])), "config.json",
                                   RopeOptions(src="config.json", type=rope_type, factor=factor))
            except Exception:  # noqa: BLE001 - a refused change writes nothing to check
                continue
            out.append({"id": f"kvtool-rope/{name}/{rope_type}", "config": plan.config})
    return out


@lru_cache(maxsize=None)
def cases() -> tuple[dict, ...]:
    out = [{"id": c.id, "config": c.config} for c in real_cases() + mutation_cases()]
    for code in ("KV010", "KV011", "KV213"):
        for folder in sorted(p for p in (RULES / code).iterdir() if (p / "config.json").is_file()):
            out.append({"id": f"rules/{code}/{folder.name}", "config": json.loads((folder / "config.json").read_text())})
    return tuple(out + _own_outputs())


def _numbers(cfg: dict):
    """kvtool's frequencies and theta for a config as written (rope's math, lint's spec)."""
    from kvtool.model.spec import build_spec
    from oracle_engine import kvtool_verdict

    kv = kvtool_verdict(cfg)
    theta = None
    try:
        spec = build_spec(cfg)
    except Exception:  # noqa: BLE001 - lint reports it (an error)
        return kv, None, None
    if spec.position == "rope" and spec.rope:
        rp = spec.rope.get("full_attention") or spec.rope.get("default")
        theta = float(rp.theta) if rp is not None and isinstance(rp.theta, (int, float)) else None
        if theta is None and rp is not None:
            from kvtool.model.rope.params import theta_of

            theta = theta_of(spec, rp)
    return kv, spec, theta


def kvtool_view(cfg: dict, version: str):
    """(facts that hold at `version`, lint's verdict on the config as written, and kvtool's frequencies and theta
    for the config as the release reads it: without the keys the facts say it does not read)."""
    from kvtool.engines.facts import effects

    kv, spec, _ = _numbers(cfg)
    if spec is None:
        return [], kv, None, None
    found = effects(spec, "transformers", (version,))
    dropped = {k for e in found for k in e.fact.drops}
    read = {k: v for k, v in cfg.items() if k not in dropped}
    kv_read, _, theta = _numbers(read) if dropped else (kv, spec, _numbers(cfg)[2])
    return found, kv, kv_read.inv_freq, theta, kv_read.attention_scaling


def disagreements(case: dict, version: str, r: dict) -> list[tuple[str, str]]:
    """(kind, text) for each way the release and kvtool's verdict for it differ on one case."""
    cfg = case["config"]
    found, kv, inv, theta, scaling = kvtool_view(cfg, version)
    refuses = [e for e in found if e.fact.effect == "refuses"]
    detectors = {e.fact.detector for e in found}
    runs = r["loads"] and r.get("forward") is not False
    out = []
    if refuses and runs and not kv.errors:  # lint's own error already says the config is broken (odd head_dim)
        out.append(("fact-not-refused", f"kvtool: {refuses[0].message()}; the release loads it"))
    # KV703 (remote code) / KV001 (a model type no table knows): the config names code the release needs;
    # KV216: a RoPE type only vLLM implements (transformers refuses it, as the warning says)
    explained = kv.errors or {"KV703", "KV001", "KV216"} & set(kv.messages)
    if not runs and not refuses and not explained:
        out.append(("refused-unexplained", f"the release refuses ({r['error']}); kvtool reports no error"))
    # lint's errors already say no engine runs this as written; KV218 / KV219 say transformers rotates the whole
    # head where kvtool's numbers (vLLM's) rotate part of it
    if not runs or kv.errors or {"KV218", "KV219"} & set(kv.warnings):
        return out
    # facts whose claim is other frequencies than written (a yarn ramp or factor the release derives its own way):
    # the lane checks that they differ
    numeric = detectors & {"yarn_original_ignored", "yarn_factor_from_context"}
    if detectors & {"rope_scaling_ignored", "rope_parameters_only"}:
        numeric = set()  # the release does not read the dict those facts are about
    if numeric and r.get("inv_freq") is not None and inv is not None:
        if len(r["inv_freq"]) == len(inv) and np.allclose(r["inv_freq"], inv, rtol=1e-5, atol=1e-12):
            out.append(("fact-freqs-equal", f"kvtool says {sorted(numeric)}; the release computes the written ones"))
        inv = None
    if r.get("inv_freq") is not None and inv is not None:
        same = len(r["inv_freq"]) == len(inv) and np.allclose(r["inv_freq"], inv, rtol=1e-5, atol=1e-12,
                                                                    equal_nan=True)
        if not same:
            out.append(("freqs-differ", f"inv_freq differ: release {np.round(r['inv_freq'][:3], 6).tolist()}... "
                                        f"kvtool {np.round(inv[:3], 6).tolist()}... (facts: {sorted(detectors)})"))
    # the factor cos / sin are multiplied by (the longrope / yarn / deepseek attention factors), as the release's
    # rotary embedding applies it in its own forward: every rope type's formula, release by release
    got = r.get("attention_scaling")
    if "yarn_mscale_ignored" in detectors:  # the release's own formula: 0.1 ln(factor) + 1
        scaling = 0.1 * np.log(float(cfg["rope_scaling"]["factor"])) + 1.0
    elif "yarn_factor_from_context" in numeric:  # the release derives its own factor: other numbers, checked above
        scaling = None
    if got is not None and scaling is not None and not np.isclose(got, scaling, rtol=1e-5):
        out.append(("scaling-differs", f"the release scales cos / sin by {got:.6g}, kvtool {scaling:.6g} "
                                       f"(facts: {sorted(detectors)})"))
    if r.get("rope_theta") is not None and theta is not None:
        if not np.isclose(r["rope_theta"], theta, rtol=1e-9, equal_nan=True):
            out.append(("theta-differs", f"the release reads rope_theta {r['rope_theta']:g}, kvtool {theta:g} "
                                         f"(facts: {sorted(detectors)})"))
    if isinstance(cfg.get("dtype"), str) and cfg.get("torch_dtype") is None and "torch_dtype" in r:
        if ("dtype_only" in detectors) != (r.get("torch_dtype") is None):
            out.append(("dtype", f"the release reads torch_dtype {r.get('torch_dtype')}; dtype fact "
                                 f"{'holds' if 'dtype_only' in detectors else 'does not hold'}"))
    hd = cfg.get("head_dim")
    if isinstance(hd, int) and isinstance(r.get("head_dim"), int):
        if ("explicit_head_dim" in detectors) != (r["head_dim"] != hd):
            out.append(("head-dim", f"the attention uses head_dim {r['head_dim']}, the config says {hd}; head_dim "
                                    f"fact {'holds' if 'explicit_head_dim' in detectors else 'does not hold'}"))
    return out


@lru_cache(maxsize=None)
def _probe(version: str) -> dict[str, dict]:
    """What the release did with every case: probed once per release and case set, kept in the engine cache (the
    probe reads only the release and the cases, so a result is reused by every test and worker)."""
    import hashlib

    from engine_releases import CACHE

    todo = list(cases())
    key = hashlib.sha256(json.dumps([todo, (REPO / "tests/oracle/engine_probe.py").read_text()],
                                    sort_keys=True).encode()).hexdigest()[:16]
    saved = CACHE / f"probe-{version}-{key}.json"
    if saved.is_file():
        return json.loads(saved.read_text())
    results = run_probe(version, todo)
    tmp = saved.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(results))
    tmp.replace(saved)
    return results


@pytest.mark.parametrize("version", RELEASES)
def test_release_agrees_with_kvtool(version: str) -> None:
    assert is_ready(version), f"transformers {version} is not installed: python tests/oracle/engine_releases.py install"
    results = _probe(version)
    problems = []
    for case in cases():
        r = results[case["id"]]
        for kind, text in disagreements(case, version, r):
            if not covering(version, case["id"], kind, r.get("error", "")):
                problems.append(f"{case['id']}: {kind}: {text}")
    assert not problems, f"transformers {version}: {len(problems)} disagreement(s)\n" + "\n".join(problems[:60])


def test_every_release_difference_is_needed() -> None:
    """No dead entries: each known difference is used by at least one release the lane runs (witness)."""
    ready = [v for v in RELEASES if is_ready(v)]
    assert ready == list(RELEASES), "install the lane's releases first"
    used = set()
    for version in RELEASES:
        results = _probe(version)
        for case in cases():
            r = results[case["id"]]
            for kind, _ in disagreements(case, version, r):
                used.update(d.id for d in RELEASE_DIFFERENCES
                            if d.covers(version, case["id"], kind, r.get("error", "")))
    assert {d.id for d in RELEASE_DIFFERENCES} <= used, sorted({d.id for d in RELEASE_DIFFERENCES} - used)
