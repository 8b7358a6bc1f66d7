"""PPO: settings and graph (``ppo_config.py``, torch-free), reward shaping, GAE, whitening and the clipped losses
(``ppo.py``), the actor and critic train steps (``ppo_interfaces.py``)."""
