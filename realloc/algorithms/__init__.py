"""RLHF algorithms as interfaces of the dataflow graph: the registry (``registry.py``), the shipped interfaces
(``builtin.py``), and one module per algorithm (settings torch-free, implementations on torch)."""
