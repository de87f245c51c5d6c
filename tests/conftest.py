"""Shared test configuration.

Tests are CPU-only: Triton kernels run under the interpreter (TRITON_INTERPRET=1), which must
be set before triton is imported anywhere. Two speed-ups that change no result
(docs/testing.md): the interpreter patches ``triton.language`` once per launch, and
``--dist loadfile`` runs the files of :data:`SPLIT_FILES` in parts.
"""

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

# Tiny matmuls are far faster single-threaded on the shared 2-core CI machine.
torch.set_num_threads(1)


def _patch_language_once_per_launch():
    """Make the Triton interpreter patch ``triton.language`` once per kernel launch.

    The interpreter (``triton.runtime.interpreter``, triton 3.x) patches the language module's
    builtins for every launch (``GridExecutor.__call__``), restoring them after it, and again
    for every call of a ``@triton.jit`` helper inside the kernel, a patch it never restores.
    A nested patch finds the builtins already replaced, so it changes nothing, but it walks
    the modules with ``inspect.getmembers`` each time (8.8 s of 27 s of interpreter time in a
    flush test, profiled 2026-12-06, docs/testing.md). Here a helper called inside a running
    launch skips the patch when that launch, or an earlier helper in it, has patched the
    helper's language modules (``tl``, ``tl.core``). Every other call (a launch, a helper
    that sees other modules or none, a helper called outside a launch) patches as before.
    The kernels run the same operations on the same values, so results keep their bits.
    Nothing changes where the interpreter is off or its internals are not the expected ones
    (``_patch_lang`` or ``GridExecutor.__call__`` absent). Tested by
    ``tests/test_interpreter_patch.py``.
    """
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang", None)
    launch_code = getattr(getattr(getattr(interpreter, "GridExecutor", None), "__call__", None),
                          "__code__", None)
    if original is None or launch_code is None or getattr(original, "_once_per_launch", False):
        return
    patched = []  # per running launch: the ids of the language modules it patched
    langs_by_fn = {}  # helper -> its language modules (its globals, read once)

    def langs_of(fn):
        langs = langs_by_fn.get(fn)
        if langs is None:
            langs = langs_by_fn[fn] = frozenset(
                id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
        return langs

    class _Launch:
        def __init__(self, scope):
            self.scope = scope

        def restore(self):
            try:
                self.scope.restore()
            finally:
                patched.pop()

    class _Nothing:
        def restore(self):
            pass

    def patch_lang(fn):
        langs = langs_of(fn)
        if sys._getframe(1).f_code is launch_code:  # a launch: patched, restored at its end
            scope = original(fn)
            patched.append(langs)
            return _Launch(scope)
        if patched and langs and langs <= patched[-1]:
            return _Nothing()  # a helper inside a launch that already patched its modules
        scope = original(fn)  # as upstream: patched, never restored
        if patched and langs:  # (triton.language's own helpers, tl.sum and co., see tl.core)
            patched[-1] = patched[-1] | langs
        return scope

    patch_lang._once_per_launch = True
    interpreter._patch_lang = patch_lang


_patch_language_once_per_launch()

import json  # noqa: E402

import pytest  # noqa: E402

#: Text of the small runner fixtures (``data_file``): three overlapping documents.
KL_TEXT = ("In the beginning God created the heaven and the earth. And the earth was without "
           "form, and void; and darkness was upon the face of the deep. ") * 2


@pytest.fixture(autouse=True)
def _same_random_inputs():
    """Every test starts from torch's global generator seeded with 0: a test that draws inputs
    without a generator of its own draws the same ones in any order, xdist worker or file part,
    so a failure reproduces with the test alone (one did not: an unseeded draw that made a
    bound fail one run in twenty, 2026-12-07)."""
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random qwen3_5 (GDN + attention) saved as a model directory (no tokenizer)."""
    from replayssm_quant.adapters.tiny import tiny_model

    d = tmp_path_factory.mktemp("tinygdn")
    tiny_model("qwen3_5").save_pretrained(d)
    return str(d)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    """A JSONL file of three documents cut from :data:`KL_TEXT`."""
    d = tmp_path_factory.mktemp("data")
    f = d / "docs.jsonl"
    f.write_text("\n".join(json.dumps({"id": f"d{i}", "text": KL_TEXT[i * 7:]}) for i in range(3)))
    return str(f)


#: Test files that ``--dist loadfile`` (pyproject.toml) may run in parts on different workers:
#: files with no module- or session-scoped fixture of their own, whose single worker would
#: otherwise be the suite's critical path (docs/testing.md). Each part is a run of whole test
#: functions in file order, the parts about equal in test count.
SPLIT_FILES = {"tests/test_replay_kernels.py": 4}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's ``loadfile`` scheduling, with the files of :data:`SPLIT_FILES` in parts."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SplitFileScheduling(LoadFileScheduling):
        def schedule(self):
            if self.collection is None and self.registered_collections:
                self._parts = _file_parts(next(iter(self.registered_collections.values())))
            return super().schedule()

        def _split_scope(self, nodeid):
            part = getattr(self, "_parts", {}).get(nodeid)
            path = super()._split_scope(nodeid)
            return path if part is None else f"{path}::part{part}"

    return SplitFileScheduling(config, log)


def _file_parts(nodeids):
    """``{nodeid: part}`` for the tests of :data:`SPLIT_FILES`: whole test functions (every
    parametrized case of one together) in file order, cut into ``n`` runs of about equal
    test count."""
    parts = {}
    for path, n in SPLIT_FILES.items():
        ids = [i for i in nodeids if i.split("::", 1)[0] == path]
        done = 0
        for i, nodeid in enumerate(ids):
            func = nodeid.split("[", 1)[0]
            if i and func != ids[i - 1].split("[", 1)[0]:
                done = i  # a new function starts: it may start a new part
            parts[nodeid] = min(n - 1, done * n // max(len(ids), 1))
    return parts
