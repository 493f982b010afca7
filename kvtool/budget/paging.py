"""How a vLLM release reserves KV-cache slots per layer and groups layers, by release.

The rules that changed between releases are `arithmetic` rows of schemas/engines/facts.json (switch names below,
kvtool.engines.facts.arithmetic): a release whose rows hold switches kvtool to that release's rule; no switch is
the newest release's rule. Each row cites the vLLM file and function it restates; tests/oracle/
test_vllm_paging.py runs those functions from each release's verbatim excerpt (tests/data/vllm/<release>/).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtool.model.kvcache import LayerKV, cdiv

# V1 before SlidingWindowSpec: every layer reserves the whole sequence
ALL_FULL = "kv_all_layers_full"
# no hybrid KV-cache manager: a model mixing full and windowed layers has all of them sized as full (one group)
MIXED_FULL = "kv_mixed_layers_full"
# V0 block managers (one block table for all layers): a windowed model keeps at most ceil(W / B) blocks
# (BlockSpaceManagerV1) or W // B + 2 blocks (BlockSpaceManagerV2 / SelfAttnBlockSpaceManager)
V0_CEIL = "kv_sliding_v0_ceil_blocks"
V0_FLOOR_PLUS_TWO = "kv_sliding_v0_floor_plus_two_blocks"
# V1 before max_in_flight_tokens: windowed layers reserve one scheduler step beyond the window
ONE_STEP = "kv_sliding_one_step"
# hybrid groups as large as the smallest kind, or the largest kind's when it is under 1.25x the smallest (the
# newest: under 1.5x)
GROUP_MIN = "kv_group_min_layers"
GROUP_125 = "kv_group_max_under_1_25x"
SWITCHES = (ALL_FULL, MIXED_FULL, V0_CEIL, V0_FLOOR_PLUS_TWO, ONE_STEP, GROUP_MIN, GROUP_125)

# vllm/config/vllm.py, VllmConfig.max_concurrent_batches (0.33.0): async scheduling, on by default with one
# pipeline stage, keeps two batches in flight, and windowed layers hold blocks for both (max_in_flight_tokens)
IN_FLIGHT_BATCHES = 2


@dataclass(frozen=True)
class Paging:
    """One vLLM release's paging rules (its arithmetic switches) and --disable-hybrid-kv-cache-manager."""

    switches: frozenset = frozenset()
    hybrid: bool = True

    def in_flight_tokens(self, step: int) -> int:
        """Tokens scheduled but not yet settled, which windowed layers reserve beyond the window."""
        return step if ONE_STEP in self.switches else IN_FLIGHT_BATCHES * step

    def keeps_windows(self, mixed: bool) -> bool:
        """Whether windowed layers are sized by their window; `mixed`: the model has more than one KV kind."""
        if ALL_FULL in self.switches:
            return False
        return not mixed or (self.hybrid and MIXED_FULL not in self.switches)

    def tokens(self, layer: LayerKV, seq_len: int, block_size: int, step: int, *, mixed: bool) -> int:
        """Token slots this release reserves for the layer for one sequence of seq_len tokens."""
        if layer.window is None or not self.keeps_windows(mixed) or layer.kind == "none" or seq_len <= 0:
            return layer.paged_tokens(seq_len, block_size, step, hybrid=False)
        bs = max(1, block_size)
        cap = (cdiv(layer.window, bs) if V0_CEIL in self.switches else
               layer.window // bs + 2 if V0_FLOOR_PLUS_TWO in self.switches else None)
        if cap is not None:  # V0: no chunked-prefill term, the block table wraps at the cap
            return min(cdiv(seq_len, bs), cap) * bs
        return layer.paged_tokens(seq_len, bs, self.in_flight_tokens(step), hybrid=True)

    def shaping(self, mixed: bool) -> frozenset[str]:
        """The switches that change a windowed model's figures (what kv-budget notes)."""
        if ALL_FULL in self.switches:
            return frozenset({ALL_FULL})
        if not self.keeps_windows(mixed):
            return frozenset({MIXED_FULL} & self.switches)
        v0 = self.switches & {V0_CEIL, V0_FLOOR_PLUS_TWO}
        return v0 or (self.switches & ({ONE_STEP, GROUP_MIN, GROUP_125} if mixed else {ONE_STEP}))

    def group_size(self, counts: list[int]) -> int:
        """Layers per hybrid KV-cache group, from the layer count of each kind."""
        small, large = min(counts), max(counts)
        if GROUP_MIN in self.switches:
            return small
        return large if large < (1.25 if GROUP_125 in self.switches else 1.5) * small else small


def mixed_kinds(layers: list[LayerKV]) -> bool:
    """Full and windowed KV layers together: what vLLM converts to full attention without its hybrid manager (a
    model whose layers all slide keeps its window: kv_cache_planning._promote_local_kv_cache_specs, 0.33.0;
    kv_cache_utils.unify_hybrid_kv_cache_specs, 0.9.0 .. 0.10.2)."""
    kv = [lay for lay in layers if lay.kind != "none"]
    return any(lay.window is None for lay in kv) and any(lay.window is not None for lay in kv)
