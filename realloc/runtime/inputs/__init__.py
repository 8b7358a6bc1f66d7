"""What a run reads and checks before any worker starts: its settings (``run_config.py``), datasets
(``datasets.py``), the evaluation set (``evaluation.py``), the preflight checks (``preflight.py``), and the
user's rewards called on the first record by `realloc show` (``reward_probe.py``)."""
