"""The linear operators of LoFAST's Theorem 1, matrix-free and dense.

``A(Γ) = HΓ + Σ_h P_h Γ W_v[h] W_o[h]``, the linear term Δ1 of eq. (10) whose
norm is the key sensitivity ζ (Lemma 1, eq. 15), and Lemma 2's ``Γ ↦ Γ A_h Xᵀ
+ X A_h Γᵀ`` whose norm is ``‖M_h(X)‖`` (eq. 25): each as a matrix-vector
product and its adjoint (power iteration), as a dense matrix (tests, tiny
sizes) and as its Gram matrix (the certificates of :mod:`.layer` and
:mod:`.structured`). docs/math.md §2–§3.
"""

from __future__ import annotations

import torch
from lipvit.certify.attention import query_key
from torch import Tensor


def _per_head(P: Tensor, Y: Tensor) -> Tensor:
    """``P_h Y_h`` for ``Y`` ``(*lead, H, N, d)`` and ``P`` ``(*lead', H, N, N)``
    broadcastable to it. A block of ``K`` vectors against one ``P`` per sample
    (``P`` ``(B, 1, H, N, N)``, ``Y`` ``(B, K, H, N, d)``) is one product per
    head with the ``K`` vectors side by side, ``(N, N) @ (N, K·d)``, rather
    than ``K`` broadcast copies of ``P`` (the cost per sample then does not grow
    with the batch)."""
    if P.dim() != Y.dim() or P.dim() < 5 or P.shape[-4] != 1 or Y.shape[-4] == 1:
        return P @ Y
    Yk = Y.movedim(-4, -2)  # (*lead, H, N, K, d)
    out = P.squeeze(-4) @ Yk.reshape(*Yk.shape[:-2], -1)  # (*lead, H, N, K·d)
    return out.reshape(Yk.shape).movedim(-2, -4)


def sensitivity_matvec(
    Gamma: Tensor, P: Tensor, W_v: Tensor, W_o: Tensor, residual: bool
) -> Tensor:
    """``A(Γ) = H Γ + Σ_h P_h Γ W_v[h] W_o[h]``, the linear term Δ1 of eq. (10).

    Args:
        Gamma: ``(*lead, N, D)``.
        P: attention matrices ``(*lead, H, N, N)`` (broadcastable: e.g.
            ``(B, 1, H, N, N)`` against ``Γ`` ``(B, K, N, D)``).
        W_v: ``(H, D, d)``; W_o: ``(H, d, D)``.
        residual: ``H = I`` if true, else ``H = 0``.

    Returns:
        ``(*lead, N, D)``.
    """
    H, D, d = W_v.shape
    *lead, N, _ = Gamma.shape
    GV = (Gamma @ W_v.transpose(0, 1).reshape(D, H * d)).reshape(*lead, N, H, d)
    PGV = _per_head(P, GV.transpose(-3, -2))  # (*lead, H, N, d) = P_h Γ W_v[h]
    out = PGV.transpose(-3, -2).reshape(*lead, N, H * d) @ W_o.reshape(H * d, D)
    return out + Gamma if residual else out


def sensitivity_rmatvec(
    Y: Tensor, P: Tensor, W_v: Tensor, W_o: Tensor, residual: bool
) -> Tensor:
    """Adjoint ``A*(Y) = Hᵀ Y + Σ_h P_hᵀ Y W_o[h]ᵀ W_v[h]ᵀ`` of the above."""
    H, D, d = W_v.shape
    *lead, N, _ = Y.shape
    YO = (Y @ W_o.reshape(H * d, D).T).reshape(*lead, N, H, d)  # Y W_o[h]ᵀ
    PYO = _per_head(P.transpose(-1, -2), YO.transpose(-3, -2))  # (*lead, H, N, d)
    W_v_cat = W_v.transpose(0, 1).reshape(D, H * d)  # (D, H·d) = [W_v[1] … W_v[H]]
    out = PYO.transpose(-3, -2).reshape(*lead, N, H * d) @ W_v_cat.T  # (*lead, N, D)
    return out + Y if residual else out


