#!/usr/bin/env bash
# docs/results.md, downstream check (issue 14): lm-eval's kjv_longctx_mc (multiple choice: the
# true next words versus three from elsewhere in the same book) at two context lengths
# (CONTEXT_CHARS, default "2000 8000" characters: about 500 and 2,000 tokens) under four state
# policies, both embedded models, then replayssm-bin-by-length by context length.
#
#   benchmarks/study/run_downstream.sh OUT [N_ITEMS]
set -uo pipefail
OUT=$1; ITEMS=${2:-16}
LMEVAL=${REPLAYSSM_LM_EVAL:-replayssm-lm-eval}
BIN=${REPLAYSSM_BIN:-replayssm-bin-by-length}
POLICIES=(fp32 shared:nvfp4 shared:nvfp4+sr read:nvfp4/rec:fp16+sr)
mkdir -p "$OUT"
for m in tiny-gdn tiny-mamba2; do
  for chars in ${CONTEXT_CHARS:-2000 8000}; do
    for p in "${POLICIES[@]}"; do
      d="$OUT/$m/${p//[:\/+]/_}/c$chars"
      [ -n "$(ls "$d"/*/results_*.json 2>/dev/null)" ] && continue   # finished: resume
      mkdir -p "$d"; s=$(date +%s)
      $LMEVAL --model replayssm \
        --model_args "pretrained=$m,state=$p,window=16,seed=0" \
        --tasks kjv_longctx_mc --include_path evals/tasks --device cpu --batch_size 1 \
        --metadata "{\"context_chars\": $chars, \"n_items\": $ITEMS}" \
        --log_samples --output_path "$d" > "$d/lm_eval.log" 2>&1 || echo "FAILED: $d (see $d/lm_eval.log)" >> "$OUT/walltimes.txt"
      echo "$m $p chars=$chars wall_s=$(( $(date +%s) - s ))" >> "$OUT/walltimes.txt"
    done
  done
  $BIN "$OUT/$m"/*/c* --length context --tokenizer $m \
      --bins 0 1024 4096 -o "$OUT/by_length_$m.csv"
done
