"""Certified bounds on the local sensitivity of attention layers and whole ViTs.

Pure functions of tensors (docs/math.md §2, §3, §6):

- :func:`attention`: the attention map ``H X + Σ_h P_h(X) X W_v[h] W_o[h]``.
- :func:`lofast_bound` / :func:`lofast_terms`: LoFAST Theorem 1 and extensions.
- :func:`key_sensitivity` (ζ, eq. 15) and :func:`lemma2_norm` (``‖M_h(X)‖``).
- :func:`specformer_bound` / :func:`specformer_terms`: SpecFormer Theorem 4.2.
- local constants of LayerNorm, LayerProject, linear layers and GELU MLPs.
"""

from certify.attention import attention, attention_probs, query_key, value_output
from certify.lofast import (
    LoFASTBound,
    LoFASTTerms,
    NormBound,
    key_sensitivity,
    lemma2_norm,
    lofast_bound,
    lofast_terms,
    softmax_local_constant,
)
from certify.specformer import SpecFormerTerms, specformer_bound, specformer_terms

__all__ = [
    "LoFASTBound",
    "LoFASTTerms",
    "NormBound",
    "SpecFormerTerms",
    "attention",
    "attention_probs",
    "gelu_mlp_local_lipschitz",
    "key_sensitivity",
    "layer_project_local_lipschitz",
    "layernorm_local_lipschitz",
    "lemma2_norm",
    "linear_norm",
    "lofast_bound",
    "lofast_terms",
    "query_key",
    "softmax_local_constant",
    "specformer_bound",
    "specformer_terms",
    "value_output",
]

from certify.local import (  # noqa: E402
    gelu_mlp_local_lipschitz,
    layer_project_local_lipschitz,
    layernorm_local_lipschitz,
    linear_norm,
)
