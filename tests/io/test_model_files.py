"""The table of files kvtool or transformers may open from a model folder, and the check each gets.

Every row is exercised (a link leading outside, a file over its limit, a FIFO for a load); the table is
compared with what transformers' own loaders open (every open traced) and with the file names its
source declares; docs/safety.md shows the table as generated.
"""

from __future__ import annotations

import ast
import os
import shutil
import sys
from pathlib import Path

import pytest

from kvtool.errors import InputError
from kvtool.io.model_files import MODEL_FILES, TEMPLATE_DIR, check_model_files, files_markdown, limit_of, row_of

REPO = Path(__file__).resolve().parents[2]
CHECKED = [r for r in MODEL_FILES if r.kind not in ("never-opened", "folder")]


def _instance(pattern: str) -> str:
    """A concrete file name the pattern matches (the name transformers would look for)."""
    return pattern.replace("*", "x")


def _folder(tmp_path: Path) -> Path:
    root = tmp_path / "m"
    root.mkdir()
    (root / "config.json").write_text('{"model_type": "llama"}')
    return root


def _place(root: Path, rel: str) -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        path.unlink()
    return path


@pytest.mark.parametrize("row", CHECKED, ids=[r.pattern for r in CHECKED])
def test_a_file_linked_outside_the_folder_is_refused_unread(tmp_path, monkeypatch, row) -> None:
    root = _folder(tmp_path)
    secret = tmp_path / "secret"
    secret.write_text('{"token": "hunter2"}')
    rel = _instance(row.pattern)
    _place(root, rel).symlink_to(secret)
    opened = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda p, *a, **k: opened.append(Path(p).resolve()) or real_open(p, *a, **k))
    if row.links_out:  # weights found without an index: a link into shared storage is the folder's own entry
        check_model_files(root, loaded=True)
        return
    with pytest.raises(InputError, match="outside the model folder") as exc:
        check_model_files(root)
    assert exc.value.file == str(root / rel)
    assert secret.resolve() not in opened


@pytest.mark.parametrize("row", [r for r in CHECKED if limit_of(r)], ids=[r.pattern for r in CHECKED if limit_of(r)])
def test_a_file_over_its_kind_limit_is_refused_by_its_size(tmp_path, row) -> None:
    root = _folder(tmp_path)
    rel = _instance(row.pattern)
    path = _place(root, rel)
    with path.open("wb") as fh:
        fh.truncate(limit_of(row) + 1)  # sparse: its size alone must refuse it
    with pytest.raises(InputError, match="byte limit") as exc:
        check_model_files(root)
    assert exc.value.file == str(path)
    path.unlink()
    with path.open("wb") as fh:
        fh.truncate(limit_of(row))
    check_model_files(root)


@pytest.mark.parametrize("row", CHECKED, ids=[r.pattern for r in CHECKED])
def test_a_fifo_transformers_would_open_is_refused_only_for_a_load(tmp_path, row) -> None:
    root = _folder(tmp_path)
    rel = _instance(row.pattern)
    os.mkfifo(_place(root, rel))
    check_model_files(root)  # kvtool's own readers skip (or refuse by kind) what is not a regular file
    if row.kind == "weights":  # kvtool.io.weight_files names it (KV606 / "not a regular file")
        check_model_files(root, loaded=True)
        return
    with pytest.raises(InputError, match="FIFO") as exc:
        check_model_files(root, loaded=True)
    assert exc.value.file == str(root / rel)


def test_a_templates_folder_linked_outside_is_refused(tmp_path) -> None:
    root = _folder(tmp_path)
    outside = tmp_path / "templates"
    outside.mkdir()
    (outside / "tool_use.jinja").write_text("{{ messages }}")
    (root / TEMPLATE_DIR).symlink_to(outside)
    with pytest.raises(InputError, match="outside the model folder") as exc:
        check_model_files(root)
    assert exc.value.file == str(root / TEMPLATE_DIR)


def test_hugging_face_cache_snapshot_links_pass(tmp_path) -> None:
    repo = tmp_path / "models--org--m"
    snap, blobs = repo / "snapshots" / "abc", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for i, name in enumerate(["config.json", "tokenizer_config.json", "chat_template.jinja"]):
        (blobs / f"sha{i}").write_text("{}")
        (snap / name).symlink_to(f"../../blobs/sha{i}")
    check_model_files(snap, loaded=True)


