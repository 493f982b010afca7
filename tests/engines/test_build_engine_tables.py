"""schemas/build_engine_tables.py on small unpacked "releases": where the model-type mapping lives, which rows follow."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("build_engine_tables", REPO / "schemas" / "build_engine_tables.py")
B = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(B)

OLD_AUTO = 'CONFIG_MAPPING_NAMES = OrderedDict([("llama", "LlamaConfig")])\n'
# 5.6 on: the literal is generated into auto_mappings.py; configuration_auto.py imports it and adds entries
NEW_AUTO = ('from .auto_mappings import CONFIG_MAPPING_NAMES, SPECIAL_MODEL_TYPE_TO_MODULE_NAME\n'
            'CONFIG_MAPPING_NAMES.update({"mimi_decoder": "MimiDecoderConfig"})\n'
            'CONFIG_MAPPING_NAMES = OrderedDict(**{"gpt-sw3": "GPT2Config"}, **CONFIG_MAPPING_NAMES)\n')
MAPPINGS = ('CONFIG_MAPPING_NAMES = OrderedDict([("exaone", "ExaoneConfig"), ("llama", "LlamaConfig")])\n'
            'SPECIAL_MODEL_TYPE_TO_MODULE_NAME = OrderedDict([])\n')


def _release(root: Path, version: str, auto: str, mappings: str | None = None, llama_config: str = "",
             rope_utils: str | None = None) -> None:
    tf = root / version / "transformers"
    (tf / "models" / "auto").mkdir(parents=True)
    (tf / "models" / "auto" / "configuration_auto.py").write_text(auto)
    if mappings is not None:
        (tf / "models" / "auto" / "auto_mappings.py").write_text(mappings)
    (tf / "models" / "llama").mkdir()
    (tf / "models" / "llama" / "configuration_llama.py").write_text(llama_config)
    if rope_utils is not None:
        (tf / "modeling_rope_utils.py").write_text(rope_utils)


def test_the_mapping_is_read_from_auto_mappings_with_configuration_autos_additions(tmp_path: Path) -> None:
    _release(tmp_path, "5.6.0", NEW_AUTO, MAPPINGS)
    assert set(B.auto_dict(tmp_path / "5.6.0", "CONFIG_MAPPING_NAMES")) == {"exaone", "llama", "mimi_decoder",
                                                                          "gpt-sw3"}


def test_a_model_type_first_listed_in_auto_mappings_gets_its_row(tmp_path: Path) -> None:
    _release(tmp_path, "5.5.0", OLD_AUTO)
    _release(tmp_path, "5.6.0", NEW_AUTO, MAPPINGS)
    rows = {r["id"]: r for r in B.build(tmp_path)["facts"]}
    row = rows["tf-model-types-from-5.6.0"]
    assert row["args"] == {"model_types": ["exaone"]} and row["releases"] == "<5.6.0"
    assert row["citation"]["file"] == "src/transformers/models/auto/auto_mappings.py"


def test_a_release_whose_mapping_was_not_unpacked_is_refused(tmp_path: Path) -> None:
    _release(tmp_path, "5.6.0", NEW_AUTO)  # auto_mappings.py left out of the unzip
    with pytest.raises(SystemExit, match="auto_mappings.py: missing"):
        B.build(tmp_path)


def test_a_release_with_no_mapping_read_is_refused(tmp_path: Path) -> None:
    _release(tmp_path, "5.6.0", "CONFIG_MAPPING_NAMES = make_mapping()\n")
    with pytest.raises(SystemExit, match="no CONFIG_MAPPING_NAMES"):
        B.build(tmp_path)


@pytest.mark.parametrize("shared,row", [("", True), ('getattr(config, "partial_rotary_factor", 1.0)\n', False)])
def test_partial_rotary_rows_stop_where_the_shared_rope_code_reads_the_key(tmp_path: Path, shared: str,
                                                                           row: bool) -> None:
    _release(tmp_path, "4.56.0", OLD_AUTO, rope_utils="ROPE_INIT_FUNCTIONS = {}\n")
    _release(tmp_path, "4.57.0", OLD_AUTO, llama_config="self.partial_rotary_factor = partial_rotary_factor\n",
             rope_utils="ROPE_INIT_FUNCTIONS = {}\n" + shared)
    ids = {r["id"] for r in B.build(tmp_path)["facts"]}
    assert ("tf-partial-rotary-factor-from-4.57.0" in ids) is row
