"""layout.zero: where ZeRO 1/2 keeps each parameter's elements, against an element-by-element flat buffer."""

from hypothesis import given, settings
from hypothesis import strategies as st

from ntp_ds.layout.zero import START_ALIGNMENT, FlatOrder


def element_by_element(groups, numels, dp, alignment):
    """Build each group's flat buffer as DeepSpeed does (parameters in order, each but the last padded to
    `alignment`, the whole padded to 2 x dp), cut it into dp partitions, and read off each parameter's fragments."""
    out = {}
    for names in groups:
        flat = []
        for i, name in enumerate(names):
            flat += [(name, k) for k in range(numels[name])]
            if i < len(names) - 1:
                flat += [None] * (-len(flat) % alignment)
        flat += [None] * (-len(flat) % (START_ALIGNMENT * dp))
        size = len(flat) // dp
        for name in names:
            out[name] = []
            for p in range(dp):
                mine = [x[1] for x in flat[p * size:(p + 1) * size] if x is not None and x[0] == name]
                if mine:
                    assert mine == list(range(mine[0], mine[0] + len(mine)))
                    out[name].append((mine[0], len(mine), p))
    return out


@st.composite
def layouts(draw):
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    names, groups = iter(range(100)), []
    for size in sizes:
        groups.append(tuple(f"p{next(names)}" for _ in range(size)))
    numels = {n: draw(st.integers(0, 40)) for g in groups for n in g}
    return tuple(groups), numels, draw(st.integers(1, 6)), draw(st.sampled_from([1, 2, 8]))


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_fragments_match_the_flat_buffer_element_by_element(case):
    groups, numels, dp, alignment = case
    order = FlatOrder(groups, alignment)
    assert order.fragments(numels, dp) == element_by_element(groups, numels, dp, alignment)
    for p in range(dp):
        assert order.addresses(numels, dp, p) == {n: (s, k) for n, frags in order.fragments(numels, dp).items()
                                                  for s, k, q in frags if q == p}


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_round_robin_order_is_deepspeed_s_reorder_for_each_data_parallel_degree(case):
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    groups, numels, dp, alignment = case
    reordered = tuple(tuple(DeepSpeedZeroOptimizer._round_robin_reorder(None, list(g), dp)[0]) for g in groups)
    order = FlatOrder(groups, alignment, round_robin=True)
    assert order.fragments(numels, dp) == element_by_element(reordered, numels, dp, alignment)
    for p in range(dp):
        assert order.addresses(numels, dp, p) == {n: (s, k) for n, frags in order.fragments(numels, dp).items()
                                                  for s, k, q in frags if q == p}


def test_partition_boundaries_follow_the_padding_to_twice_the_data_parallel_degree():
    # 10 elements over 3 ranks: padded to 12, partitions of 4.
    order = FlatOrder((("a", "b"),))
    assert order.fragments({"a": 7, "b": 3}, 3) == {"a": [(0, 4, 0), (4, 3, 1)], "b": [(0, 1, 1), (1, 2, 2)]}
    # 13 elements over 2 ranks: padded to 16, partitions of 8, where an unpadded cut would give 7.
    assert order.fragments({"a": 7, "b": 6}, 2) == {"a": [(0, 7, 0)], "b": [(0, 1, 0), (1, 5, 1)]}


def test_unpartitioned_every_anchor_holds_every_parameter_whole():
    order = FlatOrder((("a", "b", "c"),), partitioned=False)
    assert order.fragments({"a": 5, "b": 0, "c": 2}, 4) == {"a": [(0, 5, None)], "b": [], "c": [(0, 2, None)]}
    assert order.addresses({"a": 5, "b": 0, "c": 2}, 4, 3) == {"a": (0, 5), "c": (0, 2)}
