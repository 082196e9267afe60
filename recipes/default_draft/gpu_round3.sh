#!/usr/bin/env bash
# The next device round for the default draft (docs/training.md, "Not yet done"): more
# self-written prompts at a higher temperature, answered, then a continuation of the shipped
# draft (--init-from) on everything answered so far. Run detached (setsid) like round 2 and
# watch it with gpu_watch.sh (R=/tmp/round). Needs: /tmp/smol.gguf, /tmp/site (gguf wheel),
# /tmp/data/regen_recipe.jsonl.gz and /tmp/data/regen_self.jsonl.gz (round 2's answers).
set -u
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
R=/tmp/round
mkdir -p $R/regen $R/self
SELF_PROMPTS=${SELF_PROMPTS:-60000}
TRAIN_STEPS=${TRAIN_STEPS:-6000}
TRAIN_MIN=${TRAIN_MIN:-18}
S="python3 -m specscope.cli train-draft --target /tmp/smol.gguf --cache-dir /tmp/sscache --max-len 1024 --batch-tokens 16384"
zcat /tmp/data/regen_recipe.jsonl.gz > $R/regen/regenerated.jsonl
zcat /tmp/data/regen_self.jsonl.gz > $R/self/regenerated.jsonl
date +%s > $R/t0
date +%s > $R/t_regen1
$S --self-prompts $SELF_PROMPTS --self-prompt-temperature 1.0 --seed 1 --out $R/self2 \
  --regen-max-new-tokens 512 --regen-batch-size 512 --max-steps 1 --eval-every 0 --save-every 0 \
  > $R/self.log 2>&1
date +%s > $R/t_regen2
$S --data $R/regen/regenerated.jsonl $R/self/regenerated.jsonl $R/self2/regenerated.jsonl \
  --no-regenerate --init-from src/specscope/drafts/smollm2_135m_instruct --out $R/train \
  --epochs 100 --max-steps $TRAIN_STEPS --lr 5e-4 --warmup-ratio 0.01 --eval-every 1000 \
  --save-every 1000 --budget-minutes $TRAIN_MIN > $R/train.log 2>&1
date +%s > $R/t_train
touch $R/DONE
