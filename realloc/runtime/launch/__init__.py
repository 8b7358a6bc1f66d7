"""Starting workers: local processes and SLURM jobs (``launcher.py``), Ray actors (``ray_launcher.py``)."""
