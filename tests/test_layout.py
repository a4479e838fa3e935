from hypothesis import given
from hypothesis import strategies as st

from ema_ckpt.layout import Box, boxes_cover, split_rows
from tests.dcp_helpers import fsdp_boxes


def test_intersect_and_relative():
    a, b = Box((0, 0), (4, 6)), Box((2, 3), (4, 6))
    inter = a.intersect(b)
    assert inter == Box((2, 3), (2, 3))
    assert inter.relative_to(b) == Box((0, 0), (2, 3))
    assert Box((0,), (2,)).intersect(Box((2,), (2,))) is None


@given(st.lists(st.integers(0, 9), min_size=0, max_size=3), st.integers(1, 5))
def test_fsdp_boxes_cover_every_shape(shape, world):
    assert boxes_cover(tuple(shape), fsdp_boxes(tuple(shape), world))


def test_cover_detects_gaps_and_overlaps():
    assert not boxes_cover((4,), [Box((0,), (2,))])
    assert not boxes_cover((4,), [Box((0,), (3,)), Box((2,), (2,))])
    assert not boxes_cover((4,), [Box((0,), (5,))])


@given(st.integers(1, 20), st.integers(1, 6), st.integers(1, 50))
def test_split_rows_partitions_the_box(rows, cols, limit):
    box = Box((3, 0), (rows, cols))
    parts = split_rows(box, limit)
    assert sum(p.sizes[0] for p in parts) == rows
    assert all(p.numel <= max(limit, cols) for p in parts)
    assert parts[0].offsets[0] == 3
