"""Trace generators and trace files: distributions, layout, reproducibility, loading, errors."""

import numpy as np
import pytest
import torch

from tiered_tbe.traces import (
    CRITEO_KAGGLE_TABLE_ROWS,
    Trace,
    criteo_trace,
    drifting_zipf_trace,
    load_trace,
    zipf_trace,
)
from tiered_tbe.zipf import DeviceZipfSampler, ZipfSampler, _inverse_cdf


def fitted_exponent(rows: np.ndarray, head: int = 100) -> float:
    """Slope of log(frequency) against log(rank) over the ``head`` most frequent rows, negated."""
    counts = np.sort(np.bincount(rows))[::-1][:head]
    slope, _ = np.polyfit(np.log(np.arange(1, head + 1)), np.log(counts), 1)
    return -slope


@pytest.mark.parametrize("alpha", [0.7, 1.0, 1.05, 1.2, 1.5])
def test_zipf_exponent_matches_alpha(alpha):
    trace = zipf_trace(num_rows=200_000, alpha=alpha, batch_size=1000, bag_size=10, num_batches=80, seed=1)
    assert fitted_exponent(trace.rows) == pytest.approx(alpha, abs=0.05)


def test_alpha_one_is_zipf_not_uniform():
    trace = zipf_trace(num_rows=100_000, alpha=1.0, batch_size=1000, bag_size=10, num_batches=20, seed=0)
    counts = np.bincount(trace.rows, minlength=trace.num_rows)
    # Zipf(1) over 1e5 rows: the hottest row takes 1 / H(1e5) ~ 8% of the lookups; uniform would be 0.001%.
    assert counts.max() / trace.num_lookups == pytest.approx(1 / np.sum(1 / np.arange(1, 100_001)), rel=0.05)


def test_inverse_cdf_equals_binary_search():
    """The guide-table scan is the exact inverse CDF: the same answer as np.searchsorted, edges included."""
    sampler = ZipfSampler(5_000, 1.1, np.random.default_rng(0))
    uniforms = np.concatenate([
        np.random.default_rng(1).random(100_000),
        sampler.cdf[:200],  # exactly on a step: the rank after it
        np.nextafter(sampler.cdf[:200], 0),  # just below a step
        [0.0, np.nextafter(1.0, 0)],
    ])
    out = np.empty(uniforms.size, dtype=np.int64)
    _inverse_cdf(sampler.cdf, sampler.guide, uniforms, out)
    np.testing.assert_array_equal(out, np.searchsorted(sampler.cdf, uniforms, side="right"))


def test_hot_rows_are_spread_over_the_ids():
    trace = zipf_trace(num_rows=100_000, alpha=1.2, batch_size=500, bag_size=10, num_batches=20, seed=0)
    hottest = np.argsort(np.bincount(trace.rows, minlength=trace.num_rows))[::-1][:100]
    assert hottest.max() > 50_000 and hottest.min() < 50_000  # not ranks 0..99 as ids


def test_generators_are_reproducible_and_seeded():
    make = lambda seed: zipf_trace(10_000, 1.05, 64, 4, 5, seed=seed)
    np.testing.assert_array_equal(make(3).rows, make(3).rows)
    assert not np.array_equal(make(3).rows, make(4).rows)
    drift = lambda seed: drifting_zipf_trace(10_000, 1.05, 64, 4, 30, drift_period=10, seed=seed)
    np.testing.assert_array_equal(drift(3).rows, drift(3).rows)
    criteo = lambda seed: criteo_trace(1.1, batch_size=8, num_batches=3, row_cap=1000, seed=seed)
    np.testing.assert_array_equal(criteo(2).rows, criteo(2).rows)
    assert not np.array_equal(criteo(2).rows, criteo(5).rows)
    sampler = ZipfSampler(1000, 1.1, np.random.default_rng(7))
    rng_a, rng_b = np.random.default_rng(8), np.random.default_rng(8)
    np.testing.assert_array_equal(np.concatenate([sampler.sample(rng_a, 10), sampler.sample(rng_a, 5)]),
                                  sampler.sample(rng_b, 15))


