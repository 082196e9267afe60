#!/usr/bin/env bash
# Watch a round (gpu_round2.sh … gpu_round5.sh) for up to $1 seconds (default 540) and bring back what exists under $OUT:
# the regenerated data (once both regenerations are done), training metrics and logs, and,
# when the round is DONE, the exported draft (safetensors split in two, md5) and the
# engine-walk accept length of the draft on the built-in evaluation sets.
set -u
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
R=/tmp/round
end=$(( $(date +%s) + ${1:-540} ))
while [ "$(date +%s)" -lt $end ] && [ ! -f $R/DONE ]; do sleep 15; done
for f in $R/t0 $R/t_regen1 $R/t_regen2 $R/t_train; do [ -f $f ] && echo "$f $(cat $f)"; done
for f in $R/plan $R/regen.log $R/self.log $R/self5.log $R/self6.log $R/train_ddp.log $R/train.log $R/train2.log; do
  [ -f $f ] && { echo "== $f"; tr '\r' '\n' < $f | grep -v '^$' | tail -n 12; }
done
if [ -f $R/t_regen2 ] && [ ! -f $R/data_sent ]; then  # once: the round's new answers
  # the round's new sets: NEW, else the round's own list (round 6), else round 5's self4
  for n in ${NEW:-$(cat $R/new_sets 2>/dev/null || echo self4)}; do
    [ -f $R/$n/regenerated.jsonl ] || continue
    gzip -c $R/$n/regenerated.jsonl > /tmp/$n.jsonl.gz
    split -b 15M -d /tmp/$n.jsonl.gz $OUT/$n.jsonl.gz.part  # files back are <= 16 MB each
  done
  touch $R/data_sent
  ls -la $OUT
fi
[ -f $R/train/metrics.jsonl ] && cp $R/train/metrics.jsonl $OUT/metrics.jsonl
F=$R/train/draft
[ -f $R/train2/draft/model.safetensors ] && F=$R/train2/draft  # the low-lr finish, when run
if [ -f $R/DONE ] && [ -f $F/model.safetensors ] && [ ! -f $R/draft_sent ]; then
  cp $F/config.json $OUT/config.json
  split -n 2 -d $F/model.safetensors $OUT/model.safetensors.part
  md5sum $F/model.safetensors
  touch $R/draft_sent
fi
# The walk comes after the draft is back, in a call of its own (WALK=1), so a call cut short
# by the device budget cannot cost the draft.
if [ -f $R/DONE ] && [ -f $F/model.safetensors ] && [ "${WALK:-0}" = 1 ]; then
  python3 recipes/default_draft/walk_tau.py --target /tmp/smol.gguf --draft $F \
    --device cuda --cache-dir /tmp/sscache 2>&1 | tee $OUT/walk_tau.log
fi