def test_unlisted_files_are_not_checked(tmp_path) -> None:
    root = _folder(tmp_path)
    secret = tmp_path / "secret"
    secret.write_text("x")
    (root / "README.md").symlink_to(secret)  # no reader opens it; the copy of side files refuses it (io/staging.py)
    assert row_of("README.md") is None
    check_model_files(root, loaded=True)


def test_rows_match_as_fnmatch_matches() -> None:
    """row_of tests names with string methods instead of a regex per pattern: fnmatchcase's answers."""
    from fnmatch import fnmatchcase

    from kvtool.io.model_files import _matcher

    names = ["config.json", "config.a.json", "config..json", "x.json", "a/b.json", ".json", "json", "Config.json",
             "tokenizer.model", "tokenizer.model.", "tokenizer.model.x", "additional_chat_templates/x.jinja",
             "additional_chat_templates/a/b.jinja", "additional_chat_templates/.jinja", "a.py\n", "*", "", "x.bin"]
    for pattern in [*(r.pattern for r in MODEL_FILES), "a?b", "[ab]*", "*a*", "*", "a*"]:
        for name in names + ["ab", "aab", "acb", "a"]:
            assert _matcher(pattern)(name) == fnmatchcase(name, pattern), (pattern, name)
    assert [row_of(n) for n in names] == [next((r for r in MODEL_FILES if fnmatchcase(n, r.pattern)), None)
                                          for n in names]


def test_docs_show_the_table() -> None:
    assert files_markdown() in (REPO / "docs" / "safety.md").read_text(encoding="utf-8")


# --- the table against transformers itself -------------------------------------------------------------------

def _transformers_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.origin:
        pytest.skip("transformers is not installed")  # the torch lane installs it; the check runs there
    return Path(spec.origin).parent


def _string_constants(path: Path) -> dict[str, str]:
    out = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            out[node.targets[0].id] = node.value.value
    return out


def _vocab_file_names(tf: Path) -> set[str]:
    """Every value of a VOCAB_FILES_NAMES / vocab_files_names dict in transformers' model classes."""
    names = set()
    for path in (tf / "models").rglob("tokenization_*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else getattr(
                node, "target", None)
            if isinstance(target, ast.Name) and target.id in ("VOCAB_FILES_NAMES", "vocab_files_names") \
                    and isinstance(node.value, ast.Dict):
                names.update(v.value for v in node.value.values if isinstance(v, ast.Constant)
                             and isinstance(v.value, str))
    return names


# transformers modules that name the files its loaders look for in a model folder
LOADER_MODULES = ("utils/__init__.py", "utils/hub.py", "tokenization_utils_base.py", "tokenization_utils_tokenizers.py",
                  "tokenization_python.py", "integrations/mistral/constants.py", "utils/peft_utils.py")


def test_every_file_name_transformers_declares_is_in_the_table() -> None:
    tf = _transformers_dir()
    declared = {}
    for module in LOADER_MODULES:
        if (tf / module).is_file():
            for name, value in _string_constants(tf / module).items():
                if name.endswith(("_FILE", "_NAME", "_DIR")) and ("." in value or name.endswith("_DIR")) \
                        and "/" not in value and " " not in value:
                    declared[f"{module}:{name}"] = value
    for value in _vocab_file_names(tf):
        declared[f"VOCAB_FILES_NAMES:{value}"] = value
    assert len(declared) > 20, declared  # the scan found the constants (a moved module would empty it)
    assert "utils/hub.py:CHAT_TEMPLATE_FILE" in declared and "tokenization_utils_base.py:TOKENIZER_CONFIG_FILE" in declared
    missing = {k: v for k, v in declared.items() if row_of(v) is None}
    assert not missing, f"files transformers may open that kvtool's table does not list: {missing}"


