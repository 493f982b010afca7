"""Regenerate schemas/engines/transformers_releases.json: engine facts read from each transformers release's source.

    # each release's wheel, unpacked (only the files read below): ~10 MB download per release. The releases:
    # every transformers release of schemas/engines/releases.json, plus the yanked 4.46.0 and 4.57.0 (pip
    # index leaves them out; they are where model types first appear, so the rows cite them)
    for v in 4.38.0 4.38.1 ... 5.25.0 4.46.0 4.57.0; do
        pip download --no-deps transformers==$v -d /tmp/w/$v
        unzip -q /tmp/w/$v/*.whl 'transformers/models/*/configuration_*.py' 'transformers/models/auto/*.py' \
            'transformers/modeling_rope_utils.py' -d SRC/$v   # 4.38-4.42 have no modeling_rope_utils.py
        rm -r /tmp/w/$v
    done
    python schemas/build_engine_tables.py SRC

For every model type kvtool's tables know (schemas/architectures, schemas/wrappers.json), read with `ast` /
text search, never imported:
- the first release whose models/auto/configuration_auto.py lists it in CONFIG_MAPPING_NAMES (older ones refuse
  the config: AutoConfig's "does not recognize this architecture"; from 5.6 the mapping is generated into
  models/auto/auto_mappings.py, which configuration_auto.py imports and updates);
- the releases whose config class still has the two-field `_rope_scaling_validation` (rope_scaling must be
  {"type": "linear" | "dynamic", "factor": float > 1});
- the first release whose config class reads `layer_types` (older ones ignore it);
(whether a class applies rope_scaling is decided by its modeling file, which may read the attribute its config
class never declares: those rows are hand-written in facts.json from the modeling files; so are the rows about
the first forward -- a class whose RoPE init reads partial_rotary_factor while its apply_rotary_pos_emb rotates
the whole head -- and about a release's required rope keys after its own filling-in, observed by the engine lane);
- the first release whose config class reads `head_dim` (older ones use hidden_size / num_attention_heads) or
  `partial_rotary_factor` (older ones rotate the whole head) -- the latter only before the release whose shared
  RoPE code (modeling_rope_utils.py, from 4.57) reads `partial_rotary_factor` off any config: from there a class's
  own text is no evidence (5.18's minimax_m2 class only adds a `rotary_dim` conversion);
- from 4.43 (modeling_rope_utils.py), the first release whose ROPE_INIT_FUNCTIONS has each RoPE type kvtool's
  type table gives transformers (older ones fail with KeyError on the type).
Rows are grouped by the release where the behaviour changes; each cites the file of the release that shows it.
Run it when a transformers release is added to schemas/engines/releases.json; tests/oracle/test_engine_releases.py
checks the rows against the installed releases themselves.
"""

from __future__ import annotations

import ast
import json
import sys
from functools import lru_cache
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "engines" / "transformers_releases.json"
TWO_FIELDS = "two fields, `type` and `factor`"  # 4.38 says "with with two fields"
UNKNOWN_MESSAGE = ("does not know model_type {model_type!r} (AutoConfig: \"The checkpoint you are trying to load has "
                   "model type `{model_type}` but Transformers does not recognize this architecture\")")


def _version_key(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in v.split("."))


