#!/usr/bin/env bash
# Round 5 of the default draft (docs/training.md): 40,000 more opener-seeded self-written
# prompts (seed 3, the 99 openers of openers_round5.txt), answered, then a continuation of the
# shipped draft (version 4) on everything answered so far: one cosine from lr 3e-4 to 3e-5 over
# MAX_STEPS steps, sized to the time budget, instead of round 4's cut cosine and separate
# low-learning-rate finish (whose second read of the data took most of its 4.6 minutes).
# Started by gpu_stage.sh once the target is on the machine; watch it with gpu_watch.sh.
# Needs /tmp/smol.gguf and /tmp/site (gguf wheel) at start; the answers of rounds 2-4
# (/tmp/data/regen_{recipe,self,self2,self3}.jsonl.gz, from .stage/data, 34 MB) may arrive by
# a later call, before the self prompts are answered. The sources are copied first, so later
# calls that bring a newer working tree cannot change the code under a running round.
set -u
rm -rf /tmp/src_r3 && cp -r src /tmp/src_r3
export PYTHONPATH=/tmp/site:/tmp/src_r3 PYTHONUNBUFFERED=1
R=/tmp/round
mkdir -p $R/regen $R/self $R/self2 $R/self3
SELF_PROMPTS=${SELF_PROMPTS:-40000}
TRAIN_MIN=${TRAIN_MIN:-16.5}
MAX_STEPS=${MAX_STEPS:-4700}  # about what fits in TRAIN_MIN at 0.17 s per step, after reading
# dense (reference) or sdpa: whichever benchmarks/ttt_step.py measured faster on this GPU
TTT_ATTENTION=${TTT_ATTENTION:-dense}
S="python3 -m specscope.cli train-draft --target /tmp/smol.gguf --cache-dir /tmp/sscache --max-len 1024 --batch-tokens 16384"
date +%s > $R/t0
date +%s > $R/t_regen1
$S --self-prompts $SELF_PROMPTS --self-prompt-temperature 1.0 --seed 3 --out $R/self4 \
  --self-prompt-openers recipes/default_draft/openers_round5.txt \
  --regen-max-new-tokens 512 --regen-batch-size 512 --max-steps 1 --eval-every 0 --save-every 0 \
  > $R/self.log 2>&1
date +%s > $R/t_regen2
for i in $(seq 120); do  # earlier rounds' answers come by a separate call
  n=0
  for f in recipe self self2 self3; do [ -f /tmp/data/regen_$f.jsonl.gz ] && n=$((n + 1)); done
  [ $n -eq 4 ] && break
  sleep 5
done
zcat /tmp/data/regen_recipe.jsonl.gz > $R/regen/regenerated.jsonl
for f in self self2 self3; do zcat /tmp/data/regen_$f.jsonl.gz > $R/$f/regenerated.jsonl; done
D="--data $R/regen/regenerated.jsonl $R/self/regenerated.jsonl $R/self2/regenerated.jsonl \
  $R/self3/regenerated.jsonl $R/self4/regenerated.jsonl --no-regenerate \
  --ttt-attention $TTT_ATTENTION"
$S $D --init-from /tmp/src_r3/specscope/drafts/smollm2_135m_instruct --out $R/train \
  --epochs 100 --max-steps $MAX_STEPS --lr 3e-4 --warmup-ratio 0.01 --eval-every 1000 \
  --save-every 1000 --budget-minutes $TRAIN_MIN > $R/train.log 2>&1
date +%s > $R/t_train
touch $R/DONE
