"""Certification speed: samples per second of every bound method, against CROWN.

Measures ``lipvit.certify.lofast.network.network_bound`` + ``delta_out`` (what ``lipvit
certify`` runs per batch) for ``lofast`` (sound), ``lofast-fast`` (estimate)
and ``specformer``, and optionally CROWN (``--crown``, auto_LiRPA), as
process CPU time per sample (the machine may be shared) or, on CUDA,
synchronised wall time. Ratios to ``lofast-fast`` and CROWN come from the
same run. Three tables:

1. against the batch size, on the 3×128 preset (``cifar-lofast-3x128``,
   lipschitz family, random weights) or on ``--ckpt`` (e.g. a trained
   digits-size model);
2. against N, D and depth (random lipschitz models, batch ``--batch``);
3. ζ tightness of the sound route: certified ζ against a lower estimate
   (its Ritz value) and, where ``N·D ≤ --dense-max``, dense ``eigvalsh``.

The tables are also written, as numbers, to ``--out``/certify_speed.json.

Usage::

    python bench/user/certify_speed.py --threads 1                  # CPU
    python bench/user/certify_speed.py --threads 1 --ckpt model.pt  # a trained model
    python bench/user/certify_speed.py --device cuda --batches 1 64 256
    python bench/user/certify_speed.py --quick                      # smoke test
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from lipvit.certify.attention import attention_logits, value_output
from lipvit.certify.lofast.network import network_bound
from lipvit.certify.lofast.operators import sensitivity_gram
from lipvit.certify.lofast.structured import zeta_certificate

from lipvit import ViT, preset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: _out
from _out import add_out, write_json  # noqa: E402

METHODS = ("lofast", "lofast-fast", "specformer")


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return time.perf_counter()
    return time.process_time()


def per_sample(model, x, method: str, device: torch.device) -> float:
    """Seconds per sample of one bound (clean logits, all layers, δ_out at one ε)."""
    t0 = _clock(device)
    if method == "crown":
        from lipvit.certify.crown.bounds import crown_certify

        crown_certify(model, x, torch.zeros(x.shape[0], dtype=torch.long,
                                            device=device), 0.01)
    else:
        network_bound(model, x, method).delta_out(0.01)
    return (_clock(device) - t0) / x.shape[0]


def random_model(name: str, device, **over) -> ViT:
    torch.manual_seed(0)
    cfg = preset(name, family="lipschitz", mean=(0.5,) * 3, std=(0.25,) * 3, **over)
    return ViT(cfg).to(device=device, dtype=torch.float64).eval()


def images(model: ViT, B: int, device) -> torch.Tensor:
    c = model.config
    g = torch.Generator().manual_seed(1)
    x = torch.rand(B, c.in_chans, c.image_size, c.image_size, generator=g,
                   dtype=torch.float64)
    return x.to(device)


def table_batch(model, batches, methods, device,
                records: list[dict] | None = None) -> list[str]:
    rows = ["| method | batch | s/sample | samples/s | × lofast-fast | × batch 1 "
            "| × crown |", "|---|---|---|---|---|---|---|"]
    per_sample(model, images(model, 1, device), "lofast", device)  # warm-up
    t: dict[tuple[str, int], float] = {}
    for B in batches:
        x = images(model, B, device)
        for m in methods:
            t[m, B] = per_sample(model, x, m, device)
    for B in batches:
        for m in methods:
            s = t[m, B]
            crown = f"{t['crown', B] / s:.1f}" if ("crown", B) in t else "–"
            rows.append(f"| {m} | {B} | {s:.3f} | {1 / s:.2f} "
                        f"| {s / t['lofast-fast', B]:.2f} | {s / t[m, batches[0]]:.2f} "
                        f"| {crown} |")
            if records is not None:
                records.append({
                    "method": m, "batch": B, "s_per_sample": s,
                    "samples_per_s": 1 / s, "over_lofast_fast": s / t["lofast-fast", B],
                    "over_batch_1": s / t[m, batches[0]],
                    "crown_over": t["crown", B] / s if ("crown", B) in t else None})
    return rows


def table_shapes(shapes, B, methods, device,
                 records: list[dict] | None = None) -> list[str]:
    rows = ["| N | D | depth | method | s/sample | × lofast-fast |",
            "|---|---|---|---|---|---|"]
    for image, D, depth in shapes:
        model = random_model("cifar-lofast-3x128", device, image_size=image,
                             embed_dim=D, depth=depth)
        x = images(model, B, device)
        N = (image // model.config.patch_size) ** 2 + 1
        t = {m: per_sample(model, x, m, device) for m in methods}
        for m in methods:
            rows.append(f"| {N} | {D} | {depth} | {m} | {t[m]:.3f} "
                        f"| {t[m] / t['lofast-fast']:.2f} |")
            if records is not None:
                records.append({"N": N, "D": D, "depth": depth, "method": m,
                                "s_per_sample": t[m],
                                "over_lofast_fast": t[m] / t["lofast-fast"]})
    return rows


@torch.no_grad()
def table_zeta(model, B, dense_max, device,
               records: list[dict] | None = None) -> list[str]:
    rows = ["| layer | H | certified ζ | (cert − Ritz)/Ritz | (cert − dense)/dense |",
            "|---|---|---|---|---|"]
    X = model.embed(images(model, B, device))
    for k, block in enumerate(model.blocks):
        Xa = block.norm1(X)
        W_q, W_k, W_v, W_o = (w.detach() for w in block.attn.head_weights())
        P = torch.softmax(attention_logits(Xa, W_q, W_k), dim=-1)
        for residual in (False, True):
            c = zeta_certificate(P, W_v, W_o, residual)
            gap = ((c.upper - c.ritz) / c.ritz).max().item()
            dense, dense_gap = "–", None
            if Xa.shape[1] * Xa.shape[2] <= dense_max:
                G = sensitivity_gram(P, value_output(W_v, W_o), residual)
                ex = torch.linalg.eigvalsh(G)[..., -1].sqrt()
                dense_gap = ((c.upper - ex) / ex).max().item()
                dense = f"{dense_gap:.1e}"
            rows.append(f"| {k} | {'I' if residual else '0'} | "
                        f"{c.upper.max().item():.6g} | {gap:.1e} | {dense} |")
            if records is not None:
                records.append({"layer": k, "H": "I" if residual else "0",
                                "certified_zeta": c.upper.max().item(),
                                "gap_to_ritz": gap, "gap_to_dense": dense_gap})
        X = block(X)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--ckpt", default=None, help="checkpoint instead of random 3x128")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--batch", type=int, default=4, help="batch of the shape table")
    p.add_argument("--crown", action="store_true", help="also time CROWN")
    p.add_argument("--dense-max", type=int, default=2048)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--skip", nargs="*", default=[], choices=["batch", "shapes", "zeta"])
    add_out(p, __file__)
    args = p.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    methods = (*METHODS, "crown") if args.crown else METHODS
    if args.ckpt:
        from lipvit.checkpoint import load_checkpoint

        model = load_checkpoint(args.ckpt, device=device).model.double().eval()
        name = args.ckpt
    else:
        model = random_model("cifar-lofast-3x128", device)
        name = "cifar-lofast-3x128, random weights"
    shapes = [(16, 64, 1), (32, 64, 1), (32, 128, 1), (32, 128, 3)]
    if args.quick:
        args.batches, args.batch = [1, 2], 1
        shapes = [(8, 32, 1), (16, 32, 1)]
    clock = "process CPU time" if device.type == "cpu" else "synchronised wall time"
    record = {"model": name, "device": str(device), "torch": torch.__version__,
              "threads": torch.get_num_threads(), "clock": clock,
              "load_average_start": os.getloadavg()[0], "args": vars(args)}
    print(f"# certify_speed: {name}; device {device}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {clock}; load average "
          f"{record['load_average_start']:.1f}\n")
    sections = {
        "batch": ("per-sample time against the batch size",
                  lambda rec: table_batch(model, args.batches, methods, device, rec)),
        "shapes": (f"against N, D and depth (random lipschitz models, batch "
                   f"{args.batch})", lambda rec: table_shapes(shapes, args.batch,
                                                               methods, device, rec)),
        "zeta": ("ζ: certified value against its Ritz value (≤ ζ) and dense eigvalsh",
                 lambda rec: table_zeta(model, 2, args.dense_max, device, rec)),
    }
    for key, (title, table) in sections.items():
        if key not in args.skip:
            record[key] = []
            print(f"## {title}\n\n" + "\n".join(table(record[key])) + "\n",
                  flush=True)
    record["load_average_end"] = os.getloadavg()[0]
    print(f"\nload average at end {record['load_average_end']:.1f}")
    write_json(args.out, __file__, record)


if __name__ == "__main__":
    main()
