"""lipvit's hybrid ViT beside deel-torchlip's own 1-Lipschitz CNN on Fashion-MNIST.

What a user could pick instead of lipvit (issue 44): deel-torchlip's
Fashion-MNIST example, a 1-Lipschitz CNN (SpectralConv2d 1 → 16 → 32 with
"same" 3×3 kernels, GroupSort2, ScaledL2NormPool2d 2×2 after each; Flatten,
SpectralLinear 1568 → 64, GroupSort2, SpectralLinear 64 → 10), trained with
HKRMulticlassLoss(alpha = 100 in the example's old scale, i.e. 100/101,
min_margin = 0.25), Adam at 1e-3, batches of 512, 25 epochs, pixels in
[0, 1]. This script trains it (or reads the state it saved before,
``--peer-ckpt``), then certifies it and a lipvit checkpoint on the **same**
test points and prints one table:

- clean accuracy; certified accuracy at each ``--eps``: for the CNN with the
  example's own certificate ``margin / √2`` (which takes its constant as 1)
  and with lipvit's ``global`` certificate on the CNN's *sound* constant
  (:func:`peer_constant`: DFT bounds of its convolutions, exact norms of its
  linear maps; per class pair, docs/math.md §9.3); for lipvit's model with
  ``global`` (or whatever ``lipvit certify`` would pick);
- robust accuracy under PGD-ℓ2 and APGD (torchattacks, 40 steps) on the
  first ``--attack-n`` points, and a check that no certified point breaks;
- the median certified / attack radius over the correctly classified points
  of the first ``--radius-n`` (attack radius: :func:`lipvit.analysis.
  attack_radius.attack_radius` with PGD-ℓ2, APGD-T and CW).

The figure draws certified accuracy against ε for every certificate, with the
attacks' robust accuracy as upper bounds, and names the machine and date.

The peer is optional; install it with::

    python -m pip install --no-deps deel-torchlip==1.0.5

Usage (Fashion-MNIST from ``apt-get install dataset-fashion-mnist``)::

    lipvit train --dataset fashion-mnist --family lipschitz --out hybrid.pt
    python bench/peer_lipschitz_cnn.py --ckpt hybrid.pt --peer-ckpt peer.pt \\
        --json docs/figures/peer-fmnist.json --out docs/figures/peer-fmnist.png
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from lipvit.analysis.attack_radius import RadiusSettings, attack_radius
from lipvit.analysis.attacks import admissible, perturb
from lipvit.certify.certification import ROUNDING, float64_model, margin
from lipvit.certify.global_bound import GlobalConstant, global_constant, global_radius
from torch import Tensor, nn

from lipvit.commands import _common as C
from lipvit.commands.certify import default_method
from lipvit.data import load_dataset
from lipvit.spectral import conv_operator_norm, spectral_norm

INSTALL = "python -m pip install --no-deps deel-torchlip==1.0.5"


def torchlip():
    try:
        from deel import torchlip as tl
    except ImportError:
        sys.exit(f"this bench needs deel-torchlip: {INSTALL}")
    return tl


def build_peer() -> nn.Module:
    """deel-torchlip's Fashion-MNIST example model (module docstring)."""
    tl = torchlip()
    return tl.Sequential(
        tl.SpectralConv2d(1, 16, (3, 3), padding="same"), tl.GroupSort2(),
        tl.ScaledL2NormPool2d(kernel_size=(2, 2)),
        tl.SpectralConv2d(16, 32, (3, 3), padding="same"), tl.GroupSort2(),
        tl.ScaledL2NormPool2d(kernel_size=(2, 2)),
        nn.Flatten(), tl.SpectralLinear(1568, 64), tl.GroupSort2(),
        tl.SpectralLinear(64, 10),
    )


