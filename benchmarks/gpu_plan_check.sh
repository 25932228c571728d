#!/usr/bin/env bash
# Device check (one GPU): benchmarks/plan_accuracy_gpu.py (calibrate the GPU, then the one-GPU layouts of BERT-base,
# predicted vs measured). Run from the repo root with $OUT set; the profile and the measurements come back in $OUT
# (re-price them on any machine: plan_accuracy_gpu.py --reprice $OUT/plan_accuracy_gpu.json; the H200 run
# of 2026-11-26 is docs/data/plan_accuracy_gpu_h200_bert.json).
set -x
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.is_available())"
mkdir -p /tmp/sc && echo "import sys; sys.path.insert(0, '$PWD/benchmarks'); import _checkout" > /tmp/sc/sitecustomize.py
export PYTHONPATH=/tmp/sc:$PWD OMP_NUM_THREADS=4 TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1
# MODELS: "name:layers" pairs of benchmarks/_plan_accuracy_layouts.MODELS (default BERT-base); one calibration
python3 -c "from shardlib.analysis.calibrate import calibrate; calibrate(1, backend='nccl').save('$OUT/gpu_profile.json')"
for spec in ${MODELS:-bert-768:12}; do
    python3 benchmarks/plan_accuracy_gpu.py --model "${spec%%:*}" --layers "${spec##*:}" --rounds "${ROUNDS:-3}" \
        --profile "$OUT/gpu_profile.json" --json "$OUT/plan_accuracy_gpu_${spec%%:*}.json" 2>&1 \
        | tee "$OUT/plan_accuracy_gpu_${spec%%:*}.txt"
done
