"""lipvit's certified ViTs beside deel-torchlip's 1-Lipschitz CNN on Fashion-MNIST.

What a user could pick instead of lipvit: deel-torchlip's
Fashion-MNIST 1-Lipschitz CNN (SpectralConv2d 1 → 16 → 32 with "same" 3×3
kernels, GroupSort2, ScaledL2NormPool2d 2×2 after each; Flatten,
SpectralLinear 1568 → 64, GroupSort2, a last linear layer 64 → 10), pixels in
[0, 1], Adam at 1e-3, in two recipes (``--recipes``):

- ``hkr``: the example's earlier recipe, HKRMulticlassLoss(alpha = 100/101,
  min_margin = 0.25), batches of 512, 25 epochs, last layer SpectralLinear;
- ``lse``: the notebook's current default, LseHKRMulticlassLoss(alpha = 0.9,
  min_margin = 1.0, temperature = 10.0), batches of 100, 15 epochs, last
  layer FrobeniusLinear(64, 10, disjoint_neurons=True).

This script trains each recipe (or reads the state it saved before,
``--peer-dir``), then certifies them and lipvit checkpoints (``--ckpt``, any
number: the CaiT, the hybrid ViT) on the **same** test points and prints one
table:

- clean accuracy; certified accuracy at each ``--eps``: for a CNN, per class
  pair on its *sound* constant (:func:`peer_constant`: DFT bounds of its
  convolutions, exact norms of its linear maps; lipvit's ``global``
  certificate, docs/math.md §9.3, which is the recipes' own per-pair row-norm
  certificate with the constant proven instead of assumed 1); for a lipvit
  model with the method ``lipvit certify`` picks (``ball`` on the hybrid ViT,
  ``margin`` on the CaiT), named in the row's key;
- for each lipvit model, its clean accuracy with every attention term
  removed (:func:`lipvit.ablate_attention`; no certificate is reported) and,
  for a CaiT, with only its self-attention removed (its class attention,
  the only path from the tokens to the head, kept);
- robust accuracy under PGD-ℓ2 and APGD (torchattacks) on the first
  ``--attack-n`` points, and a check that no certified point breaks;
- the median certified / attack radius over the correctly classified points
  of the first ``--radius-n`` (attack radius: :func:`lipvit.analysis.
  attack_radius.attack_radius` with PGD-ℓ2, APGD-T and CW);
- training seconds.

The figure (``--out``/peer-fmnist.png) draws certified accuracy against ε for
every certificate, with the attacks' robust accuracy as upper bounds, and
names the machine and date; the table's numbers go to
``--out``/peer_lipschitz_cnn.json.

The peer is optional; install it with::

    python -m pip install --no-deps deel-torchlip==1.0.5

Usage (Fashion-MNIST from ``apt-get install dataset-fashion-mnist``)::

    lipvit train --dataset fashion-mnist --family lipschitz --out cait.pt
    lipvit train --dataset fashion-mnist --family lipschitz --preset fmnist-hybrid \\
        --out hybrid.pt
    python bench/user/peer_lipschitz_cnn.py --ckpt cait.pt --ckpt hybrid.pt \\
        --peer-dir peers --n 300 --out docs/figures
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from lipvit.analysis.attack_radius import RadiusSettings, attack_radius
from lipvit.analysis.attacks import admissible, perturb
from lipvit.certify.certification import ROUNDING, float64_model
from lipvit.certify.evaluate import certify_samples
from lipvit.certify.global_bound import GlobalConstant, global_constant, global_radius
from lipvit.certify.methods import default_method
from torch import Tensor, nn

from lipvit.ablation import ablate_attention, ablations
from lipvit.commands import _common as C
from lipvit.data import load_dataset
from lipvit.spectral import conv_operator_norm, spectral_norm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: _out
from _out import add_out, write_json  # noqa: E402

FIGURE = "peer-fmnist.png"
"""The figure's file name in ``--out``."""

INSTALL = "python -m pip install --no-deps deel-torchlip==1.0.5"


def torchlip():
    try:
        from deel import torchlip as tl
    except ImportError:
        sys.exit(f"this bench needs deel-torchlip: {INSTALL}")
    return tl


#: The CNN's two recipes (module docstring): loss, batch, epochs, last layer.
RECIPES = {
    "hkr": dict(loss=("HKRMulticlassLoss", dict(alpha=100 / 101, min_margin=0.25)),
                batch=512, epochs=25, last="SpectralLinear"),
    "lse": dict(loss=("LseHKRMulticlassLoss",
                      dict(alpha=0.9, min_margin=1.0, temperature=10.0)),
                batch=100, epochs=15, last="FrobeniusLinear"),
}


