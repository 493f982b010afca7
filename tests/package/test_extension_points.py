"""Extension points (kvtool/registry.py): everything registered is reachable from the CLI, and one of each kind
registered by a test (a rule, an architecture table, a merge method, a RoPE type, an observer) works, each
added the way docs/CONTRIBUTING.md says."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from kvtest import REPO, write_config, write_safetensors
from kvtool.cli import main
from kvtool.commands import COMMANDS
from kvtool.convert.methods import METHODS, MergeMethod, register_method
from kvtool.model.rope import types as rt
from kvtool.rules.registry import CHECKERS, RULES, checker, define
from kvtool.rules import load_all

HEADS, KV, HD = 4, 4, 8


def _model(folder: Path, model_type: str = "llama") -> Path:
    hidden = HEADS * HD
    write_config(folder, {"model_type": model_type, "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
                          "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": HEADS,
                          "num_key_value_heads": KV, "head_dim": HD, "vocab_size": 32, "max_position_embeddings": 128,
                          "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32"})
    rng = np.random.default_rng(0)
    t = {"model.embed_tokens.weight": rng.standard_normal((32, hidden), np.float32),
         "lm_head.weight": rng.standard_normal((32, hidden), np.float32)}
    for i in range(2):
        p = f"model.layers.{i}.self_attn"
        t.update({f"{p}.q_proj.weight": rng.standard_normal((HEADS * HD, hidden), np.float32),
                  f"{p}.k_proj.weight": rng.standard_normal((KV * HD, hidden), np.float32),
                  f"{p}.v_proj.weight": rng.standard_normal((KV * HD, hidden), np.float32),
                  f"{p}.o_proj.weight": rng.standard_normal((hidden, HEADS * HD), np.float32)})
    write_safetensors(folder / "model.safetensors", t)
    return folder


def _run(capsys, *args) -> tuple[int, str, str]:
    rc = main([str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.out, out.err


# --- everything registered is reachable from the CLI ----------------------------------------------
def test_every_command_is_listed_in_help(capsys):
    rc, out, _ = _run(capsys, "--help")
    listed = {line.split()[0] for line in out.split("Commands:")[1].splitlines() if line.strip()}
    assert rc == 0 and set(COMMANDS) | {"rule"} == listed


@pytest.mark.parametrize("method", METHODS.names())
def test_every_merge_method_is_accepted_by_convert(tmp_path, capsys, method):
    src = _model(tmp_path / "src")
    rc, out, err = _run(capsys, "convert", src, "--to", "gqa", "--groups", "2", "--method", method, "--dry-run")
    assert (rc, err) == (0, "") and method in out


def test_an_unknown_merge_method_lists_the_registered_ones(tmp_path, capsys):
    rc, _, err = _run(capsys, "convert", _model(tmp_path / "src"), "--to", "mqa", "--method", "meen", "--dry-run")
    assert rc == 2 and err == f"kvtool: error: --method: must be one of {', '.join(sorted(METHODS))}, got 'meen'\n"


@pytest.mark.parametrize("rope_type", rt.applicable_types())
def test_every_rope_type_the_family_allows_is_written_by_rope(tmp_path, capsys, rope_type):
    src = _model(tmp_path / "src")
    extra = []
    if rope_type == "longrope":
        for flag in ("--short-factor-file", "--long-factor-file"):
            f = tmp_path / f"{flag[2:]}.json"
            f.write_text(json.dumps([1.0] * (HD // 2)))
            extra += [flag, f]
    rc, _, err = _run(capsys, "rope", src, tmp_path / "dst", "--type", rope_type, "--factor", "2", *extra)
    assert (rc, err) == (0, "")
    assert json.loads((tmp_path / "dst" / "config.json").read_text())["rope_scaling"]["rope_type"] == rope_type


def test_every_rule_has_its_page(capsys):
    load_all()
    for code, rule in RULES.items():
        rc, out, _ = _run(capsys, "rule", code)
        assert rc == 0 and out.startswith(f"{code} ({rule.name})")


@pytest.mark.torch  # quantize-kv without --dry-run requires torch before its option checks
def test_every_observer_is_accepted_by_quantize_kv(tmp_path, capsys):
    from kvtool.quantize.observers import OBSERVERS, usage

    src = _model(tmp_path / "src")
    rc, _, err = _run(capsys, "quantize-kv", src, tmp_path / "x", "--observer", "nope")
    assert rc == 2 and err == f"kvtool: error: --observer: unknown observer 'nope'; choose from {', '.join(usage())}\n"
    for name, entry in OBSERVERS.items():
        spec = name if entry.arg is None or entry.default_arg is not None else f"{name}:99"
        rc, _, err = _run(capsys, "quantize-kv", src, tmp_path / "x", "--observer", spec, "--calib-tokens", "0")
        assert rc == 2 and "--observer" not in err, err  # refused for the token count, after the observer passed


# --- one of each, registered by the test ----------------------------------------------------------
def test_a_lint_rule_is_one_define_and_one_checker(tmp_path, capsys):
    code = "KV999"
    assert code not in RULES
    define(code, "test-toy-flag", "warning", "config sets toy_flag",
           """
           What it does: flags toy_flag.
           Why it matters: a test registers it.
           Example: {"toy_flag": true}
           Fix: remove it.
           """, hint="remove toy_flag", topic="test")

    @checker("test")
    def check_toy_flag(ctx):
        if ctx.config.get("toy_flag"):
            ctx.report(code, "toy_flag is set", path="toy_flag")

    src = _model(tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    write_config(src, {**cfg, "toy_flag": True})
    try:
        rc, out, _ = _run(capsys, "lint", src, "--format", "json", "--select", code)
        assert rc == 0 and [f["code"] for f in json.loads(out)["models"][0]["findings"]] == [code]
        assert _run(capsys, "lint", src, "--select", code, "--strict")[0] == 1
        rc, out, _ = _run(capsys, "rule", code)
        assert rc == 0 and "flags toy_flag" in out
    finally:
        RULES.remove(code)
        CHECKERS.remove("test.check_toy_flag")


def test_an_architecture_is_one_table(tmp_path, capsys):
    from kvtool.model.architectures import add_table, all_architectures

    table = json.loads((REPO / "schemas" / "architectures" / "llama.json").read_text())
    table.update(model_type="toy_llama", architectures=["ToyLlamaForCausalLM"], description="a test's table")
    path = tmp_path / "toy_llama.json"
    path.write_text(json.dumps(table))
    src = _model(tmp_path / "src", model_type="toy_llama")
    before = _run(capsys, "convert", src, tmp_path / "refused", "--to", "mqa")
    add_table(path)
    try:
        rc, _, err = _run(capsys, "convert", src, tmp_path / "dst", "--to", "mqa", "--no-eval", "--no-progress")
        assert (rc, err) == (0, ""), err
        assert json.loads((tmp_path / "dst" / "config.json").read_text())["num_key_value_heads"] == 1
    finally:
        all_architectures().remove("toy_llama")
    assert before[0] == 2 and "toy_llama" in before[2]  # unknown before the table was added


def test_a_merge_method_is_one_class(tmp_path, capsys):
    @register_method("test-first-head")
    class FirstHead(MergeMethod):
        """Keeps the first K/V head of each group (numpy, no torch)."""

        array_api = "numpy"

        def merge_layer(self, layer, w):
            def first(t):
                return np.ascontiguousarray(t.reshape(w.target_groups, -1, w.head_dim, t.shape[-1])[:, 0]
                                            .reshape(w.target_groups * w.head_dim, -1))
            # target_groups: the name before issue 30 (target_kv_heads), kept so such a plug-in still works
            return w.with_(k=first(w.k), v=first(w.v), num_kv_heads=w.target_groups)

    src = _model(tmp_path / "src")
    try:
        rc, _, err = _run(capsys, "convert", src, tmp_path / "dst", "--to", "gqa", "--groups", "2",
                          "--method", "test-first-head", "--no-eval", "--no-progress")
    finally:
        METHODS.remove("test-first-head")
    assert (rc, err) == (0, ""), err
    k = load_file(str(src / "model.safetensors"))["model.layers.1.self_attn.k_proj.weight"]
    out = load_file(str(tmp_path / "dst" / "model.safetensors"))["model.layers.1.self_attn.k_proj.weight"]
    assert np.array_equal(out, np.concatenate([k[0:HD], k[2 * HD:3 * HD]]))


def test_a_rope_type_is_one_table_entry(tmp_path, capsys):
    def math(params, g, seq_len=None):  # what freqs.py would hold: inverse frequencies, attention scaling
        return 1.0 / (g.theta ** (np.arange(0, g.dim, 2) / g.dim)) / params["factor"] ** 0.5, 1.0

    kind = rt.register(rt.RopeKind("test_sqrt", "inverse frequencies / sqrt(factor)", ("factor",), compute=math,
                                   engines=("vllm",), applicable=True))
    src = _model(tmp_path / "src")
    try:
        rc, out, err = _run(capsys, "rope", src, tmp_path / "dst", "--type", "test_sqrt", "--factor", "4")
        assert (rc, err) == (0, ""), err
        cfg = json.loads((tmp_path / "dst" / "config.json").read_text())
        assert cfg["rope_scaling"] == {"rope_type": "test_sqrt", "factor": 4.0}
        assert cfg["max_position_embeddings"] == 128  # context "multiply": vLLM multiplies it by factor
        inv, _ = rt.compute(cfg["rope_scaling"], rt.Geometry(dim=HD, theta=10000.0))
        assert np.allclose(inv, math({"factor": 4.0}, rt.Geometry(dim=HD, theta=10000.0))[0])
    finally:
        rt.KINDS.remove(kind.name)
    assert _run(capsys, "rope", src, tmp_path / "dst2", "--type", "test_sqrt", "--factor", "4")[0] == 2


def test_an_observer_is_one_class():
    import torch

    from kvtool.quantize.formats import FORMATS
    from kvtool.quantize.observers import OBSERVERS, Observer, canonical, make_observer, register

    @register("test-twice-amax", arg="K", default=2.0, check=lambda k: k >= 1, help="K >= 1")
    class TwiceAmax(Observer):
        def _scale(self):
            return self.amax() * float(self.arg) / self.fmt.max

    try:
        assert canonical("test-twice-amax") == "test-twice-amax:2"
        obs = make_observer("test-twice-amax:3", num_heads=2, per_head=True, fmt=FORMATS["e4m3"])
        obs.update(torch.tensor([1.0, -4.0]).reshape(1, 2, 1, 1).expand(1, 2, 3, 4))
        assert torch.allclose(obs.scale(), torch.tensor([3.0, 12.0]) / 448.0)
    finally:
        OBSERVERS.remove("test-twice-amax")
