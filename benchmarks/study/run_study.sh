#!/usr/bin/env bash
# The study of docs/results.md (issue 14): replayssm-kl runs of both embedded models under the
# 11 policies, windows L in {1, 4, 16, 64}, SR seeds {0, 1, 2}, then replayssm-report.
#
#   benchmarks/study/run_study.sh OUT NAME N MAX_DOCS STEPWISE_K [--state-error]
#
# SKIP_REPORT=1 leaves the report for later (replayssm-report reads buckets.parquet when
# positions.parquet is not kept).
#
# For each model the four windows run as four replayssm-kl processes writing into one output
# directory (each cell is its own part file, so they never collide); a last replayssm-kl call
# with every window then finds every cell done (resume) and writes the merged tables. The
# device commands that produced docs/results.md are in that file.
set -uo pipefail
OUT=$1; NAME=$2; N=$3; DOCS=$4; K=$5; shift 5
EXTRA=("$@")
KL=${REPLAYSSM_KL:-replayssm-kl}
REPORT=${REPLAYSSM_REPORT:-replayssm-report}
DEVICE=${DEVICE:-cuda}
ALL=(fp32 eager:fp8e4m3+sr shared:fp8e4m3+sr shared:fp8e4m3 shared:nvfp4+sr shared:nvfp4
     read:nvfp4/rec:fp32 read:nvfp4/rec:fp16+sr read:nvfp4/rec:fp16 read:nvfp4/rec:fp8e4m3+sr
     read:fp8e4m3/rec:fp32)
NOEAGER=("${ALL[@]:0:1}" "${ALL[@]:2}")  # eager runs with L = 1 whatever L is asked: once
mkdir -p "$OUT"
for m in tiny-gdn tiny-mamba2; do
  for L in 1 4 16 64; do
    if [ "$L" = 1 ]; then pols=("${ALL[@]}"); else pols=("${NOEAGER[@]}"); fi
    ( s=$(date +%s)
      $KL --model $m --policies "${pols[@]}" --windows $L --seeds 0 1 2 -N $N --max-docs $DOCS \
          --device $DEVICE --stepwise-check $K "${EXTRA[@]}" --no-progress -o "$OUT/$NAME-$m" \
          > "$OUT/log-$NAME-$m-L$L.txt" 2>&1
      echo "$m L=$L rc=$? wall_s=$(( $(date +%s) - s ))" >> "$OUT/walltimes-$NAME.txt" ) &
  done
done
wait
for m in tiny-gdn tiny-mamba2; do
  $KL --model $m --policies "${ALL[@]}" --windows 1 4 16 64 --seeds 0 1 2 -N $N --max-docs $DOCS \
      --device $DEVICE --stepwise-check $K "${EXTRA[@]}" --no-progress -o "$OUT/$NAME-$m" \
      > "$OUT/log-$NAME-$m-merge.txt" 2>&1
  echo "$m merge rc=$?" >> "$OUT/walltimes-$NAME.txt"
  if [ "${SKIP_REPORT:-0}" != 1 ]; then
    $REPORT "$OUT/$NAME-$m" -o "$OUT/report-$NAME-$m/report.md" >> "$OUT/log-$NAME-$m-merge.txt" 2>&1
  fi
done
cat "$OUT/walltimes-$NAME.txt"
