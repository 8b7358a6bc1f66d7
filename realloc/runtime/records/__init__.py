"""What a run writes into its run directory: the layout (``run_paths.py``), trace, request log and metrics
(``telemetry.py``), decoded samples (``text_io.py``), TensorBoard and wandb (``metric_sinks.py``)."""
