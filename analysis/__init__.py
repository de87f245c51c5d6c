"""Error-propagation analysis for low-precision recurrent state (ReplaySSM, arXiv 2610.13778).

Installed as ``replayssm_quant.analysis`` (the folder stays at the repository root;
``pyproject.toml`` maps it). Modules:

* :mod:`.theory` -- closed forms for the rounding error of a linear recurrence (appendix
  C.6 of the paper): mean and variance versus step, their limits, time-varying decays, the window
  effect, the separate-precision (recurrence anchor / read copy) prediction, and per-rounding
  moments of RTN and SR for every state format, from an independent float64 grid model.
* :mod:`.simulate` -- vectorised Monte Carlo of scalar, Mamba-2 and Gated DeltaNet state
  recurrences with the project's real quantizers, returning tidy frames of measured and
  predicted moments.
* :mod:`.results` -- loading and validating output directories of ``replayssm-kl``.
* :mod:`.plots` -- seaborn figures of KL curves.
* :mod:`.report` -- the ``replayssm-report`` command.

Heavy imports (pandas, matplotlib, seaborn, torch) happen in the submodules, not here.
This folder used to be the top-level package ``analysis``; importing it under that name now
fails with a message naming the new one.
"""

if __name__ != "replayssm_quant.analysis":
    raise ImportError(
        f"'{__name__}' is now 'replayssm_quant.analysis': import replayssm_quant.analysis.theory "
        "(or run `replayssm-report`) after installing the package (`pip install -e .`) or with "
        "the repository root on PYTHONPATH")

__all__ = ["theory", "simulate", "results", "plots", "report"]
