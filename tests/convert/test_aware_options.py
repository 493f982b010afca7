"""Options of --method aware: defaults that depend on each other, and refusals by name."""

from __future__ import annotations

import pytest

from kvtool.cli import main
from kvtool.convert.aware.method import REFINE_TARGETS, AwareMerge
from kvtool.convert.defaults import CALIB_TOKENS, CALIB_TOKENS_REFINE, SEQ_LEN_CLOSED_FORM, SEQ_LEN_REFINE
from kvtool.errors import UsageError


def test_sequence_length_follows_refinement_unless_given():
    assert AwareMerge().settings["seq_len"] == SEQ_LEN_CLOSED_FORM
    assert AwareMerge(refine_steps=0).settings["seq_len"] == SEQ_LEN_CLOSED_FORM
    assert AwareMerge(refine_steps=8).settings["seq_len"] == SEQ_LEN_REFINE
    assert AwareMerge(refine_steps=8, seq_len=128).settings["seq_len"] == 128
    assert AwareMerge(seq_len=64).settings["seq_len"] == 64
    assert AwareMerge(distill_steps=4).settings["seq_len"] == SEQ_LEN_REFINE  # distillation wants long sequences
    assert SEQ_LEN_REFINE > SEQ_LEN_CLOSED_FORM


def test_calibration_tokens_follow_refinement_unless_given():
    """Refinement alone takes more calibration tokens (measured on the dev texts); distillation keeps the
    training-free count, with or without refinement."""
    assert AwareMerge().settings["calib_tokens"] == CALIB_TOKENS
    assert AwareMerge(refine_steps=8).settings["calib_tokens"] == CALIB_TOKENS_REFINE
    assert AwareMerge(refine_steps=8, distill_steps=4).settings["calib_tokens"] == CALIB_TOKENS
    assert AwareMerge(distill_steps=4).settings["calib_tokens"] == CALIB_TOKENS
    assert AwareMerge(refine_steps=8, calib_tokens=512).settings["calib_tokens"] == 512
    assert CALIB_TOKENS_REFINE > CALIB_TOKENS


def test_refinement_target_follows_distillation_unless_given():
    """Refined alone, refinement fits the original stream; before distillation, the layer's own inputs (both
    measured on the dev texts, kvtool/convert/aware/method.py REFINE_TARGETS)."""
    cases = [({"refine_steps": 8}, "original", True), ({"refine_steps": 8, "distill_steps": 4}, "layer", False),
             ({"refine_steps": 8, "distill_steps": 4, "refine_target": "original"}, "original", True),
             ({"refine_steps": 8, "refine_target": "layer"}, "layer", False), ({}, "original", False)]
    for opts, target, stream in cases:
        m = AwareMerge(**opts)
        assert (m.settings["refine_target"], m.original_stream) == (target, stream), opts
        assert m.settings["refine_lr"] == REFINE_TARGETS[target]  # each target's own step unless given
    assert AwareMerge(refine_steps=8, refine_lr=1e-3).settings["refine_lr"] == 1e-3
    assert REFINE_TARGETS["original"] > REFINE_TARGETS["layer"]


@pytest.mark.parametrize("opts, field", [({"seq_len": 1}, "seq_len"), ({"refine_steps": -1}, "refine_steps"),
                                         ({"calib_tokens": 1}, "calib_tokens"), ({"grouping": "random"}, "grouping"),
                                         ({"distill_steps": -2}, "distill_steps"), ({"distill_lr": 0}, "method_opt"),
                                         ({"distill_lr": "fast"}, "method_opt"),
                                         ({"distill_lr": float("nan")}, "method_opt"),
                                         ({"distill_lr": float("inf")}, "method_opt"),
                                         ({"static_angle": -1}, "method_opt"),
                                         ({"static_angle": float("nan")}, "method_opt"),
                                         ({"static_angle": "wide"}, "method_opt"),
                                         ({"refine_lr": 0}, "method_opt"), ({"refine_lr": "fast"}, "method_opt"),
                                         ({"refine_lr": float("nan")}, "method_opt"),
                                         ({"refine_target": ["original"]}, "method_opt"),
                                         ({"serve_context": 1}, "serve_context"),
                                         ({"serve_context": 2.5}, "serve_context"),
                                         ({"serve_context": True}, "serve_context"),
                                         ({"serve_context": "8k"}, "serve_context")])
def test_bad_values_are_refused_by_name(opts, field):
    """A declared option is refused by its declaration (the options object), a --method-opt by the method."""
    from kvtool.options.convert import ConvertOptions

    with pytest.raises(UsageError) as exc:
        if field == "method_opt":
            AwareMerge(**opts)
        else:
            ConvertOptions(src="m", to="mqa", method="aware", **opts)
    assert exc.value.option == field


