"""What outlives a run: checkpoints (``checkpoint.py``) and HuggingFace export (``export.py``)."""
