"""Rewrite replayssm_quant/kernels/replay/records.py in place into a timing-only variant of
the records kernel (its results are wrong on purpose; restore the file after timing):
``noepi`` (the matrix form's epilogue replaced by a store of Y), ``nostream`` (C X replaced by
zeros: C is not read), ``nokeys`` (the products with the keys replaced by zeros), or several
joined by '+'. Run from the repository root; used by docs/kernels-replay.md, seventeenth
pass, item 5."""
import sys

PATH = "replayssm_quant/kernels/replay/records.py"
src = open(PATH).read()


def header(name):
    """The ``def`` line(s) of a jit function, up to its docstring."""
    a = src.index(f"def {name}(")
    return src[a:src.index('    """', a)]


BODIES = {
    "noepi": ("_matrix_outputs", """\
    keep = tl.sum(tl.sum(Z, axis=1), axis=0) + tl.sum(tl.sum(Zd, axis=1), axis=0) + \\
        tl.sum(tl.sum(U, axis=1), axis=0)
    tl.store(o_ptr + ((b * OT + OT0 + cx - NS) * H + h)[None, :] * V + rows[:, None],
             Y + keep, mask=(cx >= NS)[None, :] & (cx < NS + TQ)[None, :] & rmask[:, None])
"""),
    "nostream": ("_c_times_x", """\
    keep = tl.load(cms_ptr + mat * 0) * 0.0 + tl.sum(rowg, axis=0).to(tl.float32) * 0.0
    return tl.zeros([BV, NX], tl.float32) + keep
"""),
    "nokeys": ("_key_products", """\
    return (tl.zeros([LP, NX], tl.float32) + b * 1e-30,
            tl.zeros([NX, NX], tl.float32) + g * 1e-30)
"""),
}

extra = []
for v in sys.argv[1].split("+"):
    if v not in BODIES:
        raise SystemExit(f"unknown variant {v!r}; expected one of {sorted(BODIES)}")
    name, body = BODIES[v]
    h = header(name)
    src = src.replace(f"def {name}(", f"def {name}_orig(", 1)
    extra.append("@triton.jit\n" + h + body)
open(PATH, "w").write(src + "\n\n" + "\n\n".join(extra))
print("variant", sys.argv[1], "written")
