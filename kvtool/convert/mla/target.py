"""`--to mla`: multi-head latent attention (DeepSeek-V3's layout), solved per layer from calibration; its plan is
kvtool/convert/mla/plan.py's, its write kvtool/convert/mla/write.py's."""

from __future__ import annotations

from kvtool.convert.targets import Calibration, Target, register_target
from kvtool.errors import UsageError


@register_target("mla")
class Mla(Target):
    # the latent's size, the rope dimensions, the solve and the vLLM release whose MLA rows it writes
    # (--engine: kvtool.engines.mla): no other target takes them
    fields = ("kv_rank", "rope_dim", "kv_budget", "preset", "mla_solve", "engine")
    does = "solves a latent per layer"

    def __init__(self, o):
        super().__init__(o)  # the heads targets' options (--groups, --grouping, --method-opt) refused there
        if o.method != "mean":  # --method's default: the only value that does not ask for a merge
            raise UsageError(f"--to mla solves each layer from calibration (kvtool.convert.mla.solve); it takes no "
                             f"merge method (--method {o.method} merges KV heads: --to gqa / mqa)", option="method")

    @classmethod
    def calibration(cls, o) -> Calibration:
        """Every MLA conversion calibrates; without text it takes the aware merge's built-in mix
        (kvtool.datasets.MERGE_CALIBRATION), so a recipe step need not name any."""
        return Calibration(required=False)

    def plan(self, ckpt, *, max_shard_size: int, config: dict | None = None, tensors: dict | None = None):
        from kvtool.convert.mla.plan import plan_mla

        return plan_mla(self.options, ckpt, max_shard_size=max_shard_size, config=config, tensors=tensors)
