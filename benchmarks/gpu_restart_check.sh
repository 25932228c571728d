#!/usr/bin/env bash
# Device check (one GPU, NCCL): tests/chaos_script.py on 1 rank killed mid-step and mid-save under --max-restarts 2,
# then uninterrupted; FINAL digests (parameters + AdamW state) must be equal. Run from the repo root with $OUT set.
set -x
nvidia-smi --query-gpu=name --format=csv,noheader; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.is_available())"
mkdir -p /tmp/sc && echo "import sys; sys.path.insert(0, '$PWD/benchmarks'); import _checkout" > /tmp/sc/sitecustomize.py
export PYTHONPATH=/tmp/sc:$PWD:$PWD/tests OMP_NUM_THREADS=4 TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1
cd tests
echo '[{"attempt":0,"rank":0,"where":"step","step":7},{"attempt":1,"rank":0,"where":"save","step":12}]' > /tmp/f.json
A="--max-steps 16 --batch-size 8 --save-interval 3 --eval-interval 4 --log-interval 1 --no-progress"
( time python3 -m shardlib.cli run --nproc 1 --max-restarts 2 chaos_script.py $A --save-dir /tmp/c --faults /tmp/f.json ) > $OUT/chaos.txt 2>&1; echo chaos rc=$?
( time python3 -m shardlib.cli run --nproc 1 chaos_script.py $A --save-dir /tmp/k ) > $OUT/clean.txt 2>&1; echo clean rc=$?
grep -h "FINAL\|restart\|real" $OUT/chaos.txt $OUT/clean.txt
cp /tmp/c/kills.jsonl /tmp/c/steps.jsonl $OUT/ 2>/dev/null
python3 - <<'PY'
import json
k=[json.loads(l) for l in open('/tmp/c/kills.jsonl')]; s=[json.loads(l) for l in open('/tmp/c/steps.jsonl')]
for x in k:
    nxt=[r for r in s if r['attempt']==x['attempt']+1]
    print(x['where'], x['step'], 'kill -> first new step %.1f s' % (min(r['time'] for r in nxt)-x['time']))
PY
