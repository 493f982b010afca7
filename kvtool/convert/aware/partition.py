"""Which KV heads share a group, as a search: the split of n heads into equal groups whose summed cost is lowest,
for a cost measured on one group at a time (`--grouping error`: kvtool.convert.aware.grouping.GroupCost).

No torch here: the cost model (kvtool.model.costs, `--dry-run`) counts what a search measures. Every split is
tried when there are at most EXHAUSTIVE_PARTITIONS (8 heads in pairs: 105 splits of 28 distinct groups; in fours:
35 of 70). More heads are split on the costs of pairs alone (a group costs the sum of its pairs, exact for pairs):
groups grown greedily from the cheapest pairs, then two heads of two groups swapped while that lowers the total.
"""

from __future__ import annotations

from itertools import combinations
from math import comb, factorial
from typing import Callable, Iterator

EXHAUSTIVE_PARTITIONS = 1000
SWEEPS = 4
# Calibration tokens the candidate groups are measured on (the first sequences of the batch): the choice needs a
# ranking of groups, not the merge itself (docs/convert-quality.md: 1024 of 4096 tokens on the tiny MHA model).
GROUPING_TOKENS = 1024

Group = tuple[int, ...]


def measured_tokens(calib_tokens: int, seq_len: int, tokens: int = GROUPING_TOKENS) -> int:
    """Tokens the groups are measured on: whole calibration sequences, at least one, at most `tokens` else."""
    seq = max(1, min(seq_len, calib_tokens))
    return seq * max(1, min(calib_tokens // seq, tokens // seq))


def partition_count(n: int, m: int) -> int:
    """Ways to split n items into groups of m (order of and within groups ignored)."""
    g = n // m
    return factorial(n) // (factorial(m) ** g * factorial(g))


def partitions(items: list[int], m: int) -> Iterator[list[Group]]:
    """Every split of items into groups of m; the first is the contiguous one."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for mates in combinations(rest, m - 1):
        others = [h for h in rest if h not in mates]
        for tail in partitions(others, m):
            yield [(first, *mates), *tail]


def _exhaustive(n: int, m: int) -> bool:
    """Whether `best_partition` tries every split of n heads into groups of m."""
    return partition_count(n, m) <= EXHAUSTIVE_PARTITIONS


def _measured_size(n: int, groups: int) -> int:
    """Heads in each group `best_partition` measures: the groups themselves when every split is tried, else
    pairs; 0 when there is nothing to choose."""
    m = n // max(groups, 1)
    if m <= 1 or groups <= 1:
        return 0
    return m if _exhaustive(n, m) else 2


def evaluations(n: int, groups: int) -> int:
    """Group costs `best_partition` measures for n heads in `groups` groups (the cost model's count)."""
    size = _measured_size(n, groups)
    return comb(n, size) if size else 0


def attention_passes(n: int, groups: int) -> float:
    """What the measured groups cost, in passes of the whole layer's attention over the measured tokens: each
    group runs the merged attention of its heads (size of n), and the original heads run once."""
    size = _measured_size(n, groups)
    return 1 + comb(n, size) * size / n if size else 0.0


def cost_terms(n: int, groups: int, calib_tokens: int, seq_len: int) -> dict:
    """The grouping_* arguments of kvtool.model.costs.convert_aware for n KV heads into `groups` ({} when there is
    nothing to measure)."""
    if not evaluations(n, groups):
        return {}
    return {"grouping_passes": attention_passes(n, groups), "grouping_tokens": measured_tokens(calib_tokens, seq_len),
            "grouping_heads": n, "grouping_groups": evaluations(n, groups)}


def best_partition(cost: Callable[[Group], float], n: int, groups: int,
                   on_eval: Callable[[int], None] | None = None) -> list[list[int]]:
    """Groups (sorted lists of head indices, in order of their first head) of n heads into `groups` equal
    groups with the lowest summed cost(group); ties keep the contiguous split. cost(group) gets a sorted tuple
    and is called once per group measured; on_eval(k) after the k-th call (progress)."""
    m = n // groups
    if not _measured_size(n, groups):
        return [list(range(i * m, (i + 1) * m)) for i in range(groups)]
    seen: dict[Group, float] = {}

    def measured(group) -> float:
        key = tuple(sorted(group))
        if key not in seen:
            seen[key] = float(cost(key))
            if on_eval is not None:
                on_eval(len(seen))
        return seen[key]

    if _exhaustive(n, m):
        best = min(partitions(list(range(n)), m), key=lambda p: sum(measured(g) for g in p))
    else:
        for pair in combinations(range(n), 2):
            measured(pair)

        def c(group) -> float:
            return sum(seen[p] for p in combinations(sorted(group), 2))

        best = _local_search(c, _greedy(c, n, m))
    return sorted(sorted(g) for g in best)


def _greedy(c: Callable[[Group], float], n: int, m: int) -> list[list[int]]:
    """Seed each group with the cheapest free pair, then add the free head that makes it cheapest."""
    free = list(range(n))
    out = []
    while free:
        group = list(min(combinations(free, 2), key=c))
        while len(group) < m:
            group.append(min((h for h in free if h not in group), key=lambda h: c((*group, h))))
        out.append(group)
        free = [h for h in free if h not in group]
    return out


def _local_search(c: Callable[[Group], float], parts: list[list[int]]) -> list[list[int]]:
    """Swap two heads of two groups while that lowers the summed cost (at most SWEEPS passes)."""
    parts = [list(g) for g in parts]
    for _ in range(SWEEPS):
        improved = False
        for i, j in combinations(range(len(parts)), 2):
            for a in list(parts[i]):
                for b in list(parts[j]):
                    if a not in parts[i] or b not in parts[j]:
                        continue
                    gi = [h for h in parts[i] if h != a] + [b]
                    gj = [h for h in parts[j] if h != b] + [a]
                    before = c(parts[i]) + c(parts[j])
                    if c(gi) + c(gj) < before - 1e-12 * abs(before):
                        parts[i], parts[j] = gi, gj
                        improved = True
        if not improved:
            break
    return parts
