"""The overlap model's replay (helpers/cost/overlap.py), worked by hand."""
import pytest

from helpers.cost import overlap

MiB = 2**20


def test_flat_exposes_its_whole_all_reduce():
    r = overlap.replay([1.0] * 4, (4,), [3.0], overlapped=False)
    assert r.backward_s == 4.0 and r.reduces == ((4.0, 7.0),) and r.exposed_s == 3.0


def test_overlapped_buckets_start_when_full_and_the_link_is_free():
    # backward 1 s a layer; all-reduces of 3 s: the second bucket queues behind the first
    r = overlap.replay([1.0] * 4, (1, 1, 1, 1), [3.0] * 4, overlapped=True)
    assert r.reduces == ((1.0, 4.0), (4.0, 7.0), (7.0, 10.0), (10.0, 13.0))
    assert r.exposed_s == 9.0


def test_long_backward_hides_all_but_the_last_bucket():
    r = overlap.replay([5.0] * 4, (2, 2), [2.0, 2.0], overlapped=True)
    assert r.reduces == ((10.0, 12.0), (20.0, 22.0)) and r.exposed_s == 2.0


def test_not_overlapped_buckets_wait_for_backward():
    r = overlap.replay([1.0, 2.0], (1, 1), [0.5, 0.5], overlapped=False)
    assert r.reduces == ((3.0, 3.5), (3.5, 4.0)) and r.exposed_s == 1.0


@pytest.mark.parametrize("variant, bucket_mb, expected", [
    ("naive", 8, (1, 1, 1, 1)), ("overlap", 8, (1, 1, 1, 1)), ("flat", 8, (4,)),
    ("bucketed", 8, (2, 2)), ("bucketed", 12, (3, 1)), ("bucketed", 1, (1, 1, 1, 1)),
    ("bucketed", 32, (4,))])
def test_bucket_layers_follow_the_wrappers(variant, bucket_mb, expected):
    assert overlap.bucket_layers(variant, [4 * MiB] * 4, bucket_mb * MiB) == expected


def test_bad_pieces_name_the_argument():
    with pytest.raises(ValueError, match="add up to the 4 layers"):
        overlap.replay([1.0] * 4, (1, 1), [1.0, 1.0], overlapped=True)
    with pytest.raises(ValueError, match="one all-reduce per bucket"):
        overlap.replay([1.0] * 4, (2, 2), [1.0], overlapped=True)
    with pytest.raises(ValueError, match="layer_backward_s"):
        overlap.replay([-1.0], (1,), [1.0], overlapped=True)
    with pytest.raises(ValueError, match="variant must be one of"):
        overlap.bucket_layers("ddp", [1], 1)
