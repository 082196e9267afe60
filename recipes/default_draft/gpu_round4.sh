#!/usr/bin/env bash
# Round 4 of the default draft (planned; docs/training.md, "Not yet done"): self-written
# prompts seeded with openers (recipes/default_draft/openers.txt: writing, role-play,
# explanations), answered, then a continuation of the shipped draft (version 3) on everything
# answered so far. Run detached (setsid) and watch it with gpu_watch.sh (R=/tmp/round).
# Needs /tmp/smol.gguf and /tmp/site (gguf wheel) at start; the answers of rounds 2 and 3
# (/tmp/data/regen_{recipe,self,self2}.jsonl.gz, from .stage/data, 22 MB) may arrive by a
# later call, before the self prompts are answered. The sources are copied first, so later calls that
# bring a newer working tree cannot change the code under a running round.
set -u
rm -rf /tmp/src_r3 && cp -r src /tmp/src_r3
export PYTHONPATH=/tmp/site:/tmp/src_r3 PYTHONUNBUFFERED=1
R=/tmp/round
mkdir -p $R/regen $R/self $R/self2
SELF_PROMPTS=${SELF_PROMPTS:-40000}
TRAIN_STEPS=${TRAIN_STEPS:-6000}
TRAIN_MIN=${TRAIN_MIN:-12}
S="python3 -m specscope.cli train-draft --target /tmp/smol.gguf --cache-dir /tmp/sscache --max-len 1024 --batch-tokens 16384"
date +%s > $R/t0
date +%s > $R/t_regen1
$S --self-prompts $SELF_PROMPTS --self-prompt-temperature 1.0 --seed 2 --out $R/self3 \
  --self-prompt-openers recipes/default_draft/openers.txt \
  --regen-max-new-tokens 512 --regen-batch-size 512 --max-steps 1 --eval-every 0 --save-every 0 \
  > $R/self.log 2>&1
date +%s > $R/t_regen2
for i in $(seq 120); do  # earlier rounds' answers come by a separate call
  [ -f /tmp/data/regen_recipe.jsonl.gz ] && [ -f /tmp/data/regen_self.jsonl.gz ] && \
    [ -f /tmp/data/regen_self2.jsonl.gz ] && break
  sleep 5
done
zcat /tmp/data/regen_recipe.jsonl.gz > $R/regen/regenerated.jsonl
zcat /tmp/data/regen_self.jsonl.gz > $R/self/regenerated.jsonl
zcat /tmp/data/regen_self2.jsonl.gz > $R/self2/regenerated.jsonl
$S --data $R/regen/regenerated.jsonl $R/self/regenerated.jsonl $R/self2/regenerated.jsonl \
  $R/self3/regenerated.jsonl \
  --no-regenerate --init-from /tmp/src_r3/specscope/drafts/smollm2_135m_instruct --out $R/train \
  --epochs 100 --max-steps $TRAIN_STEPS --lr 3e-4 --warmup-ratio 0.01 --eval-every 1000 \
  --save-every 1000 --budget-minutes $TRAIN_MIN > $R/train.log 2>&1
date +%s > $R/t_train
touch $R/DONE
