"""What a run reads and checks before any worker starts: its settings (``run_config.py``), datasets
(``datasets.py``), the evaluation set (``evaluation.py``), and the preflight checks (``preflight.py``)."""
