"""The sizing advisor: sweeps over config fields, launch arguments, request rate and seeds;
executors (local process pool, Ray); searches for the smallest ring and the largest sustained
rate; result files and plots. ``twin sweep``, ``twin advise`` and ``twin plot`` drive it;
``docs/advisor.md`` describes it."""

from twin.advise.executors import Job, make_executor
from twin.advise.results import ResultsError, ResultsFile, read_results
from twin.advise.space import Axis, AxisError, Base, Point, grid, parse_axis, parse_seeds

__all__ = [
    "Axis",
    "AxisError",
    "Base",
    "Job",
    "Point",
    "ResultsError",
    "ResultsFile",
    "grid",
    "make_executor",
    "parse_axis",
    "parse_seeds",
    "read_results",
]
