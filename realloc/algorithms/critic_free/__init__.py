"""The critic-free family: GRPO, RLOO, ReMax (``grpo.py`` settings and graphs, ``critic_free.py`` train steps),
REINFORCE++, DAPO, GSPO (``pg_algorithms.py`` settings, ``pg_steps.py`` train steps), and the optimizer steps they
all share (``pg_train.py``)."""
