"""`taylor` and `lofast` at scale: seconds, peak memory and work per sample.

For each preset (random weights, seeded; ``digits-small``, ``fmnist-3x64``,
``fmnist-p7-3x128``, ``cifar-lofast-3x128``, ``cifar-lofast-6x384``) and family,
in a fresh subprocess each (so that its peak resident memory is its own):

* ``lofast``: ``network_bound(model, x, "lofast").delta_out(0.01)``;
* ``taylor``: ``taylor_bound(model, x, y)`` then ``.margin_drop(0.01)``.

It prints CPU seconds per sample (process time; CUDA: synchronised wall time of
a second run, after one that warms the CUDA context and kernels up),
peak memory (the process's resident set on a CPU; ``max_memory_allocated`` on
CUDA), and the floating-point work of one ``taylor`` certificate counted by
``torch.utils.flop_counter`` (matrix products, the bulk of the work) as a
multiple of one forward pass of the same model: the floor for the exact
image Jacobian norms is about ``n`` forward passes (``n`` the image's
dimension, one tangent each). ``--batch 1 8`` compares per-sample cost across
batch sizes. ``--ckpt`` adds a trained model: median ``taylor`` / ``lofast``
certified radius over ``--n`` test points. ``--tightness``: the patch-block
bounds of the whole image-Jacobian norms (docs/taylor.md §11) over the exact
norms, for the presets whose exact norms are affordable and ``--ckpt``.
``--profile PRESET FAMILY``: where one ``taylor`` certificate's time goes
(``torch.profiler``, after a warm-up run): the operators by self time and the
count of host synchronisations (values read back to the host); then lipvit's
functions by cumulative time (``cProfile``, one more certificate).
``--host-linalg-max K``: on CUDA, the largest matrix side whose dense eigen-
and singular-value problems run on the host
(:data:`lipvit.spectral.HOST_LINALG_MAX`; ``0``: all on the device, the
baseline to compare with). What it prints also goes to
``--out``/taylor_scale.json (the tables as numbers; a profile's tables as text).

Usage::

    python bench/user/taylor_scale.py --threads 1
    python bench/user/taylor_scale.py --threads 1 --presets cifar-lofast-3x128 \\
        --batch 1 8
    python bench/user/taylor_scale.py --threads 1 --ckpt fmnist_lip.pt --n 20
    python bench/user/taylor_scale.py --tightness --presets digits-small fmnist-3x64
    python bench/user/taylor_scale.py --device cuda
    python bench/user/taylor_scale.py --device cuda --profile cifar-lofast-3x128 \\
        lipschitz
    python bench/user/taylor_scale.py --device cuda --host-linalg-max 0  # cuSOLVER
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import platform
import pstats
import resource
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import torch
from lipvit.certify.lofast.network import network_bound
from lipvit.certify.taylor.certificate import taylor_bound
from torch.utils.flop_counter import FlopCounterMode

from lipvit import ViT, preset, spectral

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: helpers
from _out import add_out, write_json  # noqa: E402

PRESETS = ("digits-small", "fmnist-3x64", "fmnist-p7-3x128", "cifar-lofast-3x128",
           "cifar-lofast-6x384")


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return time.perf_counter()
    return time.process_time()


def _peak(device: torch.device) -> float:
    """Peak memory so far, GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _problem(name: str, family: str, batch: int, dev: torch.device):
    """``(cfg, model, x, y)``: a seeded random-weight model of the preset in
    float64 and ``batch`` random images labelled with its predictions."""
    torch.manual_seed(0)
    cfg = preset(name, family=family, num_classes=10)
    model = ViT(cfg).double().eval().to(dev)
    x = torch.rand(batch, cfg.in_chans, cfg.image_size, cfg.image_size,
                   dtype=torch.float64, device=dev)
    with torch.no_grad():
        y = model(x).argmax(1)
    return cfg, model, x, y


def one(name: str, family: str, method: str, batch: int, device: str,
        flops: bool) -> dict:
    """Measure one (preset, family, method, batch) in this process."""
    dev = torch.device(device)
    cfg, model, x, y = _problem(name, family, batch, dev)

    def run() -> None:
        if method == "lofast":
            network_bound(model, x, "lofast").delta_out(0.01)
        else:
            taylor_bound(model, x, y).margin_drop(0.01)

    if dev.type == "cuda":  # warm-up: CUDA context, cuBLAS handles, kernel loading
        run()
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = _clock(dev)
    run()
    seconds = (_clock(dev) - t0) / batch
    out = {"preset": name, "family": family, "method": method, "batch": batch,
           "s_per_sample": seconds, "peak_gib": _peak(dev),
           "n": x[0].numel(), "tokens": cfg.num_patches + 1, "width": cfg.embed_dim}
    if flops:
        with FlopCounterMode(display=False) as fwd:
            with torch.no_grad():
                model(x[:1])
        with FlopCounterMode(display=False) as cert:
            x1, y1 = x[:1], y[:1]
            taylor_bound(model, x1, y1).margin_drop(0.01)
        out["forward_gflop"] = fwd.get_total_flops() / 1e9
        out["taylor_gflop"] = cert.get_total_flops() / 1e9
    return out


