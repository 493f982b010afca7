"""staged_output: rename into place on success; nothing left behind on errors, Ctrl-C, ENOSPC."""

from __future__ import annotations

import errno
import os
import signal

import pytest

from kvtool.errors import InputError, UsageError
from kvtool.io.staging import copy_side_files, staged_output


def _leftovers(parent):
    return sorted(p.name for p in parent.iterdir() if ".kvtool-" in p.name)


def test_success_renames_into_place(tmp_path):
    dst = tmp_path / "out"
    with staged_output(dst, verify=None) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".out.kvtool-tmp-")
        (tmp / "a.txt").write_text("x")
        assert not dst.exists()
    assert (dst / "a.txt").read_text() == "x"
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
def test_exception_leaves_no_dst_and_no_temp(tmp_path, exc):
    dst = tmp_path / "out"
    with pytest.raises(type(exc)):
        with staged_output(dst, verify=None) as tmp:
            (tmp / "model.safetensors").write_bytes(b"half")
            raise exc
    assert not dst.exists()
    assert _leftovers(tmp_path) == []


def test_sigterm_cleans_up(tmp_path):
    dst = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        with staged_output(dst, verify=None) as tmp:
            (tmp / "x").write_text("1")
            os.kill(os.getpid(), signal.SIGTERM)
    assert not dst.exists() and _leftovers(tmp_path) == []


def test_enospc_becomes_one_line_input_error(tmp_path):
    dst = tmp_path / "out"
    with pytest.raises(InputError, match="no space left on device") as ei:
        with staged_output(dst, verify=None):
            raise OSError(errno.ENOSPC, "No space left on device")
    assert "\n" not in ei.value.line()
    assert not dst.exists() and _leftovers(tmp_path) == []


def test_non_empty_destination_needs_force_and_is_replaced_whole(tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "old.txt").write_text("old")
    with pytest.raises(UsageError, match="not empty"):
        with staged_output(dst, verify=None):
            pass
    assert (dst / "old.txt").exists()
    with staged_output(dst, force=True, verify=None) as tmp:
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in dst.iterdir()) == ["new.txt"]
    assert _leftovers(tmp_path) == []


def test_failed_forced_run_keeps_the_previous_output(tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "old.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with staged_output(dst, force=True, verify=None):
            raise RuntimeError("boom")
    assert (dst / "old.txt").read_text() == "old"


def test_empty_destination_folder_is_fine_and_file_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with staged_output(tmp_path / "empty", verify=None) as tmp:
        (tmp / "f").write_text("1")
    assert (tmp_path / "empty" / "f").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="not a folder"):
        with staged_output(tmp_path / "file", force=True, verify=None):
            pass


def test_refuses_source_as_destination(tmp_path):
    src = tmp_path / "model"
    src.mkdir()
    (src / "config.json").write_text("{}")
    for dst in (src, tmp_path):
        with pytest.raises(UsageError, match="input checkpoint"):
            with staged_output(dst, force=True, protect=[src], verify=None):
                pass
    assert (src / "config.json").exists()


def test_copy_side_files_skips_weights_config_and_index(tmp_path):
    src, dst = tmp_path / "s", tmp_path / "d"
    src.mkdir(), dst.mkdir()
    names = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
             "chat_template.jinja", "README.md", "config.json", "model.safetensors", "model-00001-of-00002.safetensors",
             "model.safetensors.index.json", "pytorch_model.bin", "kvtool.json", ".gitattributes"]
    for n in names:
        (src / n).write_text("x")
    (src / "original").mkdir()
    copied = copy_side_files(src, dst)
    assert copied == sorted(["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                             "generation_config.json", "chat_template.jinja", "README.md"])
    assert sorted(p.name for p in dst.iterdir()) == copied


def test_errors_name_dst_not_the_staging_folder(tmp_path):
    dst = tmp_path / "out"
    with pytest.raises(InputError) as e:
        with staged_output(dst, verify=None) as tmp:
            raise InputError(f"bad tensor in {tmp}/model.safetensors", file=str(tmp / "config.json"))
    assert e.value.file == str(dst / "config.json")
    assert e.value.message == f"bad tensor in {dst}/model.safetensors" and ".kvtool-tmp-" not in str(e.value)