def test_the_device_sampler_draws_the_ranks_of_the_host_sampler():
    """One distribution, two ways to draw: the same uniform gives the same row on the host and the device."""
    samplers = [ZipfSampler(n, alpha, np.random.default_rng(n)) for n, alpha in ((1, 1.05), (700, 1.2), (50, 0.0))]
    device = DeviceZipfSampler(samplers, "cpu", torch.Generator().manual_seed(0))
    uniforms = np.random.default_rng(2).random(20_000)
    for t, sampler in enumerate(samplers):
        position = device.ranks_of(torch.from_numpy(uniforms), torch.full((uniforms.size,), t))
        host_rows = sampler.id_of_rank[sampler.ranks_of(uniforms)]
        np.testing.assert_array_equal(device.local_row[position].numpy(), host_rows)
    rows = device.sample(5000).view(3, 5000)
    assert int(rows[0].max()) == 0 and int(rows[1].max()) < 700
    counts = torch.bincount(rows[2], minlength=50)  # alpha 0: uniform
    assert int(counts.min()) > 50 and int(counts.max()) < 150


def test_zipf_trace_layout():
    trace = zipf_trace(num_rows=1000, alpha=1.05, batch_size=16, bag_size=3, num_batches=4, seed=0)
    assert trace.rows.dtype == np.int64 and trace.rows.shape == (4 * 16 * 3,)
    np.testing.assert_array_equal(trace.batch_offsets, [0, 48, 96, 144, 192])
    indices, offsets = trace.tbe_batch(2)
    np.testing.assert_array_equal(offsets, np.arange(0, 49, 3))
    np.testing.assert_array_equal(indices, trace.rows[96:144])


def test_drift_moves_the_hot_rows():
    def hot_set(trace, batches):
        rows = np.concatenate([trace.batch(b) for b in batches])
        return set(np.argsort(np.bincount(rows, minlength=trace.num_rows))[::-1][:50].tolist())

    drifting = drifting_zipf_trace(50_000, 1.2, 256, 4, 60, drift_period=20, seed=0)
    steady = drifting_zipf_trace(50_000, 1.2, 256, 4, 60, drift_period=10**6, seed=0)
    early, late = range(0, 5), range(55, 60)
    assert len(hot_set(steady, early) & hot_set(steady, late)) >= 40
    assert len(hot_set(drifting, early) & hot_set(drifting, late)) <= 10
    # Mid-period, half the lookups follow the old ranking and half the new one.
    assert fitted_exponent(drifting.batch(30), head=20) < fitted_exponent(steady.batch(30), head=20)


def test_criteo_trace_tables_layout_and_cap():
    assert len(CRITEO_KAGGLE_TABLE_ROWS) == 26 and sum(CRITEO_KAGGLE_TABLE_ROWS) == 33_762_577
    trace = criteo_trace(alpha=1.1, batch_size=8, num_batches=3, bag_size=2, row_cap=5000, seed=0)
    assert trace.table_rows == tuple(min(n, 5000) for n in CRITEO_KAGGLE_TABLE_ROWS)
    assert trace.num_tables == 26 and trace.num_lookups == 3 * 26 * 8 * 2
    starts = trace.table_row_offsets
    for b in range(trace.num_batches):
        indices, offsets = trace.tbe_batch(b)
        assert offsets.shape == (26 * 8 + 1,) and offsets[-1] == indices.size == 26 * 8 * 2
        per_table = indices.reshape(26, 16)  # table-major: 8 bags of 2 per table
        assert np.all(per_table >= 0) and np.all(per_table < np.array(trace.table_rows)[:, None])
        np.testing.assert_array_equal(per_table + starts[:-1, None], trace.batch(b).reshape(26, 16))


def test_criteo_per_table_alpha():
    alphas = [0.8] * 13 + [1.6] * 13
    trace = criteo_trace(alpha=alphas, batch_size=2000, num_batches=2, row_cap=20_000, seed=0)
    table_rows = trace.rows.reshape(2, 26, 2000)
    starts = trace.table_row_offsets
    flat = table_rows[:, 2] - starts[2]  # 10M rows capped to 20k, alpha 0.8
    steep = table_rows[:, 15] - starts[15]  # 5.4M capped to 20k, alpha 1.6
    assert np.bincount(steep.ravel()).max() > 5 * np.bincount(flat.ravel()).max()
    with pytest.raises(ValueError, match="one alpha or 26"):
        criteo_trace(alpha=[1.0, 1.1], batch_size=2, num_batches=1)


# ---------------------------------------------------------------------------------------------
# Files.
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def small_criteo() -> Trace:
    return criteo_trace(alpha=1.05, batch_size=4, num_batches=3, bag_size=2, row_cap=300, seed=0)


