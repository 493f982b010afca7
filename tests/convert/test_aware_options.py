"""Options of --method aware: defaults that depend on each other, and refusals by name."""

from __future__ import annotations

import pytest

from kvtool.cli import main
from kvtool.convert.aware.method import SEQ_LEN_CLOSED_FORM, SEQ_LEN_REFINE, AwareMerge
from kvtool.errors import UsageError


def test_sequence_length_follows_refinement_unless_given():
    assert AwareMerge().settings["seq_len"] == SEQ_LEN_CLOSED_FORM
    assert AwareMerge(refine_steps=0).settings["seq_len"] == SEQ_LEN_CLOSED_FORM
    assert AwareMerge(refine_steps=8).settings["seq_len"] == SEQ_LEN_REFINE
    assert AwareMerge(refine_steps=8, seq_len=128).settings["seq_len"] == 128
    assert AwareMerge(seq_len=64).settings["seq_len"] == 64
    assert SEQ_LEN_REFINE > SEQ_LEN_CLOSED_FORM


@pytest.mark.parametrize("opts, field", [({"seq_len": 1}, "--seq-len"), ({"refine_steps": -1}, "--refine-steps"),
                                         ({"calib_tokens": 1}, "--calib-tokens"), ({"grouping": "random"}, "--grouping")])
def test_bad_values_are_refused_by_name(opts, field):
    with pytest.raises(UsageError) as exc:
        AwareMerge(**opts)
    assert exc.value.field == field


def test_mean_refuses_the_calibration_flags(tmp_path, capsys):
    from kvtest import write_config

    src = tmp_path / "m"
    write_config(src, {"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 64, "num_attention_heads": 4,
                       "num_key_value_heads": 4, "vocab_size": 32})
    rc = main(["convert", str(src), str(tmp_path / "out"), "--to", "mqa", "--seq-len", "512"])
    err = capsys.readouterr().err
    assert rc == 2 and "seq_len" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
