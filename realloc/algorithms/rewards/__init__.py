"""Rewards: rules on token ids (``rule_reward.py``) and on decoded text (``text_rules.py``), the rewards users
bring (``reward_fns.py``: batched, remote (``remote_reward.py``, stdlib only) and mixed; ``reward_args.py`` their
torch-free argument checks)."""
