"""Memory: the analytic estimator behind `lisaft estimate-memory`, and the measurements it is
checked against. See docs/memory.md for every formula."""

from lisaft.memory.command import estimate_for_recipe, settings_from_recipe
from lisaft.memory.estimate import Estimate, compute
from lisaft.memory.render import estimated_vs_measured_table
from lisaft.memory.settings import Settings

__all__ = [
    "Estimate", "Settings", "compute", "estimate_for_recipe", "settings_from_recipe",
    "estimated_vs_measured_table",
]
