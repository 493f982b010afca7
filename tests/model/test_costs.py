"""kvtool.model.costs: estimates from the coefficients in costs.json, monotone, hand-checked."""

from __future__ import annotations

import dataclasses

import pytest

from kvtool.model import costs
from kvtool.model.costs import Shape

C = costs.coefficients()
S8B = Shape(layers=32, hidden=4096, layer_params=218_112_000, other_params=1_050_677_248,
            attn_params=41_943_040, layer_kv_bytes=16_777_216, weight_bytes=16_060_522_496, vocab=128256)


def test_the_coefficients_are_positive_numbers():
    for op in ("convert_mean", "convert_aware", "quantize_kv", "eval"):
        for k, v in C[op].items():
            assert isinstance(v, (int, float)) and v > 0, (op, k)


def test_convert_mean_by_hand():
    c = C["convert_mean"]
    e = costs.convert_mean(S8B)
    assert e.disk_bound
    assert e.cpu_seconds == pytest.approx(c["startup_s"] + S8B.weight_bytes / c["copy_bytes_per_s"]
                                          + 32 * S8B.layer_kv_bytes / c["pool_bytes_per_s"])
    assert e.peak_bytes == pytest.approx(c["rss_base_bytes"] + c["rss_per_layer_kv_byte"] * S8B.layer_kv_bytes)


def test_calibration_by_hand():
    a, q = C["convert_aware"], C["quantize_kv"]
    e = costs.convert_aware(S8B, 4096, 1024, refine_steps=8)
    want = (a["startup_s"] + 32 * (S8B.layer_params * (a["s_per_param"] + 4096 * a["s_per_param_token"])
                                    + a["s_per_hidden_cubed"] * 4096 ** 3)
            + 32 * S8B.attn_params * (a["refine_fixed_s_per_attn_param"]
                                      + 8 * 1024 * a["refine_step_s_per_attn_param_token"]))
    assert e.cpu_seconds == pytest.approx(want)
    assert e.peak_bytes == pytest.approx(a["rss_base_bytes"] + a["rss_per_param"] * (S8B.layer_params
                                                                                     + S8B.other_params)
                                         + a["rss_per_hidden_squared"] * 4096 ** 2)
    e = costs.quantize_kv(S8B, 2048)
    assert e.peak_bytes == pytest.approx(q["rss_base_bytes"] + q["rss_per_param"] * S8B.other_params
                                         + q["rss_per_layer_param"] * S8B.layer_params)
    assert e.cpu_seconds == pytest.approx(q["startup_s"] + 32 * S8B.layer_params * (q["s_per_param"]
                                                                                     + 2048 * q["s_per_param_token"]))


def test_eval_by_hand():
    c = C["eval"]
    e = costs.evaluate(S8B, 1000, models=2)
    per_model = S8B.params * c["s_per_param"] + 1000 * (32 * S8B.layer_params + 128256 * 4096) * c["s_per_param_token"]
    assert e.cpu_seconds == pytest.approx(c["startup_s"] + 2 * per_model)
    resident = 4 * (S8B.layer_params + 2 * 128256 * 4096) + 2 * 4 * 1000 * 4096 + costs.LAYER_WORK_BYTES
    assert e.peak_bytes == pytest.approx(c["rss_base_bytes"] + resident)


@pytest.mark.parametrize("layers", [2, 32, 80])
def test_time_grows_with_layers_and_tokens_and_calibration_memory_does_not_grow_with_depth(layers):
    shallow, deep = dataclasses.replace(S8B, layers=layers), dataclasses.replace(S8B, layers=layers + 1)
    for f in (lambda s, t: costs.convert_aware(s, t, 256), lambda s, t: costs.convert_aware(s, t, 256, 2),
              lambda s, t: costs.quantize_kv(s, t), lambda s, t: costs.evaluate(s, t)):
        assert f(deep, 512).cpu_seconds > f(shallow, 512).cpu_seconds
        assert f(shallow, 1024).cpu_seconds > f(shallow, 512).cpu_seconds
    assert costs.convert_aware(deep, 512, 256).peak_bytes == costs.convert_aware(shallow, 512, 256).peak_bytes
    assert costs.quantize_kv(deep, 512).peak_bytes == costs.quantize_kv(shallow, 512).peak_bytes
    assert costs.evaluate(deep, 512).peak_bytes == costs.evaluate(shallow, 512).peak_bytes  # layer by layer
    assert costs.convert_mean(deep).cpu_seconds > costs.convert_mean(shallow).cpu_seconds


