"""kvtool's safetensors verdict equals the safetensors library's, over generated valid and malformed files.

Each case (tests/hostile/malformed.py: a small valid file plus one mutation, seeded) is opened by
`safetensors.safe_open` and by kvtool.io.safetensors_header.read_header; the two must agree. Every file
the library refuses must also make `kvtool lint` exit 1 with a KV606 error, and no file it accepts
may get one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from harness import run_kvtool
from kvtool.io.safetensors_header import read_header
from malformed import MUTATIONS, case

N_CASES = 8 * len(MUTATIONS)
CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128}


def library_accepts(path: Path) -> tuple[bool, str]:
    try:
        with safe_open(str(path), framework="numpy") as f:
            list(f.keys())
            f.metadata()
        return True, ""
    except Exception as exc:  # the library's refusal, whatever its type
        return False, f"{type(exc).__name__}: {exc}"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[tuple[str, Path, bool]]:
    root = tmp_path_factory.mktemp("st_corpus")
    out = []
    for i in range(N_CASES):
        name, data = case(i)
        folder = root / f"{i:04d}-{name}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(CONFIG))
        p = folder / "model.safetensors"
        p.write_bytes(data)
        out.append((name, p, library_accepts(p)[0]))
    return out


@pytest.mark.parametrize("i", range(N_CASES), ids=lambda i: f"{i:04d}-{case(i)[0]}")
def test_same_verdict_as_safetensors(i, tmp_path):
    name, data = case(i)
    p = tmp_path / "model.safetensors"
    p.write_bytes(data)
    ok, why = library_accepts(p)
    h = read_header(p)
    assert h.ok == ok, f"{name}: safetensors {'accepts' if ok else 'refuses (' + why + ')'}; kvtool says {h.problems}"
    if ok:  # same tensors, as the library reads them (a repeated name keeps its last entry)
        with safe_open(str(p), framework="numpy") as f:
            assert sorted(h.tensors) == sorted(f.keys())
            assert h.metadata == (f.metadata() or {})


def test_corpus_exercises_both_verdicts(corpus):
    refused = sum(1 for _, _, ok in corpus if not ok)
    assert refused >= N_CASES // 2 and N_CASES - refused >= 60, (refused, N_CASES)


def test_lint_flags_every_refused_file_and_no_accepted_one(corpus):
    r = run_kvtool(["lint", "--isolated", "--format", "json", "--select", "KV6", *[str(p.parent) for _, p, _ in corpus]],
                   timeout=300)
    assert r.rc == 1, r.stderr[-2000:]
    reports = json.loads(r.stdout)
    reports = reports if isinstance(reports, list) else reports.get("models", reports.get("results"))
    by_model = {Path(rep["model"]).name: rep for rep in reports}
    wrong = []
    for name, p, ok in corpus:
        rep = by_model[p.parent.name]
        assert "error" not in rep or rep["error"] is None, rep
        flagged = any(f["code"] == "KV606" and f["severity"] == "error" for f in rep["findings"])
        if flagged == ok:
            wrong.append((p.parent.name, ok, [f["message"] for f in rep["findings"]][:2]))
    assert not wrong, wrong[:10]
