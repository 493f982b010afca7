"""Hostile round 3, class 9 (issue 39): smaller contract breaks, each as a class, through the harness.

- `--engine` means one thing everywhere: repeatable in every command; a command that follows one vLLM release
  (kv-budget, rope --show) refuses a second one by name, never keeping the last.
- A refusal names what the user gave: a derived value as derived, never an option the user did not give.
- A recipe step's refusal names that step's input (an earlier step's output), never SRC's file.
- No error line lists an unbounded number of names: every list is cut ("and N more") and a line has a bound.
"""

from __future__ import annotations

import itertools
import json
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from harness import check_refusal, run_kvtool

from kvtool.errors import LIST_LIMIT, MAX_LINE

TINY = Path(__file__).resolve().parents[2] / "examples" / "llama-gqa-tiny"
RELEASES = ["vllm==0.28.0", "vllm==0.30.0", "vllm==0.33.0"]


@pytest.mark.parametrize("pair", list(itertools.permutations(RELEASES, 2)), ids="-".join)
@pytest.mark.parametrize("command", ["kv-budget", "rope-show"])
def test_a_second_vllm_release_is_refused_by_name(tmp_path, pair, command):
    args = ["kv-budget", TINY] if command == "kv-budget" else ["rope", TINY, "--show"]
    r = check_refusal([*args, *(a for req in pair for a in ("--engine", req))], sources=[TINY],
                      names=["--engine: ", "given 2 times", *(repr(p) for p in pair)])
    assert "give --engine once" in r.lines[0]


def test_lint_takes_the_same_option_repeatedly():
    r = run_kvtool(["lint", TINY, "--engine", RELEASES[0], "--engine", RELEASES[2], "--format", "json"])
    assert r.rc == 0, r.stderr
    vllm = [e for e in json.loads(r.stdout)["models"][0]["engines"] if e["engine"] == "vllm"][0]
    assert vllm["versions"] == ["0.28.0", "0.33.0"]


def test_one_release_is_followed():
    r = run_kvtool(["kv-budget", TINY, "--engine", "vllm==0.28.0"])
    assert r.rc == 0 and "vLLM 0.28.0" in r.stdout, r.stdout + r.stderr


def _recipe(tmp_path: Path, *steps: str) -> Path:
    p = tmp_path / "r.yaml"
    p.write_text("version: 1\nsteps:\n" + "".join(f"  - {s}\n" for s in steps))
    return p


@pytest.mark.parametrize("first", ["rope: {type: yarn, factor: 4}", "rope: {type: linear, factor: 2}"])
def test_a_later_step_names_its_own_input(tmp_path, first):
    """The second step is refused on what the first one wrote: the line names step 1's output, not SRC."""
    src = tmp_path / "src"
    shutil.copytree(TINY, src)
    recipe = _recipe(tmp_path, first, "convert: {to: mla, kv_rank: 4}")
    r = check_refusal(["apply", recipe, src, tmp_path / "out", "--dry-run"], sources=[src],
                      names=["step 2 (convert)", "step 1's output/config.json: rope_parameters"])
    assert str(src / "config.json") not in r.lines[0]
    # the same step on SRC itself names SRC's file
    alone = _recipe(tmp_path, "convert: {to: mla, kv_rank: 4}")
    (src / "config.json").write_text(json.dumps({**json.loads((src / "config.json").read_text()),
                                                 "rope_scaling": {"rope_type": "linear", "factor": 2.0},
                                                 "rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                                     "rope_theta": 10000.0}}))
    check_refusal(["apply", alone, src, tmp_path / "out", "--dry-run"], sources=[src],
                  names=[f"{src / 'config.json'}: rope_"])


def test_a_derived_rope_dim_is_named_as_derived(tmp_path):
    """A refusal about the rope dimensions kvtool derived never names --rope-dim, which the user did not give."""
    from tests.hostile import models

    cfg = {**models.LLAMA, "hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 4,
           "intermediate_size": 16, "rope_theta": 1e18, "max_position_embeddings": 1 << 20}
    src = models.llama(tmp_path / "hd4", cfg)
    r = run_kvtool(["convert", src, tmp_path / "out", "--to", "mla", "--kv-rank", "2", "--engine", "transformers"])
    if r.rc == 2 and "rope" in r.stderr:  # every pair static over the served context: the derived dim is 0
        assert "--rope-dim:" not in r.stderr and "derived" in r.stderr, r.stderr
    r = check_refusal(["convert", src, tmp_path / "out", "--to", "mla", "--kv-rank", "2", "--rope-dim", "4",
                       "--engine", "transformers"],
                      sources=[src], dst=tmp_path / "out", names=["--rope-dim: 4 must be even"])


class _Many(BaseHTTPRequestHandler):
    COUNT = 40_000

    def log_message(self, *args):
        pass

    def do_GET(self):  # noqa: N802
        body = json.dumps({"object": "list", "data": [{"id": f"m{i:05d}"} for i in
                                                       range(self.COUNT)]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_a_server_with_40000_models_is_one_short_line(tmp_path):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Many)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        text = tmp_path / "t.txt"
        text.write_text("the quick brown fox " * 20)
        r = check_refusal(["eval", "absent", "--server", f"http://127.0.0.1:{srv.server_address[1]}",
                           "--text", text], sources=[text], names=["'m00000'", "and 39,992 more"])
        assert len(r.lines[0]) < 2_000, len(r.lines[0])
    finally:
        srv.shutdown()
        srv.server_close()
        t.join()


def test_many_git_lfs_pointers_are_one_short_line(tmp_path):
    """3,000 weight shards, each a Git LFS pointer: the refusal names the first few and counts the rest."""
    m = tmp_path / "m"
    shutil.copytree(TINY, m)
    (m / "model.safetensors").unlink()
    n = 3000
    weight_map = {}
    for i in range(n):
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        (m / name).write_text("version https://git-lfs.github.com/spec/v1\noid sha256:" + "0" * 64 +
                              f"\nsize {1000 + i}\n")
        weight_map[f"t{i}"] = name
    (m / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    r = check_refusal(["convert", m, tmp_path / "out", "--to", "mqa"], sources=[m], dst=tmp_path / "out",
                      names=["Git LFS pointers", f"and {n - LIST_LIMIT:,} more"])
    assert len(r.lines[0]) < MAX_LINE, len(r.lines[0])


def test_every_error_line_has_a_bound():
    from kvtool.errors import InputError

    line = InputError("x" * 1_000_000, file="f", field="k").line()
    assert len(line) < MAX_LINE + 100 and line.endswith("characters more)")