def test_refinement_steps_add_time():
    times = [costs.convert_aware(S8B, 4096, 1024, n).cpu_seconds for n in (0, 1, 2, 64)]
    assert times == sorted(times) and len(set(times)) == 4


def test_distillation_by_hand():
    a = C["convert_aware"]
    free, d = costs.convert_aware(S8B, 4096, 1024), costs.convert_aware(S8B, 4096, 1024, distill_steps=8)
    per_token = (32 * S8B.layer_params + S8B.vocab * S8B.hidden) * a["s_per_param_token"]
    assert d.cpu_seconds - free.cpu_seconds == pytest.approx(per_token * (3 * 4096 + 8 * 1024
                                                                          * a["distill_step_passes"]))
    # one sequence's layer inputs, one chunk of logits with their gradient and one layer's optimizer state
    assert d.peak_bytes - free.peak_bytes == pytest.approx(4 * 32 * 1024 * S8B.hidden + 16 * 256 * S8B.vocab
                                                           + 24 * S8B.attn_params)


def test_the_original_stream_by_hand():
    """Refinement's default target runs the original model alongside the calibration: one more layer pass over
    the calibration tokens, and its hidden states; distillation runs that stream already."""
    a = C["convert_aware"]
    plain = costs.convert_aware(S8B, 4096, 1024, refine_steps=64)
    stream = costs.convert_aware(S8B, 4096, 1024, refine_steps=64, original_stream=True)
    assert stream.cpu_seconds - plain.cpu_seconds == pytest.approx(32 * S8B.layer_params * 4096
                                                                   * a["s_per_param_token"])
    assert stream.peak_bytes - plain.peak_bytes == 2 * 4 * 4096 * S8B.hidden
    both = costs.convert_aware(S8B, 4096, 1024, 64, distill_steps=8, original_stream=True)
    assert both == costs.convert_aware(S8B, 4096, 1024, 64, distill_steps=8)


def test_shape_of_a_checkpoint_from_its_headers(smollm2_path):
    shape = costs.for_checkpoint(smollm2_path)
    # SmolLM2-135M: 30 layers of 3.54 M parameters; tied embeddings 49152 x 576
    assert (shape.layers, shape.hidden, shape.vocab) == (30, 576, 49152)
    assert shape.layer_params == 2 * 576 * 576 + 2 * 192 * 576 + 3 * 576 * 1536 + 2 * 576  # q o, k v, mlp, norms
    assert shape.other_params == 49152 * 576 + 576
    assert shape.layer_kv_bytes == 2 * 192 * 576 * 4  # float32 fixture
    assert shape.attn_params == 2 * 576 * 576 + 2 * 192 * 576


def test_the_line_names_memory_time_and_where_the_model_comes_from():
    line = costs.Estimate(3 * 2**30, 150).line()
    assert line == "~3.00 GiB peak memory, ~2 min of one CPU core; measured cost model, docs/scaling.md"
    assert costs.Estimate(2**20, 12, disk_bound=True).line().startswith("~1.00 MiB peak memory, ~12 s at the measured")


def test_the_error_grouping_by_hand():
    """`--grouping error` runs the original attention once and each candidate group's merged heads: 8 KV heads in
    pairs measure all 28 pairs, each 2 of 8 heads, so 1 + 28 * 2 / 8 = 8 layer attention passes over the 1024
    tokens measured, each group's closed-form merge, and each KV head's share of the output over them."""
    from kvtool.convert.aware.partition import attention_passes, measured_tokens

    a = C["convert_aware"]
    assert attention_passes(8, 4) == 8 and attention_passes(8, 1) == attention_passes(8, 8) == 0
    assert measured_tokens(4096, 256) == 1024
    plain = costs.convert_aware(S8B, 4096, 256)
    grouped = costs.convert_aware(S8B, 4096, 256, grouping_passes=8, grouping_tokens=1024, grouping_heads=8,
                                  grouping_groups=28)
    assert grouped.cpu_seconds - plain.cpu_seconds == pytest.approx(
        32 * (8 * S8B.attn_params * 1024 * a["s_per_param_token"] + 28 * a["grouping_s_per_group"]))
    assert grouped.peak_bytes - plain.peak_bytes == 4 * 8 * 1024 * S8B.hidden