def sensitivity_matrix(P: Tensor, W_vo: Tensor, residual: bool) -> Tensor:
    """Dense ``H ⊗ I_D + Σ_h P_h ⊗ W_vo[h]ᵀ`` of eq. (15), ``(B, N·D, N·D)``.

    Acts on ``vec(Γᵀ) = Γ.reshape(N·D)``; ``W_vo = W_v W_o`` (``(H, D, D)``,
    :func:`lipvit.certify.attention.value_output`). For tests and tiny sizes.
    """
    B, H, N, _ = P.shape
    D = W_vo.shape[-1]
    K = torch.einsum("bhnm,hca->bnamc", P, W_vo)  # (B, N, D, N, D)
    if residual:
        eye = torch.eye(N * D, dtype=P.dtype, device=P.device)
        return K.reshape(B, N * D, N * D) + eye
    return K.reshape(B, N * D, N * D)


def sensitivity_gram(P: Tensor, W_vo: Tensor, residual: bool) -> Tensor:
    """Gram matrix ``KᵀK`` of :func:`sensitivity_matrix`, ``(B, N·D, N·D)``.

    With ``K = Σ_h P_h ⊗ W_vo[h]ᵀ`` (``P_0 = H``, ``W_vo[0] = I`` for the
    residual), ``KᵀK = Σ_{h,g} (P_hᵀ P_g) ⊗ (W_vo[h] W_vo[g]ᵀ)``: one GEMM over
    the ``(H+1)²`` head pairs instead of a product of two ``N·D`` matrices.
    """
    B, H, N, _ = P.shape
    D = W_vo.shape[-1]
    if residual:
        eye_n = torch.eye(N, dtype=P.dtype, device=P.device).expand(B, 1, N, N)
        P = torch.cat([eye_n, P], dim=1)  # (B, H+1, N, N)
        eye_d = torch.eye(D, dtype=W_vo.dtype, device=W_vo.device)[None]
        W_vo = torch.cat([eye_d, W_vo], dim=0)  # (H+1, D, D)
    PP = torch.einsum("bhij,bgik->bhgjk", P, P)  # (B, H', H', N, N)
    MM = torch.einsum("hae,gce->hgac", W_vo, W_vo)  # (H', H', D, D)
    G = torch.einsum("bhgjk,hgac->bjakc", PP, MM)  # (B, N, D, N, D)
    return G.reshape(B, N * D, N * D)


def lemma2_op(G: Tensor, C: Tensor, E: Tensor) -> Tensor:
    """``L(G) = G Cᵀ + E Gᵀ``, Lemma 2's map factored: ``(..., N, r) → (..., N, N)``.

    With ``C = X A_hᵀ`` and ``E = X A_h`` (``r = D``) this is
    ``Γ ↦ Γ A_h Xᵀ + X A_h Γᵀ = M_h(X) Γ`` (eq. 25); with the reduced factors of
    :func:`lemma2_reduced_factors` it has the same norm on ``r ≤ 2d`` columns.
    """
    return G @ C.transpose(-1, -2) + E @ G.transpose(-1, -2)


def lemma2_op_adjoint(Y: Tensor, C: Tensor, E: Tensor) -> Tensor:
    """Adjoint of :func:`lemma2_op`, ``Y ↦ Y C + Yᵀ E``, ``(..., N, N) → (..., N, r)``.
    """
    return Y @ C + Y.transpose(-1, -2) @ E


def lemma2_factors(X: Tensor, W_qk: Tensor) -> tuple[Tensor, Tensor]:
    """Full-space factors ``C = X A_hᵀ``, ``E = X A_h``, each ``(B, H, N, D)``."""
    C = torch.einsum("bnD,hED->bhnE", X, W_qk)  # (B, H, N, D) = X Aᵀ
    E = torch.einsum("bnD,hDE->bhnE", X, W_qk)  # (B, H, N, D) = X A
    return C, E


def lemma2_matvec(Gamma: Tensor, X: Tensor, W_qk: Tensor) -> Tensor:
    """``M_h(X) Γ_h = Γ_h A_h Xᵀ + X A_h Γ_hᵀ`` for every head, Lemma 2 / eq. (25).

    Args:
        Gamma: ``(B, H, N, D)`` (one input per head).
        X: ``(B, N, D)``.
        W_qk: ``A_h``, ``(H, D, D)``.

    Returns:
        ``(B, H, N, N)``: the first-order change of the (unscaled) logits.
    """
    return lemma2_op(Gamma, *lemma2_factors(X, W_qk))


