"""Error-propagation analysis for low-precision recurrent state (ReplaySSM, arXiv 2610.13778).

Modules:

* :mod:`analysis.theory` -- closed forms for the rounding error of a linear recurrence (appendix
  C.6 of the paper): mean and variance versus step, their limits, time-varying decays, the window
  effect, the separate-precision (recurrence anchor / read copy) prediction, and per-rounding
  moments of RTN and SR for every state format, from an independent float64 grid model.
* :mod:`analysis.simulate` -- vectorised Monte Carlo of scalar, Mamba-2 and Gated DeltaNet state
  recurrences with the project's real quantizers, returning tidy frames of measured and
  predicted moments.
* :mod:`analysis.results` -- loading and validating output directories of ``replayssm-kl``.
* :mod:`analysis.plots` -- seaborn figures of KL curves.
* :mod:`analysis.report` -- the ``replayssm-report`` command.

Heavy imports (pandas, matplotlib, seaborn, torch) happen in the submodules, not here.
"""

__all__ = ["theory", "simulate", "results", "plots", "report"]
