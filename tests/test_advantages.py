"""group_advantages / group_mean_std against a slow, obvious pure-Python reference."""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch

from comlrl.functional.advantages import group_advantages, group_mean_std

MODES = ["mean", "raw", "max", "rloo"]


# --------------------------------------------------------------------------------------------
# Reference: a dict of groups and plain loops.
# --------------------------------------------------------------------------------------------


def _groups(group_ids: list[int]) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(g, []).append(i)
    return groups


def ref_mean_std(returns: list[float], group_ids: list[int]) -> tuple[list[float], list[float]]:
    mean = [0.0] * len(returns)
    std = [0.0] * len(returns)
    for members in _groups(group_ids).values():
        vals = [returns[i] for i in members]
        m = sum(vals) / len(vals)
        s = statistics.pstdev(vals)  # population std (n), as CoMLRL
        for i in members:
            mean[i] = m
            std[i] = s
    return mean, std


def ref_advantages(returns: list[float], group_ids: list[int], mode: str, normalize: bool,
                   eps: float) -> list[float]:
    out = [0.0] * len(returns)
    for members in _groups(group_ids).values():
        vals = [returns[i] for i in members]
        m = sum(vals) / len(vals)
        s = statistics.pstdev(vals)
        for i in members:
            r = returns[i]
            if mode == "mean":
                a = r - m
            elif mode == "raw":
                a = r
            elif mode == "max":
                a = r - max(vals)
            elif mode == "rloo":
                others = [returns[j] for j in members if j != i]
                a = r - sum(others) / len(others) if others else 0.0
            else:
                raise AssertionError(mode)
            if normalize and s > eps:  # a group without spread is left unscaled
                a = a / s
            out[i] = a
    return out


# --------------------------------------------------------------------------------------------
# Data: uneven groups, shuffled non-contiguous ids, one singleton group, one constant group.
# --------------------------------------------------------------------------------------------


def _make_data(seed: int) -> tuple[list[float], list[int], int, int]:
    rng = random.Random(seed)
    sizes = [1, 5, 2, 7, 3, 4, 6]          # group 0 has size 1
    constant_group = 3                     # group 3 has all-equal rewards
    group_ids = [g for g, n in enumerate(sizes) for _ in range(n)]
    rng.shuffle(group_ids)                 # interleaved, non-contiguous
    const_value = rng.uniform(-2, 2)
    returns = [const_value if g == constant_group else rng.gauss(0.5, 1.5) for g in group_ids]
    singleton = group_ids.index(0)
    return returns, group_ids, singleton, constant_group


