"""The tour notebook (notebooks/jaxsb_tour.ipynb) runs top to bottom, the way a user runs it:
executed by nbclient in a fresh kernel with the tour's small settings (JAXSB_TOUR_SMALL=1);
any cell that raises fails the test, and the pictures it shows are really there."""

from __future__ import annotations

import base64
import os

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "notebooks", "jaxsb_tour.ipynb")


@pytest.mark.slow
def test_tour_notebook_runs_top_to_bottom(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSB_TOUR_SMALL", "1")
    monkeypatch.setenv("JAXSB_TOUR_DIR", str(tmp_path))
    monkeypatch.delenv("XLA_FLAGS", raising=False)  # the notebook sets up its own devices, as for a user
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(nb, timeout=900, kernel_name="python3",
                            resources={"metadata": {"path": os.path.join(ROOT, "notebooks")}})
    try:
        client.execute()
    finally:  # what ran, with its outputs, for a look when something fails
        nbformat.write(nb, str(tmp_path / "jaxsb_tour.executed.ipynb"))
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [base64.b64decode(o.data["image/png"]) for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == 4 and all(im.startswith(b"\x89PNG") for im in images)  # plans, training, speed-up, coverage
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "layouts (groups per micro-batch" in text and "wrote" in text
    for name in ("train/plans.png", "train/metrics.jsonl", "simulate/speedup.png", "coverage.json", "coverage.png"):
        assert (tmp_path / name).exists(), name