def assert_same_lookups(loaded: Trace, original: Trace):
    np.testing.assert_array_equal(loaded.rows, original.rows)
    np.testing.assert_array_equal(loaded.batch_offsets, original.batch_offsets)
    for b in range(original.num_batches):
        for got, want in zip(loaded.tbe_batch(b), original.tbe_batch(b)):
            np.testing.assert_array_equal(got, want)


def test_load_text_file(tmp_path):
    path = tmp_path / "trace.txt"
    path.write_text("# row ids\n5\n3\n\n5\n9\n1\n2\n7\n")
    trace = load_trace(path, batch_size=2, bag_size=1)
    np.testing.assert_array_equal(trace.rows, [5, 3, 5, 9, 1, 2, 7])
    np.testing.assert_array_equal(trace.batch_offsets, [0, 2, 4, 6, 7])  # the last batch is short
    assert trace.num_rows == 10
    with pytest.raises(ValueError, match="batch size"):
        load_trace(path)


def test_load_pt_batch_list_and_dict(tmp_path, small_criteo):
    batches = [tuple(torch.from_numpy(a) for a in small_criteo.tbe_batch(b)) for b in range(3)]
    torch.save(batches, tmp_path / "list.pt")
    assert_same_lookups(load_trace(tmp_path / "list.pt", table_rows=small_criteo.table_rows), small_criteo)

    torch.save([dict(indices=i, offsets=o) for i, o in batches], tmp_path / "dicts.pt")
    assert_same_lookups(load_trace(tmp_path / "dicts.pt", table_rows=small_criteo.table_rows), small_criteo)

    indices = torch.cat([i for i, _ in batches])
    offsets = torch.from_numpy(small_criteo.bag_offsets)
    torch.save(dict(indices=indices, offsets=offsets, batch_size=4, table_rows=list(small_criteo.table_rows)),
               tmp_path / "dict.pt")
    assert_same_lookups(load_trace(tmp_path / "dict.pt"), small_criteo)


def test_load_npy_and_npz(tmp_path):
    trace = zipf_trace(2000, 1.1, batch_size=8, bag_size=3, num_batches=4, seed=0)
    np.save(tmp_path / "pair.npy", np.array([trace.rows, trace.bag_offsets], dtype=object), allow_pickle=True)
    assert_same_lookups(load_trace(tmp_path / "pair.npy", batch_size=8), trace)
    np.save(tmp_path / "dict.npy", dict(indices=trace.rows, offsets=trace.bag_offsets, batch_size=8))
    assert_same_lookups(load_trace(tmp_path / "dict.npy"), trace)
    np.savez(tmp_path / "trace.npz", indices=trace.rows, offsets=trace.bag_offsets, batch_size=8)
    assert_same_lookups(load_trace(tmp_path / "trace.npz"), trace)
    np.save(tmp_path / "ids.npy", trace.rows)
    loaded = load_trace(tmp_path / "ids.npy", batch_size=8, bag_size=3)
    assert_same_lookups(loaded, trace)


def test_load_rejects_bad_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_trace(tmp_path / "missing.pt")
    (tmp_path / "words.txt").write_text("1\nfoo\n")
    with pytest.raises(ValueError, match="one integer row id per line"):
        load_trace(tmp_path / "words.txt", batch_size=1)
    indices = torch.tensor([0, 1, 2, 3])
    torch.save((indices, torch.tensor([0, 2, 1, 4])), tmp_path / "decreasing.pt")
    with pytest.raises(ValueError, match="non-decreasing"):
        load_trace(tmp_path / "decreasing.pt", batch_size=1)
    torch.save((indices, torch.tensor([0, 2, 4])), tmp_path / "pair.pt")
    with pytest.raises(ValueError, match="not a whole number of batches"):
        load_trace(tmp_path / "pair.pt", batch_size=3)
    with pytest.raises(ValueError, match="index 3, outside"):  # table 1 has rows 0..2
        load_trace(tmp_path / "pair.pt", batch_size=1, table_rows=[5, 3])
    torch.save(dict(indices=indices), tmp_path / "no_offsets.pt")
    with pytest.raises(ValueError, match="missing \\['offsets'\\]"):
        load_trace(tmp_path / "no_offsets.pt")
    torch.save((torch.tensor([-1, 0]), torch.tensor([0, 1, 2])), tmp_path / "negative.pt")
    with pytest.raises(ValueError, match=">= 0"):
        load_trace(tmp_path / "negative.pt", batch_size=2)
