"""Running an execution plan: a master worker drives model workers over ZMQ (realhf.txt §3, §6).

Rooms, lowest first; a room imports only the rooms above it in this list (``tests/test_layout.py``):

- ``wire/``: what crosses a socket: the typed, HMAC-signed messages (``protocol.py``) and CURVE
  encryption with its ZAP gatekeeper (``curve.py``).
- ``records/``: what a run writes into its run directory: the directory's layout (``run_paths.py``),
  trace, request log and metrics (``telemetry.py``), decoded samples (``text_io.py``), TensorBoard and
  wandb (``metric_sinks.py``).
- ``inputs/``: what a run reads and checks before any worker starts: the run's settings
  (``run_config.py``), its datasets (``datasets.py``), the evaluation set (``evaluation.py``), and the
  weights', tokenizer's and prompts' checks (``preflight.py``).
- ``transfer/``: the data plane on each worker: parameter reallocation by broadcast
  (``param_realloc.py``), host offload (``offload.py``), and the per-call data store (``data_store.py``).
  The plans they carry out are pure functions of two layouts in ``realloc/graph/transfer_plan.py``.
- ``persist/``: checkpoints (``checkpoint.py``) and HuggingFace export (``export.py``).
- ``control/``: the program a plan compiles to (``program.py``), the master (``master.py`` and its
  ``master_*.py`` parts), the model worker (``worker.py``), and stop signals (``stop_signals.py``).
- ``launch/``: starting workers: local processes and SLURM jobs (``launcher.py``), Ray actors
  (``ray_launcher.py``).

The subcommands that drive them sit at this level: ``run_cli.py`` (``realloc run``), ``show_cli.py``
(``realloc show``), ``export_cli.py`` (``realloc export``) and ``trace_cli.py`` (``realloc trace``).
"""
