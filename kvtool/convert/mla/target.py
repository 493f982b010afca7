"""`--to mla`: multi-head latent attention (DeepSeek-V3's layout), solved per layer from calibration; its plan is
kvtool/convert/mla/plan.py's, its write kvtool/convert/mla/write.py's."""

from __future__ import annotations

from kvtool.convert.targets import Calibration, Target, register_target


@register_target("mla")
class Mla(Target):
    # the latent's size, the rope dimensions and the solve: no other target takes them
    fields = ("kv_rank", "rope_dim", "kv_budget", "preset", "mla_solve")
    does = "solves a latent per layer"

    @classmethod
    def calibration(cls, o) -> Calibration:
        """Every MLA conversion calibrates; without text it takes the aware merge's built-in mix
        (kvtool.datasets.MERGE_CALIBRATION), so a recipe step need not name any."""
        return Calibration(required=False)

    def plan(self, ckpt, *, max_shard_size: int, config: dict | None = None, tensors: dict | None = None):
        from kvtool.convert.mla.plan import plan_mla

        return plan_mla(self.options, ckpt, max_shard_size=max_shard_size, config=config, tensors=tensors)
