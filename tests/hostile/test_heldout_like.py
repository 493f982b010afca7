"""Hostile inputs found by probing past the other hostile suites: each class, every command that reads it.

config.json whose top level is a JSON scalar (null, a number, a string); a `layer_types` that
transformers would refuse (unknown names, wrong length, not a list), which commands used to
accept and then compute every per-layer figure (and the converted model) from.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from harness import check_refusal, command_args, run_kvtool

TINY = Path(__file__).resolve().parents[2] / "examples" / "llama-gqa-tiny"


def _commands(m: Path, out: Path) -> dict:
    return command_args(m, out.parent)


@pytest.fixture
def model(tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(TINY, folder)
    return folder


@pytest.mark.parametrize("command", ["lint", "kv-budget", "convert", "rope-show", "apply"])
@pytest.mark.parametrize("text", ["null", "7", '"llama"', "true"])
def test_config_json_that_is_a_json_scalar(model, tmp_path, command, text) -> None:
    (model / "config.json").write_text(text)
    args, dst = _commands(model, tmp_path / "out")[command]
    check_refusal(args, sources=[model], dst=dst, names=[str(model / "config.json")])


LAYER_TYPES = {
    "unknown-names": (["bogus"] * 4, "layer_types[0]"),
    "too-few": (["full_attention"] * 2, "layer_types"),
    "too-many": (["full_attention"] * 9, "layer_types"),
    "not-a-list": ("full_attention", "layer_types"),
}


@pytest.mark.parametrize("command", ["kv-budget", "convert", "convert-dry-run", "rope", "rope-show", "apply"])
@pytest.mark.parametrize("case", sorted(LAYER_TYPES))
def test_commands_refuse_layer_types_transformers_refuses(model, tmp_path, command, case) -> None:
    value, field = LAYER_TYPES[case]
    cfg = json.loads((model / "config.json").read_text())
    cfg["layer_types"] = value
    (model / "config.json").write_text(json.dumps(cfg))
    args, dst = _commands(model, tmp_path / "out")[command]
    check_refusal(args, sources=[model], dst=dst, names=[str(model / "config.json"), f": {field}: "])


@pytest.mark.parametrize("command", ["lint", "kv-budget", "convert", "convert-dry-run", "rope", "rope-show", "apply"])
def test_config_json_symlinked_out_of_the_model_folder_is_not_read(model, tmp_path, command) -> None:
    """The same rule as for weights and side files: kvtool reads only the folders it was given."""
    outside = tmp_path / "elsewhere.json"
    outside.write_bytes((model / "config.json").read_bytes())
    (model / "config.json").unlink()
    (model / "config.json").symlink_to(outside)
    args, dst = _commands(model, tmp_path / "out")[command]
    r = check_refusal(args, sources=[model, outside], dst=dst, names=[str(model / "config.json")])
    assert "outside the model folder" in r.lines[0]


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "generation_config.json"])
def test_lint_does_not_read_side_files_symlinked_outside(model, tmp_path, monkeypatch, name) -> None:
    """lint and kv-budget read these for cross-checks only; one that leads outside is refused, unread."""
    from kvtool.errors import InputError
    from kvtool.model.checkpoint import open_checkpoint

    outside = tmp_path / "secret.json"
    outside.write_text('{"model": {"vocab": {"a": 99999}}, "bos_token_id": 77}')
    (model / name).unlink()
    (model / name).symlink_to(outside)
    real_open = Path.open

    def guarded(self, *a, **kw):
        assert Path(self).resolve() != outside.resolve(), f"{self} read"
        return real_open(self, *a, **kw)

    monkeypatch.setattr(Path, "open", guarded)
    import builtins
    real_builtin = builtins.open
    monkeypatch.setattr(builtins, "open", lambda f, *a, **kw: guarded(Path(f), *a, **kw) if isinstance(f, (str, Path))
                        else real_builtin(f, *a, **kw))
    with pytest.raises(InputError, match="outside the model folder") as exc:
        open_checkpoint(model, read_weights=False)
    assert exc.value.file == str(model / name)


def _empty_weights(model: Path, header: dict) -> Path:
    import struct

    raw = json.dumps(header).encode()
    (model / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    return model / "model.safetensors"


@pytest.mark.parametrize("command", ["convert", "convert-dry-run", "apply"])
@pytest.mark.parametrize("header", [{}, {"__metadata__": {"format": "pt"}}], ids=["no-tensors", "metadata-only"])
def test_weights_without_the_tensors_convert_needs_name_the_weights_file(model, tmp_path, command, header) -> None:
    """A valid safetensors file holding no tensors: the error names that file and the tensor, not kvtool's table."""
    st = _empty_weights(model, header)
    args, dst = _commands(model, tmp_path / "out")[command]
    r = check_refusal(args, sources=[model], dst=dst, names=[str(st), "model.layers.0.self_attn.q_proj.weight"],
                      allow_progress=command == "apply")
    assert "llama.json" not in r.stderr


