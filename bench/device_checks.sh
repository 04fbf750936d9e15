#!/bin/bash
# The GPU checks of `taylor` at scale in one call, for a lent CUDA machine whose python3
# has torch but not lipvit (nothing is fetched: lipvit installs from this tree,
# without dependencies; torchattacks and auto_LiRPA, pure Python, come from
# SITE if given). Each step has its own time limit so that one slow step does
# not eat the others' (sized from the H100 runs of 2026-11-26 and -27: the
# whole script ran 360 s there, the cuSOLVER baseline's 3×128 standard row
# alone about 40 s; about 8 minutes in all with the machine's start). Writes
# its logs, and each bench's JSON (bench/README.md), to OUT (default: ./device-out).
#
#     SITE=path/to/site-packages-copy OUT=out bash bench/device_checks.sh [CKPT DATA_DIR]
#
# Steps: the CUDA tests; the dense eigenproblems on the host against cuSOLVER
# (lipvit.spectral.HOST_LINALG_MAX, --host-linalg-max 0 the baseline) in the
# same run; `lipvit certify --method taylor --radius` on CKPT over SAMPLES
# test images (default 20; 10000 is the whole Fashion-MNIST test set, give it
# CERTIFY_S seconds) (skipped without); `taylor` at 3×128 on batches of 1 and
# 64, both families (the target: ≤ 0.1 s per sample); a profile of one
# certificate.
set -u
OUT=${OUT:-device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=${SITE:-}
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . \
    > "$OUT/install.log" 2>&1 || { tail -5 "$OUT/install.log"; exit 1; }
python3 -c "import torch, lipvit.certify.taylor.certificate; print(torch.__version__, torch.cuda.get_device_name())"
timeout 90 python3 -m pytest -m gpu -p no:cacheprovider -rs -o addopts="" -q \
    tests/test_lofast.py tests/test_structured.py tests/test_tangents.py \
    tests/test_jets.py tests/test_rounding.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -15
for K in 1024 0; do
    timeout 150 python3 bench/user/taylor_scale.py --device cuda --no-flops \
        --host-linalg-max $K --presets fmnist-3x64 cifar-lofast-3x128 \
        --out "$OUT/taylor_scale_host$K" 2>&1 | tee "$OUT/taylor_scale_host$K.md"
done
if [ $# -ge 2 ]; then
    timeout "${CERTIFY_S:-100}" python3 -m lipvit certify --ckpt "$1" --data-dir "$2" \
        --device cuda --method taylor --eps 0.05,0.1,0.25,0.5 --samples "${SAMPLES:-20}" \
        --batch-size 64 --radius \
        --json "$OUT/certify-cuda.json" 2>&1 | tr '\r' '\n' | grep -v "it/s" \
        | tee "$OUT/certify.log" | tail -12
fi
timeout 240 python3 bench/user/taylor_scale.py --device cuda --no-flops \
    --presets cifar-lofast-3x128 --batch 1 64 --out "$OUT/taylor_scale_batch64" 2>&1 \
    | tee "$OUT/taylor_scale_batch64.md"
timeout 45 python3 bench/user/taylor_scale.py --device cuda --profile fmnist-3x64 \
    lipschitz --out "$OUT/profile" > "$OUT/profile.txt" 2>&1
grep "^# profile" "$OUT/profile.txt"
