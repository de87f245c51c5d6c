"""``python -m evals.kl``: the same as the ``replayssm-kl`` command."""

import sys

from evals.kl import main

sys.exit(main())