RECIPES = {  # recipes the schema check let through to a computation, which then crashed
    "float-groups": ("version: 1\nname: x\nsteps:\n  - convert: {to: gqa, groups: 1.0}\n", "groups"),
    "float-tokens": ("version: 1\nname: x\nsteps:\n  - convert: {to: gqa, groups: 1, method: aware, "
                     "calibration: {dataset: pydoc, tokens: 64.0}}\n", "tokens"),
    "5000-digit-int": ("version: 1\nname: x\nsteps:\n  - convert: {to: gqa, groups: " + "9" * 5000 + "}\n", "line 4"),
    "long-hex-int": ("version: 1\nname: x\nsteps:\n  - convert: {to: gqa, groups: 0x" + "f" * 200 + "}\n", "line 4"),
}


@pytest.mark.parametrize("case", sorted(RECIPES))
def test_recipe_numbers_that_are_not_usable_integers(model, tmp_path, case) -> None:
    text, named = RECIPES[case]
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    check_refusal(["apply", recipe, model, tmp_path / "out"], sources=[model, recipe], dst=tmp_path / "out",
                  names=[str(recipe), named])
    r = run_kvtool(["lint", recipe])
    assert r.rc == 1 and "KV961" in r.stdout and not r.stderr.strip(), r.stdout + r.stderr


def _loaded_json_damage(model: Path, name: str, kind: str) -> Path:
    path = model / name
    if path.exists():
        path.unlink()
    if kind == "deep":
        path.write_text('{"a": ' * 50_000 + "1" + "}" * 50_000)
    elif kind == "huge-int":
        path.write_text('{"max_length": ' + "9" * 100_000 + "}")
    elif kind == "fifo":
        os.mkfifo(path)
    return path


@pytest.mark.parametrize("name,kind", [("generation_config.json", "deep"), ("generation_config.json", "fifo"),
                                       ("special_tokens_map.json", "huge-int"), ("tokenizer.json", "fifo")])
def test_eval_reads_every_json_transformers_will_parse_first(model, name, kind) -> None:
    """eval hands the folder to transformers; its json.load would recurse, or wait on a FIFO, forever."""
    path = _loaded_json_damage(model, name, kind)
    check_refusal(["eval", model, "--max-tokens", "64"], sources=[model], names=[str(path)])


@pytest.mark.parametrize("text_config", [None, [1], "llama"], ids=["null", "list", "string"])
def test_kv_budget_names_the_config_when_a_wrapper_hides_the_layer_count(tmp_path, text_config) -> None:
    m = tmp_path / "m"
    m.mkdir()
    (m / "config.json").write_text(json.dumps({"model_type": "qwen3_vl", "architectures": ["X"],
                                               "text_config": text_config}))
    check_refusal(["kv-budget", m, "--gpu", "L4"], sources=[m], names=[str(m / "config.json"), "num_hidden_layers"])


@pytest.mark.torch  # CheckpointReader hands out torch tensors (imported when a tensor is read)
def test_reader_names_file_and_tensor_for_a_dtype_torch_cannot_hold(model) -> None:
    """A C64 tensor is valid safetensors; reading it as torch fails with the file and tensor named."""
    import struct

    from kvtool.errors import InputError
    from kvtool.io.reader import CheckpointReader

    p = model / "model.safetensors"
    raw = p.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    header["model.extra_buf"] = {"dtype": "C64", "shape": [2], "data_offsets": [end, end + 16]}
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    p.write_bytes(struct.pack("<Q", len(hb)) + hb + data[:end] + b"\0" * 16)
    reader = CheckpointReader(model)
    with pytest.raises(InputError) as exc:
        reader._torch(reader._infos["model.extra_buf"], end, 16, (2,))
    assert exc.value.file == str(p) and exc.value.field == "model.extra_buf"


