import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from leanstate.reference.row_format import (
    COUNT_MAX,
    RowLayout,
    header_words,
    pack_metadata,
    pad4,
    unpack_metadata,
)


def test_pad4():
    assert [pad4(n) for n in range(0, 9)] == [0, 4, 4, 4, 4, 8, 8, 8, 8]


def test_layout_of_the_design_example():
    layout = RowLayout(128, 1, torch.float32)
    assert (layout.header_elems, layout.padded_dim, layout.padded_state_dim) == (4, 128, 4)
    assert (layout.width, layout.row_bytes, layout.state_offset) == (136, 544, 132)


def test_fp16_layout_matches_fbgemm():
    # FBGEMM: fp16, D=128, rowwise adagrad: 4 state bytes = 2 halves, padded to 4.
    layout = RowLayout.for_state_bytes(128, 4, torch.float16)
    assert (layout.header_elems, layout.state_dim, layout.width, layout.row_bytes) == (
        8,
        2,
        140,
        280,
    )


def test_no_state_has_no_state_columns():
    layout = RowLayout(6, 0, torch.bfloat16)
    assert (layout.padded_state_dim, layout.width) == (0, 16)


@pytest.mark.parametrize(
    "args, error",
    [
        ((0, 0, torch.float32), ValueError),
        ((4, -1, torch.float32), ValueError),
        ((4, 0, torch.int64), TypeError),
    ],
)
def test_bad_layouts(args, error):
    with pytest.raises(error, match="dim|dtype"):
        RowLayout(*args)


@given(
    st.integers(0, 2**32 - 1),
    st.integers(0, COUNT_MAX),
    st.booleans(),
)
def test_metadata_round_trip_and_bit_positions(timestamp, count, used):
    meta = pack_metadata(torch.tensor([timestamp]), torch.tensor([count]), torch.tensor([used]))
    expected = timestamp | count << 32 | int(used) << 63
    assert int(meta) & (2**64 - 1) == expected
    t, c, u = unpack_metadata(meta)
    assert (int(t), int(c), bool(u)) == (timestamp, count, used)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_header_words_is_a_writable_view(dtype):
    rows = torch.zeros(3, RowLayout(4, 1, dtype).width, dtype=dtype)
    words = header_words(rows)
    words[:, 0] = torch.tensor([5, -6, 7])
    assert rows.view(torch.uint8)[1, :8].tolist() == list((-6 & (2**64 - 1)).to_bytes(8, "little"))
