"""Feature shift under attack: penultimate features, t-SNE and the proxy A-distance.

SpecFormer Fig. 2b–c embeds the penultimate features of clean and PGD-attacked
test points with t-SNE and reports the A-distance between the two sets: the
smaller, the less the attack moves the features.

=============  =====================  ============================================
symbol         variable               source
=============  =====================  ============================================
φ(x)           ``features``           class token after the final norm,
                                      ``model.forward_features(x)[:, 0]``
err            ``error``              held-out error of a linear classifier
                                      trained to tell clean from attacked φ
d_A            ``a_distance``         ``2 (1 − 2 err)``, the proxy A-distance
                                      (Ben-David et al. 2007; Ganin et al. 2016)
=============  =====================  ============================================

``d_A`` lies in ``[0, 2]``: 0 when the sets cannot be told apart (err = ½), 2
when a linear classifier separates them perfectly. Ben-David's definition
minimises err over the hypothesis class, which contains the constant
classifier (err = ½ on balanced sets), so a held-out err above ½ is clipped to
½. It is an estimate (a finite held-out split), not a bound.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from lipvit.analysis.attacks import perturb
from sklearn.linear_model import LogisticRegression
from sklearn.manifold import TSNE
from sklearn.model_selection import GridSearchCV
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from torch import Tensor, nn


def penultimate_features(model: nn.Module, x: Tensor, batch_size: int = 512) -> Tensor:
    """Class-token features after the final norm, ``φ(x)``: ``(B, D)``, detached.

    The input of the linear head: ``model.pool(model.forward_features(x))``, the
    class token (the mean token for CoViT's ``attention="conv"``).
    """
    model.eval()
    device = next(model.parameters()).device
    out = []
    with torch.no_grad():
        for i in range(0, x.shape[0], batch_size):
            tokens = model.forward_features(x[i:i + batch_size].to(device))  # (b, N, D)
            out.append(model.pool(tokens))  # (b, D)
    return torch.cat(out)


@dataclass(frozen=True)
class ADistance:
    """Proxy A-distance between two feature sets (see the module table).

    Attributes:
        a_distance: ``2 (1 − 2 min(err, ½))`` in ``[0, 2]``.
        error: held-out error of the domain classifier (unclipped).
        n_train, n_test: points (both sets together) used to fit and to test.
    """

    a_distance: float
    error: float
    n_train: int
    n_test: int


def proxy_a_distance(source: np.ndarray | Tensor, target: np.ndarray | Tensor, *,
                     paired: bool = False, test_fraction: float = 0.5,
                     seed: int = 0) -> ADistance:
    """Proxy A-distance ``2 (1 − 2 err)`` of a linear domain classifier.

    A logistic regression on standardised features (inverse regularisation
    ``C`` chosen by 3-fold cross-validation on the training part) learns to
    tell ``source`` from ``target``; ``err`` is its error on the held-out part.

    Args:
        source: ``(n, D)`` features (e.g. clean). target: ``(m, D)`` (attacked).
        paired: rows ``i`` of ``source`` and ``target`` come from the same
            image (``n == m``); a pair goes wholly to train or to test, so the
            test never sees the partner of a training point.
        test_fraction: share of points (pairs) held out.
        seed: split and solver seed.

    Raises:
        ValueError: mismatched widths, too few points, or a bad fraction.
    """
    a = np.asarray(source, dtype=np.float64)
    b = np.asarray(target, dtype=np.float64)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(
            f"need (n, D) and (m, D) features, got {a.shape} and {b.shape}")
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must lie in (0, 1), got {test_fraction}")
    if paired and a.shape[0] != b.shape[0]:
        raise ValueError("paired sets need the same number of rows")
    rng = np.random.default_rng(seed)

    def split(n: int) -> tuple[np.ndarray, np.ndarray]:
        perm = rng.permutation(n)
        n_test = int(round(test_fraction * n))
        return perm[n_test:], perm[:n_test]

    if paired:
        tr, te = split(a.shape[0])
        tr_a, te_a, tr_b, te_b = tr, te, tr, te
    else:
        (tr_a, te_a), (tr_b, te_b) = split(a.shape[0]), split(b.shape[0])
    if min(len(tr_a), len(tr_b)) < 3 or min(len(te_a), len(te_b)) < 1:
        raise ValueError("too few points for a held-out domain classifier "
                         f"({a.shape[0]} and {b.shape[0]})")
    x_train = np.concatenate([a[tr_a], b[tr_b]])
    y_train = np.concatenate([np.zeros(len(tr_a)), np.ones(len(tr_b))])
    x_test = np.concatenate([a[te_a], b[te_b]])
    y_test = np.concatenate([np.zeros(len(te_a)), np.ones(len(te_b))])
    clf = GridSearchCV(
        make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000)),
        {"logisticregression__C": [0.01, 0.1, 1.0, 10.0, 100.0]}, cv=3)
    clf.fit(x_train, y_train)
    error = float(np.mean(clf.predict(x_test) != y_test))
    return ADistance(a_distance=2.0 * (1.0 - 2.0 * min(error, 0.5)), error=error,
                     n_train=int(len(y_train)), n_test=int(len(y_test)))


def tsne_embedding(features: np.ndarray | Tensor, seed: int = 0,
                   perplexity: float = 30.0) -> np.ndarray:
    """2-D t-SNE of ``(m, D)`` features (PCA start, seeded): ``(m, 2)``.

    The perplexity is lowered to ``(m − 1) / 3`` for small ``m``.
    """
    f = np.asarray(features, dtype=np.float64)
    if f.ndim != 2 or f.shape[0] < 4:
        raise ValueError(f"t-SNE needs (m, D) features with m >= 4, got {f.shape}")
    perplexity = min(perplexity, (f.shape[0] - 1) / 3)
    return TSNE(n_components=2, perplexity=perplexity, init="pca",
                random_state=seed).fit_transform(f)


@dataclass(frozen=True, eq=False)
class FeatureShift:
    """Clean versus attacked penultimate features of the same ``n`` images.

    Attributes:
        clean, attacked: ``(n, D)`` features ``φ(x)``, ``φ(x')``.
        labels: ``(n,)``. clean_prediction, attacked_prediction: ``(n,)``.
        a_distance: :class:`ADistance` between ``clean`` and ``attacked``.
        embedding: ``(2n, 2)`` t-SNE of ``[clean; attacked]`` or ``None``.
        attacked_mask: ``(2n,)`` bool, rows of ``embedding`` from attacked images.
        attack, eps, norm, settings: how ``x'`` was made.
    """

    clean: np.ndarray
    attacked: np.ndarray
    labels: np.ndarray
    clean_prediction: np.ndarray
    attacked_prediction: np.ndarray
    a_distance: ADistance
    embedding: np.ndarray | None
    attacked_mask: np.ndarray
    attack: str
    eps: float
    norm: str
    settings: Mapping[str, Any] = field(default_factory=dict)

    @property
    def clean_accuracy(self) -> float:
        return float(np.mean(self.clean_prediction == self.labels))

    @property
    def attacked_accuracy(self) -> float:
        return float(np.mean(self.attacked_prediction == self.labels))

    def to_records(self, index: Sequence[int]) -> list[dict[str, Any]]:
        """One plain dict per row of :attr:`embedding` (clean rows, then
        attacked): test-set ``index``, label, source, prediction, t-SNE point."""
        n = len(self.labels)
        return [{"index": int(index[i % n]),
                 "label": int(self.labels[i % n]),
                 "source": "attacked" if self.attacked_mask[i] else "clean",
                 "prediction": int(self.attacked_prediction[i % n]
                                   if self.attacked_mask[i]
                                   else self.clean_prediction[i % n]),
                 "tsne_x": float(self.embedding[i, 0]),
                 "tsne_y": float(self.embedding[i, 1])}
                for i in range(2 * n)]


def feature_shift(model: nn.Module, x: Tensor, y: Tensor, *, attack: str = "pgd",
                  eps: float = 8 / 255, norm: str = "linf", seed: int = 0,
                  tsne: bool = True, **settings: Any) -> FeatureShift:
    """Attack every image; compare clean and attacked features (SpecFormer Fig. 2b–c).

    Args:
        model: classifier with ``forward_features`` (a :class:`lipvit.ViT`).
        x: images ``(n, C, S, S)`` in ``[0, 1]``. y: labels ``(n,)``.
        attack, eps, norm, settings: as in :func:`lipvit.analysis.attacks.perturb`
            (every image is attacked, also misclassified ones).
        seed: attack, split and t-SNE seed.
        tsne: compute the 2-D embedding (the slow part).
    """
    model.eval()
    x_adv = perturb(model, x, y, attack, eps, norm, seed=seed, **settings)
    clean = penultimate_features(model, x)
    attacked = penultimate_features(model, x_adv)
    with torch.no_grad():
        pred_clean = model.forward_head(clean[:, None]).argmax(dim=1)
        pred_adv = model.forward_head(attacked[:, None]).argmax(dim=1)
    clean_np = clean.cpu().double().numpy()
    attacked_np = attacked.cpu().double().numpy()
    both = np.concatenate([clean_np, attacked_np])  # (2n, D)
    mask = np.r_[np.zeros(len(clean_np), bool), np.ones(len(attacked_np), bool)]
    return FeatureShift(
        clean=clean_np, attacked=attacked_np, labels=y.cpu().numpy(),
        clean_prediction=pred_clean.cpu().numpy(),
        attacked_prediction=pred_adv.cpu().numpy(),
        a_distance=proxy_a_distance(clean_np, attacked_np, paired=True, seed=seed),
        embedding=tsne_embedding(both, seed=seed) if tsne else None,
        attacked_mask=mask, attack=attack, eps=float(eps), norm=norm,
        settings={"seed": seed, **settings},
    )
