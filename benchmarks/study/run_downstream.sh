#!/usr/bin/env bash
# docs/results.md, downstream check (issue 14): an lm-eval task of the shipped long-context
# suite (TASK: kjv_longctx_mc, default -- multiple choice, context through the exact prefill --
# or kjv_longctx_ppl -- rolling log-likelihood, every token under the policy) at the context
# lengths CONTEXT_CHARS (characters; ~4 per token), under four state policies, both embedded
# models; then replayssm-bin-by-length by context length, paired against fp32.
#
#   TASK=kjv_longctx_ppl CONTEXT_CHARS="4000 16000" benchmarks/study/run_downstream.sh OUT [N_ITEMS]
set -uo pipefail
OUT=$1; ITEMS=${2:-16}
TASK=${TASK:-kjv_longctx_mc}
LMEVAL=${REPLAYSSM_LM_EVAL:-replayssm-lm-eval}
BIN=${REPLAYSSM_BIN:-replayssm-bin-by-length}
POLICIES=(fp32 shared:nvfp4 shared:nvfp4+sr read:nvfp4/rec:fp16+sr)
mkdir -p "$OUT"
for m in tiny-gdn tiny-mamba2; do
  for chars in ${CONTEXT_CHARS:-2000 8000}; do
    for p in "${POLICIES[@]}"; do
      d="$OUT/$TASK/$m/${p//[:\/+]/_}/c$chars"
      [ -n "$(ls "$d"/*/results_*.json 2>/dev/null)" ] && continue   # finished: resume
      mkdir -p "$d"; s=$(date +%s)
      $LMEVAL --model replayssm \
        --model_args "pretrained=$m,state=$p,window=16,seed=0" \
        --tasks $TASK --include_path evals/tasks --device cpu --batch_size 1 \
        --metadata "{\"context_chars\": $chars, \"n_items\": $ITEMS}" \
        --log_samples --output_path "$d" > "$d/lm_eval.log" 2>&1 \
        || echo "FAILED: $d (see $d/lm_eval.log)" >> "$OUT/walltimes.txt"
      echo "$TASK $m $p chars=$chars wall_s=$(( $(date +%s) - s ))" >> "$OUT/walltimes.txt"
    done
  done
  $BIN "$OUT/$TASK/$m"/*/c* --length context --tokenizer $m --baseline "fp32 L=16" \
      --bins 0 1024 2048 4096 8192 -o "$OUT/by_length_${TASK}_$m.csv"
done
