"""What ``realloc search`` says about LoRA models: what trains, where the reference runs, and the train step's
memory next to full fine-tuning of the same model in the same layout (``estimator/memory.py``)."""

from __future__ import annotations

import dataclasses

from realloc.algorithms.lora_graph import adapters_off
from realloc.estimator.cost import CostModel
from realloc.estimator.memory import call_memory
from realloc.graph.dataflow import DataflowGraph
from realloc.graph.plan import ExecutionPlan
from realloc.strategy import ParallelStrategy

GIB = 2**30


def lora_summary(graph: DataflowGraph, cost: CostModel, plan: ExecutionPlan) -> list[str]:
    """One block of lines per LoRA model (none without LoRA)."""
    out = []
    for model, cfg in graph.model_configs.items():
        if cfg is None or cfg.lora is None:
            continue
        lora = cfg.lora
        out.append(f"lora       {model}: rank {lora.rank}, alpha {lora.alpha:g} on {', '.join(lora.target_modules)}: "
                   f"{cfg.trained_params / 1e6:,.1f}M of {(cfg.allocated_params - cfg.adapter_params) / 1e9:.2f}B "
                   f"parameters trained, the base frozen")
        base_calls = [c for c in graph.calls_of_model(model) if adapters_off(graph.call(c))]
        if base_calls:
            out.append(f"           {', '.join(base_calls)} run(s) {model}'s base (adapters off): no reference model "
                       f"to load, place or reallocate")
        for call in graph.calls_of_model(model):
            if not graph.call(call).is_train:
                continue
            p = plan.placements[call]
            strategy = ParallelStrategy(p.dp, p.tp, p.pp)
            work, prec = cost.workload(call), cost.call_precision(call)
            mine = call_memory(cfg, work, strategy, p.n_mbs, prec, p.recompute)
            full = call_memory(dataclasses.replace(cfg, lora=None), work, strategy, p.n_mbs, prec, p.recompute)
            out.append(f"           {call} at dp{p.dp}·tp{p.tp}·pp{p.pp}: gradients + optimizer state "
                       f"{(mine.grads + mine.optimizer) / GIB:.2f} GiB/dev (full fine-tuning "
                       f"{(full.grads + full.optimizer) / GIB:.2f}), train-step memory {mine.total / GIB:.2f} "
                       f"GiB/dev (full fine-tuning {full.total / GIB:.2f})")
    return out
