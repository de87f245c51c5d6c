"""ReplaySSM dual-checkpoint state (DESIGN.md section 3).

* :mod:`.core`: pure torch references (reconstruct, output-only step, window outputs, GDN
  correction solve, the flush cast) that kernels and emulation match.
* :class:`Mamba2ReplayState`, :class:`GDNReplayState`: per-layer state objects.
* :mod:`.window`: teacher-forced window form for emulation.
"""

from .gdn import GDNReplayState, gdn_flush, gdn_step_output, gdn_verify
from .mamba2 import (Mamba2ReplayState, mamba2_flush, mamba2_records, mamba2_step_output,
                     mamba2_verify)

__all__ = ["Mamba2ReplayState", "GDNReplayState", "mamba2_flush", "gdn_flush", "mamba2_records",
           "mamba2_step_output", "gdn_step_output", "mamba2_verify", "gdn_verify"]