class _OpenTrace:
    """Paths under `root` that Python opens (the `open` audit event: builtins.open, io.open, os.open).

    transformers parses every file in Python before a native library reads it (tokenization_utils_tokenizers.py
    opens tokenizer.json before tokenizers.Tokenizer.from_file; strace shows no other open under the folder)."""

    def __init__(self, root: Path):
        self.root = str(root.resolve())
        self.seen: set[str] = set()
        self.active = True
        sys.addaudithook(self._hook)  # hooks cannot be removed: `active` turns this one off

    def _add(self, path) -> None:
        if self.active and isinstance(path, (str, bytes, os.PathLike)):
            p = os.path.realpath(os.fsdecode(path))
            if p.startswith(self.root + os.sep):
                self.seen.add(os.path.relpath(p, self.root))

    def _hook(self, event, args) -> None:
        if event == "open" and args:
            self._add(args[0])

    def stop(self) -> set[str]:
        self.active = False
        return self.seen


def _load_everything(folder: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
    tok = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    assert tok.chat_template or True
    try:
        GenerationConfig.from_pretrained(str(folder))
    except OSError:
        pass  # no generation_config.json: nothing opened


@pytest.fixture
def rich_folder(smollm2_path, tmp_path) -> Path:
    """SmolLM2's tokenizer, config and templates, plus every optional tokenizer file transformers looks for."""
    folder = tmp_path / "rich"
    folder.mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja"):
        shutil.copy(smollm2_path / name, folder / name)
    (folder / "special_tokens_map.json").write_text('{"bos_token": "<|im_start|>"}')
    (folder / "added_tokens.json").write_text("{}")
    (folder / TEMPLATE_DIR).mkdir()
    (folder / TEMPLATE_DIR / "tool_use.jinja").write_text("{{ messages }}")
    return folder


def test_every_file_transformers_opens_is_in_the_table(rich_folder, gemma3_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for folder in (rich_folder, gemma3_path):
        trace = _OpenTrace(folder)
        try:
            _load_everything(folder)
        finally:
            opened = trace.stop()
        assert "config.json" in opened and "tokenizer.json" in opened, opened
        unlisted = sorted(rel for rel in opened if row_of(rel) is None or "transformers" not in row_of(rel).opened_by)
        assert not unlisted, f"transformers opened files kvtool's table does not list for it: {unlisted}"
        if folder == rich_folder:
            expected = {"chat_template.jinja", f"{TEMPLATE_DIR}/tool_use.jinja", "special_tokens_map.json",
                        "added_tokens.json", "tokenizer_config.json", "generation_config.json"}
            assert expected <= opened, expected - opened


def test_every_file_a_model_load_opens_is_in_the_table(smollm2_path, tmp_path, monkeypatch) -> None:
    """AutoModelForCausalLM too: config, weights (opened by safetensors' Rust code: its safe_open is traced)."""
    import transformers.modeling_utils as modeling_utils
    from transformers import AutoModelForCausalLM

    from tests.hostile.models import llama_with_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = llama_with_tokenizer(tmp_path / "tiny", smollm2_path)
    trace = _OpenTrace(folder)
    real_safe_open = modeling_utils.safe_open
    monkeypatch.setattr(modeling_utils, "safe_open", lambda path, *a, **k: trace._add(path) or real_safe_open(path, *a, **k))
    try:
        AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=False)
        _load_everything(folder)
    finally:
        opened = trace.stop()
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= opened, opened
    unlisted = sorted(rel for rel in opened if row_of(rel) is None or "transformers" not in row_of(rel).opened_by)
    assert not unlisted, f"transformers opened files kvtool's table does not list for it: {unlisted}"


def test_every_file_transformers_opens_is_checked_first(rich_folder, tmp_path, monkeypatch) -> None:
    """Each file the loaders opened, linked outside: kvtool's gate refuses the folder before any load."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    trace = _OpenTrace(rich_folder)
    try:
        _load_everything(rich_folder)
    finally:
        opened = trace.stop()
    from kvtool.model.preflight import refuse_unreadable_json

    for rel in sorted(opened):
        outside = tmp_path / "outside" / rel
        outside.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(rich_folder / rel, outside)
        (rich_folder / rel).symlink_to(outside)
        with pytest.raises(InputError, match="outside the model folder"):
            check_model_files(rich_folder, loaded=True)
        (rich_folder / rel).unlink()
        shutil.move(outside, rich_folder / rel)
    check_model_files(rich_folder, loaded=True)
    refuse_unreadable_json(rich_folder)
