"""lm-eval adapter under HFLM's model and data parallelism (issue 16), CPU.

* ``parallelize=True``: HFLM loads the model with accelerate's ``device_map``; on a machine
  without GPUs accelerate offloads every weight to disk and hooks each module, which is the
  hardest case for the adapter (its mixer forward must run inside accelerate's hook and load
  the offloaded weights it reads directly). Scores and generations must equal the
  single-device run bit for bit.
* Data parallelism (``accelerate launch``): HFLM enables it only with several GPUs; here the
  mechanics lm-eval applies per rank are reproduced (requests split by rank, rolling windows
  padded to the longest rank via ``all_gather``), and the union of the ranks' scores must
  equal the one-process scores.
The GPU versions are in ``tests/test_distributed_cuda.py`` (skipped without CUDA).
"""

import pytest
import torch

pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")

from lm_eval.api.instance import Instance  # noqa: E402

from replayssm_quant.evals.lm_eval_adapter import ReplaySSMLM, check_model_args  # noqa: E402

REQS = [("In the beginning God created the heaven and the earth.", " And the earth was without form"),
        ("And God said, Let there be light:", " and there was light."),
        ("And God saw the light, that it was good:", " and God divided the light from the darkness."),
        ("And the evening and the morning", " were the first day.")]
ROLLING = ["And God called the firmament Heaven. And the evening and the morning were the second day.",
           "In the beginning God created the heaven and the earth. " * 6]


def _ll(lm, reqs=REQS):
    return [r[0] for r in lm.loglikelihood(
        [Instance("loglikelihood", {}, q, i) for i, q in enumerate(reqs)], disable_tqdm=True)]


def _rolling(lm, texts=ROLLING):
    return lm.loglikelihood_rolling(
        [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)], disable_tqdm=True)


def _gen(lm):
    args = {"until": ["\n\n"], "max_gen_toks": 6, "do_sample": False}
    return lm.generate_until([Instance("generate_until", {}, ("In the beginning", dict(args)), 0)],
                             disable_tqdm=True)


@pytest.mark.parametrize("model,state", [("tiny-gdn", "shared:nvfp4+sr"),
                                         ("tiny-mamba2", "read:nvfp4/rec:fp16+sr")])
def test_parallelize_true_equals_single_device(model, state, tmp_path):
    kw = dict(pretrained=model, state=state, window=4, seed=1, device="cpu", batch_size=2,
              max_length=48)
    plain = ReplaySSMLM(**kw)
    par = ReplaySSMLM(**kw, parallelize=True, offload_folder=str(tmp_path / "offload"))
    assert getattr(par.model, "hf_device_map", None)  # accelerate placed (offloaded) it
    assert _ll(par) == _ll(plain)
    assert _rolling(par) == _rolling(plain)
    assert _gen(par) == _gen(plain)
    par.handle.remove()  # the accelerate hook is restored, not our forward
    mixer = next(m for m in par.model.modules() if hasattr(m, "_hf_hook") and hasattr(m, "A_log"))
    assert "replayssm" not in repr(mixer.__dict__.get("_old_forward"))


def test_device_map_model_argument():
    check_model_args("pretrained=tiny-gdn,parallelize=True,device_map=balanced_low_0,"
                     "max_memory_per_gpu=10GB,max_cpu_memory=20GB,offload_folder=/tmp/o")
    with pytest.raises(ValueError, match="device_map must be one of auto, balanced.*got 'gpu'"):
        check_model_args("pretrained=tiny-gdn,parallelize=True,device_map=gpu")


def test_data_parallel_ranks_equal_one_process(monkeypatch):
    """The requests of a 2-rank run (lm-eval gives rank r the requests r, r + 2, ...) scored by
    two ranks, rolling windows padded to the longest rank as HFLM does, give the one-process
    scores: nothing in the adapter depends on the rank or on the other requests."""
    kw = dict(pretrained="tiny-gdn", state="shared:nvfp4+sr", window=4, seed=2, device="cpu",
              batch_size=2, max_length=24)  # short max_length: several rolling windows
    one = ReplaySSMLM(**kw)
    ll1, roll1 = _ll(one), _rolling(one)
    ranks = []
    for rank in (0, 1):
        lm = ReplaySSMLM(**kw)
        lm._rank, lm._world_size = rank, 2
        counts = []

        def all_gather(t, lm=lm, counts=counts):  # rank 1 has 3 more windows than rank 0
            counts.append(int(t))
            mine = int(t)
            return torch.tensor([mine, mine + 3] if lm.rank == 0 else [mine, mine])
        monkeypatch.setattr(lm, "all_gather", all_gather)
        ranks.append((_ll(lm, REQS[rank::2]), _rolling(lm, ROLLING[rank::2]), counts))
    ll2 = [None] * len(REQS)
    ll2[0::2], ll2[1::2] = ranks[0][0], ranks[1][0]
    roll2 = [None] * len(ROLLING)
    roll2[0::2], roll2[1::2] = ranks[0][1], ranks[1][1]
    assert ranks[0][2] and ranks[1][2]  # the padding path ran
    assert ll2 == ll1 and roll2 == roll1
