"""Cost estimation: hardware specs, profile tables, time, memory and reallocation cost.

The search codes against ``realloc.estimator.cost.CostModel``; see its module docstring.
"""
