"""Plan search: candidates per call, baselines, the C++ engine wrapper and reports."""
