#!/usr/bin/env bash
# Device check (one GPU, ~5 min): what a step is made of, for the cost model's time terms (issue 36, item 5) and the
# world of one's host time (issue 34). Run from the repo root with $OUT set; everything comes back in $OUT:
#   gpu_profile.json               shardlib calibrate --world 1 --backend nccl
#   anatomy_vit.json               step_anatomy.py --gpu for ViT-base eager (hand loop / Trainer, with host probes)
#   terms_<model>.json, log.txt    plan_accuracy_gpu.py --terms: predicted vs measured step and peak, kernel time
#                                  by class, the host-bound tiny step and the fixed costs (re-price them anywhere:
#                                  plan_accuracy_gpu.py --reprice terms_<model>.json)
# CHECK=1 (~3 min): an independent re-measurement instead: calibrate again (check_profile.json) and time the
# one-GPU layouts of the four models in 2 rounds without the terms (check_<model>.json, log.txt).
# ANATOMY=1 (~6 min): issue 34's GPU table instead: the world of one against hand loops, every CUDA case of
# _gpu_anatomy.CASES in interleaved rounds (anatomy.json).
set -x
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.is_available())"
mkdir -p /tmp/sc && echo "import sys; sys.path.insert(0, '$PWD/benchmarks'); import _checkout" > /tmp/sc/sitecustomize.py
export PYTHONPATH=/tmp/sc:$PWD OMP_NUM_THREADS=4 TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1
if [ -n "$ANATOMY" ]; then
    timeout 420 python3 benchmarks/step_anatomy.py --gpu --rounds 7 --steps 10 --budget 330 \
        --json "$OUT/anatomy.json" 2>&1 | grep -v Warning | tee "$OUT/log.txt" | tail -40
    exit 0
fi
PROFILE=$OUT/gpu_profile.json
[ -n "$CHECK" ] && PROFILE=$OUT/check_profile.json
timeout 60 python3 -c "from shardlib.analysis.calibrate import calibrate; calibrate(1, backend='nccl').save('$PROFILE')"
if [ -n "$CHECK" ]; then
    for spec in vit-base:12:128:64:off bert-large:24:512:8:off bert-768:12:128:8,32:off,on t5-base:12:256:16:off; do
        IFS=: read -r model layers seq batches ckpt <<< "$spec"
        timeout 75 python3 benchmarks/plan_accuracy_gpu.py --model "$model" --layers "$layers" --seq "$seq" \
            --batches "$batches" --precisions fp32,bf16 --checkpointing "$ckpt" --rounds 2 --profile "$PROFILE" \
            --json "$OUT/check_$model.json" 2>&1 | grep -v Warning | tee -a "$OUT/log.txt" | tail -3
    done
    exit 0
fi
timeout 90 python3 benchmarks/step_anatomy.py --gpu --cases vit-b32-bf16 --rounds 9 --steps 10 --budget 60 \
    --json "$OUT/anatomy_vit.json" 2>&1 | grep -v Warning | tail -12
terms() {  # name layers seq batches precisions checkpointing rounds
    timeout 150 python3 benchmarks/plan_accuracy_gpu.py --model "$1" --layers "$2" --seq "$3" --batches "$4" \
        --precisions "$5" --checkpointing "$6" --rounds "$7" --terms --profile "$PROFILE" \
        --json "$OUT/terms_$1.json" 2>&1 | grep -v Warning | tee -a "$OUT/log.txt" | tail -4
}
terms vit-base 12 128 64 fp32,bf16 off 3
terms bert-large 24 512 8 fp32,bf16 off 3
terms t5-base 12 256 16 fp32,bf16 off 3
terms bert-768 12 128 8,32 fp32,bf16,fp16 off,on 2
terms t5-small 6 128 8,32 fp32,bf16,fp16 off,on 2
