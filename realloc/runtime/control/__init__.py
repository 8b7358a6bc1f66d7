"""The control plane: the program a plan compiles to (``program.py``), the master (``master.py`` and its
``master_*.py`` parts), the model worker (``worker.py``) and stop signals (``stop_signals.py``)."""
