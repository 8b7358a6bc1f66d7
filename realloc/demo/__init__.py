"""The arithmetic demo that ``make demo`` runs: the task and its shipped files (``arith_task.py``), the demo
itself (``arith_demo.py``: GRPO from the shipped SFT checkpoint, accuracy before and after), exact-match
accuracy with transformers (``accuracy.py``), and the HF assets the example experiments build once
(``demo_assets.py``)."""
