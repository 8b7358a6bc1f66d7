"""Developer tools: tiny HF tokenizers, checkpoints and text made locally for tests and demos."""
