"""kvtool.convert.aware.partition: the search for the cheapest split of KV heads into groups (no torch)."""

from __future__ import annotations

import random
from itertools import combinations

import pytest

from kvtool.convert.aware import partition as pt


@pytest.mark.parametrize("n, m", [(4, 2), (6, 2), (6, 3), (8, 2), (8, 4), (9, 3), (4, 1), (4, 4)])
def test_partitions_are_every_split_once_contiguous_first(n, m):
    parts = list(pt.partitions(list(range(n)), m))
    assert len(parts) == pt.partition_count(n, m)
    assert parts[0] == [tuple(range(i, i + m)) for i in range(0, n, m)]
    keys = {frozenset(frozenset(g) for g in p) for p in parts}
    assert len(keys) == len(parts)  # no split twice
    for p in parts:
        assert sorted(h for g in p for h in g) == list(range(n)) and all(len(g) == m for g in p)


def _labels_cost(labels, calls):
    """A group costs one per head whose label differs from the group's most common one: 0 when alike."""
    def cost(group):
        calls.append(group)
        found = [labels[h] for h in group]
        return len(found) - max(found.count(x) for x in found)
    return cost


@pytest.mark.parametrize("n, groups, seed", [(8, 4, 0), (8, 2, 1), (9, 3, 2), (12, 6, 3), (16, 4, 4), (16, 8, 5),
                                             (32, 16, 6)])  # pairs of 32: 1.9e17 splits, searched from pair costs
def test_best_partition_finds_the_groups_of_alike_heads(n, groups, seed):
    m = n // groups
    labels = [h // m for h in range(n)]
    random.Random(seed).shuffle(labels)  # alike heads scattered, as after a --to mha of a shuffled model
    calls: list = []
    best = pt.best_partition(_labels_cost(labels, calls), n, groups)
    assert sorted(h for g in best for h in g) == list(range(n))
    assert all(len({labels[h] for h in g}) == 1 for g in best)
    assert best == sorted(best) and all(g == sorted(g) for g in best)
    assert len(calls) == len(set(calls)) == pt.evaluations(n, groups)  # each group measured once, as counted


def test_large_searches_measure_pairs_only():
    assert pt.partition_count(8, 2) == 105 <= pt.EXHAUSTIVE_PARTITIONS
    assert pt.partition_count(12, 2) == 10395 > pt.EXHAUSTIVE_PARTITIONS
    assert pt.partition_count(16, 4) == 2627625 > pt.EXHAUSTIVE_PARTITIONS
    calls: list = []
    pt.best_partition(_labels_cost(list(range(32)), calls), 32, 8)
    assert len(calls) == 496 == pt.evaluations(32, 8) and {len(g) for g in calls} == {2}
    # the passes: the original heads once, then each measured group's heads (2 or m of n)
    assert pt.attention_passes(32, 8) == 1 + 496 * 2 / 32 and pt.attention_passes(8, 2) == 1 + 70 * 4 / 8


@pytest.mark.parametrize("calib, seq, want", [(4096, 256, 1024), (4096, 1024, 1024), (16384, 2048, 2048),
                                              (512, 256, 512), (300, 256, 256), (100, 256, 100)])
def test_measured_tokens_are_whole_calibration_sequences(calib, seq, want):
    assert pt.measured_tokens(calib, seq) == want


def test_local_search_improves_on_the_greedy_start():
    # pair costs that lure the greedy seed into a bad first pair: (0, 1) is cheapest, but then 2 and 3 must pair
    # at a high price, while (0, 2) + (1, 3) is cheaper in total; with 12 heads the search is not exhaustive
    n = 12
    cheap = {(0, 1): 0.0, (0, 2): 0.1, (1, 3): 0.1, (2, 3): 10.0}
    cheap.update({(a, a + 1): 0.0 for a in range(4, n, 2)})

    def cost(group):
        return cheap.get(group, 5.0)

    best = pt.best_partition(cost, n, n // 2)
    assert [0, 2] in best and [1, 3] in best
    assert sum(cost(tuple(g)) for g in best) == pytest.approx(0.2)


def test_ties_keep_the_contiguous_split_and_trivial_cases_cost_nothing():
    calls: list = []

    def flat(group):
        calls.append(group)
        return 1.0

    assert pt.best_partition(flat, 8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert len(calls) == 28 == pt.evaluations(8, 4) and pt.attention_passes(8, 4) == 1 + 28 * 2 / 8
    calls.clear()
    assert pt.best_partition(flat, 8, 1) == [list(range(8))]  # one group (MQA): nothing to choose
    assert pt.best_partition(flat, 8, 8) == [[h] for h in range(8)]
    assert calls == [] and pt.evaluations(8, 1) == pt.evaluations(8, 8) == 0


def test_progress_counts_each_measured_group():
    seen: list[int] = []
    pt.best_partition(lambda g: float(sum(g) % 3), 6, 3, on_eval=seen.append)
    assert seen == list(range(1, len(list(combinations(range(6), 2))) + 1))


def test_cost_terms_are_what_the_cost_model_counts():
    assert pt.cost_terms(8, 4, 4096, 256) == {"grouping_passes": 8.0, "grouping_tokens": 1024, "grouping_heads": 8,
                                              "grouping_groups": 28}
    assert pt.cost_terms(8, 1, 4096, 256) == pt.cost_terms(8, 8, 4096, 256) == {}
    assert pt.cost_terms(32, 16, 16384, 1024)["grouping_groups"] == 496  # pairs only past the exhaustive search
