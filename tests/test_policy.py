import pytest
from hypothesis import given, strategies as st

from replayssm_quant.formats import FORMAT_NAMES, QuantSpec
from replayssm_quant.policy import StatePolicy

TOKENS = [f + s for f in FORMAT_NAMES for s in ("", "+sr")]


@pytest.mark.parametrize("s,kind,read,rec", [
    ("fp32", "fp32", "fp32", "fp32"),
    ("shared:nvfp4+sr", "shared", "nvfp4+sr", "nvfp4+sr"),
    ("eager:fp8e4m3", "eager", "fp8e4m3", "fp8e4m3"),
    ("read:nvfp4/rec:fp32", "separate", "nvfp4", "fp32"),
    ("read:nvfp4/rec:fp16+sr", "separate", "nvfp4", "fp16+sr"),
    ("read:fp8e4m3/rec:fp8e4m3+sr", "separate", "fp8e4m3", "fp8e4m3+sr"),
    ("eager:fp32", "eager", "fp32", "fp32"),
])
def test_parse_examples(s, kind, read, rec):
    p = StatePolicy.parse(s)
    assert (p.kind, str(p.read), str(p.rec)) == (kind, read, rec)
    assert str(p) == s and p.canonical == s
    assert isinstance(p.read, QuantSpec) and isinstance(p.rec, QuantSpec)
    assert StatePolicy.parse(p) is p


@pytest.mark.parametrize("s,canon", [
    ("  Shared:NVFP4+SR ", "shared:nvfp4+sr"),
    ("shared:fp32", "fp32"),
    ("read:fp32/rec:fp32+sr", "fp32"),
    ("read:fp32+sr/rec:fp16", "read:fp32/rec:fp16"),  # '+sr' on fp32 rounds nothing
    ("read:nvfp4/rec:fp32+sr", "read:nvfp4/rec:fp32"),
    ("READ:MXFP4/REC:BF16", "read:mxfp4/rec:bf16"),
])
def test_canonical_form(s, canon):
    assert str(StatePolicy.parse(s)) == canon


@pytest.mark.parametrize("bad", [
    "", "nvfp4", "shared:", "shared:nvfp5", "eager", "read:nvfp4", "rec:fp32/read:nvfp4",
    "read:nvfp4,rec:fp32", "read:nvfp4/rec:", "shared:nvfp4/rec:fp32", "fp8+rtn",
    "shared:fp8+rtn", "read:nvfp4/rec:fp16/x", "separate:fp16", "fp32:fp32",
])
def test_bad_policies_list_grammar(bad):
    with pytest.raises(ValueError) as e:
        StatePolicy.parse(bad)
    msg = str(e.value)
    assert repr(bad) in msg and "read:F/rec:G" in msg and "nvfp4" in msg


@pytest.mark.parametrize("bad,hint", [("shared:nvpf4+sr", "did you mean 'nvfp4'?"),
                                      ("read:nvfp4/rec:fp61", "did you mean 'fp16'?"),
                                      ("shared:fp8", "did you mean one of 'fp8e4m3', "
                                       "'fp8e5m2', 'mxfp8'?"),
                                      ("shared:fp4+sr", "did you mean one of 'nvfp4', 'mxfp4'?"),
                                      ("eager:e4m3", "did you mean 'fp8e4m3'?"),
                                      ("shared:bogus", None)])
def test_misspelled_format_suggests_the_nearest(bad, hint):
    """A misspelled format names itself, suggests the formats of a family it names ('fp8':
    both FP8 formats and MXFP8) or else the closest format name where one is close (difflib),
    and the message lists the formats and the policy forms once each."""
    with pytest.raises(ValueError) as e:
        StatePolicy.parse(bad)
    msg = str(e.value)
    assert "unknown format" in msg and ("did you mean" not in msg if hint is None else hint in msg)
    # the formats and the policy forms listed once each (besides the hint's own names)
    listed = msg.replace(hint or "", "")
    assert listed.count("fp8e4m3") == 1 and listed.count("read:F/rec:G") == 1


@pytest.mark.parametrize("bad,reason", [
    ("read:nvfp4", "'read:F' needs the anchor's format after it, 'read:F/rec:G' "
                   "(e.g. 'read:nvfp4/rec:fp32')"),
    ("read:nvfp5", "unknown format 'nvfp5' (did you mean 'nvfp4'?)"),
    ("foo:fp16", "unknown kind 'foo:'"),
    ("map:fp32@L9=shared:fp16", "a policy map ('map:...') sets the policies of a whole "
                                "model's layers and heads (state_policy, replayssm-kl "
                                "--policies); one layer's state takes one policy"),
    ("shared:nvfp4+floor", "'+floor' is not a scale mode of nvfp4 (its modes: '+rn' (default), "
                           "'+up')"),
    ("shared:mxfp4+up", "'+up' is not a scale mode of mxfp4 (its modes: '+floor' (default), "
                        "'+rceil', '+even')"),
    ("shared:fp16+rceil", "fp16 has no block scales, so no scale mode ('+rceil')"),
    ("shared:nvfp4+up+rn", "more than one scale mode"),
    ("shared:fp16+sr+sr", "a suffix repeats"),
    ("shared:fp16+xyz", "unknown suffix '+xyz'"),
])
def test_bad_policy_says_what_is_wrong(bad, reason):
    """Each refusal says what is wrong before the grammar (a new-user trial got only the
    grammar for 'read:nvfp5' and 'shared:nvfp4+floor'); the grammar lists every scale mode
    with its default."""
    with pytest.raises(ValueError) as e:
        StatePolicy.parse(bad)
    msg = str(e.value)
    assert reason in msg.split("; expected")[0], msg
    assert "'+floor' (default)" in msg and "'+rn' (default)" in msg


def test_non_string():
    with pytest.raises(ValueError, match="read:F/rec:G"):
        StatePolicy.parse(3)


@given(st.sampled_from(TOKENS), st.sampled_from(TOKENS), st.sampled_from(["shared", "eager", "read"]))
def test_roundtrip(f, g, kind):
    s = f"read:{f}/rec:{g}" if kind == "read" else f"{kind}:{f}"
    p = StatePolicy.parse(s)
    assert StatePolicy.parse(str(p)) == p
    assert StatePolicy.parse(s.upper()) == p


def test_quant_spec_sr_must_be_a_bool():
    """``QuantSpec(sr=...)``: a truthy string would turn stochastic rounding on; refused.
    ``sr=True`` on fp32 is dropped (it rounds nothing), as the parser drops ``+sr``."""
    from replayssm_quant.formats import QuantSpec

    with pytest.raises(ValueError, match="sr must be a bool, got 'no'"):
        QuantSpec("fp16", "no")
    with pytest.raises(ValueError, match="sr must be a bool"):
        QuantSpec("nvfp4", 1)
    assert str(QuantSpec("fp32", True)) == "fp32" and QuantSpec("fp32", True) == QuantSpec("fp32")
    assert str(QuantSpec("fp16", True)) == "fp16+sr"
