"""``python -m replayssm_quant.evals.kl``: the same as the ``replayssm-kl`` command."""

import sys

from replayssm_quant.evals.kl import main

sys.exit(main())