def train_peer(x: Tensor, y: Tensor, epochs: int, seed: int) -> tuple[nn.Module, float]:
    """The example's training; returns its exported plain-torch model and seconds."""
    tl = torchlip()
    torch.manual_seed(seed)
    model = build_peer()
    loss_fn = tl.HKRMulticlassLoss(alpha=100 / 101, min_margin=0.25)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    t0 = time.perf_counter()
    for epoch in range(epochs):
        model.train()
        perm = torch.randperm(len(y))
        for i in range(0, len(y), 512):
            idx = perm[i:i + 512]
            loss = loss_fn(model(x[idx]), F.one_hot(y[idx], 10).float())
            opt.zero_grad()
            loss.backward()
            opt.step()
        print(f"peer epoch {epoch + 1}/{epochs}  loss {loss.item():.4f}  "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
    model.eval()
    return model.vanilla_export().eval(), time.perf_counter() - t0


def peer_constant(vanilla: nn.Module, image_size: int = 28) -> GlobalConstant:
    """Sound constant of the exported CNN up to its last linear layer: DFT
    bounds of the convolutions on their image sizes, exact spectral norms of
    the linear maps (GroupSort, L2-norm pooling and Flatten are 1-Lipschitz)."""
    layers = list(vanilla)
    L = torch.ones((), dtype=torch.float64)
    size = image_size
    with torch.no_grad():
        for layer in layers[:-1]:
            if isinstance(layer, nn.Conv2d):
                L = L * conv_operator_norm(layer.weight.double(), size)
            elif isinstance(layer, nn.LPPool2d):
                size //= 2
            elif isinstance(layer, nn.Linear):
                L = L * spectral_norm(layer.weight.double())
    return GlobalConstant(L * (1 + ROUNDING), layers[-1].weight.double().detach())


def certified_share(r: Tensor, eps: float) -> float:
    """Share of the points certified at ``eps``: a radius > 0 (a correct
    prediction) and ≥ ``eps``."""
    return float(((r > 0) & (r >= eps)).double().mean())


def robust(model: nn.Module, x: Tensor, y: Tensor, eps: float, steps: int) -> Tensor:
    """``(n,)`` bool: no PGD-ℓ2 or APGD point at ``eps`` changes the label."""
    ok = torch.ones(len(y), dtype=torch.bool)
    for attack in ("pgd-l2", "apgd"):
        adv = perturb(model, x, y, attack, eps, norm="l2", steps=steps)
        assert bool(admissible(x, adv, eps, "l2").all())
        with torch.no_grad():
            ok &= model(adv).argmax(1) == y
    return ok


def machine() -> str:
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
            f"torch {torch.__version__}, {datetime.date.today().isoformat()}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, help="lipvit checkpoint (Fashion-MNIST)")
    p.add_argument("--peer-ckpt", required=True,
                   help="the CNN's exported state: read if it exists, else written")
    p.add_argument("--epochs", type=int, default=25, help="the CNN's epochs")
    p.add_argument("--n", type=int, default=10000, help="test points certified")
    p.add_argument("--eps", default="0.1,0.25,0.5,1.0")
    p.add_argument("--attack-n", type=int, default=1000)
    p.add_argument("--attack-steps", type=int, default=40)
    p.add_argument("--radius-n", type=int, default=100)
    p.add_argument("--json", type=Path)
    p.add_argument("--out", type=Path, help="figure (PNG)")
    args = p.parse_args()
    eps_list = [float(e) for e in args.eps.split(",")]

    ckpt = C.load_checkpoint(Path(args.ckpt))
    data = C.load_test_set(ckpt, n=args.n)
    x, y = data.x.double(), data.y
    peer_path = Path(args.peer_ckpt)
    if peer_path.exists():
        saved = torch.load(peer_path, weights_only=True)
        peer = build_peer().vanilla_export()
        peer.load_state_dict(saved["state_dict"])
        peer_seconds = float(saved["seconds"])
    else:
        train_set = load_dataset("fashion-mnist")
        peer, peer_seconds = train_peer(train_set.x_train, train_set.y_train,
                                        args.epochs, seed=0)
        torch.save({"state_dict": peer.state_dict(), "seconds": peer_seconds},
                   peer_path)
    peer = peer.double().eval()
    ours = float64_model(ckpt.model)
    method, _ = default_method(ours)

    with torch.no_grad():
        logits_ours = torch.cat([ours(x[i:i + 1000]) for i in range(0, len(y), 1000)])
        logits_peer = torch.cat([peer(x[i:i + 1000]) for i in range(0, len(y), 1000)])
    t0 = time.perf_counter()
    r_ours = global_radius(logits_ours, y, global_constant(ours))
    cert_seconds = time.perf_counter() - t0
    gc_peer = peer_constant(peer)
    own = (margin(logits_peer, y) / math.sqrt(2)).clamp_min(0)  # the example's
    rows = {
        f"lipvit {ckpt.config.arch} ({method})": (logits_ours, r_ours, ours),
        "torchlip CNN (margin/√2, its own)": (logits_peer, own, peer),
        "torchlip CNN (global, sound L)": (
            logits_peer, global_radius(logits_peer, y, gc_peer), peer),
    }
    na, nr = min(args.attack_n, len(y)), min(args.radius_n, len(y))
    results = {}
    for name, (logits, r, model) in rows.items():
        correct = logits.argmax(1) == y
        res = {"clean": float(correct.double().mean()),
               "certified": {e: certified_share(r, e) for e in eps_list},
               "median_radius": float(r.median())}
        if name.startswith("torchlip CNN (global"):
            results[name] = res
            continue  # same model as the row above: attacked there
        xa, ya = x[:na].float(), y[:na]
        m = model.float()
        res["robust"], res["broken_certified"] = {}, {}
        for e in eps_list:
            ok = robust(m, xa, ya, e, args.attack_steps)
            res["robust"][e] = float(ok.double().mean())
            res["broken_certified"][e] = int(((r[:na] >= e) & ~ok).sum())
        rad = attack_radius(model.double(), x[:nr], y[:nr],
                            RadiusSettings(attacks=("pgd-l2", "apgd-t", "cw"),
                                           steps=20, restarts=1)).radius
        rad = torch.as_tensor(rad, dtype=torch.float64)
        ok = correct[:nr] & torch.isfinite(rad) & (rad > 0)
        res["median_cert_over_attack"] = float((r[:nr][ok] / rad[ok]).median())
        res["median_attack_radius"] = float(rad[ok].median())
        results[name] = res
    results["_meta"] = {
        "machine": machine(), "n": len(y), "attack_n": na, "radius_n": nr,
        "peer_constant": float(gc_peer.L), "ours_constant": float(
            global_constant(ours).L), "peer_train_seconds": peer_seconds,
        "ours_train_seconds": ckpt.summary.get("seconds"),
        "ours_certify_seconds_per_sample": cert_seconds / len(y),
        "ours_attention": ckpt.summary.get("hybrid", {}).get("attention"),
    }
    print(f"Fashion-MNIST, {len(y)} test points ({machine()}); attacks on the first "
          f"{na}, attack radii on the first {nr}")
    head = ["system", "clean", *(f"cert {e:g}" for e in eps_list), "median radius",
            "cert/attack", *(f"robust {e:g}" for e in eps_list), "broken"]
    print(" | ".join(head))
    for name, res in results.items():
        if name.startswith("_"):
            continue
        cells = [name, f"{100 * res['clean']:.1f}",
                 *(f"{100 * res['certified'][e]:.1f}" for e in eps_list),
                 f"{res['median_radius']:.3f}",
                 f"{res['median_cert_over_attack']:.2f}"
                 if "median_cert_over_attack" in res else "–",
                 *(f"{100 * res['robust'][e]:.1f}" if "robust" in res else "–"
                   for e in eps_list),
                 str(sum(res.get("broken_certified", {}).values()))]
        print(" | ".join(cells))
    print(f"constants: lipvit {results['_meta']['ours_constant']:.6f}, torchlip CNN "
          f"{results['_meta']['peer_constant']:.6f}; training seconds: lipvit "
          f"{results['_meta']['ours_train_seconds']}, torchlip CNN {peer_seconds:.0f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    if args.out:
        plot(results, {n: r for n, (_, r, _) in rows.items()}, eps_list, args.out)


def plot(results: dict, radii: dict[str, Tensor], eps_list: list[float],
         out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 6))
    grid = torch.linspace(0, max(eps_list) * 1.5, 301, dtype=torch.float64)
    names = list(radii)
    # The CNN's own certificate and the sound one coincide here: one curve
    # each would hide the other, so the sound one is drawn dotted on top.
    styles = {names[0]: ("C0", "-"), names[1]: ("C1", "-"), names[2]: ("k", ":")}
    for name, r in radii.items():
        color, line = styles[name]
        curve = [100 * certified_share(r, float(e)) for e in grid]
        ax.plot(grid, curve, line, color=color, label=f"{name}: certified")
        res = results[name]
        if "robust" in res:
            ax.plot(eps_list, [100 * res["robust"][e] for e in eps_list], "x--",
                    color=color, label=f"{name}: PGD-ℓ2 + APGD on the first "
                    f"{results['_meta']['attack_n']} (upper bound)")
    ax.set_xlabel("ℓ2 radius ε (pixels in [0, 1])")
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(0, 100)
    ax.set_xlim(0, float(grid[-1]))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=1)
    meta = results["_meta"]
    ax.set_title(f"Fashion-MNIST, {meta['n']} test points: certified accuracy\n"
                 f"{meta['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main()
