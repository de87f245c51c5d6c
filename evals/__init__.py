"""Runners users call, installed as ``replayssm_quant.evals`` (the folder stays at the repository
root; ``pyproject.toml`` maps it): the teacher-forced KL runner (:mod:`.kl`, ``replayssm-kl``),
the lm-eval adapter (:mod:`.lm_eval_adapter`, ``replayssm-lm-eval``; task configs in
``tasks/``) and binning by generation length (:mod:`.bin_by_length`).

This folder used to be the top-level package ``evals``; importing it under that name now
fails with a message naming the new one (no shim: a second copy of these modules under the
old name would register the lm-eval model twice).
"""

import os

if __name__ != "replayssm_quant.evals":
    raise ImportError(
        f"'{__name__}' is now 'replayssm_quant.evals': import replayssm_quant.evals.kl (or run "
        "`replayssm-kl` / `python -m replayssm_quant.evals.kl`) after installing the package "
        "(`pip install -e .`) or with the repository root on PYTHONPATH")

#: lm-eval task configs shipped with the package (``--include_path``); in a checkout, evals/tasks
TASKS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tasks")
