#!/usr/bin/env bash
# The default draft's device round (docs/training.md), run detached (setsid) so it goes on
# between device calls: regenerate the rest of the recipe prompts, have the target write
# SELF_PROMPTS requests of its own (Magpie) and answer them, then train on everything.
# Needs: /tmp/smol.gguf (the default GGUF), /tmp/site (gguf wheel), /tmp/data/prompts.jsonl
# (make_prompts.py) and optionally /tmp/data/regenerated.jsonl.gz (an earlier partial run).
# Progress: /tmp/round/*.log; /tmp/round/DONE when finished.
set -u
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
R=/tmp/round
mkdir -p $R/regen
SELF_PROMPTS=${SELF_PROMPTS:-30000}
TRAIN_STEPS=${TRAIN_STEPS:-4000}
TRAIN_MIN=${TRAIN_MIN:-13}
S="python3 -m specscope.cli train-draft --target /tmp/smol.gguf --cache-dir /tmp/sscache --max-len 1024 --batch-tokens 16384"
[ -f /tmp/data/regenerated.jsonl.gz ] && [ ! -s $R/regen/regenerated.jsonl ] && \
  zcat /tmp/data/regenerated.jsonl.gz > $R/regen/regenerated.jsonl
date +%s > $R/t0
$S --data /tmp/data/prompts.jsonl --out $R/regen --regen-max-new-tokens 512 \
  --regen-batch-size 512 --max-steps 1 --eval-every 0 --save-every 0 > $R/regen.log 2>&1
date +%s > $R/t_regen1
$S --self-prompts $SELF_PROMPTS --out $R/self --regen-max-new-tokens 512 \
  --regen-batch-size 512 --max-steps 1 --eval-every 0 --save-every 0 > $R/self.log 2>&1
date +%s > $R/t_regen2
$S --data $R/regen/regenerated.jsonl $R/self/regenerated.jsonl --no-regenerate --out $R/train \
  --epochs 100 --max-steps $TRAIN_STEPS --lr 1e-3 --eval-every 1000 --save-every 1000 \
  --budget-minutes $TRAIN_MIN > $R/train.log 2>&1
date +%s > $R/t_train
touch $R/DONE
