"""kvtool.eval.run: eval's plan (every refusal that needs no model, what is evaluated, the estimate) shared by
`kvtool eval` and a recipe's eval step."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvtest import write_checkpoint
from kvtool.errors import KvtoolError
from kvtool.eval.run import plan, render_plan
from kvtool.options.eval import EvalOptions


@pytest.fixture
def src(tmp_path, tiny_llama_config):
    return str(write_checkpoint(tmp_path / "m", tiny_llama_config))


def test_the_commands_gates_need_a_baseline(src):
    assert plan(src, EvalOptions(model=src)).gates == {}  # the default 2% needs one: PPL alone
    assert plan(src, EvalOptions(model=src, baseline=src)).gates == {"max_ppl_increase": 0.02}
    assert plan(src, EvalOptions(model=src, baseline=src, max_ppl_increase="off", max_kld=0.1)).gates == {
        "max_kld": 0.1}
    with pytest.raises(KvtoolError, match="give --baseline") as got:
        plan(src, EvalOptions(model=src, min_top1=0.9))
    assert got.value.option == "min_top1"


def test_given_gates_are_the_only_gates(src):
    o = EvalOptions(model=src, baseline=src)
    assert plan(src, o, gates={}).gates == {}
    assert plan(src, o, gates={"min_top1": 0.9}).gates == {"min_top1": 0.9}


def test_tokens_are_max_tokens_or_a_quarter_of_the_characters(src, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("x" * 4000)
    p = plan(src, EvalOptions(model=src, text=[str(text)]))
    assert (p.tokens, p.tokens_exact, [t.name for t in p.texts]) == (1000, False, [str(text)])
    assert "".join(p.texts[0].pieces()) == "x" * 4000  # checked by the plan, read when evaluated
    p = plan(src, EvalOptions(model=src, text=[str(text)], max_tokens=100))
    assert (p.tokens, p.tokens_exact) == (100, True)
    assert render_plan(p).splitlines()[1].startswith("  tokens       100 through ")


@pytest.mark.parametrize(("kw", "option"), [({"max_length": 64, "stride": 64}, "stride"), ({"max_tokens": 1}, "max_tokens"),
                                             ({"batch_size": 0}, "batch_size"), ({"max_memory": "0=1GiB"}, "max_memory"),
                                             ({"kv_scales": "two"}, "kv_scales"), ({"format": "xml"}, "format")])
def test_option_refusals(kw, option, src):
    with pytest.raises(KvtoolError) as got:
        plan(src, EvalOptions(model=src, **kw))
    assert got.value.option == option


def test_a_bad_folder_is_refused_unless_a_planned_shape_stands_in(tmp_path, src):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{")
    with pytest.raises(KvtoolError):
        plan(str(bad), EvalOptions(model=str(bad)))
    from kvtool.model import costs

    shape = costs.for_checkpoint(src)
    p = plan("", EvalOptions(model="", baseline=src), texts=None, tokens=500, shape=shape)
    assert p.tokens == 500 and p.estimate().line() == costs.evaluate(shape, 500, models=2).line()


def test_planning_imports_no_torch(src):
    code = ("import sys\nfrom kvtool.eval.run import plan, render_plan\nfrom kvtool.options.eval import EvalOptions\n"
            f"print(render_plan(plan({src!r}, EvalOptions(model={src!r}, baseline={src!r}))), end='')\n"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'torch imported'\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"kvtool eval plan: {src} against {src}\n  tokens       ~")