@pytest.mark.parametrize("flag, value, name", [("--seq-len", "512", "seq_len"), ("--distill-steps", "8", "distill_steps"),
                                               ("--calib-dataset", "pydoc", "calib_dataset"),
                                               ("--serve-context", "4096", "serve_context")])
def test_mean_refuses_the_calibration_flags(tmp_path, capsys, flag, value, name):
    from kvtest import write_config

    src = tmp_path / "m"
    write_config(src, {"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 64, "num_attention_heads": 4,
                       "num_key_value_heads": 4, "vocab_size": 32})
    rc = main(["convert", str(src), str(tmp_path / "out"), "--to", "mqa", flag, value])
    err = capsys.readouterr().err
    assert rc == 2 and name in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("eval_flag, uses_torch, driver, cuda, want", [
    (False, True, True, True, ("cuda", False)),    # --no-eval still calibrates on the GPU
    (False, False, True, True, ("cpu", False)),    # mean pooling never needs torch
    (None, True, True, True, ("cuda", True)),      # a GPU: evaluate by default
    (None, True, False, False, ("cpu", False)),    # no driver: CPU, no eval unless asked
    (True, True, False, False, ("cpu", True)),     # --eval on a CPU machine
])
def test_convert_device_serves_calibration_and_eval(monkeypatch, eval_flag, uses_torch, driver, cuda, want):
    import torch

    import kvtool.commands.convert as cmd

    monkeypatch.setattr(cmd, "_nvidia_driver", lambda: driver)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert cmd._device_and_eval(eval_flag, uses_torch) == want


def test_calibration_defaults_to_the_builtin_dataset():
    from kvtool.convert.aware.calibration import calibration_sources, read_text
    from kvtool.datasets import CALIBRATION_LABEL, calibration_text, calibration_texts

    from kvtool.datasets import MERGE_CALIBRATION

    # no --calib-text needed: None is resolved once, to the merge's own default (no other function guesses it)
    assert AwareMerge().settings["calib_dataset"] == MERGE_CALIBRATION == "mixed"
    assert AwareMerge(calib_text="a.txt").settings["calib_dataset"] is None
    assert read_text(None, "pydoc") == (calibration_text(), CALIBRATION_LABEL)
    # the merge's default is the mixed dataset, one source per genre (equal shares of the sequences)
    assert [s.text for s in calibration_sources(None, "mixed")] == calibration_texts("mixed")[0]
    assert [s.text for s in calibration_sources(None, "pydoc")] == [calibration_text()]


@pytest.mark.parametrize("value", [-0.1, 1.5, "a", True])
def test_cov_shrink_is_a_share_from_0_to_1(value):
    assert AwareMerge(cov_shrink=0.05).settings["cov_shrink"] == 0.05
    with pytest.raises(UsageError, match="cov_shrink must be a number from 0 to 1") as exc:
        AwareMerge(cov_shrink=value)
    assert exc.value.option == "method_opt"


@pytest.mark.parametrize("opts, needle", [({"calib_dataset": "wikitext9"}, "unknown dataset 'wikitext9'"),
                                          ({"calib_dataset": "pydoc", "calib_text": "a.txt"}, "not both")])
def test_calibration_source_refusals(opts, needle):
    with pytest.raises(UsageError, match=needle) as exc:
        AwareMerge(**opts)
    assert exc.value.option == "calib_dataset"



def test_the_plan_says_what_the_calibration_will_be():
    assert AwareMerge().summary() == ("calibrated merge on 4096 tokens of mixed (pydoc + devil + jargon) in sequences "
                                      "of 256, training-free")
    assert AwareMerge(calib_dataset="pydoc", refine_steps=8).summary() == (
        "calibrated merge on 16384 tokens of pydoc in sequences of 1024, 8 refinement steps per layer")
    assert AwareMerge(refine_steps=64, distill_steps=32).summary().endswith(
        "sequences of 1024, 64 refinement steps per layer, 32 distillation steps")
    assert "of notes.txt in sequences" in AwareMerge(calib_text="notes.txt", calib_tokens=512).summary()
    assert AwareMerge(serve_context=4096).summary().endswith("training-free, for contexts up to 4096 tokens")


def test_the_dry_run_plan_shows_the_method_summary(tmp_path, capsys, tiny_llama_config):
    from kvtest import write_checkpoint

    write_checkpoint(tmp_path / "src", tiny_llama_config)
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "dst"), "--to", "mqa", "--method", "aware",
                 "--calib-tokens", "512", "--dry-run"]) == 0
    assert "  method       aware: calibrated merge on 512 tokens of mixed (pydoc + devil + jargon)" in capsys.readouterr().out
