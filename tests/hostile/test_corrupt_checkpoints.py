"""Corrupt and hostile checkpoints x every command that reads them: one refusal contract.

Each case damages a valid tiny Llama folder (a safetensors file the library refuses, a broken or
escaping index, pickle-only weights whose payload would create the trap file, an auto_map whose
module would create it on import) and runs a command on it through harness.check_refusal: exit 2,
one line naming the file (and tensor or field), no output folder, the source unchanged, the trap
never created.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest

from harness import check_refusal
from kvtest import write_config, write_safetensors
from malformed import edited

H, L, HEADS, KV, VOCAB, FF = 64, 2, 4, 2, 128, 128
CONFIG = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": H, "intermediate_size": FF,
    "num_hidden_layers": L, "num_attention_heads": HEADS, "num_key_value_heads": KV, "vocab_size": VOCAB,
    "max_position_embeddings": 256, "rope_theta": 10000.0, "torch_dtype": "float32", "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2,
}
ST, INDEX = "model.safetensors", "model.safetensors.index.json"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def llama_tensors() -> dict:
    rng = np.random.default_rng(0)
    hd = H // HEADS
    shapes = {"model.embed_tokens.weight": (VOCAB, H), "lm_head.weight": (VOCAB, H), "model.norm.weight": (H,)}
    for i in range(L):
        p = f"model.layers.{i}"
        shapes.update({f"{p}.self_attn.q_proj.weight": (HEADS * hd, H), f"{p}.self_attn.k_proj.weight": (KV * hd, H),
                       f"{p}.self_attn.v_proj.weight": (KV * hd, H), f"{p}.self_attn.o_proj.weight": (H, HEADS * hd),
                       f"{p}.mlp.gate_proj.weight": (FF, H), f"{p}.mlp.up_proj.weight": (FF, H),
                       f"{p}.mlp.down_proj.weight": (H, FF), f"{p}.input_layernorm.weight": (H,),
                       f"{p}.post_attention_layernorm.weight": (H,)})
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}


def sharded(src: Path, *, index: bool = True, twice: str | None = None, weight_map: dict | None = None) -> None:
    ts = llama_tensors()
    names = sorted(ts)
    parts = (names[: len(names) // 2], names[len(names) // 2:])
    if twice:
        parts = tuple(p if twice in p else p + [twice] for p in parts)
    wm = {}
    for fname, part in zip(SHARDS, parts):
        write_safetensors(src / fname, {n: ts[n] for n in part})
        wm.update({n: fname for n in part})
    wm.update(weight_map or {})
    if index:
        (src / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": wm}))


def _rewrite(src: Path, **kw) -> None:
    p = src / ST
    p.write_bytes(edited(p.read_bytes(), **kw))


def _overlap(h):  # the embedding's offsets point at lm_head's bytes
    h["model.embed_tokens.weight"]["data_offsets"] = h["lm_head.weight"]["data_offsets"]


def _cut(src: Path) -> None:
    p = src / ST
    p.write_bytes(p.read_bytes()[:-100])


def _not_utf8(h) -> bytes:
    return json.dumps(h).encode().replace(b"model.norm", b"model.\xffnorm")


def _dup_metadata(h) -> bytes:
    h["__metadata__"] = {"format": "np"}
    return b'{"__metadata__":{"a":"1"},' + json.dumps(h).encode()[1:]


# name -> (damage(src, outside), words the error line must name)
CORRUPT = {
    "overlapping-offsets": (lambda s, o: _rewrite(s, edit=_overlap), [ST, "data_offsets"]),
    "bytes-after-last-tensor": (lambda s, o: _rewrite(s, tail=b"\0" * 8), [ST, "bytes after the last tensor"]),
    "metadata-not-strings": (lambda s, o: _rewrite(s, edit=lambda h: h.update(__metadata__={"step": 1})),
                             [ST, "__metadata__"]),
    "metadata-twice": (lambda s, o: _rewrite(s, edit=_dup_metadata), [ST, "__metadata__"]),
    "header-length-off-by-one": (lambda s, o: _rewrite(s, length_delta=1), [ST, "header"]),
    "truncated": (lambda s, o: _cut(s), [ST]),
    "header-not-utf8": (lambda s, o: _rewrite(s, edit=_not_utf8), [ST, "UTF-8"]),
    "unknown-dtype": (lambda s, o: _rewrite(s, edit=lambda h: h["model.norm.weight"].update(dtype="F33")),
                      [ST, "model.norm.weight", "dtype"]),
    "tensor-in-two-shards": (lambda s, o: ((s / ST).unlink(), sharded(s, twice="model.norm.weight")),
                             ["model.norm.weight", SHARDS[0], SHARDS[1]]),
    "empty-weight-map": (lambda s, o: ((s / ST).unlink(), sharded(s), (s / INDEX).write_text('{"weight_map": {}}')),
                         [INDEX, "weight_map", "empty"]),
    "shards-without-index": (lambda s, o: ((s / ST).unlink(), sharded(s, index=False)), [SHARDS[0], INDEX]),
    "missing-shard": (lambda s, o: ((s / ST).unlink(), sharded(s), (s / SHARDS[1]).unlink()), [INDEX, SHARDS[1]]),
    "index-names-wrong-shard": (lambda s, o: ((s / ST).unlink(), sharded(s, weight_map={
        "model.norm.weight": SHARDS[0] if "model.norm.weight" not in _first_half() else SHARDS[1]})),
        [INDEX, "model.norm.weight"]),
    "index-escape-dotdot": (lambda s, o: ((s / ST).unlink(), sharded(s, weight_map={"model.norm.weight": "../outside.safetensors"})),
                            [INDEX, "../outside.safetensors"]),
    "index-escape-absolute": (lambda s, o: ((s / ST).unlink(), sharded(s, weight_map={"model.norm.weight": str(o)})),
                              [INDEX, "outside.safetensors"]),
    "index-escape-symlink": (lambda s, o: ((s / ST).unlink(), sharded(s, weight_map={"model.norm.weight": "link.safetensors"}),
                                           (s / "link.safetensors").symlink_to(o)), [INDEX, "link.safetensors"]),
}


def _first_half() -> list[str]:
    names = sorted(llama_tensors())
    return names[: len(names) // 2]


@pytest.fixture
def folder(tmp_path) -> tuple[Path, Path]:
    src = tmp_path / "src"
    write_config(src, CONFIG)
    write_safetensors(src / ST, llama_tensors())
    outside = tmp_path / "outside.safetensors"  # a valid file outside the model folder: never to be read
    write_safetensors(outside, {"model.norm.weight": np.ones(H, np.float32)})
    (tmp_path / "calib.txt").write_text("the quick brown fox jumps over the lazy dog. " * 50)
    return src, outside


def _commands(src: Path, tmp: Path) -> dict[str, tuple[list[str], Path | None]]:
    dst = tmp / "dst"
    recipe = tmp / "recipe.yaml"
    recipe.write_text("version: 1\nname: t\nsteps:\n  - convert: {to: mqa}\n")
    return {
        "convert": (["convert", src, dst, "--to", "mqa", "--no-eval"], dst),
        "convert-dry-run": (["convert", src, "--to", "mqa", "--dry-run"], None),
        "rope": (["rope", src, dst, "--type", "linear", "--factor", "2"], dst),
        "quantize-kv": (["quantize-kv", src, dst, "--calib-text", tmp / "calib.txt"], dst),
        "eval": (["eval", src, "--max-tokens", "64"], None),
        "kv-budget": (["kv-budget", src], None),
        "apply": (["apply", recipe, src, dst], dst),
    }


COMMANDS = ["convert", "convert-dry-run", "rope", "quantize-kv", "eval", "kv-budget", "apply"]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("damage", sorted(CORRUPT))
def test_corrupt_weights_are_refused(folder, tmp_path, damage, command):
    src, outside = folder
    fn, names = CORRUPT[damage]
    fn(src, outside)
    args, dst = _commands(src, tmp_path)[command]
    check_refusal(args, sources=[src, outside], dst=dst, names=names, trap=tmp_path / "trap",
                  allow_progress=command == "apply")


class _Payload:
    """Unpickling this creates the trap file: a pickle must never be opened."""

    def __init__(self, trap: Path):
        self.trap = str(trap)

    def __reduce__(self):
        return (os.system, (f"touch {self.trap}",))


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("pickle_name", ["pytorch_model.bin", "model.pt"])
def test_pickle_only_folder_is_refused_unopened(folder, tmp_path, command, pickle_name):
    src, outside = folder
    (src / ST).unlink()
    trap = tmp_path / "trap"
    (src / pickle_name).write_bytes(pickle.dumps({"model.norm.weight": _Payload(trap)}))
    args, dst = _commands(src, tmp_path)[command]
    check_refusal(args, sources=[src], dst=dst, names=[str(src), pickle_name, "never unpickles"], trap=trap,
                  allow_progress=command == "apply")


MODELING = "import os, pathlib\npathlib.Path(os.environ['KVTOOL_HOSTILE_TRAP']).write_text('checkpoint code ran')\n"


def _auto_map(src: Path, where: str) -> tuple[str, str]:
    (src / "modeling_x.py").write_text(MODELING)
    (src / "tokenization_x.py").write_text(MODELING)
    if where == "config.json":
        write_config(src, {**CONFIG, "auto_map": {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}})
        return "config.json", "auto_map.AutoModelForCausalLM"
    (src / "tokenizer_config.json").write_text(json.dumps(
        {"auto_map": {"AutoTokenizer": ["tokenization_x.XTokenizer", None]}, "tokenizer_class": "XTokenizer"}))
    return "tokenizer_config.json", "auto_map.AutoTokenizer"


def _loading_commands(src: Path, tmp: Path) -> dict[str, tuple[list[str], Path | None]]:
    dst = tmp / "dst"
    recipe = tmp / "recipe.yaml"
    recipe.write_text("version: 1\nname: t\nsteps:\n  - eval: {dataset: pydoc, max_tokens: 64}\n")
    return {
        "eval": (["eval", src, "--max-tokens", "64"], None),
        "quantize-kv": (["quantize-kv", src, dst, "--calib-text", tmp / "calib.txt"], dst),
        "convert-aware": (["convert", src, dst, "--to", "mqa", "--method", "aware", "--no-eval"], dst),
        "convert-eval": (["convert", src, dst, "--to", "mqa", "--eval"], dst),
        "apply": (["apply", recipe, src, dst], dst),
    }


@pytest.mark.parametrize("command", ["eval", "quantize-kv", "convert-aware", "convert-eval", "apply"])
@pytest.mark.parametrize("where", ["config.json", "tokenizer_config.json"])
def test_auto_map_is_refused_by_name(folder, tmp_path, command, where):
    src, _ = folder
    file, entry = _auto_map(src, where)
    args, dst = _loading_commands(src, tmp_path)[command]
    check_refusal(args, sources=[src], dst=dst, names=[file, entry, "kvtool never runs it"], trap=tmp_path / "trap",
                  allow_progress=command == "apply")


@pytest.mark.parametrize("command", ["convert-dry-run", "kv-budget"])
def test_auto_map_does_not_stop_commands_that_load_no_model(folder, tmp_path, command):
    from harness import run_kvtool

    src, _ = folder
    _auto_map(src, "config.json")
    args, _ = _commands(src, tmp_path)[command]
    r = run_kvtool(args, env={"KVTOOL_HOSTILE_TRAP": str(tmp_path / "trap")})
    assert r.rc == 0, r.stderr
    assert not (tmp_path / "trap").exists()
