"""Banded attention computes the whole masked call bit for bit, on fewer keys."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ctxc.passes.runtime.banded_attention import KEY_BLOCK, banded_sdpa, mask_bands, usable
from tests.fixtures.helpers import diff_msg


def _masks(n: int) -> dict[str, torch.Tensor]:
    i = torch.arange(n)
    causal = i[None, :] <= i[:, None]  # [n, n]
    sliding = causal & (i[None, :] > i[:, None] - 300)
    padded = causal & (i[None, :] >= 700)  # the first 700 keys hidden: rows < 700 see nothing
    return {
        k: m[None, None] for k, m in [("causal", causal), ("sliding", sliding), ("padded", padded)]
    }


@pytest.mark.parametrize("n", [1800, 2600])
@pytest.mark.parametrize("kind", ["causal", "sliding", "padded"])
def test_banded_equals_whole_call(n: int, kind: str) -> None:
    g = torch.Generator().manual_seed(n)
    q = torch.randn(1, 4, n, 16, generator=g) * 3  # [b, h, n, e]
    k = torch.randn(1, 2, n, 16, generator=g).repeat_interleave(2, dim=1) * 3
    v = torch.randn(1, 2, n, 16, generator=g).repeat_interleave(2, dim=1)
    mask = _masks(n)[kind]
    assert usable(q, mask, 0.0, False)
    bands = mask_bands(mask)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25)
    got = banded_sdpa(q, k, v, mask, bands, scale=0.25)
    both_nan = got.isnan() & want.isnan()
    assert torch.equal(got[~both_nan], want[~both_nan]), diff_msg(
        kind, got.nan_to_num(), want.nan_to_num()
    )
    read = sum((b.rows[1] - b.rows[0]) * (b.keys[1] - b.keys[0]) for b in bands)
    assert read < n * n, f"{kind}: the bands read all {n}x{n} scores"
    assert all(b.keys[0] % KEY_BLOCK == 0 for b in bands)
    assert bands[-1].rows[1] == n and min(b.rows[1] - b.rows[0] for b in bands) >= 768


def test_usable_refuses_what_it_cannot_compute() -> None:
    q = torch.zeros(1, 1, 2000, 8)
    mask = torch.ones(1, 1, 2000, 2000, dtype=torch.bool)
    assert usable(q, mask, 0.0, False)
    assert not usable(q, mask.float(), 0.0, False)  # an additive float mask
    assert not usable(q, None, 0.0, True)
    assert not usable(q, mask, 0.1, False)
    assert not usable(q[..., :1000, :], mask[..., :1000, :1000], 0.0, False)  # one chunk: as is
