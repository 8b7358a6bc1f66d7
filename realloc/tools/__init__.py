"""Tools a policy calls during a multi-turn rollout, each run in a contained child process (``sandbox.py``)."""
