"""Compile the replay kernels of one decode operation for sm_90 on a machine without a GPU, and
report what the compiler made of them: registers, stack, shared memory, and static SASS
instruction counts per opcode and per source line (docs/kernels-replay.md, "Eighth pass").

No kernel is launched. A stand-in Triton driver reports an sm_90 (Hopper) target, and every
``JITFunction.run`` compiles as a warmup (no launch), so the operation's host code runs on CPU
tensors of the benchmark geometry (B = 2) with outputs left unwritten; the kernels it compiles
are disassembled with Triton's own ``nvdisasm -g`` (source lines) and ``cuobjdump
-res-usage``. Static counts are not executed counts (loops over record slots count once), but
they compare variants of straight-line tile code well, before device time is spent.

Written against Triton 3.9's ``triton.runtime.driver.set_active`` and ``JITFunction.run``
(internals: another Triton version may need changes). Needs Triton's bundled CUDA tools
(``triton/backends/nvidia/bin``; Linux x86-64 wheels ship them).

Usage::

    python benchmarks/sass_static.py --model gdn --policy nvfp4 --op flush [--top 25]
    python benchmarks/sass_static.py --model gdn --policy nvfp4 --op step [--e2m1 integer]
    python benchmarks/sass_static.py --quant-spec fp16+sr   # a quantizer kernel instead
    python benchmarks/sass_static.py --pair fp16+sr,nvfp4 --pair-form lean --loops
    python benchmarks/sass_static.py --model mamba2 --op step --sm 80   # for an A100

``--pair PLAIN,SCALED`` compiles ``pack_pair_triton`` (the split flush's pair cast) on a
``[4, 64, 128]`` tensor with a seed above 2^32, as the flush passes (a seed of 1 would be
specialised by Triton to a constant and change the Philox code), in the form ``--pair-form``.
``--loops`` adds, per loop of each kernel (a backward branch spanning at least 200
instructions), its static instruction count and that count per jit function of
``kernels/quant.py`` (the lines' enclosing ``def``): what the twenty-seventh pass counted.

``SASS_DUMP=FILE`` appends each kernel's disassembly to FILE.
"""

from __future__ import annotations

import argparse
import ast
import collections
import contextlib
import os
import re
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"  # before triton is imported: real compilation
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

KERNELS = ("_flush_kernel", "_records_kernel", "_key_products_kernel", "_fold_coeffs_kernel",
           "_nvfp4_read_kernel", "_x_int_kernel", "_step_out_kernel", "_f32_read_kernel",
           "_f32_step_kernel", "_nvfp4_step_kernel")
SM = 90  # the compute capability compiled for (--sm)
_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


