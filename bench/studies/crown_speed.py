"""CROWN's CPU time per sample: the bounded model rebuilt per sample (before) or
built once per run (:class:`lipvit.certify.crown.bounds.CrownModel`), each without and
with ``GLIBC_TUNABLES=glibc.malloc.mmap_max=0``, measured in the same run.

    PYTHONPATH=. python bench/studies/crown_speed.py --samples 4

Process CPU time (``time.process_time``) per sample on 1 thread, the digits-tiny
preset of the lipschitz family with random weights (CROWN's cost depends on the
graph, not on the weights), over test digits. Each allocator setting runs in a
child process (glibc reads the variable at start); ratios are against the
first row. The table also goes to ``--out``/crown_speed.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from lipvit.certify.crown import bounds as crown

import lipvit
from lipvit.data import load_dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: _out
from _out import add_out, write_json  # noqa: E402


def _child(samples: int) -> dict[str, float]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = load_dataset("digits")
    model = lipvit.ViT(lipvit.preset("digits-tiny", family="lipschitz",
                                     mean=data.mean, std=data.std)).double().eval()
    x, y = data.x_test[:samples].double(), data.y_test[:samples]
    crown.crown_margin_bounds(model, x[:1], y[:1], 0.01)  # warm-up (imports)
    out = {}
    for mode in ("rebuilt", "reused"):
        prepared = crown.crown_model(model) if mode == "reused" else None
        t0 = time.process_time()
        for i in range(samples):
            crown.crown_margin_bounds(model, x[i:i + 1], y[i:i + 1], 0.01,
                                      prepared=prepared)
        out[mode] = (time.process_time() - t0) / samples
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    add_out(parser, __file__)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.samples)))
        return
    rows = {}
    settings = (("default", None), ("mmap_max=0", "glibc.malloc.mmap_max=0"))
    for label, tunables in settings:
        env = {k: v for k, v in os.environ.items()
               if k != "GLIBC_TUNABLES"}
        env["OMP_NUM_THREADS"] = "1"
        if tunables:
            env["GLIBC_TUNABLES"] = tunables
        done = subprocess.run([sys.executable, __file__, "--child", "--samples",
                               str(args.samples)], env=env, check=True,
                              capture_output=True, text=True)
        rows[label] = json.loads(done.stdout.strip().splitlines()[-1])
    base = rows["default"]["rebuilt"]
    print(f"CROWN, digits-tiny lipschitz, {args.samples} samples, 1 thread, "
          "process CPU s/sample")
    print(f"{'allocator':<12} {'bounded model':<14} {'s/sample':>9} {'speed-up':>9}")
    record = {"preset": "digits-tiny", "family": "lipschitz",
              "samples": args.samples, "threads": 1, "rows": []}
    for label, times in rows.items():
        for mode, seconds in times.items():
            print(f"{label:<12} {mode:<14} {seconds:>9.3f} {base / seconds:>8.2f}x")
            record["rows"].append({"allocator": label, "bounded_model": mode,
                                   "cpu_s_per_sample": seconds,
                                   "speed_up": base / seconds})
    write_json(args.out, __file__, record)


if __name__ == "__main__":
    main()
