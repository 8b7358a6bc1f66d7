"""Tiny assets made locally, nothing downloaded, for tests, benchmarks and the shipped example experiments:
``hf.py`` a byte-level BPE tokenizer and random LLaMA/Qwen2 checkpoints in HuggingFace's format,
``text.py`` the small English corpus and the prompt files in ``experiments/data/``."""
