"""Value pattern, head ownership and decode-pool verification."""

from __future__ import annotations

import itertools

import pytest
import torch

from twin.core.layout import compute_head_slice_params
from twin.hw.kernels import gather_to_staging, pool_token_indices, scatter_from_staging
from twin.hw.kvpattern import (
    Mismatch,
    TransferCase,
    expected_tokens,
    fill_prefill_pool,
    pattern_value,
    rank_head_range,
    run_transfer,
    verify_decode_pool,
    writer_ranks,
)

TPS = [1, 2, 4, 8]


def test_rank_head_range() -> None:
    assert rank_head_range(2, 1, 8) == range(4, 8)
    assert rank_head_range(1, 0, 2) == range(0, 2)
    assert [rank_head_range(4, r, 2) for r in range(4)] == [range(0, 1)] * 2 + [range(1, 2)] * 2
    with pytest.raises(ValueError):
        rank_head_range(3, 0, 8)


@pytest.mark.parametrize("heads", [2, 4, 8])
def test_head_slices_connect_matching_global_heads(heads: int) -> None:
    """Every writer sends global heads that the decode rank stores at dst_head_start."""
    for src_tp, dst_tp in itertools.product(TPS, TPS):
        for d in range(dst_tp):
            dst_heads = rank_head_range(dst_tp, d, heads)
            covered: set[int] = set()
            for r in writer_ranks(src_tp, dst_tp, d):
                src_start, nh, dst_start, _ = compute_head_slice_params(src_tp, dst_tp, r, d, heads)
                sent = rank_head_range(src_tp, r, heads)[src_start : src_start + nh]
                assert list(sent) == list(dst_heads[dst_start : dst_start + nh]), (src_tp, dst_tp)
                covered |= set(sent)
            assert covered == set(dst_heads)


def test_pattern_is_pure_and_distinct() -> None:
    table = expected_tokens(5, [0, 3], range(10, 14), [2, 6], 8, torch.bfloat16)
    assert table.shape == (2, 2, 4, 2, 8)
    one = pattern_value(5, 3, 1, 12, 6, 7, torch.bfloat16)
    assert one.view(torch.int16) == table[1, 1, 2, 1, 7].view(torch.int16)
    again = expected_tokens(5, [0, 3], range(10, 14), [2, 6], 8, torch.bfloat16)
    assert torch.equal(table.view(torch.int16), again.view(torch.int16))
    other = expected_tokens(6, [0, 3], range(10, 14), [2, 6], 8, torch.bfloat16)
    assert (table.view(torch.int16) != other.view(torch.int16)).float().mean() > 0.99


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]
)
def test_pattern_values_are_finite(dtype: torch.dtype) -> None:
    table = expected_tokens(1, 4, range(64), range(8), 16, dtype)
    assert table.dtype == dtype
    assert bool(torch.isfinite(table.float()).all())


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn]
)
def test_factored_table_equals_the_element_definition(dtype: torch.dtype) -> None:
    """expected_tokens builds its table from a row hash and a dim hash; every element must be
    pattern_value of its own coordinates (the reference definition)."""
    layers, tokens, heads = [1, 4], range(30, 47), [0, 3, 5]
    table = expected_tokens(11, layers, tokens, heads, 16, dtype)
    ref = pattern_value(
        11,
        torch.tensor(layers).view(1, -1, 1, 1, 1),
        torch.arange(2).view(-1, 1, 1, 1, 1),
        torch.tensor(list(tokens)).view(1, 1, -1, 1, 1),
        torch.tensor(heads).view(1, 1, 1, -1, 1),
        torch.arange(16).view(1, 1, 1, 1, -1),
        dtype,
    )
    iv = {1: torch.int8, 2: torch.int16, 4: torch.int32}[table.element_size()]
    assert ref.shape == table.shape
    assert torch.equal(table.view(iv), ref.view(iv))
    # a dim of a row differs from the same dim of the next token's row, but for chance (1 in 128
    # for fp8's 7 free bits)
    assert bool((table.view(iv)[:, :, 1:] != table.view(iv)[:, :, :-1]).float().mean() > 0.97)


def test_fill_then_verify_prefill_pool() -> None:
    page_size, heads = 4, rank_head_range(2, 1, 8)
    k = [torch.zeros(32, len(heads), 8, dtype=torch.float16) for _ in range(2)]
    v = [torch.zeros(32, len(heads), 8, dtype=torch.float16) for _ in range(2)]
    pages = [6, 1, 3]
    fill_prefill_pool(k, v, pages, page_size, 9, token_offset=12, head_offset=heads.start)
    tokens = pool_token_indices(pages, page_size)
    assert verify_decode_pool(k, v, 9, range(12, 24), tokens, heads) is None
    bad = verify_decode_pool(k, v, 9, range(13, 25), tokens, heads)
    assert bad is not None and bad.token == 13 and bad.layer == 0 and bad.kv == "k"
    assert verify_decode_pool(k, v, 8, range(12, 24), tokens, heads) is not None


def test_corrupt_decode_pool_byte_is_located() -> None:
    case = TransferCase(2, 1, 8, num_layers=3, dtype=torch.bfloat16, token_offset=32, seed=4)
    res = run_transfer(case, gather_to_staging, scatter_from_staging)
    assert res.mismatches == [None]
    pages = res.decode_pages[0]
    pool_token = int(pages[1]) * case.page_size + 5  # chunk token 16 + 5
    layer = res.decode_v[0][2]
    layer.view(torch.uint8).view(layer.shape[0], layer.shape[1], -1)[pool_token, 6, 2 * 3 + 1] ^= 1
    tokens = pool_token_indices(pages, case.page_size)
    positions = range(32, 32 + tokens.numel())
    found = verify_decode_pool(res.decode_k[0], res.decode_v[0], 7, positions, tokens, range(8))
    assert isinstance(found, Mismatch)
    assert (found.request, found.layer, found.kv, found.token, found.head, found.dim) == (
        7,
        2,
        "v",
        32 + 16 + 5,
        6,
        3,
    )
    assert found.count == 1 and found.expected != found.got
    assert "layer 2 V token 53 head 6 dim 3" in str(found)


def test_corrupt_staging_byte_is_located() -> None:
    """A flipped byte in writer 1's V block shows up at the decode head it scatters to."""
    case = TransferCase(4, 2, 8, num_layers=2, head_dim=8, page_size=16, chunk_pages=2, seed=9)
    num_tokens, nh, elem = 32, 2, 2
    writer, layer, token, head, dim = 1, 1, 17, 1, 5
    per_writer = 2 * case.num_layers * num_tokens * nh * case.head_dim * elem
    row = (case.num_layers + layer) * num_tokens + token  # V layers follow all K layers
    offset = writer * per_writer + (row * nh + head) * case.head_dim * elem + dim * elem

    def corrupting_scatter(region: torch.Tensor, *args: object) -> None:
        region[offset] ^= 0x80
        scatter_from_staging(region, *args)

    res = run_transfer(case, gather_to_staging, corrupting_scatter)
    dst_start = compute_head_slice_params(4, 2, writer, 1, 8)[2]
    for d, found in enumerate(res.mismatches):
        assert found is not None
        assert (found.layer, found.kv, found.token, found.dim) == (layer, "v", token, dim)
        assert found.head == rank_head_range(2, d, 8).start + dst_start + head
        assert found.count == 1
