"""One ``lipvit`` command's wall, user and system time and page faults with
glibc's default allocator and with lipvit's (:mod:`lipvit.allocator`),
measured in the same run.

    python bench/studies/allocator_speed.py --ckpt runs/demo/models/lipschitz.pt \\
        --n 16 --repeats 2

Each setting runs the command in its own child process on one thread (the
command line sets the allocator only in the ``lipvit`` program, so the child
sets it itself, or not), the two settings alternating ``--repeats`` times;
times from ``getrusage`` of the children. The default command is the
pipeline's ``certify lipschitz`` step (``taylor`` with radii) on ``--n``
points; ``-- ARGS`` runs another ``lipvit`` command instead. The table also
goes to ``--out``/allocator_speed.json.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: _out
from _out import add_out, write_json  # noqa: E402

CHILD = """
import sys
from lipvit.allocator import keep_freed_memory
from lipvit.cli import main
if sys.argv[1] == "lipvit":
    keep_freed_memory()
main(args=sys.argv[2:], prog_name="lipvit")
"""
SETTINGS = ("default", "lipvit")


def _run(setting: str, args: list[str]) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    env["OMP_NUM_THREADS"] = "1"
    before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    subprocess.run([sys.executable, "-c", CHILD, setting, *args], env=env,
                   check=True, stdout=subprocess.DEVNULL)
    wall, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"wall_s": wall, "user_s": after.ru_utime - before.ru_utime,
            "sys_s": after.ru_stime - before.ru_stime,
            "minor_faults": after.ru_minflt - before.ru_minflt}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", type=Path,
                        default=Path("runs/demo/models/lipschitz.pt"))
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("command", nargs="*", help="another lipvit command (after --)")
    add_out(parser, __file__)
    args = parser.parse_args()
    command = args.command or [
        "certify", "--ckpt", str(args.ckpt), "--eps", "0.002,0.005,0.01,0.02,0.05",
        "--method", "taylor", "--radius", "--n", str(args.n), "--json", "-"]
    runs: dict[str, list[dict[str, float]]] = {s: [] for s in SETTINGS}
    for _ in range(args.repeats):
        for setting in SETTINGS:
            runs[setting].append(_run(setting, command))
            print(setting, {k: round(v, 1) for k, v in runs[setting][-1].items()},
                  flush=True)
    best = {s: min(r, key=lambda row: row["wall_s"]) for s, r in runs.items()}
    base = best["default"]["wall_s"]
    print(f"lipvit {' '.join(command)}  (1 thread, best of {args.repeats})")
    print(f"{'allocator':<10} {'wall s':>8} {'user s':>8} {'sys s':>8} "
          f"{'faults':>10} {'speed-up':>9}")
    for setting, row in best.items():
        print(f"{setting:<10} {row['wall_s']:>8.1f} {row['user_s']:>8.1f} "
              f"{row['sys_s']:>8.1f} {row['minor_faults']:>10.0f} "
              f"{base / row['wall_s']:>8.2f}x")
    write_json(args.out, __file__, {
        "command": ["lipvit", *command], "threads": 1, "repeats": args.repeats,
        "machine": f"{platform.system()} {platform.release()}, {os.cpu_count()} CPUs",
        "runs": runs, "best": best, "speed_up": base / best["lipvit"]["wall_s"]})


if __name__ == "__main__":
    main()
