"""ppo_tiny.py on a local cluster of two device kinds (docs/heterogeneous.md): one CPU device computing in fp32
(``cpu``) and one computing in bf16 (``cpu-bf16``: it differs from ``cpu`` in speed and numerics, as a V100 in
fp16 differs from an A100 in bf16). Each worker holds its parameters in its pool's dtype; a model reallocated
between the pools is cast on receive.

    realloc search experiments/ppo_tiny_two_kinds.py
    realloc run experiments/ppo_tiny_two_kinds.py --iterations 3
"""

import dataclasses

from ppo_tiny import TinyPPO

from realloc.api import Pool, auto


@auto(pools=[Pool("cpu0", "cpu", 1), Pool("cpu1", "cpu-bf16", 1)], batch_size=32, prompt_len=8,
      gen_len=8)
@dataclasses.dataclass
class TinyPPOTwoKinds(TinyPPO):
    pass
