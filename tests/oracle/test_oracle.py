"""The oracle lane: kvtool's verdicts and numbers against transformers' own code, input by input.

For every real config under tests/data/configs and every generated mutation (tests/oracle/cases.py):
- transformers loads it with the model_type's config class and, for tiny models, builds the model and
  runs one forward;
- lint's config checks give kvtool's verdict, and `kvtool rope`'s math the frequencies;
- they must agree: a config transformers refuses needs a lint error, a config lint errs on must not
  run in transformers, and the frequencies must match, unless tests/oracle/known_differences.py
  lists the disagreement with the engine behaviour that justifies kvtool's answer.
Then `kvtool rope --type T --factor 2` on every real and tiny config: whatever it writes (exit 0),
transformers must load, with the frequencies kvtool reports.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")

from known_differences import KNOWN_DIFFERENCES, render_markdown  # noqa: E402
from oracle_cases import BASES, Case, mutation_cases, real_cases  # noqa: E402
from oracle_engine import config_class, is_cheap, kvtool_verdict, transformers_verdict  # noqa: E402

from kvtool.errors import InputError, UsageError  # noqa: E402

pytestmark = pytest.mark.oracle
REPO = Path(__file__).resolve().parents[2]
ROPE_TYPES = ("linear", "dynamic", "yarn", "llama3")  # longrope needs each model's published lists

REAL = real_cases()
MUTATIONS = mutation_cases()
# Remote-code configs (no transformers class for their model_type): lint reports KV703 for them.
REMOTE = [c.id for c in REAL if config_class(c.config.get("model_type")) is None]
CASES = [c for c in REAL + MUTATIONS if c.id not in REMOTE]


@lru_cache(maxsize=None)
def _verdicts(case_id: str):
    case = next(c for c in CASES if c.id == case_id)
    return case, transformers_verdict(case.config), kvtool_verdict(case.config)


def _disagreements(case: Case, tv, kv) -> tuple[list[str], set[str]]:
    """(what the known differences leave unexplained, the ids of the entries that explained the rest)."""
    problems, used = [], set()
    if "KV000" in kv.errors:
        problems.append(f"lint crashed: {kv.messages['KV000']}")
    if not tv.runs and not kv.errors:
        covering = [d for d in KNOWN_DIFFERENCES if d.kind in ("engine-only", "transformers-bug")
                    and d.covers_case(case.id) and d.covers_error(tv.error)
                    and (not d.codes or set(d.codes) & set(kv.warnings))]
        used.update(d.id for d in covering)
        if not covering:
            problems.append(f"transformers refuses ({tv.error}) but lint reports no error (warnings: {kv.warnings})")
    if tv.runs and kv.errors:
        for code in kv.errors:
            covering = [d for d in KNOWN_DIFFERENCES if d.kind == "stricter" and code in d.codes
                        and d.covers_case(case.id)]
            used.update(d.id for d in covering)
            if not covering:
                problems.append(f"lint reports {code} ({kv.messages[code]}) but transformers "
                                f"{'runs a forward' if tv.forward else 'loads the config'}")
    if tv.runs and not kv.errors and tv.inv_freq is not None and kv.inv_freq is not None:
        same = tv.inv_freq.shape == kv.inv_freq.shape and np.allclose(tv.inv_freq, kv.inv_freq, rtol=1e-6, atol=0)
        same = same and abs(tv.attention_scaling - kv.attention_scaling) <= 1e-6 * max(1.0, abs(tv.attention_scaling))
        if not same:
            covering = [d for d in KNOWN_DIFFERENCES if d.kind == "frequencies" and d.covers_case(case.id)
                        and (not d.codes or set(d.codes) & set(kv.warnings))]
            used.update(d.id for d in covering)
            if not covering:
                problems.append(f"frequencies differ: transformers {tv.inv_freq.shape} x{tv.attention_scaling:.6g}, "
                                f"kvtool {kv.inv_freq.shape} x{kv.attention_scaling:.6g}")
    return problems, used


@pytest.mark.parametrize("case_id", [c.id for c in CASES])
def test_kvtool_agrees_with_transformers(case_id: str) -> None:
    problems, _ = _disagreements(*_verdicts(case_id))
    assert not problems, problems


def _rope_cases() -> list[tuple[str, dict]]:
    out = [(f"rope/{c.id.split('/', 1)[1]}", c.config) for c in REAL if c.id not in REMOTE]
    out += [(f"rope/tiny-{name}", cfg) for name, cfg in BASES.items()]
    return out


ROPE_CASES = _rope_cases()


def _rope_run(name: str, rope_type: str, tmp_path: Path):
    """`kvtool rope NAME --type T --factor 2`: None when refused, else (case, transformers, kvtool) for the output."""
    import json

    from kvtool.options.rope import RopeOptions
    from kvtool.rope.command import run

    src, dst = tmp_path / "config.json", tmp_path / "out.json"
    src.write_text(json.dumps(dict(ROPE_CASES)[name]))
    try:
        run(RopeOptions(src=str(src), dst=str(dst), type=rope_type, factor=2.0), echo=lambda line: None)
    except (UsageError, InputError):
        return None  # refused: nothing written, nothing to load
    new = json.loads(dst.read_text())
    return Case(f"{name}/{rope_type}", new), transformers_verdict(new), kvtool_verdict(new)


def _rope_disagreements(case: Case, tv, kv) -> tuple[list[str], set[str]]:
    problems, used = _disagreements(case, tv, kv)
    if not tv.runs:
        covering = [d for d in KNOWN_DIFFERENCES if d.kind == "transformers-bug" and d.covers_case(case.id)
                    and d.covers_error(tv.error)]
        used.update(d.id for d in covering)
        problems = [] if covering else [f"kvtool rope wrote it but transformers refuses: {tv.error}"]
    return problems, used


@pytest.mark.parametrize("rope_type", ROPE_TYPES)
@pytest.mark.parametrize("name", [n for n, _ in ROPE_CASES])
def test_rope_writes_only_what_transformers_loads(name: str, rope_type: str, tmp_path) -> None:
    """`kvtool rope` exits 0 only for configs transformers loads (and, tiny, runs) with kvtool's frequencies."""
    result = _rope_run(name, rope_type, tmp_path)
    if result is not None:
        problems, _ = _rope_disagreements(*result)
        assert not problems, problems


