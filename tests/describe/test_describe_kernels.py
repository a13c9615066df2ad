"""The description pass's faster kernels against the plain products they replace."""

import torch

from conceptlens.describe.describer import _add_outer
from conceptlens.describe.finish import map_xy


def test_sparse_outer_counts_equal_the_dense_product():
    g = torch.Generator().manual_seed(0)
    fired = (torch.rand(40, 30, generator=g) < 0.1).float()  # (rows, n) 0/1
    dense, sparse = torch.full((30, 30), 2.0), torch.full((30, 30), 2.0)  # accumulates onto earlier sums
    _add_outer(dense, fired, sparse=False)
    _add_outer(sparse, fired, sparse=True)
    assert torch.equal(sparse, dense) and torch.equal(dense - 2.0, fired.T @ fired)


def test_map_xy_axes_have_a_fixed_sign():
    g = torch.Generator().manual_seed(1)
    for dirs in (torch.randn(20, 5, generator=g), torch.randn(5, 20, generator=g)):
        xy = map_xy(dirs)
        assert torch.all(xy.gather(0, xy.abs().argmax(0, keepdim=True)) > 0)
        torch.testing.assert_close(map_xy(-dirs), xy)  # every direction negated: the same picture


def test_coarse_bin_counts_equal_the_fine_bins_of_every_value():
    from conceptlens.describe.describer import FINE, _count_bins, fine_bins
    from conceptlens.describe.topn import order_key

    g = torch.Generator().manual_seed(2)
    z = torch.randn(300, 7, generator=g) * torch.exp2(torch.randint(-24, 24, (300, 7), generator=g).float())
    z[::5] = 0.0  # exact zeros, signed zeros and values past both ends of the fine range
    z[1, :3] = torch.tensor([-0.0, 1e30, -1e-30])
    key = order_key(z)
    hist = torch.full((7, FINE), 3, dtype=torch.long)  # adds onto earlier counts
    _count_bins(hist, key)
    by_hand = torch.stack([torch.bincount(fine_bins(key[:, c]), minlength=FINE) for c in range(7)])
    assert torch.equal(hist - 3, by_hand)


def test_map_xy_is_the_two_leading_principal_components():
    g = torch.Generator().manual_seed(3)
    for dirs in (torch.randn(40, 6, generator=g) * torch.arange(1, 7), torch.randn(6, 40, generator=g)):
        unit = torch.nn.functional.normalize(dirs.double(), dim=1)
        centred = unit - unit.mean(0)
        u, s, _ = torch.linalg.svd(centred, full_matrices=False)
        ref = u[:, :2] * s[:2]  # PCA scores, up to each axis's sign
        ref = ref * torch.where(ref.gather(0, ref.abs().argmax(0, keepdim=True)) < 0, -1.0, 1.0)
        torch.testing.assert_close(map_xy(dirs).double(), ref, atol=1e-5, rtol=1e-4)
