"""The `kvtool lint` contract: exit codes, several models, [tool.kvtool] defaults, bad input, start-up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtest import write_config, write_safetensors
from kvtool.cli import main

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"
GOOD = str(CONFIGS / "llama-3.1-8b.json")
BAD = str(CONFIGS / "gpt-j-6b.json")  # KV201: unknown RoPE type 'gptj'
WARN = str(CONFIGS / "nemotron-h-56b-base-8k.json")  # warnings only (KV002, KV703)


def run(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(["lint", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture(autouse=True)
def _isolated_cwd(tmp_path, monkeypatch):
    """Each test runs in an empty folder, so the repository's pyproject.toml does not apply."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return work


# --- exit codes -------------------------------------------------------------------------------

def test_clean_model_exits_0(capsys):
    rc, out, _ = run(capsys, GOOD)
    assert rc == 0 and "0 error(s)" in out


def test_error_finding_exits_1(capsys):
    rc, out, _ = run(capsys, BAD)
    assert rc == 1 and "KV201" in out


def test_warnings_fail_only_with_strict(capsys):
    assert run(capsys, WARN)[0] == 0
    assert run(capsys, WARN, "--strict")[0] == 1


def test_several_models_in_one_run(capsys):
    rc, out, _ = run(capsys, GOOD, BAD, WARN, "--format", "json")
    models = json.loads(out)["models"]
    assert [Path(m["model"]).name for m in models] == ["llama-3.1-8b.json", "gpt-j-6b.json",
                                                       "nemotron-h-56b-base-8k.json"]
    assert rc == 1


def test_unreadable_input_wins_over_findings(capsys):
    rc, out, err = run(capsys, BAD, "no/such/folder")
    assert rc == 2 and "KV201" in out
    assert err == "kvtool: error: no/such/folder: no such file or folder\n"


def test_select_and_ignore(capsys):
    assert run(capsys, BAD, "--ignore", "KV2")[0] == 0
    assert run(capsys, BAD, "--select", "KV1")[0] == 0
    assert run(capsys, BAD, "--select", "KV2")[0] == 1
    assert run(capsys, BAD, "--select", "KV", "--ignore", "KV201")[0] == 0


@pytest.mark.parametrize("args,needle", [
    (["--select", "KV99X"], "matches no rule"),
    (["--ignore", "E501"], "matches no rule"),
    (["--format", "yaml"], "--format: must be one of text, json, sarif, github, got 'yaml'"),
    (["--tensor-parallel-size", "0"], "positive integer"),
])
def test_usage_errors_exit_2(capsys, args, needle):
    rc, _, err = run(capsys, GOOD, *args)
    assert rc == 2 and needle in err and "Traceback" not in err


def test_tensor_parallel_size_checks_divisibility(capsys):
    # llama-3.1-8b: 32 query heads, 8 KV heads. TP 8 divides both; TP 3 divides neither.
    assert run(capsys, GOOD, "--tensor-parallel-size", "8")[0] == 0
    rc, out, _ = run(capsys, GOOD, "-tp", "3")
    assert rc == 1 and "KV103" in out


# --- [tool.kvtool] in pyproject.toml --------------------------------------------------------------

def write_pyproject(folder: Path, body: str) -> Path:
    p = folder / "pyproject.toml"
    p.write_text("[project]\nname = 'x'\n\n[tool.kvtool]\n" + body)
    return p


def test_pyproject_ignore_and_strict(capsys, _isolated_cwd):
    write_pyproject(_isolated_cwd, 'ignore = ["KV2"]\n')
    assert run(capsys, BAD)[0] == 0
    write_pyproject(_isolated_cwd, "strict = true\n")
    assert run(capsys, WARN)[0] == 1
    assert run(capsys, WARN, "--no-strict")[0] == 0  # the command line overrides
    assert run(capsys, BAD, "--isolated")[0] == 1


def test_pyproject_is_found_in_a_parent_folder(capsys, _isolated_cwd, monkeypatch):
    write_pyproject(_isolated_cwd, 'select = ["KV1"]\nformat = "json"\ntensor-parallel-size = 3\n')
    sub = _isolated_cwd / "a" / "b"
    sub.mkdir(parents=True)
    monkeypatch.chdir(sub)
    rc, out, _ = run(capsys, GOOD)
    codes = {f["code"] for f in json.loads(out)["models"][0]["findings"]}
    assert rc == 1 and codes == {"KV103", "KV104"}  # only KV1 selected; TP 3 (from the file) fits neither 32 nor 8


def test_pyproject_per_file_ignores(capsys, _isolated_cwd, tiny_llama_config):
    legacy = _isolated_cwd / "models" / "legacy"
    cfg = dict(tiny_llama_config, rope_scaling={"rope_type": "gptj"})
    write_config(legacy, cfg)
    write_config(_isolated_cwd / "models" / "new", cfg)
    write_pyproject(_isolated_cwd, '[tool.kvtool.per-file-ignores]\n"models/legacy/*" = ["KV201"]\n')
    assert run(capsys, "models/legacy")[0] == 0
    assert run(capsys, "models/new")[0] == 1


def test_explicit_config_option(capsys, tmp_path):
    cfg = write_pyproject(tmp_path, 'ignore = ["KV201"]\n')
    assert run(capsys, BAD, "--config", str(cfg))[0] == 0
    rc, _, err = run(capsys, BAD, "--config", str(tmp_path / "missing.toml"))
    assert rc == 2 and "missing.toml" in err


