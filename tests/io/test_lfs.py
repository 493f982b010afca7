"""kvtool.io.lfs: checkpoints checked out without Git LFS (pointer files instead of shards)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from kvtool.cli import main
from kvtool.io.lfs import MAX_POINTER_BYTES, read_pointer

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "llama-gqa-tiny"
BROKEN = REPO / "tests" / "data" / "lint_demo" / "broken-llama"  # KV601 on k/v, KV801 (needs headers)
NEEDS_TORCH = [pytest.mark.torch,
               pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="the command needs torch")]
OID = "4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393"


def pointer(size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{OID}\nsize {size}\n".encode()


def without_lfs(src: Path, dst: Path, sizes: dict[str, int] | None = None) -> Path:
    """A copy of src whose .safetensors files are LFS pointers (as `actions/checkout` without lfs leaves them)."""
    shutil.copytree(src, dst)
    for f in sorted(dst.glob("*.safetensors")):
        f.write_bytes(pointer((sizes or {}).get(f.name, f.stat().st_size)))
    return dst


def test_read_pointer(tmp_path):
    p = tmp_path / "model.safetensors"
    p.write_bytes(pointer(4953586384))
    ptr = read_pointer(p)
    assert ptr is not None and ptr.size == 4953586384 and ptr.oid == f"sha256:{OID}" and ptr.file == p.name
    p.write_bytes(b"version https://example.com/other\n")
    assert read_pointer(p) is None
    p.write_bytes(pointer(1) + b" " * MAX_POINTER_BYTES)  # longer than any pointer: not one
    assert read_pointer(p) is None


def test_lint_says_once_the_weights_were_not_pulled(tmp_path, capsys):
    m = without_lfs(BROKEN, tmp_path / "m", {"model.safetensors": 3 * 2**30})
    assert main(["lint", "--format", "json", str(m)]) == 1  # config errors still fail
    findings = json.loads(capsys.readouterr().out)["models"][0]["findings"]
    codes = [f["code"] for f in findings]
    assert codes.count("KV613") == 1 and "KV606" not in codes  # no "header length 2336927755350992246"
    assert "KV601" not in codes and "KV801" not in codes  # weight checks skipped, not guessed from nothing
    assert {"KV501", "KV504"} <= set(codes)  # every config-only rule still runs
    kv611 = next(f for f in findings if f["code"] == "KV613")
    assert kv611["severity"] == "info" and "model.safetensors (3.00 GiB)" in kv611["message"]
    assert "git lfs pull" in kv611["hint"] and "lfs: true" in kv611["hint"]


def test_require_weights_makes_it_an_error(tmp_path, capsys):
    m = without_lfs(EXAMPLE, tmp_path / "m")
    assert main(["lint", str(m)]) == 0
    assert "KV613 [info]" in capsys.readouterr().out
    assert main(["lint", "--require-weights", str(m)]) == 1
    assert "KV613 [error]" in capsys.readouterr().out


def test_one_pulled_shard_of_two_still_skips_every_weight_check(tmp_path, capsys):
    src = REPO / "tests" / "data" / "rules" / "KV610" / "pass"  # two shards + index
    m = tmp_path / "m"
    shutil.copytree(src, m)
    (m / "model-00002-of-00002.safetensors").write_bytes(pointer(123))
    assert main(["lint", "--format", "json", str(m)]) == 0
    findings = json.loads(capsys.readouterr().out)["models"][0]["findings"]
    assert [f["code"] for f in findings] == ["KV613"]
    assert "1 file(s)" in findings[0]["message"] and "model-00002-of-00002.safetensors (123 B)" in findings[0]["message"]


def test_kv_budget_estimates_the_weights(tmp_path, capsys):
    m = without_lfs(EXAMPLE, tmp_path / "m")
    assert main(["kv-budget", str(m), "--gpu", "L4", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["weight_source"] == "estimate"


@pytest.mark.parametrize("args", [
    ["convert", "{m}", "{out}", "--to", "mqa", "--no-eval"],
    ["convert", "{m}", "--to", "mqa", "--dry-run"],
    pytest.param(["eval", "{m}", "--device", "cpu"], marks=NEEDS_TORCH),
    pytest.param(["quantize-kv", "{m}", "{out}", "--device", "cpu"], marks=NEEDS_TORCH),
])
def test_commands_that_read_weights_stop_with_how_to_pull(tmp_path, capsys, args):
    m = without_lfs(EXAMPLE, tmp_path / "m")
    out = tmp_path / "out"
    rc = main([a.format(m=m, out=out) for a in args])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and not out.exists()
    assert err[0].startswith(f"kvtool: error: {m}: the weights were not pulled: 1 file(s) are Git LFS pointers")
    assert "git lfs pull" in err[0]


def test_workflow_example_pulls_lfs_and_action_is_composite():
    import yaml

    wf = yaml.safe_load((REPO / "docs" / "ci" / "github-actions.yml").read_text())
    steps = wf["jobs"]["lint"]["steps"]
    checkout = next(s for s in steps if str(s.get("uses", "")).startswith("actions/checkout"))
    assert checkout["with"]["lfs"] is True
    action = yaml.safe_load((REPO / "action.yml").read_text())
    assert action["runs"]["using"] == "composite"
    assert {"paths", "args", "require-weights", "sarif-file"} <= set(action["inputs"])
    for step in action["runs"]["steps"]:
        # inputs reach scripts through env only: `${{ inputs.x }}` pasted into `run:` is a script injection
        assert "${{" not in step.get("run", ""), step
