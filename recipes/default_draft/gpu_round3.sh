#!/usr/bin/env bash
# Round 3 of the default draft (docs/training.md): more self-written prompts at a higher
# temperature, answered, then a continuation of the shipped draft (--init-from) on everything
# answered so far. Run detached (setsid) and watch it with gpu_watch.sh (R=/tmp/round).
# Needs /tmp/smol.gguf and /tmp/site (gguf wheel) at start; round 2's answers
# (/tmp/data/regen_recipe.jsonl.gz, /tmp/data/regen_self.jsonl.gz) may arrive by a later call,
# before the self prompts are answered. The sources are copied first, so later calls that
# bring a newer working tree cannot change the code under a running round.
set -u
rm -rf /tmp/src_r3 && cp -r src /tmp/src_r3
export PYTHONPATH=/tmp/site:/tmp/src_r3 PYTHONUNBUFFERED=1
R=/tmp/round
mkdir -p $R/regen $R/self
SELF_PROMPTS=${SELF_PROMPTS:-36000}
TRAIN_STEPS=${TRAIN_STEPS:-6000}
TRAIN_MIN=${TRAIN_MIN:-12.5}
S="python3 -m specscope.cli train-draft --target /tmp/smol.gguf --cache-dir /tmp/sscache --max-len 1024 --batch-tokens 16384"
date +%s > $R/t0
date +%s > $R/t_regen1
$S --self-prompts $SELF_PROMPTS --self-prompt-temperature 1.0 --seed 1 --out $R/self2 \
  --regen-max-new-tokens 512 --regen-batch-size 512 --max-steps 1 --eval-every 0 --save-every 0 \
  > $R/self.log 2>&1
date +%s > $R/t_regen2
for i in $(seq 120); do  # round 2's answers come by a separate call
  [ -f /tmp/data/regen_recipe.jsonl.gz ] && [ -f /tmp/data/regen_self.jsonl.gz ] && break
  sleep 5
done
zcat /tmp/data/regen_recipe.jsonl.gz > $R/regen/regenerated.jsonl
zcat /tmp/data/regen_self.jsonl.gz > $R/self/regenerated.jsonl
$S --data $R/regen/regenerated.jsonl $R/self/regenerated.jsonl $R/self2/regenerated.jsonl \
  --no-regenerate --init-from /tmp/src_r3/specscope/drafts/smollm2_135m_instruct --out $R/train \
  --epochs 100 --max-steps $TRAIN_STEPS --lr 5e-4 --warmup-ratio 0.01 --eval-every 1000 \
  --save-every 1000 --budget-minutes $TRAIN_MIN > $R/train.log 2>&1
date +%s > $R/t_train
touch $R/DONE