@pytest.mark.parametrize("target_files", [0, 1], ids=["empty-target", "user-folder-target"])
@pytest.mark.parametrize("command", ["convert", "rope", "apply"])
def test_destination_that_is_a_symlink_is_not_written_through(model, tmp_path, command, target_files) -> None:
    """Was: an empty target gave 'Not a directory'; --force over a link left a .DST.kvtool-old-* link behind."""
    target = tmp_path / "theirs"
    target.mkdir()
    if target_files:
        (target / "notes.txt").write_text("mine")
    dst = tmp_path / "out"
    dst.symlink_to(target)
    args, _ = _commands(model, dst)[command]
    r = check_refusal(args, sources=[model, target], names=[str(dst), "symlink"], allow_progress=command == "apply")
    assert dst.is_symlink() and "Not a directory" not in r.stderr
    if command == "rope":
        return  # rope has no --force
    r = run_kvtool([*args, "--force"])
    assert r.rc == 0, r.stderr
    assert dst.is_dir() and not dst.is_symlink() and (dst / "config.json").is_file()
    assert sorted(p.name for p in target.iterdir()) == (["notes.txt"] if target_files else [])
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.kvtool-")]


@pytest.mark.parametrize("command", ["kv-budget", "convert", "rope", "apply"])
def test_index_beside_a_model_safetensors_it_does_not_name(model, tmp_path, command) -> None:
    """transformers would load the stray model.safetensors; kvtool checked the index: refused as ambiguous (KV611)."""
    from safetensors.numpy import save_file

    (model / "model.safetensors").rename(model / "model-00001-of-00001.safetensors")
    from kvtool.io.safetensors_header import read_header

    names = read_header(model / "model-00001-of-00001.safetensors", "model-00001-of-00001.safetensors").tensors
    (model / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: "model-00001-of-00001.safetensors" for n in names}}))
    import numpy as np
    save_file({"x": np.zeros(2, np.float32)}, str(model / "model.safetensors"))
    args, dst = _commands(model, tmp_path / "out")[command]
    check_refusal(args, sources=[model], dst=dst, names=[str(model / "model.safetensors"), "ambiguous"],
                  allow_progress=command == "apply")
    r = run_kvtool(["lint", model])
    assert r.rc == 1 and "KV611" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("where", ["folder", "shard"])
def test_a_newline_in_a_path_cannot_forge_a_second_error_line(tmp_path, where) -> None:
    """A folder or a shard named with a newline: still one stderr line, the newline escaped."""
    m = tmp_path / ("bad\nkvtool: error: forged" if where == "folder" else "m")
    shutil.copytree(TINY, m)
    if where == "folder":
        cfg = json.loads((m / "config.json").read_text())
        cfg["num_key_value_heads"] = 0
        (m / "config.json").write_text(json.dumps(cfg))
        args = ["kv-budget", m]
    else:
        (m / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {"lm_head.weight": "evil\nkvtool: error: forged.safetensors"}}))
        args = ["convert", m, "--dry-run", "--to", "mqa"]
    r = check_refusal(args, sources=[m], names=["\\nkvtool: error: forged"])
    assert r.stderr.count("kvtool: error:") == 2 and r.stderr.count("\n") == 1, r.stderr


def _special_weights(model: Path, kind: str) -> Path:
    target = model / "model.safetensors"
    target.unlink()
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "device":
        target.symlink_to("/dev/urandom")
    else:
        target.mkdir()
    return target


@pytest.mark.parametrize("kind", ["fifo", "device", "folder"])
def test_lint_flags_weights_that_are_not_regular_files(model, kind) -> None:
    """Not skipped as if the folder were config-only: the safetensors library cannot read them either."""
    target = _special_weights(model, kind)
    r = run_kvtool(["lint", model], timeout=30)
    assert r.rc == 1 and f"{target}: KV606 [error] is not a regular file" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("command", ["kv-budget", "convert", "convert-dry-run", "apply"])
@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_commands_refuse_weights_that_are_not_regular_files(model, tmp_path, command, kind) -> None:
    target = _special_weights(model, kind)
    args, dst = _commands(model, tmp_path / "out")[command]
    check_refusal(args, sources=[model], dst=dst, names=[str(target), "not a regular file"], timeout=30)