def lemma2_rmatvec(Y: Tensor, X: Tensor, W_qk: Tensor) -> Tensor:
    """Adjoint of :func:`lemma2_matvec`: ``Y ↦ Y X A_hᵀ + Yᵀ X A_h``, ``(B, H, N, D)``.
    """
    return lemma2_op_adjoint(Y, *lemma2_factors(X, W_qk))


def lemma2_matrix(X: Tensor, W_qk: Tensor) -> Tensor:
    """Dense ``M_h(X)`` of eq. (25), ``(B, H, N², N·D)``; for tests and tiny sizes.

    Row ``(i, j)`` (row-major) holds ``β_ij = Γ_iᵀ A x_j + x_iᵀ A Γ_j`` as a
    linear form of ``vec(Γᵀ) = Γ.reshape(N·D)``.
    """
    B, N, D = X.shape
    H = W_qk.shape[0]
    eye = torch.eye(N, dtype=X.dtype, device=X.device)
    AX = torch.einsum("hDE,bjE->bhjD", W_qk, X)  # (B, H, N, D): row j = (A x_j)ᵀ
    AtX = torch.einsum("hED,biE->bhiD", W_qk, X)  # (B, H, N, D): row i = (Aᵀ x_i)ᵀ
    first = torch.einsum("ik,bhjD->bhijkD", eye, AX)  # Γ_i term: δ_ik (A x_j)
    second = torch.einsum("jk,bhiD->bhijkD", eye, AtX)  # Γ_j term: δ_jk (Aᵀ x_i)
    return (first + second).reshape(B, H, N * N, N * D)


def lemma2_reduced_factors(
    X: Tensor, W_q: Tensor, W_k: Tensor
) -> tuple[Tensor, Tensor]:
    """``C = X A_hᵀ Q_h``, ``E = X A_h Q_h``, each ``(B, H, N, r)``, ``r = min(2d, D)``.

    ``M_h(X) Γ`` depends on ``Γ`` only through ``Γ W_q[h]`` and ``Γ W_k[h]``. With
    ``Q_h`` (``D × r``) orthonormal columns spanning a space that contains the
    columns of ``[W_q[h], W_k[h]]`` (Householder QR), ``Γ A_h = Γ Q_h Q_hᵀ A_h``
    and ``A_h Γᵀ = A_h Q_h Q_hᵀ Γᵀ``, so ``M_h(X) Γ = L(Γ Q_h)`` with
    :func:`lemma2_op`. ``Γ ↦ Γ Q_h`` maps the unit Frobenius ball onto the unit
    ball of ``R^{N×r}`` (``G ↦ G Q_hᵀ`` is an isometric right inverse), hence
    ``‖M_h(X)‖ = ‖L‖`` exactly.
    """
    H, D, d = W_q.shape
    W_qk = query_key(W_q, W_k)  # (H, D, D)
    C, E = lemma2_factors(X, W_qk)  # (B, H, N, D) each
    if 2 * d >= D:
        return C, E
    Q = torch.linalg.qr(torch.cat([W_q, W_k], dim=-1)).Q  # (H, D, 2d)
    return C @ Q, E @ Q  # (B, H, N, 2d) each


def lemma2_gram(C: Tensor, E: Tensor) -> Tensor:
    """Gram matrix of :func:`lemma2_op` on ``vec(G)`` (row-major), ``(..., N·r, N·r)``.

    ``‖G Cᵀ + E Gᵀ‖_F² = Σ_i g_iᵀ(CᵀC + EᵀE)g_i + 2 Σ G_ib G_jk C_jb E_ik``, i.e.
    the Gram matrix is ``I_N ⊗ (CᵀC + EᵀE) + T + Tᵀ`` with
    ``T[(i,b),(j,k)] = C_jb E_ik``.
    """
    *batch, N, r = C.shape
    eye = torch.eye(N, dtype=C.dtype, device=C.device)
    inner = C.transpose(-1, -2) @ C + E.transpose(-1, -2) @ E  # (..., r, r)
    diag = torch.einsum("ij,...bk->...ibjk", eye, inner)  # (..., N, r, N, r)
    T = torch.einsum("...jb,...ik->...ibjk", C, E)  # (..., N, r, N, r)
    G = diag + T + T.permute(*range(len(batch)), -2, -1, -4, -3)
    return G.reshape(*batch, N * r, N * r)
