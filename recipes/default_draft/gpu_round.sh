#!/usr/bin/env bash
# One device call of the default-draft recipe (see docs/training.md): continue the target's
# regeneration of the prompts in the background, meanwhile train a learning-rate probe on what
# is already regenerated, then train the draft on everything regenerated so far.
# Needs: /tmp/smol.gguf (the default GGUF), /tmp/site (gguf wheel), /tmp/regen (resumable).
set -u
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
REGEN_S=${REGEN_S:-330}
TRAIN_MIN=${TRAIN_MIN:-3.3}
S="python3 -m specscope.cli train-draft --target /tmp/smol.gguf --cache-dir /tmp/sscache --max-len 1024 --batch-tokens 16384"
timeout $REGEN_S $S --data .stage/data/prompts.jsonl --out /tmp/regen --regen-max-new-tokens 512 \
  --regen-batch-size 384 --max-steps 1 --eval-every 0 --save-every 0 > $OUT/regen.log 2>&1 &
timeout $((REGEN_S - 10)) $S --data /tmp/run/regen_part1.jsonl --no-regenerate --out /tmp/run/probe \
  --epochs 10 --lr 1e-3 --eval-every 0 --save-every 0 --budget-minutes 4.5 > $OUT/probe.log 2>&1
wait
wc -l /tmp/regen/regenerated.jsonl
python3 - <<'PY'
import json
def tau(p):
    ev = [json.loads(l) for l in open(p)][-1]["eval"]
    return ev["predicted_accept_length"]["5"], ev["acceptance_by_position"]
print("probe lr 1e-3:", tau("/tmp/run/probe/metrics.jsonl"))
print("base  lr 5e-4:", tau("/tmp/run/out/metrics.jsonl"))
lr = "1e-3" if tau("/tmp/run/probe/metrics.jsonl")[0] > tau("/tmp/run/out/metrics.jsonl")[0] + 0.03 else "5e-4"
open("/tmp/run/lr", "w").write(lr)
print("chosen lr", lr)
PY
mkdir -p /tmp/run/final && cp /tmp/regen/regenerated.jsonl /tmp/run/final/data.jsonl
gzip -c /tmp/regen/regenerated.jsonl > $OUT/regenerated.jsonl.gz
$S --data /tmp/run/final/data.jsonl --no-regenerate --out /tmp/run/final/out --epochs 8 \
  --lr $(cat /tmp/run/lr) --eval-every 300 --save-every 300 --budget-minutes $TRAIN_MIN > $OUT/final.log 2>&1
tail -4 $OUT/final.log
cp /tmp/run/final/out/metrics.jsonl $OUT/final_metrics.jsonl
cp /tmp/run/final/out/draft/config.json $OUT/config.json
split -n 2 -d /tmp/run/final/out/draft/model.safetensors $OUT/model.safetensors.part
md5sum /tmp/run/final/out/draft/model.safetensors
