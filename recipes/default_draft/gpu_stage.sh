#!/usr/bin/env bash
# Brings the default model and the earlier rounds' answers onto the warm H200 machine over
# back-to-back device calls (each call carries at most 64 MiB), and starts a round:
#   call 1: carry [.stage/a, .whl]  bash recipes/default_draft/gpu_stage.sh a
#   call 2: carry [.stage/b]        bash recipes/default_draft/gpu_stage.sh b
#   call 3: carry [.stage/c]        ROUND=6 bash recipes/default_draft/gpu_stage.sh c
#   call 4: carry [.stage/data_a]   bash recipes/default_draft/gpu_stage.sh data
#   call 5: carry [.stage/data_b]   bash recipes/default_draft/gpu_stage.sh data; then gpu_watch.sh
# .stage/{a,b,c}/part0{0,1,2} are `split -n 3 -d SmolLM2-135M-Instruct.Q4_1.gguf`; .whl holds
# the gguf wheel; .stage/data_a holds regen_{recipe,self,self2}.jsonl.gz and .stage/data_b
# regen_{self3,self4}.jsonl.gz (round 5 carried all four of its sets in one .stage/data).
# Call 1 also starts benchmarks/ttt_step.py in the background (dense against sdpa TTT
# attention on this GPU, while the GPU is otherwise idle); call 3 reads it to choose the
# round's --ttt-attention and sizes MAX_STEPS to the measured step time and TRAIN_MIN.
set -eu
mkdir -p /tmp/parts /tmp/data
case "$1" in
  a)
    cp .stage/a/part00 /tmp/parts/
    pip install --no-deps --target /tmp/site -q .whl/*.whl 2>&1 | tail -n 2
    rm -rf /tmp/src_b /tmp/bench_b && cp -r src /tmp/src_b && cp -r benchmarks /tmp/bench_b
    (cd /tmp && setsid nohup env PYTHONPATH=/tmp/src_b python3 /tmp/bench_b/ttt_step.py \
      --device cuda --shape smollm2-135m --out /tmp/ttt.json > /tmp/ttt.out 2>&1 < /dev/null &)
    ;;
  b)
    cp .stage/b/part01 /tmp/parts/
    cat /tmp/ttt.out || true
    ;;
  c)
    cp .stage/c/part02 /tmp/parts/
    cat /tmp/parts/part00 /tmp/parts/part01 /tmp/parts/part02 > /tmp/smol.gguf
    md5sum /tmp/smol.gguf
    for i in $(seq 60); do [ -f /tmp/ttt.json ] && break; sleep 2; done
    cat /tmp/ttt.out
    ROUND=${ROUND:-6}
    GPUS=$(nvidia-smi -L | wc -l)
    if [ "$ROUND" = 5 ]; then TRAIN_MIN=${TRAIN_MIN:-16.5}
    elif [ "$GPUS" -gt 1 ]; then TRAIN_MIN=${TRAIN_MIN:-16}  # after 7 min of regeneration
    else TRAIN_MIN=${TRAIN_MIN:-24}; fi  # one GPU: no regeneration, the budget trains
    # Round 5's dense run took 0.153 s per real step (evaluations included) after about 90 s
    # of loading; a faster mode scales that by its measured ratio to dense. Round 6 planned
    # 0.103 s from a benchmark whose modes shared their lengths (sdpa, second, found the
    # target's shapes warm) and ran 0.145 s; ttt_step.py now gives each mode its own.
    read -r MODE STEPS < <(python3 -c "
import json
r = json.load(open('/tmp/ttt.json'))['results']
d, s = r['dense']['step_ms'], r['sdpa']['step_ms']
mode = 'sdpa' if s < 0.95 * d else 'dense'
real = max(153.0 * r[mode]['step_ms'] / d, 80.0) / 1e3  # round 5 ran at 0.81x the benchmark
print(mode, int(($TRAIN_MIN * 60 - 90) / real))" || echo dense $(python3 -c "print(int(($TRAIN_MIN * 60 - 90) / 0.153))"))
    echo "round $ROUND on $GPUS GPU(s): --ttt-attention $MODE, MAX_STEPS $STEPS, TRAIN_MIN $TRAIN_MIN"
    (setsid nohup env TTT_ATTENTION=$MODE MAX_STEPS=$STEPS TRAIN_MIN=$TRAIN_MIN \
      MAX_ANSWER_TOKENS=${MAX_ANSWER_TOKENS:-} \
      bash recipes/default_draft/gpu_round$ROUND.sh > /tmp/round.out 2>&1 < /dev/null &)
    sleep 20; cat /tmp/round.out; cat /tmp/round/plan 2>/dev/null || true
    ;;
  data)
    for f in .stage/data*/regen_*.jsonl.gz; do
      cp "$f" "/tmp/data/$(basename "$f").tmp" && mv "/tmp/data/$(basename "$f").tmp" "/tmp/data/$(basename "$f")"
    done
    ls -la /tmp/data
    ;;
  *) echo "usage: gpu_stage.sh a|b|c|data" >&2; exit 2 ;;
esac
