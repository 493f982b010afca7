"""Smaller contract breaks, each as a class: one verdict in every command, one line, the right name.

- Query heads that do not split over the KV heads (lint's KV101 / KV102): every command refuses with the
  same line (exit 2), kv-budget included; generated over the ways a split fails.
- A hub-like id with no network: one line, exit 2, within a bounded time, in every command that takes one
  (no huggingface_hub retries).
- A file kvtool cannot read (permissions) is named by its own name in every command, never DST's.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from harness import check_refusal, command_args, run_kvtool

from kvtool.io.hub import PROBE_S

TINY = Path(__file__).resolve().parents[2] / "examples" / "llama-gqa-tiny"
CONFIGS = Path("/work/shared/configs")
REPO_CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"


def _commands(m: Path, ws: Path) -> dict:
    return command_args(m, ws)


# (num_attention_heads, num_key_value_heads) of the tiny llama (8 query heads) that no engine can split
SPLITS = {"not-a-divisor": 3, "more-kv-than-query": 16, "coprime": 5}


@pytest.mark.parametrize("case", sorted(SPLITS))
def test_heads_that_do_not_split_get_one_answer_everywhere(tmp_path, case) -> None:
    m = tmp_path / "m"
    shutil.copytree(TINY, m)
    cfg = json.loads((m / "config.json").read_text())
    cfg["num_key_value_heads"] = SPLITS[case]
    (m / "config.json").write_text(json.dumps(cfg))
    lines = set()
    for command, (args, dst) in _commands(m, tmp_path).items():
        if command == "lint":  # a finding (KV101 / KV102, exit 1), asserted below
            continue
        r = check_refusal(args, sources=[m], dst=dst, names=[str(m / "config.json"), ": num_key_value_heads: "])
        lines.add(r.lines[0])
    assert len(lines) == 1, lines  # the same line, word for word, from every command
    assert f"{cfg['num_attention_heads']} query heads do not split into {SPLITS[case]} KV heads" in lines.pop()
    lint = run_kvtool(["lint", m])
    assert lint.rc == 1 and ("KV102" in lint.stdout or "KV101" in lint.stdout), lint.stdout


def _mla_config() -> dict:
    return json.loads((REPO_CONFIGS / "deepseek-v2-lite.json").read_text())


def test_mla_kv_heads_other_than_query_heads_get_one_answer(tmp_path) -> None:
    """MLA decompresses one K/V head per query head: lint flags any other count, and kv-budget refuses it."""
    m = tmp_path / "m"
    m.mkdir()
    cfg = _mla_config()
    cfg["num_key_value_heads"] = 1
    (m / "config.json").write_text(json.dumps(cfg))
    lines = {check_refusal(args, sources=[m], names=[str(m / "config.json"), ": num_key_value_heads: "]).lines[0]
             for args in (["kv-budget", m], ["kv-budget", m / "config.json"], ["rope", m, "--show"])}
    assert len(lines) == 1 and "MLA" in lines.pop()
    lint = run_kvtool(["lint", m])
    assert lint.rc == 1 and "KV102" in lint.stdout, lint.stdout


def test_every_public_config_still_splits() -> None:
    """The refusal is not a guess: no real model's config trips it."""
    from kvtool.model.numbers import head_split_problem
    from kvtool.model.spec import build_spec

    files = sorted(REPO_CONFIGS.glob("*.json")) + sorted(CONFIGS.glob("*.json"))  # the wider corpus, where present
    checked = 0
    for path in files:
        cfg = json.loads(path.read_text())
        if isinstance(cfg, dict) and ("model_type" in cfg or "text_config" in cfg):
            assert head_split_problem(build_spec(cfg)) is None, path.name
            checked += 1
    assert checked >= 50, checked


# --- hub ids without a network ------------------------------------------------------------------------------

HUB_COMMANDS = {
    "lint": ["lint", "org/name"],
    "kv-budget": ["kv-budget", "org/name"],
    "rope-show": ["rope", "org/name", "--show"],
    "eval": ["eval", "org/name", "--device", "cpu"],
}
NETWORKS = {
    # nothing listens on port 9 of this machine: the connection is refused at once
    "refused": {"HF_ENDPOINT": "http://127.0.0.1:9"},
    # TEST-NET-1 (RFC 5737) is never routed: the connect waits until kvtool stops waiting
    "black-hole": {"HF_ENDPOINT": "http://192.0.2.1:80"},
    "offline-variable": {"HF_HUB_OFFLINE": "1"},
    "transformers-offline-variable": {"TRANSFORMERS_OFFLINE": "1"},
}


@pytest.mark.parametrize("network", sorted(NETWORKS))
@pytest.mark.parametrize("command", sorted(HUB_COMMANDS))
def test_hub_id_without_a_network_is_one_line_and_fast(tmp_path, command, network) -> None:
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "", "TRANSFORMERS_OFFLINE": "", **NETWORKS[network]}
    for var in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        env[var] = ""
    r = check_refusal(HUB_COMMANDS[command], sources=[], env=env, names=["org/name", "local Hugging Face cache"],
                      timeout=60)
    assert "Retry" not in r.stderr
    assert r.seconds < PROBE_S + 20, r.seconds  # the probe's bound plus start-up on a loaded machine


def test_hub_id_in_the_local_cache_is_read_without_a_network(tmp_path) -> None:
    """Offline is not "unusable": a config the cache holds is used, and nothing waits on the network."""
    hf = pytest.importorskip("huggingface_hub")
    snap = tmp_path / "hf" / "hub" / "models--org--name" / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    shutil.copy(TINY / "config.json", snap / "config.json")
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("0" * 40)
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": ""}
    r = run_kvtool(["kv-budget", "org/name", "--format", "json"], env=env, timeout=60)
    assert r.rc == 0 and json.loads(r.stdout)["kv_bytes_per_token"] > 0, r.stdout + r.stderr
    assert r.seconds < PROBE_S + 20 and hf.__name__


# --- unreadable files are named by their own name ------------------------------------------------------------

def _unreadable_prefix() -> list[str]:
    """Root reads any file: run kvtool without the capabilities that let it (util-linux setpriv)."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    assert setpriv, "running as root needs setpriv (util-linux) to make a file unreadable"
    return [setpriv, "--bounding-set=-dac_override,-dac_read_search"]


# files kvtool reads, transformers reads, copies as a side file, or streams as weights; each command that
# touches it (kv-budget neither reads nor copies a README)
UNREADABLE = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
              "chat_template.jinja", "README.md"]
CASES = [(c, n) for c in ("convert", "rope", "apply", "quantize-kv", "kv-budget", "eval") for n in UNREADABLE
         if not (c in ("kv-budget", "eval") and n == "README.md")]


@pytest.mark.parametrize("command,name", CASES)
def test_an_unreadable_file_is_named_not_dst(tmp_path, command, name) -> None:
    m = tmp_path / "m"
    shutil.copytree(TINY, m)
    (m / "chat_template.jinja").write_text("{{ messages }}\n")
    (m / "README.md").write_text("# tiny\n")
    (m / name).chmod(0)
    args, dst = _commands(m, tmp_path)[command]
    try:
        r = check_refusal(args, sources=[m], dst=dst, names=[str(m / name), "Permission denied"],
                          prefix=_unreadable_prefix(), allow_progress=command == "apply")
    finally:
        (m / name).chmod(0o644)
    assert r.lines[-1].startswith(f"kvtool: error: {m / name}: "), r.lines  # the file is named, DST is not
