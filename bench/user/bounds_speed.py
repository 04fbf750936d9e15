"""Speed of the bound routines against their dense or looped baselines, ratios
measured in one run.

Three measurements, each printed as a markdown table:

1. ζ (LoFAST eq. 15) for growing ``N·D``: the matrix-free power-iteration
   estimate (``lipvit.certify.lofast.layer.key_sensitivity(exact=False)``) against the
   exact routes — the library's ``exact=True`` (dense Gram ``eigvalsh`` up to
   ``N·D = 256``, power iteration + Cholesky certificate above) and a plain
   dense SVD of the explicit ``(N·D) × (N·D)`` Kronecker matrix.
2. ``sqrt(‖J‖_1 ‖J‖_∞)`` (Cauchy paper eq. 16) of a standard pre-LN ViT block:
   ``lipvit.analysis.jacobian_l1_linf_estimate`` (vmapped VJP rows) against a loop
   of one backward pass per output entry, as the paper's reference code does
   (the loop here is already batched over samples through the sum trick,
   which favours the baseline).
3. Per-sample time of ``lipvit.certify.lofast.layer.lofast_bound`` for all three
attention
   layers of the LoFAST 3-layer 128-wide model (``cifar-lofast-3x128``,
   lipschitz family: N = 65, D = 128, H = 8, randomly initialised, inputs
   projected onto the Frobenius ball of radius 1 as the model does), exact and
   fast. LoFAST reports 0.055 s per sample for a whole 3-layer network.

Timing: one untimed warm-up call per routine, then ``--repeats`` rounds that
call every routine of a comparison in turn (interleaved, order rotated per
round); the table shows medians. Ratios are of medians from the same run.

The tables are also written, as numbers, to ``--out``/bounds_speed.json.

Usage::

    python bench/user/bounds_speed.py               # CPU, a few minutes on 2 cores
    python bench/user/bounds_speed.py --threads 1   # stable figures on a shared CPU
    python bench/user/bounds_speed.py --device cuda # where a GPU is available
    python bench/user/bounds_speed.py --quick       # smaller sizes, for a smoke test
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from lipvit.analysis.jacobian import jacobian_l1_linf_estimate
from lipvit.certify.attention import attention_probs, value_output
from lipvit.certify.lofast.layer import key_sensitivity, lofast_bound
from lipvit.certify.lofast.operators import sensitivity_matrix
from torch import Tensor

from lipvit import ViT, ViTConfig, preset
from lipvit.layers import layer_project

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: _out
from _out import add_out, write_json  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved(
    fns: dict[str, Callable[[], Any]], repeats: int, device: torch.device,
    warmup: Callable[[], Any] | None = None,
) -> tuple[dict[str, float], dict[str, Any]]:
    """Median wall time and last result of each routine; rounds interleave them.

    Every routine is called once untimed first, or ``warmup`` alone is, where
    given (for routines too slow to run twice).
    """
    names = list(fns)
    results = {} if warmup is not None else {name: fns[name]() for name in names}
    if warmup is not None:
        warmup()
    _sync(device)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            _sync(device)
            t0 = time.perf_counter()
            results[name] = fns[name]()
            _sync(device)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}, results


def _layer(N: int, D: int, H: int, B: int, dtype, device, seed: int):
    """Random attention layer (trained-like scale) and inputs on the radius-1 ball."""
    g = torch.Generator().manual_seed(seed)
    d = D // H
    W_q, W_k, W_v = (torch.randn(H, D, d, generator=g, dtype=dtype) / D**0.5
                     for _ in range(3))
    W_o = torch.randn(H, d, D, generator=g, dtype=dtype) / d**0.5
    X = layer_project(torch.randn(B, N, D, generator=g, dtype=dtype), 1.0, (-2, -1))
    return [t.to(device) for t in (X, W_q, W_k, W_v, W_o)]


def _zeta(X, W_q, W_k, W_v, W_o, exact: bool) -> Tensor:
    return key_sensitivity(X, W_q, W_k, W_v, W_o, exact=exact).value


def _zeta_svd(X, W_q, W_k, W_v, W_o) -> Tensor:
    """ζ by a dense SVD of the explicit Kronecker matrix of eq. (15) (float64)."""
    P = attention_probs(X.double(), W_q.double(), W_k.double())  # (B, H, N, N)
    K = sensitivity_matrix(P, value_output(W_v.double(), W_o.double()), True)
    return torch.linalg.matrix_norm(K, ord=2)  # (B,)


def bench_zeta(sizes, repeats: int, dtype, device,
               records: list[dict] | None = None) -> list[str]:
    rows = ["| N | D | H | N·D | matrix-free (s) | exact=True (s) | dense SVD (s) "
            "| exact/mf | SVD/mf | mf below SVD | exact above SVD |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for N, D, H in sizes:
        layer = _layer(N, D, H, 1, dtype, device, seed=N * D)
        t, out = interleaved({"mf": partial(_zeta, *layer, exact=False),
                              "exact": partial(_zeta, *layer, exact=True),
                              "svd": partial(_zeta_svd, *layer)}, repeats, device)
        ref = out["svd"].double()
        gap = ((ref - out["mf"].double()) / ref).max().item()
        excess = (out["exact"].double() / ref - 1).max().item()
        assert excess >= -1e-6, "exact ζ below the dense SVD"
        rows.append(f"| {N} | {D} | {H} | {N * D} | {t['mf']:.4f} | {t['exact']:.4f} "
                    f"| {t['svd']:.4f} | {t['exact'] / t['mf']:.1f} "
                    f"| {t['svd'] / t['mf']:.1f} | {gap:.1e} | {excess:.1e} |")
        if records is not None:
            records.append({"N": N, "D": D, "H": H, "ND": N * D,
                            "matrix_free_s": t["mf"], "exact_s": t["exact"],
                            "dense_svd_s": t["svd"],
                            "exact_over_mf": t["exact"] / t["mf"],
                            "svd_over_mf": t["svd"] / t["mf"],
                            "mf_below_svd": gap, "exact_above_svd": excess})
    return rows


def l1_linf_loop(fn: Callable[[Tensor], Tensor], X: Tensor) -> Tensor:
    """Baseline: ``sqrt(‖J‖_1 ‖J‖_∞)`` with one backward pass per output entry."""
    B = X.shape[0]
    Xr = X.detach().requires_grad_(True)
    Y = fn(Xr).sum(0).reshape(-1)  # (m,): entry i's gradient is row i of every J_b
    col_sums = torch.zeros(B, X[0].numel(), dtype=X.dtype, device=X.device)
    row_max = torch.zeros(B, dtype=X.dtype, device=X.device)
    for i in range(Y.shape[0]):
        (g,) = torch.autograd.grad(Y[i], Xr, retain_graph=True)
        r = g.abs().reshape(B, -1)  # (B, n)
        row_max = torch.maximum(row_max, r.sum(-1))
        col_sums += r
    return (col_sums.amax(-1) * row_max).sqrt()


def bench_jacobian(shapes, B: int, repeats: int, dtype, device,
                   records: list[dict] | None = None) -> list[str]:
    rows = ["| N | D | rows per sample | batch | vmapped chunks (s) "
            "| per-entry loop (s) | speed-up |", "|---|---|---|---|---|---|---|"]
    for image_size, D in shapes:
        torch.manual_seed(0)
        cfg = ViTConfig(image_size=image_size, patch_size=2, embed_dim=D,
                        num_heads=4, depth=1)
        block = ViT(cfg).blocks[0].to(device=device, dtype=dtype).eval()
        N = cfg.num_patches + 1
        X = torch.randn(B, N, D, dtype=dtype, device=device)
        t, out = interleaved({"fast": partial(jacobian_l1_linf_estimate, block, X),
                              "loop": partial(l1_linf_loop, block, X)}, repeats, device)
        tol = 1e-4 if dtype == torch.float32 else 1e-10
        assert torch.allclose(out["fast"], out["loop"], rtol=tol), "l1/linf mismatch"
        rows.append(f"| {N} | {D} | {N * D} | {B} | {t['fast']:.3f} | {t['loop']:.3f} "
                    f"| {t['loop'] / t['fast']:.1f} |")
        if records is not None:
            records.append({"N": N, "D": D, "rows_per_sample": N * D, "batch": B,
                            "vmapped_s": t["fast"], "loop_s": t["loop"],
                            "speed_up": t["loop"] / t["fast"]})
    return rows


def bench_network(B_exact: int, B_fast: int, repeats: int, fast_budgets, dtype,
                  device, eps: float = 0.01,
                  records: list[dict] | None = None) -> list[str]:
    torch.manual_seed(0)
    cfg = preset("cifar-lofast-3x128", family="lipschitz", mean=(0.5,) * 3,
                 std=(0.25,) * 3)
    model = ViT(cfg).to(device=device, dtype=dtype).eval()
    B = max(B_exact, B_fast)
    with torch.no_grad():
        x = model.embed(torch.rand(B, 3, 32, 32, dtype=dtype, device=device))
        layers = []  # (clean attention input, head weights) per block
        for block in model.blocks:
            Xa = block.norm1(x)  # (B, N, D), projected as the model does
            layers.append((Xa, [w.detach() for w in block.attn.head_weights()]))
            x = block(x)
    N, D, H = layers[0][0].shape[1], cfg.embed_dim, cfg.num_heads

    def run(n: int, exact: bool, **kw) -> Tensor:
        return torch.stack([lofast_bound(Xa[:n], *W, eps, exact=exact, **kw).total
                            for Xa, W in layers])  # (3, n)

    fns = {"exact": partial(run, B_exact, True)}
    labels = {"exact": f"exact=True | {B_exact}"}
    for n_iter, tol in fast_budgets:
        name = f"fast n_iter={n_iter} tol={tol:g}"
        fns[name] = partial(run, B_fast, False, n_iter=n_iter, tol=tol)
        labels[name] = f"exact=False, n_iter={n_iter}, tol={tol:g} | {B_fast}"
    Xa, W = layers[0]
    t, out = interleaved(fns, repeats, device, warmup=lambda: (
        lofast_bound(Xa[:1], *W, eps, exact=False, n_iter=2),
        lofast_bound(Xa[:1, :17, :32], *(w[:2, :32, :16] for w in W[:3]),
                     W[3][:2, :16, :32], eps, exact=True)))
    rows = [f"LoFAST 3-layer model: N={N}, D={D}, H={H}, three attention layers, "
            f"ε={eps}, {dtype}, device {device}.", "",
            "| route | batch | s per sample (3 layers) | vs paper 0.055 s "
            "| max rel. gap of total to exact |", "|---|---|---|---|---|"]
    ref = out["exact"]  # (3, B_exact)
    for name in fns:
        n = B_exact if name == "exact" else B_fast
        per = t[name] / n
        m = min(n, B_exact)
        gap = ((ref[:, :m] - out[name][:, :m]) / ref[:, :m]).abs().max()
        rows.append(f"| {labels[name]} | {per:.3f} | {per / 0.055:.2f}x "
                    f"| {gap.item():.1e} |")
        if records is not None:
            records.append({"route": name, "batch": n, "N": N, "D": D, "H": H,
                            "eps": eps, "s_per_sample": per,
                            "vs_paper_0.055": per / 0.055,
                            "max_rel_gap_to_exact": gap.item()})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice); 1 gives stable "
                   "figures on a machine shared with other jobs")
    p.add_argument("--batch-exact", type=int, default=1)
    p.add_argument("--batch-fast", type=int, default=4)
    p.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    p.add_argument("--skip", nargs="*", default=[],
                   choices=["zeta", "jacobian", "network"])
    add_out(p, __file__)
    args = p.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    if args.quick:
        zeta_sizes = [(9, 8, 2), (17, 16, 4)]
        jac_shapes = [(4, 16)]
        net = dict(B_exact=1, B_fast=1, repeats=1, fast_budgets=[(30, 1e-3)])
    else:
        zeta_sizes = [(17, 16, 4), (17, 32, 4), (33, 32, 4), (65, 32, 8)]
        jac_shapes = [(6, 16), (8, 32)]
        net = dict(B_exact=args.batch_exact, B_fast=args.batch_fast, repeats=1,
                   fast_budgets=[(1000, 1e-9), (100, 1e-6)])
    record: dict[str, Any] = {
        "device": str(device), "dtype": args.dtype, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "repeats": args.repeats,
        "load_average_start": os.getloadavg()[0], "args": vars(args)}
    print(f"# bounds_speed: device {device}, {dtype}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} CPU threads, {args.repeats} interleaved repeats "
          f"(medians); load average at start {record['load_average_start']:.1f}\n")
    if "zeta" not in args.skip:
        print("## ζ: matrix-free estimate vs exact routes (batch 1)\n")
        record["zeta"] = []
        print("\n".join(bench_zeta(zeta_sizes, args.repeats, dtype, device,
                                   record["zeta"])), "\n")
    if "jacobian" not in args.skip:
        print("## sqrt(‖J‖_1‖J‖_∞) of a standard ViT block: vmapped rows vs "
              "per-entry loop\n")
        record["jacobian"] = []
        print("\n".join(bench_jacobian(jac_shapes, 2, args.repeats, dtype, device,
                                       record["jacobian"])), "\n")
    if "network" not in args.skip:
        print("## lofast_bound per sample, LoFAST 3-layer 128-wide size\n")
        record["network"] = []
        print("\n".join(bench_network(dtype=dtype, device=device, **net,
                                      records=record["network"])))
    record["load_average_end"] = os.getloadavg()[0]
    print(f"\nload average at end {record['load_average_end']:.1f}")
    write_json(args.out, __file__, record)


if __name__ == "__main__":
    main()
