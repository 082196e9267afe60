#!/usr/bin/env bash
# Round 6 of the default draft (version 6, the shipped draft; docs/training.md), started by
# `ROUND=6 bash recipes/default_draft/gpu_stage.sh c`. It adapts to the GPUs it finds:
# - two or more: one self-prompt process per GPU (40,000 opener-seeded requests each, seeds
#   4, 5, …, written and answered at the same time), then data-parallel training over all
#   GPUs (torchrun), so a second of device budget buys twice the data and twice the steps;
# - one: no new prompts (SELF_PROMPTS=0 by default); the whole budget trains version 5
#   further on the five sets it was trained on, which tells whether rounds gain from more
#   training or from more data.
# Training: --init-from version 5 on every set answered so far, one cosine from lr 3e-4 to 3e-5
# over MAX_STEPS (gpu_stage.sh sizes it from the measured step time), TTT attention as
# benchmarks/ttt_step.py measured. Needs /tmp/smol.gguf and /tmp/site at start; the earlier
# answers (/tmp/data/regen_{recipe,self,self2,self3,self4}.jsonl.gz) may arrive later.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
rm -rf /tmp/src_r6 && cp -r src /tmp/src_r6
export PYTHONPATH=/tmp/site:/tmp/src_r6 PYTHONUNBUFFERED=1
R=/tmp/round
mkdir -p $R/regen $R/self $R/self2 $R/self3 $R/self4
GPUS=${GPUS:-$(nvidia-smi -L | wc -l)}
if [ "$GPUS" -gt 1 ]; then SELF_PROMPTS=${SELF_PROMPTS:-40000}; else SELF_PROMPTS=${SELF_PROMPTS:-0}; fi
TRAIN_MIN=${TRAIN_MIN:-15}
MAX_STEPS=${MAX_STEPS:-5000}
TTT_ATTENTION=${TTT_ATTENTION:-dense}
S="-m specscope.cli train-draft --target /tmp/smol.gguf --cache-dir /tmp/sscache --max-len 1024 --batch-tokens 16384"
echo "round 6: $GPUS GPU(s), $SELF_PROMPTS self prompts per GPU, $TRAIN_MIN min, $MAX_STEPS steps, $TTT_ATTENTION, max answer tokens ${MAX_ANSWER_TOKENS:-all}" > $R/plan
date +%s > $R/t0
date +%s > $R/t_regen1
NEW=""
if [ "$SELF_PROMPTS" -gt 0 ]; then
  pids=""
  for g in $(seq 0 $((GPUS - 1))); do
    n=$((5 + g)); NEW="$NEW self$n"; mkdir -p $R/self$n
    CUDA_VISIBLE_DEVICES=$g python3 $S --self-prompts $SELF_PROMPTS --self-prompt-temperature 1.0 \
      --seed $((4 + g)) --out $R/self$n --self-prompt-openers recipes/default_draft/openers_round5.txt \
      --regen-max-new-tokens 512 --regen-batch-size 512 --max-steps 1 --eval-every 0 \
      --save-every 0 > $R/self$n.log 2>&1 &
    pids="$pids $!"
  done
  wait $pids
fi
echo "$NEW" > $R/new_sets
date +%s > $R/t_regen2
for i in $(seq 120); do  # earlier rounds' answers come by separate calls
  n=0
  for f in recipe self self2 self3 self4; do [ -f /tmp/data/regen_$f.jsonl.gz ] && n=$((n + 1)); done
  [ $n -eq 5 ] && break
  sleep 5
done
zcat /tmp/data/regen_recipe.jsonl.gz > $R/regen/regenerated.jsonl
for f in self self2 self3 self4; do zcat /tmp/data/regen_$f.jsonl.gz > $R/$f/regenerated.jsonl; done
FILES="$R/regen/regenerated.jsonl"
for f in self self2 self3 self4 $NEW; do FILES="$FILES $R/$f/regenerated.jsonl"; done
if [ "$GPUS" -gt 1 ]; then L="python3 -m torch.distributed.run --nproc-per-node $GPUS"; else L=python3; fi
# MAX_ANSWER_TOKENS=256 trains only where a 256-token answer drafts (docs/training.md)
$L $S --data $FILES --no-regenerate --ttt-attention $TTT_ATTENTION \
  ${MAX_ANSWER_TOKENS:+--max-answer-tokens $MAX_ANSWER_TOKENS} \
  --init-from /tmp/src_r6/specscope/drafts/smollm2_135m_instruct --out $R/train \
  --epochs 100 --max-steps $MAX_STEPS --lr 3e-4 --warmup-ratio 0.01 --eval-every 1000 \
  --save-every 1000 --budget-minutes $TRAIN_MIN > $R/train.log 2>&1
rc=$?
if [ $rc -ne 0 ] && [ "$GPUS" -gt 1 ] && [ ! -f $R/train/draft/model.safetensors ]; then
  # data-parallel training failed (it had never run on GPUs before this round): train on one
  # GPU for what is left of the budget (its cosine sized at round 5's 0.153 s per dense
  # step, after about 90 s of loading), so the round still yields a draft
  left=$(python3 -c "import time; print(max(3.0, $TRAIN_MIN - (time.time() - $(cat $R/t_regen2)) / 60))")
  echo "torchrun failed (rc $rc); one GPU for $left min" >> $R/plan
  mv $R/train.log $R/train_ddp.log; rm -rf $R/train
  python3 $S --data $FILES --no-regenerate --ttt-attention $TTT_ATTENTION \
    ${MAX_ANSWER_TOKENS:+--max-answer-tokens $MAX_ANSWER_TOKENS} \
    --init-from /tmp/src_r6/specscope/drafts/smollm2_135m_instruct --out $R/train \
    --epochs 100 --max-steps $(python3 -c "print(int(($left * 60 - 90) / 0.153))") --lr 3e-4 --warmup-ratio 0.01 --eval-every 1000 \
    --save-every 1000 --budget-minutes $left > $R/train.log 2>&1
fi
date +%s > $R/t_train
# Version 6's finish: the cosine above was cut by its budget at lr 8.3e-5 (the steps ran at
# 0.145 s, not the 0.103 s planned), so a short cosine from 8e-5 to 8e-6 over round 6's new
# sets alone, which load in seconds. In the session it ran by hand, after the walk, from the
# same command; FINISH=0 skips it.
if [ "${FINISH:-1}" = 1 ] && [ -f $R/train/draft/model.safetensors ] && [ -n "$NEW" ]; then
  NEWFILES=""; for f in $NEW; do NEWFILES="$NEWFILES $R/$f/regenerated.jsonl"; done
  $L $S --data $NEWFILES --no-regenerate --ttt-attention $TTT_ATTENTION \
    --init-from $R/train/draft --out $R/train2 --epochs 10 --max-steps 450 --lr 8e-5 \
    --warmup-ratio 0.01 --eval-every 0 --save-every 0 --budget-minutes 2.7 > $R/train2.log 2>&1
fi
touch $R/DONE
