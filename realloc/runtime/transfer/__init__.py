"""The data plane on each worker: parameter reallocation (``param_realloc.py``), host offload (``offload.py``)
and the per-call data store (``data_store.py``)."""
