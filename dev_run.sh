#!/bin/bash
# session-5 device call: decode.py (the issue-15 deliverable) after the kernel changes
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/fla_core-0.6.0-py3-none-any.whl .whl/flash_linear_attention-0.6.0-py3-none-any.whl
export PYTHONPATH=/tmp/site:$PWD TRITON_INTERPRET=0
mkdir -p $OUT
timeout 560 python3 benchmarks/decode.py --ref-seqs 16 --reps 30 --emulation benchmarks/results/emulation_h200.json --out $OUT/decode_h200.json > $OUT/decode.log 2>&1
echo rc=$?
tail -30 $OUT/decode.log
