"""Plan search: candidates per call, baselines, the C++ engine wrapper and reports.

``search(experiment, time_limit=...)`` returns the searched ExecutionPlan and
``baseline(experiment, name)`` a baseline's (``heuristic``, ``colocate-dp``, ``split``).
"""

from realloc.search.planner import RunLimits, baseline, plan_search, search

__all__ = ["RunLimits", "baseline", "plan_search", "search"]