def test_the_rope_oracle_sees_written_outputs(tmp_path) -> None:
    """test_rope_writes_only_what_transformers_loads checks nothing for a refused case: kvtool refusing every case
    would pass it. Measured 2026-12-04: 215 of 272 written, 57 refused."""
    import json

    from kvtool.options.rope import RopeOptions
    from kvtool.rope.command import run

    written = 0
    for name, config in ROPE_CASES:
        for rope_type in ROPE_TYPES:
            src, dst = tmp_path / "config.json", tmp_path / f"{name.replace('/', '-')}-{rope_type}.json"
            src.write_text(json.dumps(config))
            try:
                run(RopeOptions(src=str(src), dst=str(dst), type=rope_type, factor=2.0), echo=lambda line: None)
            except (UsageError, InputError):
                continue
            written += 1
    assert written >= 2 * len(ROPE_CASES) * len(ROPE_TYPES) // 3, written


def test_inputs_cover_the_issue() -> None:
    """Every config under tests/data/configs and hundreds of mutations over each area."""
    assert len(REAL) >= 70 and len(REMOTE) <= 12, REMOTE
    assert len(MUTATIONS) >= 400
    areas = {c.id.split("/")[1].split("_")[0] for c in MUTATIONS}
    assert {"rope", "heads", "head", "dtype", "mla", "sliding", "moe", "top", "text"} <= areas | {
        c.id.split("/")[-1].split("_")[0] for c in MUTATIONS}
    assert sum(1 for c in MUTATIONS if c.base and is_cheap(c.config)) >= 300  # a forward runs for most


def test_refusals_are_seen_both_ways() -> None:
    """The oracle is not vacuous: transformers refuses some inputs and runs most."""
    verdicts = [_verdicts(c.id) for c in CASES if c.base][:400]
    refused = sum(1 for _, tv, _ in verdicts if not tv.runs)
    assert 40 <= refused <= len(verdicts) - 200, refused


@pytest.mark.parametrize("diff", KNOWN_DIFFERENCES, ids=[d.id for d in KNOWN_DIFFERENCES])
def test_every_known_difference_is_needed(diff, tmp_path) -> None:
    """No dead entries: each known difference explains its witness input, which is in the lane."""
    if diff.witness.startswith("rope/"):
        name, rope_type = diff.witness.rsplit("/", 1)
        result = _rope_run(name, rope_type, tmp_path)
        assert result is not None, f"kvtool rope refuses the witness {diff.witness}"
        problems, used = _rope_disagreements(*result)
    else:
        problems, used = _disagreements(*_verdicts(diff.witness))
    assert diff.id in used and not problems, (used, problems)


def test_known_differences_in_docs() -> None:
    lint_page = (REPO / "docs" / "lint.md").read_text(encoding="utf-8")
    assert render_markdown() in lint_page, "docs/lint.md's known-differences table is stale: paste render_markdown()"
