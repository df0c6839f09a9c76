"""visualization/visualization.ipynb runs top to bottom (about two minutes on CPU; RESTKV_NOTEBOOK=0 skips it)."""

import os

import pytest
from helpers import ROOT

VIS = str(ROOT / "visualization")


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("RESTKV_NOTEBOOK") == "0", reason="RESTKV_NOTEBOOK=0")
def test_notebook_executes(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("NEEDLE_NOTEBOOK_OUT", str(tmp_path))
    nb = nbformat.read(os.path.join(VIS, "visualization.ipynb"), as_version=4)
    nbclient.NotebookClient(nb, timeout=1200, kernel_name="python3", resources={"metadata": {"path": VIS}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 5
    assert (tmp_path / "attention.png").is_file() and (tmp_path / "smollm2-135m" / "budget_curve.png").is_file()