SYNCS = ("aten::_local_scalar_dense", "aten::nonzero", "cudaStreamSynchronize",
         "cudaDeviceSynchronize", "cudaMemcpyAsync")


def profile(name: str, family: str, device: str, rows: int = 20) -> dict:
    """Print where one ``taylor`` certificate (batch 1) spends its time; return
    the same (the tables as text)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    dev = torch.device(device)
    _, model, x, y = _problem(name, family, 1, dev)
    taylor_bound(model, x, y).margin_drop(0.01)  # warm-up
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                           if dev.type == "cuda" else [])
    t0 = _clock(dev)
    with torch_profile(activities=activities) as prof:
        taylor_bound(model, x, y).margin_drop(0.01)
    seconds = _clock(dev) - t0
    events = prof.key_averages()
    counts = {e.key: e.count for e in events if e.key in SYNCS}
    print(f"# profile: {name} {family}, {device}, {seconds:.2f} s under the profiler; "
          f"host synchronisations: {counts}")
    operators = events.table(sort_by="self_cpu_time_total", row_limit=rows)
    print(operators)
    by_function = cProfile.Profile()  # one more certificate: lipvit's own functions
    by_function.runcall(lambda: taylor_bound(model, x, y).margin_drop(0.01))
    print("# lipvit functions by cumulative time (cProfile, one more certificate)")
    text = io.StringIO()
    pstats.Stats(by_function, stream=text).sort_stats("cumulative").print_stats(
        r"lipvit|certify/", 2 * rows)
    print(text.getvalue(), end="")
    return {"profile": {"preset": name, "family": family, "device": device,
                        "seconds": seconds, "host_synchronisations": counts,
                        "operators_by_self_time": operators,
                        "functions_by_cumulative_time": text.getvalue()}}


def tightness(model, x, label: str, records: list[dict] | None = None) -> str:
    """The patch-block bounds of the whole-matrix image Jacobian norms over the
    exact ones (``n × n`` Gram matrices), ranges over samples and states (their
    numbers appended to ``records`` if given)."""
    from lipvit.certify.taylor.jacobian_norms import jacobian_norms

    n = x[0].numel()
    exact = jacobian_norms(model, x, exact_max=n, max_memory=64 * 2**30)
    block = jacobian_norms(model, x, exact_max=0)
    s, a = block.stream / exact.stream, block.attn_in / exact.attn_in
    if records is not None:
        records.append({
            "model": label, "samples": len(x),
            "stream": {"min": s.min(), "max": s.max(), "median": s.median()},
            "attention_input": {"min": a.min(), "max": a.max(),
                                "median": a.median()}})
    return (f"| {label} | {len(x)} | {s.min():.3f}–{s.max():.3f} "
            f"(median {s.median():.3f}) | {a.min():.3f}–{a.max():.3f} "
            f"(median {a.median():.3f}) |")


def radius_ratio(path: str, n: int, records: list[dict] | None = None) -> str:
    """Median taylor / lofast certified radius on a checkpoint's test points
    (the numbers appended to ``records`` if given)."""
    from _points import float64_points
    from lipvit.certify.certification import certified_radius, margin

    model, x, y, _ = float64_points(path, n)
    t0 = time.process_time()
    tb = taylor_bound(model, x, y)
    r_taylor = tb.radius(rtol=1e-3)
    t_taylor = (time.process_time() - t0) / len(x)
    nb = network_bound(model, x, "lofast")
    r_lofast = certified_radius(margin(nb.logits, y), nb.delta_out, rtol=1e-3)
    ok = (r_lofast > 0) & (r_taylor > 0)
    ratio = (r_taylor[ok] / r_lofast[ok]).median().item() if ok.any() else float("nan")
    if records is not None:
        records.append({
            "ckpt": path, "points": len(x), "both_positive": int(ok.sum()),
            "median_radius_taylor": r_taylor.median(),
            "median_radius_lofast": r_lofast.median(), "median_ratio": ratio,
            "taylor_cpu_s_per_sample": t_taylor})
    return (f"{path}: {len(x)} points, {int(ok.sum())} with both radii > 0; median "
            f"radius taylor {r_taylor.median():.4g}, lofast {r_lofast.median():.4g}; "
            f"median per-point ratio {ratio:.3g}; taylor with radius search "
            f"{t_taylor:.2f} s CPU per sample")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", nargs="+", default=list(PRESETS))
    parser.add_argument("--families", nargs="+", default=["lipschitz", "standard"])
    parser.add_argument("--batch", nargs="+", type=int, default=[1])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-flops", action="store_true")
    parser.add_argument("--ckpt", nargs="*", default=[])
    parser.add_argument("--n", type=int, default=20)
    parser.add_argument("--tightness", action="store_true",
                        help="block bound / exact norm, presets with n ≤ 1024 "
                             "(random weights) and --ckpt")
    parser.add_argument("--one", nargs=4, metavar=("PRESET", "FAMILY", "METHOD",
                                                   "BATCH"), help=argparse.SUPPRESS)
    parser.add_argument("--profile", nargs=2, metavar=("PRESET", "FAMILY"),
                        help="profile one taylor certificate instead")
    parser.add_argument("--host-linalg-max", type=int, default=spectral.HOST_LINALG_MAX,
                        help="CUDA: largest matrix side solved on the host (0: none)")
    add_out(parser, __file__)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    spectral.HOST_LINALG_MAX = args.host_linalg_max
    if args.profile:
        write_json(args.out, __file__,
                   {"args": vars(args), **profile(*args.profile, args.device)})
        return
    if args.one:
        name, family, method, batch = args.one
        print(json.dumps(one(name, family, method, int(batch), args.device,
                             method == "taylor" and not args.no_flops)))
        return
    cpu = platform.processor() or platform.machine()
    record: dict = {"date": str(date.today()), "cpu": cpu, "device": args.device,
                    "threads": args.threads, "torch": torch.__version__,
                    "host_linalg_max": args.host_linalg_max, "args": vars(args),
                    "rows": []}
    print(f"# taylor_scale, {date.today()}, {cpu}, {args.device}, "
          f"{args.threads} thread(s), torch {torch.__version__}"
          + (f", host linalg ≤ {args.host_linalg_max}" if args.device != "cpu" else ""))
    print("| preset | family | n | N × D | batch | lofast s/sample | lofast peak GiB "
          "| taylor s/sample | taylor peak GiB | taylor work (forward passes) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.presets:
        for family in args.families:
            for batch in args.batch:
                rows = {}
                for method in ("lofast", "taylor"):
                    cmd = [sys.executable, __file__, "--one", name, family, method,
                           str(batch), "--device", args.device, "--threads",
                           str(args.threads), "--host-linalg-max",
                           str(args.host_linalg_max)] + (["--no-flops"] if args.no_flops
                                                 or batch > 1 else [])
                    done = subprocess.run(cmd, capture_output=True, text=True)
                    if done.returncode:
                        print(f"| {name} | {family} | failed: "
                              f"{done.stderr.strip().splitlines()[-1]} |")
                        record["rows"].append({
                            "preset": name, "family": family, "batch": batch,
                            "method": method,
                            "failed": done.stderr.strip().splitlines()[-1]})
                        break
                    rows[method] = json.loads(done.stdout.strip().splitlines()[-1])
                else:
                    lo, ta = rows["lofast"], rows["taylor"]
                    work = (f"{ta['taylor_gflop'] / ta['forward_gflop']:.0f}"
                            f" ({ta['taylor_gflop']:.0f} GFLOP)"
                            if "taylor_gflop" in ta else "–")
                    print(f"| {name} | {family} | {ta['n']} | {ta['tokens']} × "
                          f"{ta['width']} | {batch} | {lo['s_per_sample']:.3g} | "
                          f"{lo['peak_gib']:.2f} | {ta['s_per_sample']:.3g} | "
                          f"{ta['peak_gib']:.2f} | {work} |", flush=True)
                    record["rows"].append({
                        "preset": name, "family": family, "batch": batch,
                        "n": ta["n"], "tokens": ta["tokens"], "width": ta["width"],
                        "lofast_s_per_sample": lo["s_per_sample"],
                        "lofast_peak_gib": lo["peak_gib"],
                        "taylor_s_per_sample": ta["s_per_sample"],
                        "taylor_peak_gib": ta["peak_gib"],
                        "taylor_gflop": ta.get("taylor_gflop"),
                        "forward_gflop": ta.get("forward_gflop"),
                        "taylor_work_forward_passes": (
                            ta["taylor_gflop"] / ta["forward_gflop"]
                            if "taylor_gflop" in ta else None)})
    if args.tightness:
        record["tightness"] = []
        print("| model | samples | stream: block / exact | attention input: "
              "block / exact |\n|---|---|---|---|")
        for name in args.presets:
            for family in args.families:
                torch.manual_seed(0)
                cfg = preset(name, family=family, num_classes=10)
                if cfg.in_chans * cfg.image_size**2 > 1024:
                    continue
                model = ViT(cfg).double().eval()
                x = torch.rand(4, cfg.in_chans, cfg.image_size, cfg.image_size,
                               dtype=torch.float64)
                print(tightness(model, x, f"{name} {family} (random)",
                                record["tightness"]), flush=True)
        for path in args.ckpt:
            from _points import float64_points

            model, x, _, _ = float64_points(path, min(args.n, 8))
            print(tightness(model, x, path, record["tightness"]), flush=True)
    if args.ckpt:
        record["radius_ratio"] = []
    for path in args.ckpt:
        print(radius_ratio(path, args.n, record.get("radius_ratio")))
    write_json(args.out, __file__, record)


if __name__ == "__main__":
    main()
