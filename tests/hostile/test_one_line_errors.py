"""Internal errors where one line naming the file and field is promised (issue 31, class 6), generated.

Each class runs through the harness on every command that reads what it breaks: lone surrogates in config
strings; longrope factor lists of the wrong length (lint's KV207 check, run once for every command: the same
line everywhere); weights that contradict the config; recipe keys that are not names and YAML scalars their
tag cannot build; a DST that cannot be created; a hostile pyproject.toml in the working folder (the lint step
of the GitHub Action); KVTOOL_CACHE naming a file; stdout on a full device after DST was published. Last, a
fuzz over the harness's safetensors mutations (malformed.py) on every command: whatever the weights, the
output contract of contract.check_output holds.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from contract import check_output
from harness import check_refusal, run_kvtool
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from malformed import MUTATIONS, case

TINY = Path(__file__).resolve().parents[2] / "examples" / "llama-gqa-tiny"
EXAMPLES = int(os.environ.get("KVTOOL_HOSTILE_EXAMPLES", "3"))
SLOW = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def _commands(m: Path, out: Path, recipe: Path) -> dict:
    return {
        "lint": ["lint", m],
        "kv-budget": ["kv-budget", m],
        "rope-show": ["rope", m, "--show"],
        "rope": ["rope", m, out, "--type", "linear", "--factor", "2"],
        "convert-dry-run": ["convert", m, "--to", "mqa", "--dry-run"],
        "convert": ["convert", m, out, "--to", "mqa", "--no-eval"],
        "apply-dry-run": ["apply", recipe, m, out, "--dry-run"],
        "quantize-kv-dry-run": ["quantize-kv", m, "--dry-run"],
        "eval-dry-run": ["eval", m, "--dry-run"],
    }


COMMANDS = sorted(_commands(Path(), Path(), Path()))


def _model(root: Path, edit=None) -> tuple[Path, Path, Path]:
    m = root / "m"
    shutil.copytree(TINY, m)
    if edit is not None:
        cfg = json.loads((m / "config.json").read_text())
        edit(cfg)
        (m / "config.json").write_text(json.dumps(cfg, indent=2))  # ASCII: \u escapes keep lone surrogates
    recipe = root / "r.yaml"
    recipe.write_text("version: 1\nsteps:\n  - convert: {to: mqa}\n")
    return m, recipe, root / "out"


def _refuses(root, edit, command, names) -> str:
    m, recipe, out = _model(root, edit)
    r = check_refusal(_commands(m, out, recipe)[command], sources=[m, recipe], dst=out,
                      names=[str(m / "config.json"), *names])
    return r.lines[0]


# --- lone surrogates ------------------------------------------------------------------------------------
FIELDS = ["architectures.0", "hidden_act", "rope_parameters.rope_type", "_name_or_path", "note.deep.0", "<key>"]


@pytest.mark.parametrize("command", COMMANDS)
@SLOW
@given(field=st.sampled_from(FIELDS), surrogate=st.integers(0xD800, 0xDFFF), before=st.text(max_size=3))
def test_a_lone_surrogate_in_config_is_one_line_naming_the_field(command, field, surrogate, before) -> None:
    value = before + chr(surrogate)

    def edit(cfg):
        if field == "<key>":
            cfg[value] = 1
            return
        node, *rest = field.split(".")
        if node == "note":
            cfg["note"] = {"deep": [value]}
        elif rest:
            cfg.setdefault(node, {}) if not isinstance(cfg.get(node), list) else None
            target = cfg[node]
            if isinstance(target, list):
                target[int(rest[0])] = value
            else:
                target[rest[0]] = value
        else:
            cfg[node] = value

    with tempfile.TemporaryDirectory() as d:
        line = _refuses(Path(d), edit, command, ["lone surrogate"])
    shown = {"<key>": "", "note.deep.0": "note.deep[0]", "architectures.0": "architectures[0]"}.get(field, field)
    assert shown in line and f"\\u{surrogate:04x}" in line, line


# --- longrope factor lists --------------------------------------------------------------------------------
@pytest.mark.parametrize("key,length", [("short_factor", 3), ("long_factor", 5), ("short_factor", 0),
                                        ("long_factor", 64)])
def test_a_longrope_list_of_the_wrong_length_is_refused_the_same_by_every_command(tmp_path, key, length) -> None:
    def edit(cfg):
        rp = {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": 1024,
              "short_factor": [1.0] * 4, "long_factor": [1.5] * 4}
        rp[key] = [1.0] * length
        cfg["rope_parameters"] = rp

    lines = set()
    for command in COMMANDS:
        if command == "lint":
            m, _, _ = _model(tmp_path / command, edit)
            r = run_kvtool(["lint", m])
            assert r.rc == 1 and "KV207" in r.stdout, r.stdout
            continue
        line = _refuses(tmp_path / command, edit, command, [f"rope_parameters.{key}", "rotary_dim 8 needs 4"])
        lines.add(line.replace(str(tmp_path / command), "DIR"))
    assert len(lines) == 1, lines  # one check, one line, whichever command


# --- weights that contradict the config ------------------------------------------------------------------
CONTRADICTIONS = {  # config edit -> the field the line names
    "kv-heads": ({"num_key_value_heads": 4}, "self_attn.k_proj.weight"),
    "query-heads": ({"num_attention_heads": 4}, "self_attn.q_proj.weight"),
    "head-dim": ({"head_dim": 16}, "self_attn.q_proj.weight"),
    "vocab": ({"vocab_size": 999}, "vocab_size"),
}


@pytest.mark.parametrize("command", ["convert", "convert-dry-run", "quantize-kv-dry-run", "eval-dry-run",
                                     "apply-dry-run"])
@pytest.mark.parametrize("kind", sorted(CONTRADICTIONS))
def test_weights_that_contradict_the_config_are_one_line(tmp_path, command, kind) -> None:
    change, field = CONTRADICTIONS[kind]
    m, recipe, out = _model(tmp_path, lambda cfg: cfg.update(change))
    r = check_refusal(_commands(m, out, recipe)[command], sources=[m], dst=out,
                      names=[field, "config.json and the weights disagree"])
    assert str(m) in r.lines[0]
    lint = run_kvtool(["lint", m])  # lint reports the same defect as a finding
    assert lint.rc == 1 and ("KV601" in lint.stdout or "KV603" in lint.stdout), lint.stdout


# --- recipes: keys that are not names, scalars their tag cannot build --------------------------------------
TAGS = ["!!int", "!!float", "!!bool", "!!timestamp", "!!null", "!!binary", "!!set", "!!omap", "!!pairs",
        "!<tag:yaml.org,2002:int>", "!custom", "!!python/name:os.system"]
SCALARS = ['"x"', '""', "maybe", "2001-13-45", "1", "-.5e3", "[1]", "{a: 1}", "=", "0x_"]
KEYS = ["1", "null", "~", "true", "3.5", "2001-12-14", "[a, b]", "{a: 1}", "!!int 7", '"ok"']
SPOTS = {  # where the generated text goes
    "version": "version: {v}\nsteps:\n  - convert: {{to: mqa}}\n",
    "name": "version: 1\nname: {v}\nsteps:\n  - convert: {{to: mqa}}\n",
    "option": "version: 1\nsteps:\n  - convert: {{to: {v}}}\n",
    "threshold": "version: 1\nsteps:\n  - eval: {{thresholds: {{max_kld: {v}}}}}\n",
    "top-key": "version: 1\n{v}: 2\nsteps:\n  - convert: {{to: mqa}}\n",
    "option-key": "version: 1\nsteps:\n  - convert: {{to: mqa, {v}: 2}}\n",
    "threshold-key": "version: 1\nsteps:\n  - eval: {{thresholds: {{max_kld: 0.5, {v}: 1}}}}\n",
}


@settings(SLOW, max_examples=max(12, 4 * EXAMPLES))
@given(spot=st.sampled_from(sorted(SPOTS)), tag=st.sampled_from(["", *TAGS]), scalar=st.sampled_from(SCALARS),
       key=st.sampled_from(KEYS))
def test_recipe_keys_and_tagged_scalars_are_one_line(tmp_path_factory, spot, tag, scalar, key) -> None:
    root = tmp_path_factory.mktemp("recipe")
    m, _, out = _model(root)
    v = key if spot.endswith("key") else f"{tag} {scalar}".strip()
    recipe = root / "r.yaml"
    recipe.write_text(SPOTS[spot].format(v=v))
    what = f"{recipe.read_text()!r}"
    for args, fmt in ((["apply", recipe, m, out, "--dry-run"], "text"), (["lint", recipe, "--format", "json"], "json")):
        r = run_kvtool(args)
        check_output(r, fmt, f"{args[0]}: {what}\n{r.stderr}{r.stdout[-1500:]}")
        if r.rc == 2:
            assert str(recipe) in r.lines[0], r.lines
    assert not out.exists()


# --- a DST that cannot be created ------------------------------------------------------------------------
def _dst(tmp_path: Path, kind: str) -> Path:
    if kind == "under-a-file":
        (tmp_path / "f").write_text("x")
        return tmp_path / "f" / "out"
    if kind == "name-too-long":
        return tmp_path / ("x" * 300)
    if kind == "in-proc":
        return Path("/proc/1/kvtool-out")
    if kind == "under-a-fifo":
        os.mkfifo(tmp_path / "p")
        return tmp_path / "p" / "out"
    raise AssertionError(kind)


@pytest.mark.parametrize("command", ["apply", "convert", "rope"])
@pytest.mark.parametrize("kind", ["under-a-file", "name-too-long", "in-proc", "under-a-fifo"])
def test_a_dst_that_cannot_be_created_is_one_line(tmp_path, command, kind) -> None:
    m, recipe, _ = _model(tmp_path)
    dst = _dst(tmp_path, kind)
    args = {"apply": ["apply", recipe, m, dst], "convert": ["convert", m, dst, "--to", "mqa", "--no-eval"],
            "rope": ["rope", m, dst, "--type", "linear", "--factor", "2"]}[command]
    r = check_refusal(args, sources=[m, recipe], timeout=60)
    assert str(dst)[:60] in r.lines[0], r.lines


# --- a hostile pyproject.toml where the lint step runs --------------------------------------------------
PYPROJECTS = {
    "tool-not-a-table": "tool = 1\n",
    "kvtool-an-array": "[[tool.kvtool]]\nselect = ['KV']\n",
    "nested-arrays": "a = " + "[" * 5000 + "]" * 5000 + "\n",
    "nested-tables": "a = " + "{x=" * 3000 + "1" + "}" * 3000 + "\n",
    "invalid": "[tool.kvtool\n",
    "not-utf8": b"[tool.kvtool]\nselect = ['\xff']\n",
    "huge": "[tool.kvtool]\nselect = [" + ",".join(['"KV1"'] * 900_000) + "]\n",
    "twice": "[tool.kvtool]\nper_file_ignores = {m = ['KV']}\nper-file-ignores = {n = ['KV']}\n",
    "surrogate": '[tool.kvtool]\nselect = ["\\ud800"]\n',
}
VALUES = ["1", '"x"', "[1]", "{a = 1}", "true", "1.5", "1979-05-27", '["\\u001b]0;x\\u0007"]', "-1", "inf"]
KNOWN_KEYS = ["select", "ignore", "strict", "tensor-parallel-size", "format", "per-file-ignores",
              "tensor_parallel_size"]


def _lint_in(folder: Path, model: Path):
    return run_kvtool(["lint", model], cwd=folder)


@pytest.mark.parametrize("kind", sorted(PYPROJECTS))
def test_a_hostile_pyproject_is_one_line_for_the_lint_step(tmp_path, kind) -> None:
    m, _, _ = _model(tmp_path)
    text = PYPROJECTS[kind]
    py = tmp_path / "pyproject.toml"
    py.write_bytes(text if isinstance(text, bytes) else text.encode())
    r = _lint_in(tmp_path, m)
    check_output(r, "text", f"{kind}: {r.stderr}")
    assert r.rc == 2 and str(py) in r.lines[0], r.stderr


@settings(SLOW, max_examples=max(10, 3 * EXAMPLES))
@given(key=st.sampled_from(KNOWN_KEYS), value=st.sampled_from(VALUES))
def test_tool_kvtool_values_of_any_type_are_one_line_or_accepted(tmp_path_factory, key, value) -> None:
    root = tmp_path_factory.mktemp("pyproject")
    m, _, _ = _model(root)
    (root / "pyproject.toml").write_text(f"[tool.kvtool]\n{key} = {value}\n")
    r = _lint_in(root, m)
    check_output(r, "text", f"{key} = {value}: {r.stderr}")
    if r.rc == 2:
        assert str(root / "pyproject.toml") in r.lines[0], r.lines


@pytest.mark.parametrize("target", ["/dev/zero", "loop", "missing", "folder"])
def test_a_pyproject_that_is_a_link_or_not_a_file_never_crashes(tmp_path, target) -> None:
    m, _, _ = _model(tmp_path)
    py = tmp_path / "pyproject.toml"
    if target == "loop":
        py.symlink_to(py)
    elif target == "missing":
        py.symlink_to(tmp_path / "nowhere")
    elif target == "folder":
        py.mkdir()
    else:
        py.symlink_to(target)
    r = _lint_in(tmp_path, m)
    check_output(r, "text", r.stderr)


# --- KVTOOL_CACHE that is not a folder ------------------------------------------------------------------
@pytest.mark.parametrize("where", ["file", "under-a-file", "proc"])
def test_kvtool_cache_naming_a_file_is_one_line(tmp_path, where) -> None:
    f = tmp_path / "cache"
    f.write_text("not a folder")
    cache = {"file": f, "under-a-file": f / "sub", "proc": Path("/proc/1/kvtool")}[where]
    check_refusal(["fixtures", "--path", "smollm2"], sources=[f], env={"KVTOOL_CACHE": str(cache)},
                  names=["KVTOOL_CACHE", str(cache)])
    assert f.read_text() == "not a folder"


# --- stdout on a full device ------------------------------------------------------------------------------
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full on this system")
@pytest.mark.parametrize("command", ["rope", "convert", "lint", "kv-budget"])
def test_stdout_on_a_full_device_is_one_line_and_dst_stays_whole(tmp_path, command) -> None:
    from kvtool.io.safetensors_header import read_header

    m, _, out = _model(tmp_path)
    args = {"rope": ["rope", m, out, "--type", "linear", "--factor", "2"],
            "convert": ["convert", m, out, "--to", "mqa", "--no-eval"], "lint": ["lint", m],
            "kv-budget": ["kv-budget", m]}[command]
    with open("/dev/full", "w") as full:
        p = subprocess.run([sys.executable, "-m", "kvtool", *map(str, args)], stdout=full, stderr=subprocess.PIPE,
                           stdin=subprocess.DEVNULL, timeout=60, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = p.stderr.decode().splitlines()
    assert p.returncode == 2 and len(lines) == 1, lines
    assert lines[0].startswith("kvtool: error: stdout: cannot write: No space left on device"), lines
    if command in ("rope", "convert"):  # published before the report was printed: kept, whole, and said so
        assert lines[0].endswith(f"{out} is written"), lines
        json.loads((out / "config.json").read_text())
        header = read_header(out / "model.safetensors")  # the safetensors library's own rules
        assert header.ok and header.tensors and all(t.dtype == "BF16" for t in header.tensors.values())
        assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.kvtool-")]


# --- fuzz: the harness's safetensors mutations, every command --------------------------------------------
FUZZ_CASES = int(os.environ.get("KVTOOL_HOSTILE_FUZZ", "8"))


@pytest.mark.parametrize("command", COMMANDS)
def test_any_weights_file_keeps_the_output_contract(tmp_path, command) -> None:
    step = max(1, len(MUTATIONS) // FUZZ_CASES)
    for i in range(0, step * FUZZ_CASES, step):
        name, data = case(i + len(MUTATIONS) * (COMMANDS.index(command) % 3))  # other seeds per command
        root = tmp_path / str(i)
        m, recipe, out = _model(root)
        (m / "model.safetensors").write_bytes(data)
        r = run_kvtool(_commands(m, out, recipe)[command])
        check_output(r, "text", f"kvtool {command} on mutation {name} (case {i})\nrc={r.rc}\n{r.stderr}")
