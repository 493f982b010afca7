"""Conversion targets are one registry (kvtool/convert/targets.py): no code outside a target asks which target
it holds, every registered target is a `--to` choice and answers every question a plan is asked."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvtool.convert.targets import TARGETS, Calibration, Target

PACKAGE = Path(__file__).resolve().parents[2] / "kvtool"
NAMED = {"to", "target"}  # what a branch on the target reads: o.to, plan.target, getattr(p, "target")
# a compare with a target's name that is about something else, by file and the words compared
NOT_TARGETS = {
    ("convert/source.py", 'arch.attention.get("kind") == "mla"'),  # the source model is MLA (its table's kind)
    ("model/architectures.py", 'attn.get("kind") == "mla"'),
    ("model/spec.py", 'self.arch.attention["kind"] == "mla"'),
    ("convert/mla/solve.py", 'options.seed == "mqa"'),  # the MLA solve's seed: the aware MQA merge
    ("model/kv_scale_names.py", 'attention == "mla"'),  # a checkpoint's attention kind (its KV scales)
    ("rules/quantization.py", 'attention == "mla"'),
    ("budget/budget.py", 'attention_kind(spec) != "mla"'),  # the model is MLA: which vLLM rows serve it (KV404)
    ("rules/mla_moe.py", 'attention_kind(spec) != "mla"'),
    ("budget/variants.py", 'change == "mqa"'),  # kv-budget's what-if variants, not a conversion
    ("budget/variants.py", 'change == "mha"'),
}


def _named(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id in NAMED
    if isinstance(node, ast.Attribute):
        return node.attr in NAMED
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
            and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value in NAMED)


PLAN_CLASSES = {"ConvertPlan", "MlaPlan"}
EQUALITY = (ast.Eq, ast.NotEq, ast.In, ast.NotIn)


def branches_on_target(tree: ast.AST, names: set[str]) -> list[ast.AST]:
    """Code that reads which target it is: `to == "mla"`, `o.to != ...`, `getattr(p, "target") == ...`,
    `x in ("mqa", "mla")`, any equality with a target's name in it, `isinstance(p, MlaPlan)`."""
    classes = PLAN_CLASSES | {TARGETS[n].__name__ for n in names if n in TARGETS}
    found: list[ast.AST] = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance"
                and len(node.args) == 2):
            kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            if any(isinstance(k, ast.Name) and k.id in classes for k in kinds):
                found.append(node)
        if not isinstance(node, ast.Compare) or not all(isinstance(op, EQUALITY) for op in node.ops):
            continue
        sides = [node.left, *node.comparators]
        consts = [c for s in sides for c in ([s] if isinstance(s, ast.Constant) else getattr(s, "elts", []))
                  if isinstance(c, ast.Constant)]
        if any(_named(s) for s in sides) or any(c.value in names for c in consts):
            found.append(node)
    return found


def test_no_code_asks_which_target_it_holds():
    names = set(TARGETS.names())
    hits = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        for node in branches_on_target(ast.parse(text), names):
            rel, words = path.relative_to(PACKAGE).as_posix(), ast.get_source_segment(text, node)
            if (rel, words) not in NOT_TARGETS:
                hits.append(f"kvtool/{rel}:{node.lineno}: {words}")
    assert not hits, "ask the target (kvtool/convert/targets.py), not its name:\n" + "\n".join(hits)


@pytest.mark.parametrize("code", ['if o.to == "mla":\n    pass', 'x = p.to != "gqa"', 'if to in ("mqa", "mha"): pass',
                                  'if getattr(plan, "target", None) == "mla": pass', 'y = "mqa" == kind',
                                  'if isinstance(p, MlaPlan): pass', 'ok = isinstance(t, (int, Mla))'])
def test_the_check_finds_each_kind_of_branch(code):
    assert branches_on_target(ast.parse(code), {"gqa", "mqa", "mha", "mla"})


def test_the_check_finds_the_branches_that_were_there_before_the_registry():
    """kvtool/convert/run.py and report.py as they were (commit 98c6885): every branch is found."""
    before = {"run.py": ['method = get_method(o.method) if o.to != "mla" else None', 'if o.to == "mla":\n    pass',
                         'if getattr(p, "target", None) == "mla":\n    pass'],
              "driver.py": ['if to == "mqa":\n    g = 1\nelif to == "mha":\n    g = num_heads'],
              "plan.py": ['if o.to != "mla" and getattr(o, name) is not None:\n    pass']}
    for lines in before.values():
        for code in lines:
            assert branches_on_target(ast.parse(code), set(TARGETS.names())), code


def test_each_not_a_target_exception_still_exists():
    """An exception whose line went away is dropped from the list, not left to excuse a new one."""
    for rel, words in NOT_TARGETS:
        assert words in (PACKAGE / rel).read_text(), (rel, words)


def test_the_targets_are_to_s_choices_in_order():
    from kvtool.options.convert import ConvertOptions
    from kvtool.options.fields import field_named

    assert TARGETS.names()[:4] == ["gqa", "mqa", "mha", "mla"]
    assert list(field_named(ConvertOptions, "to").choices) == TARGETS.names()


@pytest.mark.parametrize("name", TARGETS.names())
def test_every_target_is_a_target_with_its_own_options_declared(name):
    from kvtool.options.convert import ConvertOptions
    from kvtool.options.fields import field_named

    cls = TARGETS.get(name)
    assert issubclass(cls, Target) and cls.name == name and cls.does
    for f in cls.fields:
        assert field_named(ConvertOptions, f) is not None, f  # a declared convert option
    assert cls.calibration(ConvertOptions(src="", to=name)) in (None, Calibration(True), Calibration(False))


def test_another_target_s_option_is_refused_by_name(tmp_path):
    from kvtool.convert.run import plan
    from kvtool.errors import UsageError
    from kvtool.options.convert import ConvertOptions

    for f in TARGETS.get("mla").fields:
        o = ConvertOptions(src=str(tmp_path), to="mqa")
        setattr(o, f, "joint" if f == "mla_solve" else "flashmla" if f == "preset" else "50%" if f == "kv_budget"
                else 8)
        with pytest.raises(UsageError) as exc:
            plan(o)
        assert exc.value.option == f and exc.value.message == "only --to mla takes it (--to mqa converts KV heads)"


@pytest.mark.parametrize("name", TARGETS.names())
def test_a_target_s_own_options_are_labelled_for_it_in_help(name):
    """The options a target claims (Target.fields) sit in its section of `convert --help` (Spec.applies)."""
    from kvtool.options.convert import ConvertOptions
    from kvtool.options.fields import field_named

    for f in TARGETS.get(name).fields:
        applies = field_named(ConvertOptions, f).spec.applies or ()
        claimed = {t for t in TARGETS.names() if f in TARGETS.get(t).fields}
        # a label never promises the option to a target that refuses it; a merge method's own option ("--method
        # aware") belongs to the heads targets, the only ones that take --method
        assert {a.split()[1] for a in applies if a.startswith("--to ")} <= claimed, f
        assert all(a.startswith(("--to ", "--method ")) for a in applies), f
        if claimed == {name}:  # a target's own option sits in its section alone
            assert applies == (f"--to {name}",), f
