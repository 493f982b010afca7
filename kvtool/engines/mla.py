"""Which MLA cache rows each vLLM release serves: schemas/engines/mla_backends.json, rows with release ranges.

vLLM caches one row of `kv_lora_rank + qk_rope_head_dim` values per token and MLA layer, and calls that its head
size (vllm/transformers_utils/model_arch_config_convertor.py, ModelArchConfigConvertorBase.get_head_size, 0.33.0).
Two tables, each row a release range (a packaging SpecifierSet) with a citation:

- `common`: `MLACommonBackend.get_supported_head_sizes` of that release. `MLACommonMetadata.__post_init__` checks
  every dense MLA backend's metadata against it at the first forward pass ("Head dimension N is not supported by
  MLA"), whatever the backend itself declares, so these are the only row sizes the release serves.
- `backends`: each dense MLA backend (vLLM's `--attention-backend` name), the head sizes it declares itself
  (`get_supported_head_sizes`: [] any, null inherits `common`), the GPUs it runs on and the dimensions its kernel
  fixes, for the releases read.

tests/oracle/test_vllm_mla_backends.py checks every row against verbatim excerpts of each release read
(tests/data/vllm/<release>/mla/). convert --to mla writes only servable rows (kvtool/convert/mla/plan.py), lint
flags the others (KV404, kvtool/rules/mla_moe.py), kv-budget notes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from kvtool.model.engine_tables import Citation, load
from kvtool.engines.ranges import contains

FILE = "schemas/engines/mla_backends.json"


@dataclass(frozen=True)
class Rows:
    """The row sizes one range of releases serves (MLACommonBackend.get_supported_head_sizes)."""

    releases: str
    head_sizes: tuple[int, ...]
    citation: Citation


@dataclass(frozen=True)
class Backend:
    name: str  # vLLM's --attention-backend value
    releases: str
    gpus: str
    declares: tuple[int, ...] | None  # its own get_supported_head_sizes: () any, None inherits MLACommonBackend's
    citation: Citation
    kv_lora_rank: int | None = None  # fixed by the kernel
    qk_rope_head_dim: int | None = None
    qk_nope_head_dims: tuple[int, ...] | None = None
    v_head_dims: tuple[int, ...] | None = None

    def sizes(self, common: tuple[int, ...]) -> tuple[int, ...]:
        """The row sizes it serves: what it declares, within what MLACommonMetadata checks."""
        return tuple(s for s in common if not self.declares or s in self.declares)

    def refusal(self, dims, common: tuple[int, ...]) -> str | None:
        """Why it does not serve `dims` (kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim), None when it
        does."""
        size = dims.kv_lora_rank + dims.qk_rope_head_dim
        own = self.sizes(common)
        if size not in own:
            return f"row {size} is not {or_list(own)}"
        if self.kv_lora_rank is not None and dims.kv_lora_rank != self.kv_lora_rank:
            return f"the kernel fixes kv_lora_rank {self.kv_lora_rank}"
        if self.qk_rope_head_dim is not None and dims.qk_rope_head_dim != self.qk_rope_head_dim:
            return f"the kernel fixes qk_rope_head_dim {self.qk_rope_head_dim}"
        if self.qk_nope_head_dims is not None and dims.qk_nope_head_dim not in self.qk_nope_head_dims:
            return f"qk_nope_head_dim must be {or_list(self.qk_nope_head_dims)}"
        if self.v_head_dims is not None and dims.v_head_dim not in self.v_head_dims:
            return f"v_head_dim must be {or_list(self.v_head_dims)}"
        return None


def or_list(values) -> str:
    """(320, 512, 576) -> '320, 512 or 576'."""
    v = [str(x) for x in values]
    return v[0] if len(v) == 1 else f"{', '.join(v[:-1])} or {v[-1]}" if v else "none"


@lru_cache(maxsize=None)
def table() -> tuple[tuple[Rows, ...], tuple[Backend, ...]]:
    data = load(FILE)
    common = tuple(Rows(r["releases"], tuple(r["head_sizes"]), r["citation"]) for r in data["common"])
    backs = []
    for r in data["backends"]:
        unknown = set(r) - {"name", "releases", "gpus", "declares", "citation", "kv_lora_rank", "qk_rope_head_dim",
                            "qk_nope_head_dims", "v_head_dims"}
        if unknown:
            raise ValueError(f"{FILE}: backend {r.get('name')!r}: unknown keys {sorted(unknown)}")
        backs.append(Backend(name=r["name"], releases=r["releases"], gpus=r["gpus"],
                             declares=None if r["declares"] is None else tuple(r["declares"]),
                             citation=r["citation"], kv_lora_rank=r.get("kv_lora_rank"),
                             qk_rope_head_dim=r.get("qk_rope_head_dim"),
                             qk_nope_head_dims=tuple(r["qk_nope_head_dims"]) if r.get("qk_nope_head_dims") else None,
                             v_head_dims=tuple(r["v_head_dims"]) if r.get("v_head_dims") else None))
    return common, tuple(backs)


def read_releases() -> tuple[str, ...]:
    """The vLLM releases some `common` row covers, oldest first (of the releases kvtool knows)."""
    from kvtool.engines.releases import known

    common, _ = table()
    return tuple(v for v in known()["vllm"] if any(contains(r.releases, v) for r in common))


def rows(version: str) -> Rows | None:
    """The row sizes `version` serves; None where kvtool has not read that release's MLA backends."""
    common, _ = table()
    return next((r for r in common if contains(r.releases, version)), None)


def backends(version: str) -> tuple[Backend, ...]:
    _, backs = table()
    return tuple(b for b in backs if contains(b.releases, version))


def sizes_text(version: str, sizes: tuple[int, ...]) -> str:
    """'vllm 0.33.0 serves MLA rows of 320, 512 or 576 cached values (kv_lora_rank + qk_rope_head_dim)' (version:
    a release, or a label for several)."""
    return (f"vllm {version} serves MLA rows of {or_list(sizes)} cached values per token and layer "
            "(kv_lora_rank + qk_rope_head_dim)")


def summary(version: str, dims) -> str:
    """One line: the backends of `version` that serve `dims`, then those that do not, grouped by reason."""
    r = rows(version)
    if r is None:
        return f"vLLM {version}: MLA backends not read by kvtool"
    ok: list[str] = []
    why_not: dict[str, list[str]] = {}
    names = [b.name for b in backends(version)]
    for b in backends(version):
        why = b.refusal(dims, r.head_sizes)
        if why is None:
            ok.append(f"{b.name} ({b.gpus})")
        else:
            why_not.setdefault(why, []).append(b.name + (f" on {b.gpus}" if names.count(b.name) > 1 else ""))
    size = dims.kv_lora_rank + dims.qk_rope_head_dim
    if not backends(version):
        ok = [f"row {size} served" if size in r.head_sizes else f"row {size} served by no backend"]
    line = f"vLLM {version}: " + (", ".join(ok) if ok else "no MLA backend")
    return line + "".join(f"; not {', '.join(names)} ({why})" for why, names in why_not.items())
