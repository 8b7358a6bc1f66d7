"""Environments of multi-turn rollouts (``base.py``: the contract; ``tool_env.py``: the built-in tool caller)."""
