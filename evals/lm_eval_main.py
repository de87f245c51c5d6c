"""Console entry of ``replayssm-lm-eval``: imports the lm-eval adapter (lm-eval,
transformers, datasets: a few seconds) inside the Ctrl-C guard, so an interrupt during the
imports is one line with exit code 130 as it is later (``lm_eval_adapter.cli``)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """``replayssm-lm-eval``: :func:`replayssm_quant.evals.lm_eval_adapter.cli`, with a
    Ctrl-C before its own guard (the imports, the argument parsing) reported in one line.

    Returns:
        the exit code: ``cli``'s, or 130 when interrupted.
    """
    try:
        from replayssm_quant.evals.lm_eval_adapter import cli

        return cli(argv)
    except KeyboardInterrupt:
        print("replayssm-lm-eval: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