def _tensors(returns, group_ids):
    return torch.tensor(returns, dtype=torch.float32), torch.tensor(group_ids, dtype=torch.int64)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_group_advantages_match_reference(mode, normalize, seed):
    returns, group_ids, singleton, constant_group = _make_data(seed)
    r, g = _tensors(returns, group_ids)
    # the reference sees exactly the float32 values the library sees
    returns32 = r.double().tolist()
    eps = 1e-4
    got = group_advantages(r, g, mode=mode, normalize=normalize, eps=eps)
    assert got.dtype == torch.float32
    assert got.shape == r.shape
    assert torch.isfinite(got).all()
    want = torch.tensor(ref_advantages(returns32, group_ids, mode, normalize, eps), dtype=torch.float64)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)

    # the constant group: zero advantage (not NaN) except for 'raw', which has no baseline
    const_rows = [i for i, gid in enumerate(group_ids) if gid == constant_group]
    if mode != "raw":
        assert all(got[i].item() == pytest.approx(0.0, abs=1e-6) for i in const_rows)
    # the singleton group: its own baseline (mean/max) or no others (rloo) -> 0
    if mode in ("mean", "max", "rloo"):
        assert got[singleton].item() == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_group_advantages_independent_of_row_order(mode, normalize):
    """Permuting rows permutes the advantages: groups are found by id, never by position."""
    returns, group_ids, _, _ = _make_data(7)
    r, g = _tensors(returns, group_ids)
    perm = torch.randperm(len(returns), generator=torch.Generator().manual_seed(3))
    base = group_advantages(r, g, mode=mode, normalize=normalize)
    permuted = group_advantages(r[perm], g[perm], mode=mode, normalize=normalize)
    torch.testing.assert_close(permuted, base[perm], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_group_advantages_sparse_group_ids(mode, normalize):
    """Group ids with gaps (e.g. a data-parallel shard holding groups 3, 10, 42, ...) behave like
    the same groups numbered densely: unused ids must not leak NaN into the result."""
    returns, group_ids, _, _ = _make_data(13)
    sparse = {0: 3, 1: 10, 2: 42, 3: 0, 4: 7, 5: 8, 6: 20}
    sparse_ids = [sparse[g] for g in group_ids]
    r, _ = _tensors(returns, group_ids)
    got = group_advantages(r, torch.tensor(sparse_ids), mode=mode, normalize=normalize)
    assert torch.isfinite(got).all()
    want = torch.tensor(ref_advantages(r.double().tolist(), sparse_ids, mode, normalize, 1e-6), dtype=torch.float64)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_group_advantages_relabelled_groups():
    """Renaming group ids (a bijection of [0, G)) does not change any advantage."""
    returns, group_ids, _, _ = _make_data(11)
    relabel = {0: 4, 1: 6, 2: 0, 3: 1, 4: 5, 5: 3, 6: 2}
    r, g = _tensors(returns, group_ids)
    g2 = torch.tensor([relabel[x] for x in group_ids])
    for mode in MODES:
        torch.testing.assert_close(group_advantages(r, g, mode, True), group_advantages(r, g2, mode, True))


def test_rloo_is_return_minus_mean_of_others_explicit():
    returns = torch.tensor([1.0, 4.0, 2.0, 10.0, -3.0, 7.0, 0.5])
    group_ids = torch.tensor([1, 0, 1, 2, 1, 0, 3])   # groups: {0:[4,7]}, {1:[1,2,-3]}, {2:[10]}, {3:[0.5]}
    got = group_advantages(returns, group_ids, mode="rloo")
    want = torch.tensor([
        1.0 - (2.0 + -3.0) / 2,    # row 0, group 1, others 2, -3
        4.0 - 7.0,                 # row 1, group 0, other 7
        2.0 - (1.0 + -3.0) / 2,    # row 2
        0.0,                       # row 3, singleton
        -3.0 - (1.0 + 2.0) / 2,    # row 4
        7.0 - 4.0,                 # row 5
        0.0,                       # row 6, singleton
    ])
    torch.testing.assert_close(got, want)
    # and the documented identity K/(K-1) * (r - mean) for groups of K > 1
    mean_adv = group_advantages(returns, group_ids, mode="mean")
    k = torch.bincount(group_ids).double()[group_ids]
    multi = k > 1
    torch.testing.assert_close(got[multi].double(), (mean_adv.double() * k / (k - 1))[multi], rtol=1e-6, atol=1e-6)


def test_max_mode_nonpositive_and_zero_at_argmax():
    returns, group_ids, _, _ = _make_data(5)
    r, g = _tensors(returns, group_ids)
    adv = group_advantages(r, g, mode="max")
    assert (adv <= 0).all()
    for gid in set(group_ids):
        rows = [i for i, x in enumerate(group_ids) if x == gid]
        assert max(adv[i].item() for i in rows) == 0.0


def test_equal_rewards_everywhere_give_zero_not_nan():
    r = torch.full((6,), 3.25)
    g = torch.tensor([0, 0, 1, 1, 1, 2])
    for mode in ("mean", "max", "rloo"):
        for normalize in (False, True):
            adv = group_advantages(r, g, mode=mode, normalize=normalize)
            assert not torch.isnan(adv).any(), (mode, normalize)
            assert torch.equal(adv, torch.zeros(6)), (mode, normalize)


def test_normalize_divides_by_population_std():
    r = torch.tensor([0.0, 1.0, 2.0, 5.0, 5.0, 9.0])
    g = torch.tensor([0, 0, 0, 1, 1, 1])
    adv = group_advantages(r, g, mode="mean", normalize=True)
    s0 = statistics.pstdev([0.0, 1.0, 2.0])
    s1 = statistics.pstdev([5.0, 5.0, 9.0])
    want = [(0 - 1) / s0, 0.0, (2 - 1) / s0, (5 - 19 / 3) / s1, (5 - 19 / 3) / s1, (9 - 19 / 3) / s1]
    torch.testing.assert_close(adv.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=1e-6)


def test_normalize_leaves_groups_without_spread_unscaled():
    """A raw (no-baseline) group of equal returns keeps its returns: dividing by a zero std would
    blow them up, and re-centring would erase the baseline choice (CoMLRL 1.4.3 does the latter)."""
    r = torch.tensor([2.0, 2.0, 1.0, 3.0])
    g = torch.tensor([0, 0, 1, 1])
    adv = group_advantages(r, g, mode="raw", normalize=True)
    torch.testing.assert_close(adv, torch.tensor([2.0, 2.0, 1.0, 3.0]))


@pytest.mark.parametrize("mode", MODES)
def test_normalized_baselines_stay_distinct(mode):
    """Unlike CoMLRL 1.4.3 (which re-centres after normalising, making every mode the same), the
    baseline still matters with normalisation on: only MAGRPO's advantages have zero mean."""
    r = torch.tensor([1.0, 0.0, 3.0, 2.0])
    g = torch.zeros(4, dtype=torch.int64)
    adv = group_advantages(r, g, mode=mode, normalize=True)
    std = statistics.pstdev([1.0, 0.0, 3.0, 2.0])
    baseline = {"mean": 1.5, "raw": 0.0, "max": 3.0}.get(mode)
    want = (r - baseline) / std if baseline is not None else (r - (r.sum() - r) / 3) / std
    torch.testing.assert_close(adv, want.float())


def test_group_advantages_keeps_device_and_accepts_float64():
    r = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    g = torch.tensor([0, 0, 1])
    adv = group_advantages(r, g)
    assert adv.dtype == torch.float32 and adv.device == r.device
    torch.testing.assert_close(adv, torch.tensor([-0.5, 0.5, 0.0]))


@pytest.mark.parametrize("mode", ["", "MEAN", "grpo", "min", None])
def test_bad_mode_raises(mode):
    with pytest.raises(ValueError):
        group_advantages(torch.tensor([1.0, 2.0]), torch.tensor([0, 0]), mode=mode)


def test_shape_mismatch_raises():
    with pytest.raises(ValueError):
        group_advantages(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 0]))
    with pytest.raises(ValueError):
        group_advantages(torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.int64))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_group_mean_std_match_reference(seed):
    returns, group_ids, singleton, constant_group = _make_data(seed)
    r, g = _tensors(returns, group_ids)
    mean, std = group_mean_std(r, g)
    ref_mean, ref_std = ref_mean_std(r.double().tolist(), group_ids)
    torch.testing.assert_close(mean.double(), torch.tensor(ref_mean, dtype=torch.float64), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(std.double(), torch.tensor(ref_std, dtype=torch.float64), rtol=1e-9, atol=1e-9)
    assert std[singleton].item() == 0.0
    for i, gid in enumerate(group_ids):
        if gid == constant_group:
            assert std[i].item() == pytest.approx(0.0, abs=1e-12)
    assert not math.isnan(std.sum().item())
