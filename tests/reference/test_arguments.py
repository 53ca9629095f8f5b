"""One rule for integer arguments (``leanstate.reference.arguments``), and the places that
used to disagree now agreeing on it."""

import re

import numpy as np
import pytest
import torch

import leanstate
from leanstate.reference import checkpoint as textbook
from leanstate.reference.arguments import int_argument, is_int
from leanstate.reference.sharding import bucket_owner


@pytest.mark.parametrize("value", [0, 7, np.int64(7), np.int32(7), torch.tensor(7)])
def test_integers_of_every_kind_are_ints(value):
    assert is_int(value) and int_argument(value, "x") == int(value)


@pytest.mark.parametrize("value", [True, False, 1.0, "1", None, np.float64(1.0), torch.tensor(1.0)])
def test_bools_floats_and_strings_are_not(value):
    assert not is_int(value)
    with pytest.raises(ValueError, match=re.escape(f"x must be an int; got {value!r}")):
        int_argument(value, "x")


def test_the_range_is_named_and_the_error_class_chosen():
    with pytest.raises(ValueError, match=r"n must be an int in \[1, 4\]; got 5"):
        int_argument(5, "n", low=1, high=4)
    with pytest.raises(ValueError, match="n must be an int >= 1; got 0"):
        int_argument(0, "n", low=1)
    with pytest.raises(TypeError, match="n must be an int <= 3; got 4"):
        int_argument(4, "n", high=3, error=TypeError)


@pytest.mark.parametrize("chunk_bytes", [True, 0, 1.5, "64"])
def test_textbook_and_hardened_saves_refuse_the_same_chunk_bytes(tmp_path, chunk_bytes):
    store = leanstate.KVStore(4, backend="reference")
    for save in (textbook.save_checkpoint, leanstate.save_checkpoint):
        with pytest.raises(ValueError, match="chunk_bytes must be a positive int"):
            save(tmp_path / "c", {"t": store}, chunk_bytes=chunk_bytes)


def test_numpy_integers_are_taken_by_the_store_the_checkpoints_and_the_sharding(tmp_path):
    store = leanstate.KVStore(4, num_shards=np.int64(4), seed=np.int32(3), backend="reference")
    store.set(torch.tensor([1, 2]), torch.ones(2, 4))
    for save in (textbook.save_checkpoint, leanstate.save_checkpoint):
        save(tmp_path / save.__module__, {"t": store}, chunk_bytes=np.int64(64))
    assert bucket_owner(
        torch.tensor([0, 9]), world_size=np.int64(2), total_num_buckets=np.int64(10)
    ).tolist() == [0, 1]
    assert store.keys_in_range(np.int64(2), np.int64(3)).tolist() == [2]