def _dict_keys(path: Path, name: str) -> dict[str, str]:
    """A module-level dict literal (or OrderedDict([...]) / list of pairs) read with ast."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        if not any(isinstance(t, ast.Name) and t.id == name for t in targets):
            continue
        value = node.value
        return _literal_pairs(value)
    return {}


def _literal_pairs(value: ast.expr) -> dict[str, str]:
    pairs = []
    if isinstance(value, ast.Call):  # OrderedDict([...]) / OrderedDict(**{...}, **OTHER): the literal parts
        pairs += [p for kw in value.keywords if kw.arg is None and isinstance(kw.value, ast.Dict)
                  for p in zip(kw.value.keys, kw.value.values)]
        value = value.args[0] if value.args else None
    if isinstance(value, ast.Dict):
        pairs += list(zip(value.keys, value.values))
    else:  # a list of (key, value) tuples
        pairs += [tuple(e.elts) for e in getattr(value, "elts", []) if isinstance(e, ast.Tuple) and len(e.elts) == 2]
    # entries that are not literals (a conditional class name) keep their key
    return {k.value: (v.value if isinstance(v, ast.Constant) else None) for k, v in pairs
            if isinstance(k, ast.Constant) and isinstance(k.value, str)}


def _updates(path: Path, name: str) -> dict[str, str]:
    """The literal entries of module-level `NAME.update({...})` calls."""
    out: dict[str, str] = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        call = node.value if isinstance(node, ast.Expr) else None
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "update" \
                and isinstance(call.func.value, ast.Name) and call.func.value.id == name and call.args:
            out.update(_literal_pairs(call.args[0]))
    return out


@lru_cache(maxsize=None)
def auto_dict(src: Path, name: str) -> dict[str, str]:
    """configuration_auto.py's NAME as the module ends up with it: from 5.6 the literal lives in the generated
    auto_mappings.py and configuration_auto.py imports it and adds entries (`.update`, `OrderedDict(**{...}, ...)`)."""
    auto = src / "transformers/models/auto"
    imports = "from .auto_mappings import" in (auto / "configuration_auto.py").read_text(encoding="utf-8")
    if imports and not (auto / "auto_mappings.py").is_file():
        raise SystemExit(f"{auto}/auto_mappings.py: missing (unzip 'transformers/models/auto/*.py')")
    out = _dict_keys(auto / "auto_mappings.py", name) if imports else {}
    out.update(_dict_keys(auto / "configuration_auto.py", name))
    out.update(_updates(auto / "configuration_auto.py", name))
    return out


def known_model_types() -> dict[str, str]:
    """model_type -> the outer model_type AutoConfig sees (a wrapper's inner text types map to themselves)."""
    out = {}
    for path in sorted((HERE / "architectures").glob("*.json")):
        table = json.loads(path.read_text(encoding="utf-8"))
        for mt in [table["model_type"], *table.get("aliases", [])]:
            if mt != "generic":
                out[mt] = mt
    for outer in json.loads((HERE / "wrappers.json").read_text(encoding="utf-8"))["wrappers"]:
        out[outer] = outer
    return out


def module_of(src: Path, model_type: str) -> str:
    special = auto_dict(src, "SPECIAL_MODEL_TYPE_TO_MODULE_NAME")
    return special.get(model_type, model_type.replace("-", "_"))


def _config_source(src: Path, model_type: str) -> Path | None:
    mod = module_of(src, model_type)
    path = src / "transformers" / "models" / mod / f"configuration_{mod}.py"
    return path if path.is_file() else None


def _rows_by_boundary(found: dict[str, str], make) -> list[dict]:
    """Group model types by the release where the behaviour changes: one row per boundary."""
    by: dict[str, list[str]] = {}
    for mt, boundary in found.items():
        by.setdefault(boundary, []).append(mt)
    return [make(boundary, sorted(mts)) for boundary, mts in sorted(by.items(), key=lambda kv: _version_key(kv[0]))]


def build(src_root: Path) -> dict:
    versions = sorted((p.name for p in src_root.iterdir() if (p / "transformers").is_dir()), key=_version_key)
    if not versions:
        raise SystemExit(f"{src_root}: no unpacked releases")
    types = known_model_types()
    present: dict[str, str] = {}  # model type -> first release listing it
    two_fields_until: dict[str, str] = {}  # model type -> first release without the two-field validation
    layer_types_from: dict[str, str] = {}  # model type -> first release whose config class reads layer_types
    rope_from: dict[str, str] = {}  # model type -> first release whose config class reads rope_scaling / _parameters
    head_dim_from: dict[str, str] = {}  # model type -> first release whose config class reads head_dim
    prf_from: dict[str, str] = {}  # model type -> first release whose config class reads partial_rotary_factor
    seen_two_fields: set[str] = set()
    for v in versions:
        src = src_root / v
        mapping = auto_dict(src, "CONFIG_MAPPING_NAMES")
        if not mapping:  # a moved mapping would otherwise read as "no model type known" without a word
            raise SystemExit(f"{src}: no CONFIG_MAPPING_NAMES read from models/auto/")
        for mt in types:
            if mt not in mapping:
                continue
            present.setdefault(mt, v)
            cfg = _config_source(src, mt)
            text = cfg.read_text(encoding="utf-8") if cfg else ""
            if TWO_FIELDS in text:
                seen_two_fields.add(mt)
            elif mt in seen_two_fields:
                two_fields_until.setdefault(mt, v)
            if "layer_types" in text:
                layer_types_from.setdefault(mt, v)
            if "rope_scaling" in text or "rope_parameters" in text:
                rope_from.setdefault(mt, v)
            if "head_dim" in text:
                head_dim_from.setdefault(mt, v)
            if "partial_rotary_factor" in text:
                prf_from.setdefault(mt, v)
    rope_types: dict[str, str] = {}  # rope type -> first release whose ROPE_INIT_FUNCTIONS has it
    rope_utils = [v for v in versions if (src_root / v / "transformers/modeling_rope_utils.py").is_file()]
    shared_prf = next((v for v in rope_utils if any(
        f'{how}"partial_rotary_factor"' in (src_root / v / "transformers/modeling_rope_utils.py").read_text(
            encoding="utf-8") for how in ("getattr(config, ", "getattr(self, ", "kwargs.get("))), None)
    if shared_prf:
        prf_from = {mt: v for mt, v in prf_from.items() if _version_key(v) < _version_key(shared_prf)}
    for v in rope_utils:
        init = _dict_keys(src_root / v / "transformers/modeling_rope_utils.py", "ROPE_INIT_FUNCTIONS")
        for t in init:
            rope_types.setdefault(t, v)
    sys.path.insert(0, str(HERE.parent))
    from kvtool.model.rope.types import KINDS

    oldest = versions[0]
    rows: list[dict] = []
    first_utils = rope_utils[0] if rope_utils else None
    rows += _rows_by_boundary({t: v for t, v in rope_types.items() if first_utils and v != first_utils
                               and t in KINDS and "transformers" in KINDS[t].engines}, lambda b, ts: {
        "id": f"tf-rope-types-from-{b}", "engine": "transformers", "releases": f">={first_utils},<{b}",
        "effect": "refuses", "detector": "rope_type_unknown", "args": {"rope_types": ts},
        "says": "does not know rope type {rope_type!r} (KeyError on ROPE_INIT_FUNCTIONS)",
        "citation": {"file": "src/transformers/modeling_rope_utils.py",
                     "function": "ROPE_INIT_FUNCTIONS (first listed)", "release": b}})
    rows += _rows_by_boundary({mt: v for mt, v in present.items() if v != oldest}, lambda b, mts: {
        "id": f"tf-model-types-from-{b}", "engine": "transformers", "releases": f"<{b}", "effect": "refuses",
        "detector": "model_type_unknown", "args": {"model_types": mts}, "says": UNKNOWN_MESSAGE,
        "citation": {"file": "src/transformers/models/auto/" + (
            "auto_mappings.py" if (src_root / b / "transformers/models/auto/auto_mappings.py").is_file()
            else "configuration_auto.py"), "function": "CONFIG_MAPPING_NAMES (first listed)", "release": b}})
    rows += _rows_by_boundary(two_fields_until, lambda b, mts: {
        "id": f"tf-rope-scaling-two-fields-until-{b}", "engine": "transformers", "releases": f"<{b}",
        "effect": "refuses", "detector": "rope_scaling_two_fields", "args": {"model_types": mts},
        "says": "refuses {what}: \"{message}\"",
        "citation": {"file": f"src/transformers/models/{module_of(src_root / oldest, mts[0])}/"
                             f"configuration_{module_of(src_root / oldest, mts[0])}.py",
                     "function": "_rope_scaling_validation", "release": _previous(versions, b)}})
    # keys a config class starts reading at a release: before it, the release ignores them
    for found, key, detector, says in (
            (layer_types_from, "layer_types", "layer_types_ignored",
             "ignores layer_types (its {kinds} layers are laid out by the class's older keys)"),
            (head_dim_from, "head_dim", "explicit_head_dim",
             "ignores head_dim = {head_dim} and uses hidden_size / num_attention_heads = {hidden_size} / {heads} = "
             "{derived} (the checkpoint's q/k/v/o weights then fail to load: size mismatch)"),
            (prf_from, "partial_rotary_factor", "partial_rotary_ignored",
             "ignores partial_rotary_factor = {factor} and rotates the whole head")):
        rows += _rows_by_boundary({mt: v for mt, v in found.items() if present[mt] != v},
                                  lambda b, mts, key=key, detector=detector, says=says: {
            "id": f"tf-{key.replace('_', '-')}-from-{b}", "engine": "transformers", "releases": f"<{b}",
            "effect": "reads-differently", "detector": detector, "args": {"model_types": mts}, "drops": [key],
            "says": says,
            "citation": {"file": f"src/transformers/models/{module_of(src_root / b, mts[0])}/"
                                 f"configuration_{module_of(src_root / b, mts[0])}.py",
                         "function": f"__init__ (first reads {key})", "release": b}})
    return {"about": "Generated by schemas/build_engine_tables.py from the source of transformers "
                     f"{versions[0]}..{versions[-1]} ({len(versions)} releases); do not edit by hand.",
            "releases_read": versions, "facts": rows}


def _previous(versions: list[str], v: str) -> str:
    i = versions.index(v)
    return versions[i - 1] if i else v


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__)
        return 2
    doc = build(Path(argv[0]))
    OUT.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {OUT}: {len(doc['facts'])} rows from {len(doc['releases_read'])} releases")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
