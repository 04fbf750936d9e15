"""Where the certified CaiT loses: a sweep over its attention and training.

Trains CaiT variants (``lipvit.cait``) on the first ``--n-train`` Fashion-MNIST
training images for ``--epochs`` with ``lipvit.train.train`` (the default
recipe: certified training for ``ball`` at ``cert_eps``), each a row of
``--variants``, then measures on the first ``--n-test`` test images:

- clean accuracy, with every attention term removed and with only the
  self-attention removed (:func:`lipvit.ablate_attention`);
- certified accuracy at every ``--eps`` and the median radius by ``ball``
  (local constants, docs/math.md §10) and by ``global`` (the proven global
  constant, §9), on the same points;
- robust accuracy under PGD-ℓ2 and APGD (20 steps) at every ``--eps``,
  the ceiling over the certificates, and the certified points the attacks
  break (none, or a bound is wrong);
- each attention block's mean logit spreads (content, the part that changes
  with the image, positional) and the class attention's local constant at
  the median point.

A variant is ``name=config overrides;train overrides`` with Python keyword
syntax, e.g. ``content2=cls_content=2.0;`` (class attention's content
logits held at norm 2) or ``eps25=;cert_eps=0.25``.

The models go to ``--models`` (default ``--out``/models; a model already
there is not retrained), the measurements to ``--out``/cait_sweep.json.

Usage::

    python bench/studies/cait_sweep.py --n-train 20000 --epochs 4 --n-test 300 \\
        --models runs/sweep --out docs/figures
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch
from lipvit.analysis.attacks import robust_accuracy
from lipvit.certify.evaluate import certify_samples

from lipvit.ablation import ablate_attention
from lipvit.checkpoint import load_checkpoint
from lipvit.config import preset
from lipvit.data import load_dataset
from lipvit.train import train, train_config_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: _out
from _out import add_out, write_json  # noqa: E402

DEFAULT_VARIANTS = (
    "default=;",
    "content0.5=cls_content=0.5;",
    "content2=cls_content=2.0;",
    "depth1=depth=1;",
    "eps0.25=;cert_eps=0.25",
)


def parse_variant(text: str) -> tuple[str, dict, dict]:
    """``name=cfg;train`` to the name and its two override dicts."""
    name, _, rest = text.partition("=")
    cfg, _, tc = rest.partition(";")
    return name, eval(f"dict({cfg})"), eval(f"dict({tc})")  # the user's own text


def measure(model, x, y, eps_list) -> dict:
    """Clean, ablated, certified (ball and global) and attacked accuracy, and
    the attention's spreads."""
    report = certify_samples(model, x, y, ["ball", "global"], eps_list, radius=True,
                             batch_size=100)
    with torch.no_grad():
        clean = float((model(x).argmax(1) == y).double().mean())
        ablated = {f"ablated_{which}":
                   float((ablate_attention(model, which)(x).argmax(1) == y)
                         .double().mean()) for which in ("all", "self")}
    out = {"clean": clean, **ablated}
    for method in ("ball", "global"):
        r = report.radii[method]
        out[method] = {"certified": {e: float((r >= e).double().mean())
                                     for e in eps_list},
                       "median_radius": float(r.median())}
    out["attacked"], out["broken"] = {}, 0
    for e in eps_list:
        alive = torch.as_tensor(robust_accuracy(
            model, x, y, ["pgd-l2", "apgd"], e, norm="l2", steps=20).worst_case)
        out["attacked"][e] = float(alive.double().mean())
        certified = report.radii["ball"] >= e
        out["broken"] += int((certified & ~alive).sum())
    out["attention"] = model.double().attention_spread(x.double())
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", nargs="*", default=list(DEFAULT_VARIANTS))
    p.add_argument("--n-train", type=int, default=20000)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--n-test", type=int, default=300)
    p.add_argument("--eps", default="0.1,0.25,0.5,1.0")
    p.add_argument("--models", type=Path, default=None,
                   help="folder for the models (default: OUT/models)")
    p.add_argument("--threads", type=int, default=1)
    add_out(p, __file__)
    args = p.parse_args()
    models = args.models or args.out / "models"
    torch.set_num_threads(args.threads)
    eps_list = [float(e) for e in args.eps.split(",")]
    full = load_dataset("fashion-mnist")
    data = dataclasses.replace(full, x_train=full.x_train[:args.n_train],
                               y_train=full.y_train[:args.n_train])
    x, y = full.x_test[:args.n_test], full.y_test[:args.n_test]
    models.mkdir(parents=True, exist_ok=True)
    results = {}
    for text in args.variants:
        name, cfg_over, train_over = parse_variant(text)
        cfg = preset("fmnist-cait", **cfg_over)
        tc = train_config_for("lipschitz", "fashion-mnist", arch="cait",
                              device="cpu", threads=args.threads,
                              **{"epochs": args.epochs, **train_over})
        path = models / f"{name}.pt"
        t0 = time.perf_counter()
        if not path.exists():
            train(cfg, tc, data, path, progress=False)
        seconds = time.perf_counter() - t0
        model = load_checkpoint(path).model.eval()
        results[name] = {"variant": text, "train_seconds": seconds,
                         **measure(model, x, y, eps_list)}
        r = results[name]
        print(f"{name}: clean {r['clean']:.3f} (ablated {r['ablated_all']:.3f}, "
              f"self-attention ablated {r['ablated_self']:.3f}); "
              + "; ".join(f"{m} " + "/".join(f"{r[m]['certified'][e]:.3f}"
                                            for e in eps_list)
                          + f" median {r[m]['median_radius']:.3f}"
                          for m in ("ball", "global"))
              + "; attacked " + "/".join(f"{r['attacked'][e]:.3f}" for e in eps_list)
              + f" (certified and broken: {r['broken']})"
              + "; content spread " + ", ".join(f"{a['content']:.2f}"
                                                for a in r["attention"]),
              flush=True)
    write_json(args.out, __file__, results)


if __name__ == "__main__":
    sys.exit(main())