def build_peer(recipe: str) -> nn.Module:
    """deel-torchlip's Fashion-MNIST CNN with ``recipe``'s last layer."""
    tl = torchlip()
    last = (tl.FrobeniusLinear(64, 10, disjoint_neurons=True)
            if RECIPES[recipe]["last"] == "FrobeniusLinear"
            else tl.SpectralLinear(64, 10))
    return tl.Sequential(
        tl.SpectralConv2d(1, 16, (3, 3), padding="same"), tl.GroupSort2(),
        tl.ScaledL2NormPool2d(kernel_size=(2, 2)),
        tl.SpectralConv2d(16, 32, (3, 3), padding="same"), tl.GroupSort2(),
        tl.ScaledL2NormPool2d(kernel_size=(2, 2)),
        nn.Flatten(), tl.SpectralLinear(1568, 64), tl.GroupSort2(), last,
    )


def train_peer(recipe: str, x: Tensor, y: Tensor, seed: int) -> tuple[nn.Module, float]:
    """``recipe``'s training; returns its exported plain-torch model and seconds."""
    tl = torchlip()
    spec = RECIPES[recipe]
    torch.manual_seed(seed)
    model = build_peer(recipe)
    name, kwargs = spec["loss"]
    loss_fn = getattr(tl, name)(**kwargs)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    t0 = time.perf_counter()
    for epoch in range(spec["epochs"]):
        model.train()
        perm = torch.randperm(len(y))
        for i in range(0, len(y), spec["batch"]):
            idx = perm[i:i + spec["batch"]]
            loss = loss_fn(model(x[idx]), F.one_hot(y[idx], 10).float())
            opt.zero_grad()
            loss.backward()
            opt.step()
        print(f"peer {recipe} epoch {epoch + 1}/{spec['epochs']}  loss "
              f"{loss.item():.4f}  {time.perf_counter() - t0:.0f} s", flush=True)
    model.eval()
    return model.vanilla_export().eval(), time.perf_counter() - t0


def load_or_train_peer(recipe: str, folder: Path) -> tuple[nn.Module, float]:
    """The recipe's exported CNN from ``folder`` (trained and saved there if
    absent) and its training seconds."""
    path = folder / f"peer-{recipe}.pt"
    if path.exists():
        saved = torch.load(path, weights_only=True)
        peer = build_peer(recipe).vanilla_export()
        peer.load_state_dict(saved["state_dict"])
        return peer.eval(), float(saved["seconds"])
    train_set = load_dataset("fashion-mnist")
    peer, seconds = train_peer(recipe, train_set.x_train, train_set.y_train, seed=0)
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": peer.state_dict(), "seconds": seconds}, path)
    return peer, seconds


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


def lipvit_radii(model: nn.Module, x: Tensor, y: Tensor, method: str,
                 eps_list: list[float]) -> Tensor:
    """Certified radius per point of a lipvit model by ``method``."""
    return certify_samples(model, x, y, [method], eps_list, radius=True,
                           batch_size=250).radii[method]


