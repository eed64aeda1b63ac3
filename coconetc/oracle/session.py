"""Kept for importers not yet renamed (coconetc/cli.py): interpreted runs are in
interpreted.py, saving a run in npz.py. Import from those."""

from coconetc.oracle.interpreted import Report, run_interp, save_npz
from coconetc.oracle.npz import save_results

__all__ = ["Report", "run_interp", "save_npz", "save_results"]
