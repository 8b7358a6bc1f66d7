"""Steps on pairs and supervised data: DPO and SFT (``dpo.py`` settings and graphs, ``supervised.py`` train steps),
reward models (``reward_model.py`` settings and graph, ``rm_train.py`` the Bradley-Terry step and pair scoring)."""