@pytest.mark.parametrize("body,needle", [
    ('selct = ["KV1"]\n', "unknown key(s) selct"),
    ("strict = 'yes'\n", "tool.kvtool.strict"),
    ('format = "xml"\n', "tool.kvtool.format"),
    ("tensor-parallel-size = -2\n", "tensor-parallel-size"),
    ('select = ["ZZ9"]\n', "matches no rule"),
    ("select = [\n", "invalid TOML"),
])
def test_bad_pyproject_exits_2_naming_file_and_key(capsys, _isolated_cwd, body, needle):
    write_pyproject(_isolated_cwd, body)
    rc, _, err = run(capsys, GOOD)
    assert rc == 2 and needle in err and "Traceback" not in err
    assert "pyproject.toml" in err or "matches no rule" in err


# --- bad input: one line, exit 2 or a finding, never a traceback ---------------------------------

def test_missing_folder(capsys, tmp_path):
    rc, out, err = run(capsys, str(tmp_path / "nope"))
    assert rc == 2 and "Traceback" not in out + err and out == ""
    # kvtool's one error format, on stderr, like every other kvtool error (not `PATH: error: PATH: ...`)
    assert err == f"kvtool: error: {tmp_path / 'nope'}: no such file or folder\n"


def test_folder_without_config(capsys, tmp_path):
    (tmp_path / "m").mkdir()
    rc, _, err = run(capsys, str(tmp_path / "m"))
    assert rc == 2 and "no config.json" in err


def test_invalid_json_names_line_and_column(capsys, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text('{\n  "model_type": "llama",\n  "hidden_size": 64,,\n}\n')
    rc, _, err = run(capsys, str(d))
    assert rc == 2 and "line 3 column" in err and "config.json" in err


def test_json_that_is_not_an_object(capsys, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("[1, 2, 3]\n")
    rc, _, err = run(capsys, str(d))
    assert rc == 2 and "expected a JSON object" in err


def test_unreadable_file(capsys, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").mkdir()  # a folder where the file should be: unreadable even as root
    rc, _, err = run(capsys, str(d))
    assert rc == 2 and "config.json" in err and "Traceback" not in err


def test_undecodable_file(capsys, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_bytes(b'{"model_type": "\xff\xfe"}')
    rc, _, err = run(capsys, str(d))
    assert rc == 2 and "not UTF-8" in err


def test_symlink_loop(capsys, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    os.symlink(d / "config.json", d / "config.json")
    rc, _, err = run(capsys, str(d))
    assert rc == 2 and "symlink loop" in err
    loop = tmp_path / "loop"
    os.symlink(loop, loop)
    rc, _, err = run(capsys, str(loop))
    assert rc == 2 and "symlink loop" in err


def test_empty_safetensors_is_a_finding(capsys, tmp_path, tiny_llama_config):
    d = tmp_path / "m"
    write_config(d, tiny_llama_config)
    (d / "model.safetensors").write_bytes(b"")
    rc, out, err = run(capsys, str(d))
    assert rc == 1 and "KV606" in out and "Traceback" not in out + err


def test_wrapper_and_weights_lint_end_to_end(capsys, tmp_path, tiny_llama_config):
    """A llava-style folder whose weights use the wrapper's language_model.model.* names."""
    import numpy as np

    inner = {k: v for k, v in tiny_llama_config.items() if k != "architectures"}
    d = tmp_path / "llava"
    write_config(d, {"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"], "text_config": inner})
    hd, h, kv, hidden = 16, 4, 2, 64
    tensors = {"language_model.model.embed_tokens.weight": np.zeros((128, hidden), np.float16),
               "language_model.lm_head.weight": np.zeros((128, hidden), np.float16)}
    for i in range(2):
        p = f"language_model.model.layers.{i}.self_attn"
        tensors[f"{p}.q_proj.weight"] = np.zeros((h * hd, hidden), np.float16)
        tensors[f"{p}.k_proj.weight"] = np.zeros((kv * hd * (2 if i else 1), hidden), np.float16)  # layer 1 wrong
        tensors[f"{p}.v_proj.weight"] = np.zeros((kv * hd, hidden), np.float16)
        tensors[f"{p}.o_proj.weight"] = np.zeros((hidden, h * hd), np.float16)
    write_safetensors(d / "model.safetensors", tensors)
    rc, out, _ = run(capsys, str(d), "--format", "json")
    findings = json.loads(out)["models"][0]["findings"]
    codes = {f["code"] for f in findings}
    assert "KV003" in codes and "KV601" in codes and "KV602" not in codes and "KV604" not in codes
    assert any("layers.1.self_attn.k_proj" in (f["path"] or "") for f in findings if f["code"] == "KV601")
    assert rc == 1


# --- a real process ---------------------------------------------------------------------------

def test_real_subprocess_and_no_torch_import(tmp_path):
    """`python -m kvtool lint` exits with the documented code, and neither torch nor transformers loads."""
    probe = (
        "import sys, runpy\n"
        "sys.argv = ['kvtool', 'lint', %r, %r, '--format', 'sarif']\n"
        "from kvtool.cli import main\n"
        "rc = main(sys.argv[1:])\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))\n"
        "print('HEAVY', heavy, file=sys.stderr)\n"
        "sys.exit(rc)\n" % (GOOD, BAD)
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "HEAVY []" in proc.stderr
    sarif = json.loads(proc.stdout)
    assert sarif["version"] == "2.1.0" and sarif["runs"][0]["results"]
    plain = subprocess.run([sys.executable, "-m", "kvtool", "lint", GOOD], capture_output=True, text=True,
                           cwd=tmp_path, env=env, timeout=120)
    assert plain.returncode == 0 and "0 error(s)" in plain.stdout


def test_pyproject_snake_case_keys_and_string_selectors(capsys, _isolated_cwd):
    write_pyproject(_isolated_cwd, 'tensor_parallel_size = 3\nselect = "KV103, KV104"\n')
    rc, out, _ = run(capsys, GOOD)
    assert rc == 1 and "KV103" in out and "KV104" in out