class _Sm90Driver:
    """The parts of a Triton driver that compiling asks for, reporting an sm_90 device (or
    the capability ``SM`` names)."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", SM, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")


@contextlib.contextmanager
def _compiling():
    """Within: an sm_90 stand-in driver, and every ``JITFunction.run`` compiles (warmup, no
    launch), appending ``(kernel name, compiled)`` to the yielded list."""
    compiled = []
    real_run = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        k = real_run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.fn.__name__, k))
        return k

    driver.set_active(_Sm90Driver())
    JITFunction.run = run
    try:
        yield compiled
    finally:
        JITFunction.run = real_run


def compile_operation(model: str, policy: str, op: str, e2m1: str | None = None,
                      records_options: dict | None = None, flush_options: dict | None = None):
    """Run ``op`` (flush | step | verify) of ``benchmarks/decode.py`` under ``policy`` on CPU
    tensors with every launch turned into a compile; returns ``[(kernel name, compiled)]``.
    ``e2m1``: the records kernel's E2M1 decoder where its launch leaves the choice to the
    device: None for CUDA's default (``"lookup"``; ``"half"`` with ``use_dot="f16x3"``),
    although the tensors here are on the CPU, or one of ``"lookup"``, ``"integer"``,
    ``"half"`` (nvfp4 only); a launch that names its decoder keeps it.
    ``records_options``: launch options given to every ``records_outputs`` call in place of
    the wrappers' (e.g. ``{"use_dot": "f16x3"}``). ``flush_options``: launch options of the
    flush call (``op="flush"``; e.g. ``{"anchor_tma": True}``)."""
    from replayssm_quant.kernels.replay import flush, records

    real_choice, real_outputs = records._e2m1_mode, records.records_outputs
    real_checks = records._check_devices, flush._check_devices
    real_cvt = records._e4m3_cvt_runs

    def choice(e2m1_decode, device, ptx_default="lookup"):
        return (e2m1 or ptx_default) if e2m1_decode is None else e2m1_decode

    def outputs(*a, **kw):
        return real_outputs(*a, **{**kw, **(records_options or {})})

    def no_check(where, **tensors):  # the tensors are on the CPU here by design
        return None

    records._e2m1_mode, records.records_outputs = choice, outputs
    records._check_devices = flush._check_devices = no_check
    # the device-side range checks: their flag is written by a launch that only compiles here,
    # so torch._assert_async would read uninitialised memory (a flaky host error)
    real_ranges = flush._assert_ranges, records._assert_ranges
    flush._assert_ranges = records._assert_ranges = lambda *a, **k: None
    records._e4m3_cvt_runs = lambda device: SM >= 89  # as a CUDA device of capability SM
    try:
        return _compile_operation(model, policy, op, flush_options)
    finally:
        records._e2m1_mode, records.records_outputs = real_choice, real_outputs
        records._check_devices, flush._check_devices = real_checks
        flush._assert_ranges, records._assert_ranges = real_ranges
        records._e4m3_cvt_runs = real_cvt


def _compile_operation(model: str, policy: str, op: str, flush_options: dict | None = None):
    with _compiling() as compiled:
        import decode as dc
        import replay_kernels as rk

        from replayssm_quant.policy import StatePolicy
        from replayssm_quant.quant import pack

        rk.DEV = dc.DEV = "cpu"
        dc.pack = lambda *a, backend=None, **k: pack(*a, backend="torch", **k)
        geo = {"gdn": (32, 16, 128, 128, 16), "mamba2": (128, 1, 64, 128, 16)}[model]
        B, T = 2, 8
        M = rk.Model(model, B, *geo)
        pol = StatePolicy.parse(dc.POLICIES.get(policy, policy))
        st = dc.make_set(M, torch.Generator().manual_seed(0), pol, T, False)
        compiled.clear()
        try:
            if op == "flush":
                # the fused flush (the decode default splits matrix-scaled casts out of it)
                dc.run_flush(M, st, pol, {**dc.flush_args(M, st), "split_casts": False,
                                          **(flush_options or {})})
            elif op == "step":
                dc.run_step(M, st, torch.full((B,), min(7, M.L - 2), dtype=torch.int64))
            else:
                dc.run_verify(M, st, torch.full((B,), M.L - T, dtype=torch.int64))
        except triton.CompilationError:
            raise
        except Exception as e:  # host code after the (unlaunched) kernels may fail; keep them
            print(f"note: host code after the compiles raised {type(e).__name__}: {e}"[:300])
    return compiled


SEED = 0x1234_5678_9ABC  # the benchmarks' seed: above 2^32, as a flush passes it (a seed of 1
# would be specialised by Triton to a compile-time constant, which changes the Philox code)


def _compile_call(call):
    """Run ``call()`` (host code that launches kernels) under :func:`_compiling`: every kernel
    compiles, none launches; returns ``[(kernel name, compiled)]``. An exception from host
    code after the (unlaunched) kernels is reported and the compiles kept."""
    with _compiling() as compiled:
        try:
            call()
        except triton.CompilationError:
            raise
        except Exception as e:
            print(f"note: host code after the compiles raised {type(e).__name__}: {e}"[:300])
    return compiled


def compile_quantizer(spec: str):
    """Compile ``pack_triton`` of ``spec`` for a ``[4, 128, 128]`` tensor (the quantizer kernels
    of the split flush's casts) without launching; returns ``[(kernel name, compiled)]``.
    (Until 2026-12-04 with seed 1, specialised to a constant: SR kernels' counts from before
    then are a little lower than a flush's.)"""
    from replayssm_quant.kernels.quant import pack_triton

    return _compile_call(lambda: pack_triton(torch.zeros(4, 128, 128), spec, seed=SEED,
                                             stream=torch.arange(4)))


def compile_pair(plain: str, scaled: str, form: str):
    """Compile ``pack_pair_triton(x, plain, scaled, form=form)`` for a ``[4, 64, 128]`` tensor
    (Mamba-2's matrices) with :data:`SEED` and distinct stream keys, without launching;
    returns ``[(kernel name, compiled)]``."""
    from replayssm_quant.kernels.quant import pack_pair_triton

    keys = torch.arange(4, dtype=torch.int64) * 0x1_0000_0001 + 17
    return _compile_call(lambda: pack_pair_triton(
        torch.zeros(4, 64, 128), plain, scaled, seed=SEED, plain_stream=keys,
        scaled_stream=keys + 5, form=form))


def _functions(path: str) -> dict:
    """Line number -> name of the enclosing top-level ``def`` of a Python source file."""
    names, cur = {}, "?"
    with open(path) as f:
        for i, line in enumerate(f, 1):
            m = re.match(r"def (\w+)", line)
            if m:
                cur = m.group(1)
            names[i] = cur
    return names


def loop_report(sass: str, min_size: int = 200) -> list:
    """Per loop of a disassembly (``nvdisasm -g``; a backward branch spanning at least
    ``min_size`` instructions): ``{"instructions": n, "functions": {name: n}}``, the
    instructions attributed to the jit function whose source line they carry (files of the
    ``replayssm_quant`` package; others by file name)."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, ln in enumerate(lines)
              if (m := re.match(r"^(\.L_x_\d+):", ln))}
    srcs: dict = {}
    loops = []
    for i, ln in enumerate(lines):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", ln)
        if not (m and m.group(1) in labels and labels[m.group(1)] < i):
            continue
        count, funcs, fn = 0, collections.Counter(), "?"
        for body in lines[labels[m.group(1)]:i + 1]:
            f = re.search(r'File "([^"]+)", line (\d+)', body)
            if f:
                path, no = f.group(1), int(f.group(2))
                if "replayssm_quant" in path and os.path.exists(path):
                    if path not in srcs:
                        srcs[path] = _functions(path)
                    fn = srcs[path].get(no, "?")
                else:
                    fn = os.path.basename(path)
                continue
            if re.match(r"\s*/\*[0-9a-f]+\*/\s+", body):
                count += 1
                funcs[fn] += 1
        if count >= min_size:
            loops.append({"instructions": count, "functions": dict(funcs.most_common())})
    return loops


def sass_report(cubin: bytes, top: int) -> dict:
    """Resource usage and static SASS counts (per opcode, per source line) of a cubin."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        res = subprocess.run([os.path.join(_BIN, "cuobjdump"), "-res-usage", path],
                             capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([os.path.join(_BIN, "nvdisasm"), "-g", "-c", path],
                              capture_output=True, text=True, check=True).stdout
    if os.environ.get("SASS_DUMP"):  # the disassembly itself, appended to that file
        with open(os.environ["SASS_DUMP"], "a") as f:
            f.write(sass)
    ops, lines = collections.Counter(), collections.Counter()
    loc = "?"
    for line in sass.splitlines():
        f = re.search(r'File "([^"]+)", line (\d+)', line)
        if f:
            loc = f"{os.path.basename(f.group(1))}:{f.group(2)}"
            continue
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m:
            ops[m.group(2)] += 1
            lines[loc] += 1
    usage = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", res))
    usage.pop("SHARED", None)  # cuobjdump's static figure; Triton's allocation is dynamic
    return {"instructions": sum(ops.values()), "usage": {k: int(v) for k, v in usage.items()},
            "opcodes": dict(ops.most_common(top)), "lines": dict(lines.most_common(top)),
            "loops": loop_report(sass)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("gdn", "mamba2"), default="gdn")
    ap.add_argument("--policy", default="nvfp4",
                    help="fp32, nvfp4 (read:nvfp4/rec:fp16+sr) or a policy string")
    ap.add_argument("--op", choices=("flush", "step", "verify"), default="flush")
    ap.add_argument("--top", type=int, default=25, help="opcodes and source lines listed")
    ap.add_argument("--e2m1", choices=("lookup", "integer", "half"), default=None,
                    help="E2M1 decoder of the records kernel where the launch leaves it to the "
                         "device (default: CUDA's choice, lookup, or half with "
                         "use_dot='f16x3'): lookup, integer (the interpreter's) or half "
                         "(packed float16 pairs; nvfp4 copies)")
    ap.add_argument("--records-option", action="append", default=[], metavar="KEY=VALUE",
                    help="a launch option of every records_outputs call, in place of the "
                         "wrappers' (verify's anchor launch included, which may compile a "
                         "variant that never runs; a Python literal or a string), e.g. "
                         "use_dot=f16x3; repeatable")
    ap.add_argument("--flush-option", action="append", default=[], metavar="KEY=VALUE",
                    help="with --op flush: a launch option of the flush call (a Python literal "
                         "or a string), e.g. anchor_tma=True, block_v=16, or split_casts=True "
                         "(the fused flush is compiled otherwise); repeatable")
    ap.add_argument("--sm", type=int, default=90,
                    help="compute capability to compile for, as major * 10 + minor (default "
                         "90, the H200's; e.g. 80 for an A100)")
    ap.add_argument("--quant-spec", default=None,
                    help="instead of a decode operation: the quantizer kernel of pack_triton for "
                         "this format (e.g. fp16+sr, nvfp4), on a [4, 128, 128] tensor")
    ap.add_argument("--pair", default=None, metavar="PLAIN,SCALED",
                    help="instead of a decode operation: pack_pair_triton's kernel for these two "
                         "specs (e.g. fp16+sr,nvfp4) on a [4, 64, 128] tensor")
    ap.add_argument("--pair-form", default="generic",
                    help="pack_pair_triton's form with --pair (generic, lean, lean_rcp)")
    ap.add_argument("--loops", action="store_true",
                    help="also list each loop's static instructions per jit function")
    args = ap.parse_args(argv)
    global SM
    if args.sm < 70:
        ap.error(f"--sm must be a compute capability of at least 70 (e.g. 80, 89, 90), got "
                 f"{args.sm}")
    SM = args.sm
    if args.top < 1:
        ap.error(f"--top must be >= 1, got {args.top}")
    options, flush_options = {}, {}
    for flag, items, into in (("--records-option", args.records_option, options),
                              ("--flush-option", args.flush_option, flush_options)):
        for item in items:
            key, eq, text = item.partition("=")
            if not eq or not key.isidentifier():
                ap.error(f"{flag} must be KEY=VALUE, got {item!r}")
            try:
                into[key] = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                into[key] = text
    if flush_options and args.op != "flush":
        ap.error(f"--flush-option applies to --op flush, got --op {args.op}")
    taken = {"length", "sequence_ids", "flush_index", "seed", "layer", "q",
             "store_state", "dequantize", "u_cached", "fold_cached_corrections", "return_w"}
    if taken & set(flush_options):
        ap.error(f"--flush-option cannot set {sorted(taken & set(flush_options))}: the "
                 f"compiled call sets them (the decode benchmark's serving flush)")
    if args.quant_spec is not None:
        from replayssm_quant.formats import parse_spec

        try:
            if parse_spec(args.quant_spec).is_identity:
                ap.error(f"--quant-spec: {args.quant_spec} has no quantizer kernel")
        except ValueError as e:
            ap.error(f"--quant-spec: {e}")
    import decode as dc

    from replayssm_quant.policy import StatePolicy

    try:
        StatePolicy.parse(dc.POLICIES.get(args.policy, args.policy))
    except ValueError as e:
        ap.error(f"--policy: {e}")
    for tool in ("ptxas", "nvdisasm", "cuobjdump"):
        if not os.path.exists(os.path.join(_BIN, tool)):
            sys.exit(f"sass_static.py needs Triton's bundled {tool} (not found in {_BIN})")
    if args.pair is not None:
        from replayssm_quant.kernels.quant import PAIR_FORMS, pair_casts

        specs = args.pair.split(",")
        if len(specs) != 2:
            ap.error(f"--pair must be PLAIN,SCALED (e.g. fp16+sr,nvfp4), got {args.pair!r}")
        if args.pair_form not in PAIR_FORMS:
            ap.error(f"--pair-form must be one of {PAIR_FORMS}, got {args.pair_form!r}")
        try:
            ok = pair_casts(*specs)
        except ValueError as e:
            ap.error(f"--pair: {e}")
        if not ok:
            ap.error(f"--pair: pack_pair_triton casts to (fp32 or an unscaled format, nvfp4), "
                     f"got {args.pair!r}")
        kernels = compile_pair(specs[0], specs[1], args.pair_form)
    elif args.quant_spec is not None:
        kernels = compile_quantizer(args.quant_spec)
        if not kernels:
            sys.exit(f"no quantizer kernel was compiled for {args.quant_spec!r} (fp32 has none)")
    else:
        kernels = [(n, k) for n, k in compile_operation(args.model, args.policy, args.op,
                                                          args.e2m1, options, flush_options)
                   if n in KERNELS]
    if not kernels:
        sys.exit(f"no replay kernel ({', '.join(KERNELS)}) was compiled for {args.model} "
                 f"{args.policy} {args.op}")
    for i, (name, k) in enumerate(kernels):
        r = sass_report(k.asm["cubin"], args.top)
        shared = getattr(getattr(k, "metadata", None), "shared", None)
        print(f"launch {i}: {name}: {r['instructions']} static SASS instructions, "
              f"{r['usage']}, shared memory {shared} bytes")
        print("  opcodes:", ", ".join(f"{o} {c}" for o, c in r["opcodes"].items()))
        for loc, c in r["lines"].items():
            print(f"  {c:6d}  {loc}")
        if args.loops:
            for j, lp in enumerate(r["loops"]):
                print(f"  loop {j}: {lp['instructions']} instructions: "
                      + ", ".join(f"{f} {c}" for f, c in lp["functions"].items()))


if __name__ == "__main__":
    main()
