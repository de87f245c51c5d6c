"""Execute both analysis notebooks top to bottom with nbclient (issue 7: they run in CI).

They run with their small default sizes (10-20 s each on 2 CPU cores) and are part of the
default suite; deselect them with ``-k "not notebook"`` when iterating on something else. The
kl_curves default (a small ``replayssm-kl`` sweep, minutes on CPU) is marked ``slow``.
Parameters are injected papermill-style: a cell inserted after the cell tagged ``parameters``.
"""

import json
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from replayssm_quant.analysis import results

NB_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = ("error_propagation", "kl_curves")


def _run(name: str, params: dict, cwd: Path):
    nb = nbformat.read(NB_DIR / f"{name}.ipynb", as_version=4)
    idx = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    src = "# injected parameters\n" + "\n".join(f"{k} = {v!r}" for k, v in params.items())
    nb.cells.insert(idx + 1, nbformat.v4.new_code_cell(src))
    client = NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(cwd)}})  # fmt: skip
    client.execute()
    text = []
    for c in nb.cells:
        for o in c.get("outputs", []):
            if o.get("output_type") == "stream":
                text.append(o["text"])
            elif "data" in o:
                text.append(str(o["data"].get("text/plain", "")))
    return nb, "\n".join(text)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_committed_stripped_with_parameters_cell(name):
    nb = nbformat.read(NB_DIR / f"{name}.ipynb", as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.outputs == [] and c.execution_count is None for c in code)
    assert sum("parameters" in c.metadata.get("tags", []) for c in nb.cells) == 1


def test_notebook_error_propagation_executes(tmp_path):
    repo = NB_DIR.parent
    _, out = _run("error_propagation", {"SEED": 1}, repo)
    assert "measured/pred" in out  # the theory-vs-simulation table was produced
    assert "RTN stuck threshold on 1 - a at x = 1: 0.001953125" in out


def test_notebook_kl_curves_loads_run_dirs(tmp_path):
    """RUN_DIRS given: the notebook loads them and draws every figure and table."""
    run = results.write_synthetic_run(tmp_path / "given_run", windows=(1, 16), n_tokens=128, docs=3)
    nb, out = _run("kl_curves", {"RUN_DIRS": [str(run)], "WORK_DIR": str(tmp_path / "w")},
                   NB_DIR.parent)  # fmt: skip
    assert "kl_mean" in out and "given_run" in out
    n_figs = sum("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))
    assert n_figs >= 5
    assert not (tmp_path / "w" / "synthetic_run").exists()  # nothing generated


@pytest.mark.slow
def test_notebook_kl_curves_generates_a_run(tmp_path):
    """No RUN_DIRS: a small replayssm-kl sweep on the embedded model (minutes on CPU, hence
    ``slow``); if the runner is missing or fails, the labelled synthetic fallback."""
    nb, out = _run("kl_curves", {"WORK_DIR": str(tmp_path)}, NB_DIR.parent)
    assert "kl_mean" in out
    if (tmp_path / "kl_run" / "positions.parquet").is_file():
        assert "SYNTHETIC" not in out
    else:
        assert "SYNTHETIC DATA -- NOT A MEASUREMENT" in out
        assert json.loads((tmp_path / "synthetic_run" / "manifest.json").read_text())["synthetic"]


def test_notebook_kl_curves_synthetic_fallback_is_labelled(tmp_path):
    """RUN_KL = False and no RUN_DIRS: the fallback frame is labelled synthetic everywhere."""
    _, out = _run("kl_curves", {"RUN_KL": False, "WORK_DIR": str(tmp_path)}, NB_DIR.parent)
    assert "SYNTHETIC DATA -- NOT A MEASUREMENT" in out
    assert json.loads((tmp_path / "synthetic_run" / "manifest.json").read_text())["synthetic"]
