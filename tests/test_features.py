"""Tests for lipvit.analysis.features: penultimate features, A-distance, shift."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from lipvit.analysis import features as Fe

import lipvit


@pytest.mark.parametrize("seed", [0, 1])
def test_a_distance_separable_sets_is_two(seed):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(150, 8))
    b = rng.normal(size=(150, 8)) + 4.0  # far apart along every axis
    d = Fe.proxy_a_distance(a, b, seed=seed)
    assert d.error == 0.0 and d.a_distance == 2.0
    assert d.n_train + d.n_test == 300


def test_a_distance_identical_pairs_is_zero():
    # Each test image appears with both labels: no classifier beats chance.
    rng = np.random.default_rng(0)
    a = rng.normal(size=(120, 8))
    d = Fe.proxy_a_distance(a, a.copy(), paired=True)
    assert d.error == 0.5 and d.a_distance == 0.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_distance_same_distribution_is_small(seed):
    rng = np.random.default_rng(seed)
    d = Fe.proxy_a_distance(rng.normal(size=(300, 8)), rng.normal(size=(300, 8)),
                            seed=seed)
    assert 0.0 <= d.a_distance < 0.4
    assert d.a_distance == pytest.approx(2 * (1 - 2 * min(d.error, 0.5)))


def test_a_distance_grows_with_the_shift():
    rng = np.random.default_rng(3)
    a = rng.normal(size=(200, 4))
    noise = rng.normal(size=(200, 4))
    dists = [Fe.proxy_a_distance(a, noise + s, seed=3).a_distance
             for s in (0.0, 0.5, 3.0)]
    assert dists[0] < dists[1] < dists[2]


def test_a_distance_bad_inputs():
    with pytest.raises(ValueError, match="features"):
        Fe.proxy_a_distance(np.zeros((10, 3)), np.zeros((10, 4)))
    with pytest.raises(ValueError, match="same number"):
        Fe.proxy_a_distance(np.zeros((10, 3)), np.zeros((9, 3)), paired=True)
    with pytest.raises(ValueError, match="too few"):
        Fe.proxy_a_distance(np.zeros((3, 3)), np.ones((3, 3)))
    with pytest.raises(ValueError, match="test_fraction"):
        Fe.proxy_a_distance(np.zeros((10, 3)), np.ones((10, 3)), test_fraction=1.0)


@pytest.fixture(scope="module")
def model_and_data():
    torch.manual_seed(0)
    model = lipvit.ViT(lipvit.preset("digits-tiny", family="standard")).eval()
    x = torch.rand(24, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 10, (24,), generator=torch.Generator().manual_seed(1))
    return model, x, y


def test_penultimate_features_feed_the_head(model_and_data):
    model, x, y = model_and_data
    f = Fe.penultimate_features(model, x, batch_size=7)
    assert f.shape == (24, 32)
    with torch.no_grad():
        torch.testing.assert_close(f, model.forward_features(x)[:, 0])
        torch.testing.assert_close(model.head(f), model(x))


def test_feature_shift_zero_eps_is_no_shift(model_and_data):
    model, x, y = model_and_data
    s = Fe.feature_shift(model, x, y, attack="pgd", eps=0.0, tsne=False, steps=2)
    np.testing.assert_allclose(s.clean, s.attacked, atol=1e-6)
    assert s.a_distance.a_distance == 0.0 and s.embedding is None
    np.testing.assert_array_equal(s.clean_prediction, s.attacked_prediction)


def test_feature_shift_attack_moves_features(model_and_data):
    model, x, y = model_and_data
    s = Fe.feature_shift(model, x, y, attack="pgd-l2", eps=2.0, norm="l2", steps=5)
    assert s.clean.shape == s.attacked.shape == (24, 32)
    assert np.linalg.norm(s.clean - s.attacked, axis=1).min() > 1e-3
    assert s.embedding.shape == (48, 2) and np.all(np.isfinite(s.embedding))
    assert s.attacked_mask.sum() == 24 and not s.attacked_mask[:24].any()
    assert 0.0 <= s.a_distance.a_distance <= 2.0
    assert s.attacked_accuracy <= 1.0 and s.attack == "pgd-l2" and s.norm == "l2"
    with torch.no_grad():
        pred = model(x).argmax(1).numpy()
    np.testing.assert_array_equal(s.clean_prediction, pred)


def test_tsne_embedding_is_seeded():
    rng = np.random.default_rng(0)
    f = rng.normal(size=(20, 5))
    a, b = Fe.tsne_embedding(f, seed=1), Fe.tsne_embedding(f, seed=1)
    assert a.shape == (20, 2)
    np.testing.assert_allclose(a, b)
    with pytest.raises(ValueError, match="m >= 4"):
        Fe.tsne_embedding(f[:3])
