"""The policy-gradient loss every policy-gradient algorithm shares, PPO's and the critic-free family's: its
settings (``pg_config.py``, torch-free), the loss (``pg_loss.py``), the decoupled objective's proximal log-probs
(``decoupled.py``)."""
