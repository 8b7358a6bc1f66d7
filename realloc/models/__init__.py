"""realloc's model engine on megatron-core.

megatron-core announces at import that Transformer Engine and Apex are missing and that it falls back
to torch implementations. realloc never uses those paths (its own engine, optimizer and norms), so the
notices are silenced here, before any megatron import, instead of filling every worker log.
"""

import logging
import warnings

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed", category=UserWarning)
logging.getLogger("megatron.core.distributed.fsdp").setLevel(logging.WARNING)
