#!/usr/bin/env bash
# Device check (one GPU): benchmarks/plan_accuracy_gpu.py (calibrate the GPU, then the one-GPU layouts of BERT-base,
# predicted vs measured). Run from the repo root with $OUT set; the profile and the measurements come back in $OUT
# (re-price them on any machine: plan_accuracy_gpu.py --reprice $OUT/plan_accuracy_gpu.json; the H200 run
# of 2026-11-26 is docs/data/plan_accuracy_gpu_h200.json).
set -x
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.is_available())"
mkdir -p /tmp/sc && echo "import sys; sys.path.insert(0, '$PWD/benchmarks'); import _checkout" > /tmp/sc/sitecustomize.py
export PYTHONPATH=/tmp/sc:$PWD OMP_NUM_THREADS=4 TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1
python3 benchmarks/plan_accuracy_gpu.py --rounds "${ROUNDS:-3}" --profile-out "$OUT/gpu_profile.json" \
    --json "$OUT/plan_accuracy_gpu.json" 2>&1 | tee "$OUT/plan_accuracy_gpu.txt"
