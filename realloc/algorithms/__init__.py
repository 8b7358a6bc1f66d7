"""RLHF algorithms as interfaces of the dataflow graph, in rooms that import only the rooms listed before them
(``tests/test_layout.py``):

- the top level: what every algorithm builds on (``interface.py``, ``context.py``, ``common.py``, ``losses.py``,
  ``train_config.py``, ``train_step.py``, ``lora_graph.py``) and, above every room, the table of shipped interfaces
  (``builtin.py``, ``registry.py``);
- ``rewards/``: rule, text, batched, remote and mixed rewards;
- ``pg/``: the policy-gradient loss that PPO and the critic-free family share;
- ``ppo/``: PPO;
- ``critic_free/``: GRPO, RLOO, ReMax, REINFORCE++, DAPO, GSPO;
- ``pairs/``: DPO, SFT and reward models.

Settings modules are torch-free; implementations are named ``"module:function"`` and imported by the workers.

The user API's import paths from before the rooms keep working: ``OLD_PATHS`` maps each to the module it moved to,
and importing the old name gives that same module (imported on first use, so importing this package stays cheap).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from importlib.machinery import ModuleSpec
from types import ModuleType

OLD_PATHS = {f"{__name__}.{old}": f"{__name__}.{new}" for old, new in (
    ("ppo_config", "ppo.ppo_config"),
    ("grpo", "critic_free.grpo"),
    ("pg_algorithms", "critic_free.pg_algorithms"),
    ("dpo", "pairs.dpo"),
    ("reward_model", "pairs.reward_model"),
    ("reward_fns", "rewards.reward_fns"),
    ("text_rules", "rewards.text_rules"),
)}


class _OldPath(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old import path of ``OLD_PATHS``; loading it gives the moved module itself."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> ModuleSpec | None:
        return importlib.util.spec_from_loader(name, self) if name in OLD_PATHS else None

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        module = importlib.import_module(OLD_PATHS[spec.name])
        spec.loader_state = module.__spec__  # the import system sets __spec__ to the old name's: put it back below
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = module.__spec__.loader_state  # the moved module ran when create_module imported it


if not any(type(f).__name__ == "_OldPath" and type(f).__module__ == __name__ for f in sys.meta_path):
    sys.meta_path.append(_OldPath())
