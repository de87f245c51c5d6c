"""Launch each of GDN's three CUDA C++ decode kernels at ``decode.py``'s B = 256 geometry (32
value heads, 16 key heads, 128 x 128, L = 16, T = 8), each case twice (the first warms), for
Nsight Compute to profile every launch; ``--summarize`` then reads ncu's CSV and reports, per
case, the second launch's time, DRAM and SM throughput (% of peak), achieved occupancy and
warps issued per scheduler per cycle (issue 15: which kernels will scale with the H200's 1.4x
bandwidth and which will not; docs/kernels-replay.md, fifty-second pass).

Cases, in launch order (two launches each): the step at ring positions 0, 7 and 14 from an
FP32 and from an NVFP4 read copy (``gdn_step.cu``, default stages); verify under ``fp32`` at
starts 0 and 8 (``gdn_verify.cu``); the flush of ``read:nvfp4/rec:fp16+sr`` in its serving
form (``gdn_flush.cu``, the default variant).

Usage (on the device)::

    ncu --clock-control none --csv --page details \\
        --kernel-name regex:'step_kernel|verify_kernel|flush_tc_kernel' \\
        --section SpeedOfLight --section Occupancy --section SchedulerStats \\
        python3 benchmarks/cuda_kernels_ncu.py --labels $OUT/labels.json > $OUT/ncu.csv
    python3 benchmarks/cuda_kernels_ncu.py --summarize $OUT/ncu.csv --labels $OUT/labels.json \\
        --out $OUT/cuda_kernels_ncu.json
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

#: ncu metrics read by --summarize (the SpeedOfLight, Occupancy and SchedulerStats sections)
METRICS = {
    "Duration": "time_us",
    "DRAM Throughput": "dram_pct",
    "Compute (SM) Throughput": "sm_pct",
    "Achieved Occupancy": "occupancy_pct",
    "Issued Warp Per Scheduler": "issued_per_scheduler",
}


def cases():
    """The (label, policy, op, argument) cases in launch order."""
    out = []
    for pol, name in (("fp32", "fp32"), ("read:nvfp4/rec:fp16+sr", "nvfp4")):
        out += [(f"step_{name}_h{h}", pol, "step", h) for h in (0, 7, 14)]
    out += [(f"verify_fp32_start{s}", "fp32", "verify", s) for s in (0, 8)]
    out.append(("flush_nvfp4_sr", "read:nvfp4/rec:fp16+sr", "flush", None))
    return out


def launch(labels_path: str) -> None:
    import torch

    import decode as dc
    import replay_kernels as rk
    from replayssm_quant.policy import StatePolicy

    if not torch.cuda.is_available():
        raise SystemExit("cuda_kernels_ncu.py launches CUDA kernels; run it on the device")
    dc.GDN_STEP = dc.GDN_FLUSH = dc.GDN_VERIFY = "cuda"
    M = rk.Model("gdn", 256, 32, 16, 128, 128, 16)
    sets, labels = {}, []
    for label, pol, op, arg in cases():
        if pol not in sets:
            p = StatePolicy.parse(pol)
            sets[pol] = (p, dc.make_set(M, torch.Generator(device="cuda").manual_seed(5), p, 8,
                                        False))
        p, st = sets[pol]
        for _ in range(2):
            if op == "step":
                ring = {n: t.clone() for n, t in st["ring"].items()}  # the step appends
                dc.run_step(M, dict(st, ring=ring),
                            torch.full((M.B,), arg, dtype=torch.int64, device="cuda"))
            elif op == "verify":
                dc.run_verify(M, st, torch.full((M.B,), arg, dtype=torch.int64, device="cuda"))
            else:
                dc.run_flush(M, st, p, dc.flush_args(M, st))
            torch.cuda.synchronize()
            labels.append(label)
    Path(labels_path).write_text(json.dumps(labels))


def _num(text: str) -> float:
    return float(text.replace(",", ""))


def summarize(csv_path: str, labels_path: str) -> dict:
    """Per case, the second launch's metrics (:data:`METRICS`; Duration in us) from ncu's
    ``--csv --page details`` output, matched to the launches by order; raises ValueError if
    ncu profiled a different number of launches than the driver made."""
    labels = json.loads(Path(labels_path).read_text())
    text = Path(csv_path).read_text()
    text = text[text.index('"ID"'):] if '"ID"' in text else text
    rows = list(csv.DictReader(io.StringIO(text)))
    by_id: dict[str, dict] = {}
    for r in rows:
        m = r.get("Metric Name")
        if m in METRICS:
            d = by_id.setdefault(r["ID"], {"kernel": r["Kernel Name"].split("(")[0]})
            v = _num(r["Metric Value"])
            if m == "Duration":
                unit = r.get("Metric Unit", "")
                scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3,
                         "msecond": 1e3}
                if unit not in scale:
                    raise ValueError(f"ncu's Duration unit {unit!r}: expected one of {sorted(scale)}")
                v *= scale[unit]
            d[METRICS[m]] = v
    ids = sorted(by_id, key=int)
    if len(ids) != len(labels):
        raise ValueError(f"ncu profiled {len(ids)} launches, the driver made {len(labels)}")
    out = {}
    for i, lab in zip(ids, labels):
        out[lab] = by_id[i]  # (the second launch of a case overwrites the first)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--labels", required=True, help="JSON list of the launches' case labels")
    ap.add_argument("--summarize", metavar="CSV", help="ncu's CSV to summarize (no launches)")
    ap.add_argument("--out", help="with --summarize: JSON path for the table")
    a = ap.parse_args(argv)
    if not a.summarize:
        launch(a.labels)
        return 0
    res = summarize(a.summarize, a.labels)
    for lab, d in res.items():
        dram = d.get("dram_pct", float("nan"))
        print(f"{lab:24s} {d.get('time_us', float('nan')):8.1f} us  DRAM {dram:5.1f} %  "
              f"SM {d.get('sm_pct', float('nan')):5.1f} %  occupancy "
              f"{d.get('occupancy_pct', float('nan')):5.1f} %  issued/scheduler "
              f"{d.get('issued_per_scheduler', float('nan')):.2f}  {d['kernel']}")
    if a.out:
        Path(a.out).write_text(json.dumps({"cases": res, "metrics": METRICS}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