def evaluate(name: str, model: nn.Module, x: Tensor, y: Tensor, r: Tensor,
             eps_list: list[float], args) -> dict:
    """Clean and certified accuracy, robust accuracy under attacks, broken
    certificates and the certified / attack radius of one system."""
    with torch.no_grad():
        logits = torch.cat([model(x[i:i + 1000]) for i in range(0, len(y), 1000)])
    correct = logits.argmax(1) == y
    res = {"clean": float(correct.double().mean()),
           "certified": {e: certified_share(r, e) for e in eps_list},
           "median_radius": float(r.median())}
    na, nr = min(args.attack_n, len(y)), min(args.radius_n, len(y))
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
    print(f"{name}: done", flush=True)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, action="append",
                   help="lipvit checkpoint (Fashion-MNIST); repeat for several")
    p.add_argument("--peer-dir", required=True, type=Path,
                   help="the CNNs' exported states: read if there, else written")
    p.add_argument("--recipes", default="hkr,lse", help="the CNN's recipes")
    p.add_argument("--n", type=int, default=10000, help="test points certified")
    p.add_argument("--eps", default="0.1,0.25,0.5,1.0")
    p.add_argument("--attack-n", type=int, default=1000)
    p.add_argument("--attack-steps", type=int, default=40)
    p.add_argument("--radius-n", type=int, default=100)
    add_out(p, __file__)
    args = p.parse_args()
    eps_list = [float(e) for e in args.eps.split(",")]

    ckpts = [C.load_checkpoint(Path(c)) for c in args.ckpt]
    data = C.load_test_set(ckpts[0], n=args.n)
    x, y = data.x.double(), data.y
    results, radii, meta = {}, {}, {}
    for ckpt in ckpts:
        ours = float64_model(ckpt.model)
        method, _ = default_method(ours)
        name = f"lipvit {ckpt.config.arch} ({method})"
        t0 = time.perf_counter()
        r = lipvit_radii(ours, x, y, method, eps_list)
        seconds = time.perf_counter() - t0
        results[name] = evaluate(name, ours, x, y, r, eps_list, args)
        results[name]["train_seconds"] = ckpt.summary.get("seconds")
        results[name]["certify_seconds_per_sample"] = seconds / len(y)
        results[name]["attention"] = ckpt.summary.get(
            "proven", ckpt.summary.get("hybrid", {})).get("attention")
        results[name]["global_constant"] = float(global_constant(ours).L)
        radii[name] = r
        # its attention ablated (CaiT: also its self-attention alone): clean
        # accuracy only
        for which in ablations(ours):
            with torch.no_grad():
                ablated = ablate_attention(ours, which)(x).argmax(1) == y
            label = "attention" if which == "all" else "self-attention"
            results[f"{name}, {label} ablated"] = {
                "clean": float(ablated.double().mean())}
    for recipe in args.recipes.split(","):
        peer, seconds = load_or_train_peer(recipe, args.peer_dir)
        peer = peer.double().eval()
        gc_peer = peer_constant(peer)
        with torch.no_grad():
            logits = torch.cat([peer(x[i:i + 1000]) for i in range(0, len(y), 1000)])
        name = f"torchlip CNN, {recipe} (per pair, sound L)"
        r = global_radius(logits, y, gc_peer)
        results[name] = evaluate(name, peer, x, y, r, eps_list, args)
        results[name]["train_seconds"] = seconds
        results[name]["global_constant"] = float(gc_peer.L)
        radii[name] = r
    meta = {"machine": machine(), "n": len(y), "attack_n": min(args.attack_n, len(y)),
            "radius_n": min(args.radius_n, len(y)), "index": data.index[:20]}
    results["_meta"] = meta
    print(f"Fashion-MNIST, {len(y)} test points ({machine()}); attacks on the first "
          f"{meta['attack_n']}, attack radii on the first {meta['radius_n']}")
    head = ["system", "clean", *(f"cert {e:g}" for e in eps_list), "median radius",
            "cert/attack", *(f"robust {e:g}" for e in eps_list), "broken",
            "train s"]
    print(" | ".join(head))
    for name, res in results.items():
        if name.startswith("_"):
            continue
        if "certified" not in res:
            print(" | ".join([name, f"{100 * res['clean']:.1f}"]
                             + ["–"] * (len(head) - 2)))
            continue
        cells = [name, f"{100 * res['clean']:.1f}",
                 *(f"{100 * res['certified'][e]:.1f}" for e in eps_list),
                 f"{res['median_radius']:.3f}", f"{res['median_cert_over_attack']:.2f}",
                 *(f"{100 * res['robust'][e]:.1f}" for e in eps_list),
                 str(sum(res["broken_certified"].values())),
                 f"{res['train_seconds']:.0f}" if res.get("train_seconds") else "–"]
        print(" | ".join(cells))
    write_json(args.out, __file__, results)
    plot(results, radii, eps_list, args.out / FIGURE)


def plot(results: dict, radii: dict[str, Tensor], eps_list: list[float],
         out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 6.5))
    # to the largest certified radius, so that no curve is cut off above 0
    top = max(float(r[torch.isfinite(r)].max()) for r in radii.values())
    grid = torch.linspace(0, max(max(eps_list) * 1.5, top * 1.02), 301,
                          dtype=torch.float64)
    for i, (name, r) in enumerate(radii.items()):
        color, line = f"C{i}", "-" if name.startswith("lipvit") else "--"
        curve = [100 * certified_share(r, float(e)) for e in grid]
        ax.plot(grid, curve, line, color=color, label=f"{name}: certified")
        res = results[name]
        ax.plot(eps_list, [100 * res["robust"][e] for e in eps_list], "x:",
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
