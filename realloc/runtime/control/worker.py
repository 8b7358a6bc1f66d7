"""A model worker: one process per device, an RPC server for the master (realhf.txt §3, §6).

It holds one ``ParallelModel`` per (model, layout) the plan puts on its device, the data its calls
produced or received (per iteration, by sequence range), and executes the master's requests
strictly in the order they arrive. The master numbers every request globally and sends each one
to all its participants at once, so any two workers run their common collectives (reallocation
broadcasts, data transfers, tensor/pipeline/data-parallel communication inside calls) in the same
order: no deadlock is possible on gloo or NCCL.

A heartbeat thread reports liveness every second on its own socket and ends the process if the
master stops answering (the master died), so no worker outlives a run.

Run as ``python -m realloc.runtime.control.worker ...`` (the launchers build the command line).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
import zmq

from realloc.algorithms.common import set_step_lr, step_lr
from realloc.algorithms.context import CallContext, CallResult, Data, reward_sums
from realloc.algorithms.lora_graph import adapters_off
from realloc.algorithms.registry import interfaces_of
from realloc.calls import InterfaceType
from realloc.data.prompts import PromptDataset
from realloc.data.tokenizer import Tokenizer
from realloc.graph.dataflow import build_graph
from realloc.graph.plan import ExecutionPlan
from realloc.graph.transfer_plan import dp_ranges
from realloc.models.engine import ParallelModel
from realloc.models.groups import ModelLayout, ProcessGroupCache
from realloc.models.hf_io import load_hf_checkpoint
from realloc.models.weights import param_seed
from realloc.overrides import load_with_overrides
from realloc.runtime.control.program import CallLayout, LayoutKey, RuntimeProgram
from realloc.runtime.control.store_listener import rendezvous_store
from realloc.runtime.control.pool_dtypes import LOCAL_DEVICE_ENV, reallocate_model
from realloc.runtime.control.worker_errors import reply_error
from realloc.runtime.control.worker_fused import run_request
from realloc.runtime.control.worker_heartbeat import HEARTBEAT_INTERVAL, Heartbeat
from realloc.runtime.control.worker_partial import PartialStore
from realloc.runtime.control.worker_sends import PendingSends
from realloc.runtime.control.worker_stream import Kept, streaming_generation
from realloc.runtime.control.worker_tail import migrating_generation
from realloc.runtime.inputs.datasets import dataset_rows, dataset_rows_at, load_dataset
from realloc.runtime.inputs.evaluation import EVAL_SEED, eval_calls, eval_key, write_eval_samples
from realloc.runtime.inputs.preflight import vocab_limit
from realloc.runtime.inputs.run_config import RunConfig
from realloc.runtime.persist import checkpoint
from realloc.runtime.records.run_paths import RunPaths
from realloc.runtime.records.startup import WORKER_PRELOAD, process_start_time, settle_heap, worker_argv
from realloc.runtime.records.text_io import SampleLog, SpecialTokens
from realloc.runtime.transfer.data_store import DataStore, pack_rows, row_bytes, row_tokens, unpack_rows
from realloc.runtime.transfer.offload import HostOffload
from realloc.runtime.transfer.param_realloc import Reallocator
from realloc.runtime.wire import protocol
from realloc.runtime.wire.curve import CurveKeys, secure_client

PROCESS_GROUP_TIMEOUT = datetime.timedelta(minutes=30)

log = logging.getLogger("realloc.worker")


class ModelHandle:
    """One model in one layout on this device."""

    def __init__(self, layout: CallLayout, model: ParallelModel, optimizer: torch.optim.Optimizer | None) -> None:
        self.layout, self.model, self.optimizer = layout, model, optimizer
        self.offloader: HostOffload | None = None
        # Train steps applied to the parameters held here (set at home; a snapshot copies it with them).
        self.version = 0

    @property
    def coords(self) -> tuple[int, int, int]:
        g = self.model.groups
        return g.dp_rank, g.tp_rank, g.pp_rank


def packed_reply(channel: protocol.Channel, reply: protocol.Reply) -> list[bytes]:
    """The frames of ``reply``; if it is too large to send (the master would drop it and wait forever), those
    of a failure naming the problem instead, so the run stops with that error."""
    try:
        return channel.pack(protocol.MASTER, reply)
    except protocol.MessageTooLarge as e:
        log.error("request %d: the reply cannot be sent: %s", reply.req, e)
        failure = protocol.Reply(req=reply.req, rank=reply.rank, ok=False, start=reply.start, end=reply.end,
                                 error=f"the reply to request {reply.req} cannot be sent: {e}")
        return channel.pack(protocol.MASTER, failure)


class ModelWorker:
    def __init__(self, args: argparse.Namespace) -> None:
        self.rank = args.rank
        self.world_size = args.world_size
        self.run_dir = Path(args.run_dir)
        secret = protocol.read_secret()
        spec = load_with_overrides(args.experiment, args.set)
        self.config = RunConfig.of(spec)
        graph = build_graph(spec)
        plan = ExecutionPlan.load(self.run_dir / "plan.json")
        self.program = RuntimeProgram(graph, plan)
        self.spec = spec
        if args.device == "cuda":
            # Ray (and SLURM with --gpus-per-task) shows each worker only its own GPU.
            local = 0 if torch.cuda.device_count() == 1 else int(os.environ.get(  # pools: the index in its pool's node
                LOCAL_DEVICE_ENV, spec.cluster.local_device(self.rank)))  # the local launcher: its own GPU
            self.device = torch.device("cuda", local)
            torch.cuda.set_device(self.device)
            backend = "nccl"
        else:
            self.device = torch.device("cpu")
            backend = "gloo"
        # Data buffers travel on the communication device (NCCL only moves device memory).
        self.comm_device = self.device
        self.zctx = zmq.Context()
        self.sock = self.zctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, protocol.socket_identity(protocol.worker_name(self.rank)))
        self.sock.setsockopt(zmq.LINGER, 1000)
        secure_client(self.sock, CurveKeys.of(secret))
        self.sock.connect(args.master)
        self.channel = protocol.Channel(secret, args.run_id, protocol.worker_name(self.rank))
        self.heartbeat = Heartbeat(self.zctx, args.master, secret, args.run_id, self.rank)
        self.heartbeat.start()
        started, imported, ready = getattr(args, "times", (0.0, 0.0, 0.0))
        self._send(protocol.Hello(rank=self.rank, pid=os.getpid(), host=socket.gethostname(), started=started,
                                  imported=imported, ready=ready))

        host, port = args.store.rsplit(":", 1)
        store = rendezvous_store(host, int(port), args.store_fd, PROCESS_GROUP_TIMEOUT)  # worker 0 may serve it
        dist.init_process_group(backend, store=dist.PrefixStore(f"{args.run_id}/world", store), rank=self.rank,
                                world_size=self.world_size, timeout=PROCESS_GROUP_TIMEOUT)
        self.groups = ProcessGroupCache()
        self.reallocator = Reallocator(self.groups, self.rank)
        self.handles: dict[LayoutKey, ModelHandle] = {}
        self.store = DataStore()
        self.dataset: PromptDataset | None = None
        self.eval_dataset: PromptDataset | None = None
        self.total_iterations = 0
        self.tokenizer = Tokenizer.load(self.config.tokenizer) if self.config.tokenizer else None
        self.tokens = SpecialTokens.of(spec, self.tokenizer)
        self.samples = SampleLog(self.tokenizer, self.config.sample_every, self.config.log_samples)
        self.sample_parts: list[protocol.SamplePart] = []  # the current call's, sent with its reply
        self.row_tokens: tuple[int, list[int]] = (0, [])  # a generation's (first row, tokens per row), likewise
        self.held_rows: list[int] = []  # a migrating generation's rows at its end (worker_tail.py), likewise
        self.streams: Kept = {}  # a streaming generation's decoding between its two requests (worker_stream.py)
        self.sends = PendingSends()  # data sent point to point, not waited for (worker_sends.py)

    def on_stop_signal(self, signum: int, frame: object) -> None:
        """SIGTERM (a cluster ending the job) does not end this worker: the master is told with the next
        heartbeat and stops the whole run, with a checkpoint if there is time (stop_signals.py)."""
        log.warning("worker %d: %s received; the master stops the run", self.rank, signal.Signals(signum).name)
        self.heartbeat.stop_signal = signum

    # -- wire -----------------------------------------------------------------------------------------------
    def _send(self, body: protocol._Msg) -> None:
        self.sock.send_multipart(self.channel.pack(protocol.MASTER, body))

    def serve(self) -> None:
        while True:
            if not self.sock.poll(1000):
                continue
            env = self.channel.try_unpack(self.sock.recv_multipart(), protocol.MASTER)
            if env is None or not isinstance(env.body, tuple(protocol.REQUEST_TYPES.values())):
                continue
            req = env.body
            self.heartbeat.busy_req = req.req
            on_gpu = self.device.type == "cuda"
            if on_gpu:
                torch.cuda.reset_peak_memory_stats(self.device)  # each request's own peak
            start, cpu = time.time(), time.thread_time()  # cpu: this thread's CPU time, for a loaded machine
            self.sample_parts, self.row_tokens, self.held_rows = [], (0, []), []
            try:
                stats, outputs = self.handle(req)
                if on_gpu:
                    torch.cuda.synchronize(self.device)  # the request's kernels end inside its span
                memory = ({"peak_bytes": torch.cuda.max_memory_allocated(self.device),
                           "allocated_bytes": torch.cuda.memory_allocated(self.device)} if on_gpu else {})
                reply = protocol.Reply(req=req.req, rank=self.rank, ok=True, start=start, end=time.time(),
                                       stats=stats, outputs=outputs, samples=self.sample_parts, memory=memory,
                                       rows_lo=self.row_tokens[0], row_tokens=self.row_tokens[1],
                                       rows=self.held_rows)
            except Exception as e:  # noqa: BLE001 - report any failure to the master, which stops the run
                log.error("request %d (%s) failed:\n%s", req.req, req.type, traceback.format_exc())
                reply = protocol.Reply(req=req.req, rank=self.rank, ok=False,
                                       error=reply_error(e),
                                       start=start, end=time.time())
            self.heartbeat.busy_req = -1
            if reply.ok:
                log.info("%s: %.3f s (cpu %.4f s), %s", _describe(req), reply.end - reply.start,
                         time.thread_time() - cpu, self._memory())
            self.sock.send_multipart(packed_reply(self.channel, reply))
            if isinstance(req, protocol.Shutdown):
                return

    def handle(self, req: protocol._Msg) -> tuple[dict[str, float], list[protocol.OutputMeta]]:
        if isinstance(req, protocol.Setup):
            self.total_iterations = req.total_iterations
            self.setup(req.resume, req.verify_checkpoint)
            settle_heap()  # start-up ran without the cyclic collector (worker_main.py)
            for h in self.handles.values():
                h.version = req.start_iteration
        elif isinstance(req, protocol.RunCall):  # a fused train pair runs both calls as one (worker_fused.py)
            return run_request(self, req)
        elif isinstance(req, protocol.Reallocate):
            return self.reallocate(req), []
        elif isinstance(req, protocol.TransferData):
            return self.transfer(req), []
        elif isinstance(req, protocol.Offload):
            self.offload(req)
        elif isinstance(req, protocol.SaveCheckpoint):
            self.save(Path(req.directory), req.iteration)
        elif isinstance(req, protocol.ReleaseData):
            self.store.release(req.before_iteration)
        elif isinstance(req, protocol.EnsureGroups):
            self.groups.ensure_rank_sets(req.rank_sets)
        if isinstance(req, (protocol.ReleaseData, protocol.SaveCheckpoint, protocol.Shutdown)):
            self.sends.drain()
        return {}, []  # Shutdown: serve() stops after the reply

    # -- setup ----------------------------------------------------------------------------------------------
    def setup(self, resume: str | None, verify_checkpoint: bool = True) -> None:
        prog = self.program
        # Collective over the world: every worker creates every group, in the same order.
        layouts = []
        for cl in prog.all_layouts().values():
            cfg = prog.model_config(cl.model)
            layouts.append(ModelLayout.for_model(cfg, cl.mesh, cl.strategy))
        self.groups.ensure_layouts(layouts)
        self.groups.ensure_rank_sets(prog.startup_rank_sets())

        torch.manual_seed(self.config.seed)
        for key, cl in prog.layouts_on(self.rank).items():
            cfg = prog.model_config(cl.model)
            g = self.groups.model_groups(ModelLayout.for_model(cfg, cl.mesh, cl.strategy), self.rank)
            home = prog.calls[prog.home_call(cl.model)].key == key
            source = self.spec.models.get(cl.model)
            # Parameters start at home (from the checkpoint, or seeded random); other layouts are filled by
            # reallocation when their turn comes.
            model = ParallelModel(cfg, g, device=self.device, dtype=getattr(torch, prog.dtype_of(cl.call)[0]),
                                  init="random" if home and source is None else "empty", seed=self.config.seed)
            # A resumed run takes trained models from its own checkpoint; frozen ones always come from theirs.
            if home and source is not None and not (resume and prog.is_trained(cl.model)):
                t0 = time.time()
                load_hf_checkpoint(model, source.path, score_init_seed=(
                    param_seed(self.config.seed, f"{cl.model}/value-head") if source.new_value_head else None),
                    adapter_init_seed=self.config.seed)
                log.info("loaded %s from %s into %s in %.1f s", cl.model, source.path, _layout_name(cl),
                         time.time() - t0)
            if not home:
                model.release()
            opt = None
            if home and prog.is_trained(cl.model):
                train = prog.graph.interfaces[prog.train_call(cl.model)]
                settings = train.settings(self.spec.config)
                grad_dtype = torch.bfloat16 if settings.grad_dtype == "bf16" else torch.float32
                opt = model.make_optimizer(getattr(settings, train.lr), eps=settings.adam_eps, grad_dtype=grad_dtype)
            self.handles[key] = ModelHandle(cl, model, opt)
            calls = [c for c, x in prog.calls.items() if x.key == key]
            log.info("%s layout %s %s (coords dp,tp,pp %s) for %s%s%s", cl.model, cl.mesh.name, cl.strategy,
                     self.handles[key].coords, ", ".join(calls), ", home" if home else "",
                     ", with optimizer" if opt is not None else "")
        graph = prog.graph
        if any((any(k in self.spec.dataset_keys for k in r.input_data) or graph.interfaces[r.name].records)
               and self.rank in prog.calls[r.name].ranks for r in self.spec.rpcs):
            self.dataset = load_dataset(graph.dataset_kind, self.config.dataset, self.spec, self.config,
                                        self.tokenizer, prog.generation_vocab_size(),
                                        RunPaths(self.run_dir).prompt_cache)
        ev = self.config.eval
        ec = eval_calls(self.spec) if ev.every else None
        # evaluation generates (or scores) in the train step's layout; a reward reading the records (answers)
        # needs them where the reward call runs, which a disaggregated plan puts elsewhere
        if ec is not None and self.rank in set(prog.calls[ec.train].ranks) | set(prog.calls[ec.reward].ranks):
            kind = graph.dataset_kind if ec.scorer else "prompts"
            self.eval_dataset = load_dataset(kind, ev.dataset, self.spec, self.config, self.tokenizer,
                                             prog.generation_vocab_size(), RunPaths(self.run_dir).prompt_cache)
        self.partials = PartialStore(self.spec.max_staleness, prog.staleness, Path(resume) if resume else None,
                                     verify_checkpoint)
        if resume:
            self.load(Path(resume), verify_checkpoint)

    def _memory(self) -> str:
        """This device's memory now: allocated and peak on a GPU, the process's resident set on a CPU."""
        if self.device.type == "cuda":
            gib = 2**30
            return (f"{torch.cuda.memory_allocated(self.device) / gib:.2f} GiB allocated, peak "
                    f"{torch.cuda.max_memory_allocated(self.device) / gib:.2f} GiB")
        try:
            pages = int(Path("/proc/self/statm").read_text().split()[1])
            return f"{pages * os.sysconf('SC_PAGE_SIZE') / 2**20:.0f} MiB resident"
        except (OSError, ValueError, IndexError):
            return "memory unknown"

    def _records(self, evaluating: bool) -> Any:
        ds = self.eval_dataset if evaluating else self.dataset
        assert ds is not None
        return ds.record

    def _home(self, model: str) -> ModelHandle | None:
        return self.handles.get(self.program.calls[self.program.home_call(model)].key)

    # -- calls ------------------------------------------------------------------------------------------------
    def run_call(self, call: str, iteration: int, eval_batch: int = -1, layout_call: str = "",
                 ranges: list[list[int]] | None = None, rows: list[list[int]] | None = None
                 ) -> tuple[dict[str, float], list[protocol.OutputMeta]]:
        """Run ``call``'s interface in its own layout (or ``layout_call``'s). With ``eval_batch`` >= 0, an
        evaluation pass: prompts from the eval set, data under ``eval<j>/`` keys (``evaluation.py``)."""
        prog, spec = self.program, self.spec
        cl = prog.calls[layout_call or call]
        evaluating = eval_batch >= 0
        key_of = (lambda k: eval_key(eval_batch, k)) if evaluating else (lambda k: k)
        rpc = spec.call(call)
        cfg = prog.model_config(cl.model)
        iface = prog.graph.interfaces[call]
        out_keys = {slot.role: key for slot, key in zip(iface.out_slots, rpc.output_data)}
        if evaluating and rpc.is_train:  # an evaluation without generation: the scoring namesake, no step
            iface = interfaces_of(spec)[(eval_calls(spec).scorer, InterfaceType.INFERENCE)]
            out_keys = {slot.role: f"{call}/{slot.role}" for slot in iface.out_slots}
        fn = iface.resolve()
        in_keys = {slot.role: key for slot, key in zip(iface.in_slots, rpc.input_data)}
        if cfg is None:  # a rule function: every device of the mesh is one dp rank
            handle, (dp_rank, tp_rank, pp_rank) = None, (cl.ranks.index(self.rank), 0, 0)
            dp, pp = cl.strategy.dp, 1
        else:
            handle = self.handles[cl.key]
            dp_rank, tp_rank, pp_rank = handle.coords
            dp, pp = cl.strategy.dp, cl.strategy.pp
        lo, hi = ranges[dp_rank] if ranges else dp_ranges(prog.batch_size, dp)[dp_rank]  # token-balanced, or even
        ids: Sequence[int] = rows[dp_rank] if rows else range(lo, hi)  # or a list: a part of a streamed call
        if rows and not ids and (call, iteration) not in self.streams:  # no rows in this part (a chunked
            # stream's replica without running rows still joins the counts, worker_stream.py)
            return {}, []
        inputs: Data = {}
        for role, key in in_keys.items():
            if key in spec.dataset_keys:
                ds, position, seed = ((self.eval_dataset, eval_batch, EVAL_SEED) if evaluating
                                      else (self.dataset, iteration, self.config.seed))
                assert ds is not None
                inputs[role] = (dataset_rows_at(ds, position, spec.batch_size, seed, ids, rpc.n_samples) if rows
                                else dataset_rows(ds, position, spec.batch_size, seed, lo, hi, rpc.n_samples))
            else:
                inputs[role] = self.store.get_rows(key_of(key), iteration, ids)
        ctx = CallContext(call=rpc, model=handle.model if handle else None,
                                optimizer=handle.optimizer if handle else None, config=iface.settings(spec.config),
                                prompt_len=spec.prompt_len, gen_len=spec.gen_len, seed=self.config.seed,
                                iteration=iteration, ids=ids, batch_size=prog.batch_size, n_mbs=cl.n_mbs,
                                total_iterations=self.total_iterations,
                                eos_token_ids=self.tokens.eos_token_ids, pad_token_id=self.tokens.pad_token_id,
                                vocab_limit=vocab_limit(self.tokenizer, prog.generation_vocab_size()),
                                greedy=evaluating and self.config.eval.greedy,
                                purpose=f"eval{eval_batch}" if evaluating else "generate", recompute=cl.recompute,
                                group_size=spec.group_size, tokenizer=self.tokenizer,
                                records=self._records(evaluating) if iface.records else None,
                                lr_field=iface.lr if rpc.is_train else None)
        self.partials.attach(ctx, fn, handle, evaluating)  # partial rollouts: the rows carried between iterations
        if rpc.is_train:  # the schedule holds for every train step, a custom one included (common.set_step_lr)
            set_step_lr(ctx, 0)
        tail = prog.plan.tail.get(call) if rpc.interface_type is InterfaceType.GENERATE and not evaluating else None
        if tail is not None:  # long-tail migration: this replica's rows at the end are others (worker_tail.py)
            res, self.held_rows = (streaming_generation(ctx, fn, inputs, tail, call, self.streams,
                                                        iface.resolve_stepwise())
                                   if tail.streams_only else migrating_generation(ctx, fn, inputs, tail, call))
            if res is None:
                return {}, []
            result, ids = res, self.held_rows
        elif adapters_off(rpc):  # a LoRA model's base (the reference of a LoRA actor): lora_graph.py
            assert handle is not None
            with handle.model.adapters_disabled():
                result = fn(ctx, inputs)
        else:
            result = fn(ctx, inputs)
        CallResult.check(result, call, iface.name, out_keys, self.rank, early_stage=pp_rank < pp - 1)
        # The framework, not the reward function, makes the reward stats (context.reward_sums)
        reward_roles = [s.role for s in iface.out_slots if s.kind == "rewards"]
        result.sums.update(reward_sums(call, iface.name, result, reward_roles, len(ids)))
        if rpc.is_train and ctx.optimizer is not None:
            result.globals.setdefault(f"{rpc.model_name}_lr", step_lr(ctx, 0))
        stale = prog.is_stale(call) and not evaluating
        if handle is not None and not evaluating and call == prog.train_call(cl.model):
            handle.version += 1
        metas = []
        for role, key in out_keys.items():
            if role in result.outputs:
                tensors = result.outputs[role]
                self.store.put_rows(key_of(key), iteration, ids, tensors)
                metas.append(protocol.OutputMeta(key=key_of(key), tensors=self.store.meta(key_of(key), iteration)))
        reporter = tp_rank == 0 and pp_rank == pp - 1
        scored = reward_roles[0] if reward_roles and reward_roles[0] in result.outputs else None
        if evaluating and reporter and scored and ("seq" in inputs or "seq" in result.outputs):  # multi-turn: out
            write_eval_samples(self.run_dir, iteration, self.rank, eval_batch, range(lo, hi),
                               inputs.get("seq", result.outputs.get("seq")), result.outputs[scored]["score"],
                               self.tokenizer)
        elif reporter and scored and "seq" in inputs:
            self.sample_parts = self.samples.parts(iteration, ids, in_keys["seq"], inputs["seq"],
                                                   scores=result.outputs[scored]["score"])
        elif reporter and not evaluating and {"seq", "logp"} <= set(result.outputs):
            self.sample_parts = self.samples.parts(iteration, ids, out_keys["seq"], result.outputs["seq"],
                                                   logp=result.outputs["logp"]["logp"], rewards=result.outputs.get(scored))
            if self.config.balance_tokens:  # the master balances the later calls' dp ranks by them
                self.row_tokens = (lo, row_tokens(result.outputs["seq"]))
        stats: dict[str, float] = {}
        if reporter:
            stats.update(result.sums)
            if dp_rank == 0:
                stats.update(result.globals)
                if stale:  # generation running ahead: the version its samples came from (master_schedule.py)
                    assert handle is not None
                    stats["param_version"] = float(handle.version)
        if stale and handle is not None:
            for part in self.sample_parts:
                part.fields["version"] = handle.version
        return stats, metas

    # -- parameters --------------------------------------------------------------------------------------------
    @torch.no_grad()
    def reallocate(self, req: protocol.Reallocate) -> dict[str, float]:
        prog = self.program
        r = next(x for x in prog.reallocs(req.model) if (x.src_call, x.dst_call) == (req.src_call, req.dst_call))
        src = self.handles.get(prog.calls[r.src_call].key)
        dst = self.handles.get(prog.calls[r.dst_call].key)
        if src is not None and src.model.state != "ready":
            raise RuntimeError(f"reallocate {req.model} {req.src_call}->{req.dst_call}: the source layout holds no "
                               f"parameters here ({src.model.state})")
        if dst is not None and dst.model.state == "released":
            dst.model.materialize()
        if src is not None and req.version >= 0 and src.version != req.version:
            raise RuntimeError(f"snapshot {req.model} {req.src_call}->{req.dst_call} (iteration {req.iteration + 1}): "
                               f"home holds parameter version {src.version}, the schedule expects {req.version}")
        st = reallocate_model(self.reallocator, prog, r, src.model if src else None, dst.model if dst else None,
                              self.device, req.drop_src)  # cast on receive, home kept across dtypes (pool_dtypes.py)
        if dst is not None:
            dst.version = req.version if req.version >= 0 else (src.version if src is not None else dst.version)
        return {"sent_bytes": float(st.sent_bytes), "received_bytes": float(st.received_bytes)}

    def offload(self, req: protocol.Offload) -> None:
        h = self.handles.get(self.program.calls[req.call].key)
        if h is None:
            return
        if req.to_host:
            h.offloader = HostOffload(h.model.params())
            h.offloader.offload()
        elif h.offloader is not None:
            h.offloader.reload()
            h.offloader = None

    # -- data ----------------------------------------------------------------------------------------------------
    def transfer(self, req: protocol.TransferData) -> dict[str, float]:
        """Run the pieces this device takes part in, in the plan's order; pieces with the same source and
        destinations travel as one message (grouped identically on every participant)."""
        me = self.rank
        messages: dict[tuple[int, tuple[int, ...]], list[protocol.Broadcast]] = {}
        for b in req.broadcasts:
            if b.src == me or me in b.dsts:
                messages.setdefault((b.src, tuple(b.dsts)), []).append(b)
        sent = received = 0
        for (src, dsts), pieces in messages.items():
            if src == me:
                buf = torch.cat([pack_rows(self.store.get(req.key, req.iteration, p.lo, p.hi), req.tensors)
                                 for p in pieces]).to(self.comm_device)
                sent += buf.numel()
            else:
                n = sum((p.hi - p.lo) for p in pieces) * row_bytes(req.tensors)
                buf = torch.empty(n, dtype=torch.uint8, device=self.comm_device)
                received += n
            if len(dsts) == 1:
                if src == me:
                    self.sends.send(buf, dsts[0])
                else:
                    dist.recv(buf, src)
            else:
                dist.broadcast(buf, src, group=self.groups.get((src, *dsts)))
            if src != me:
                off, host = 0, buf.cpu()
                for p in pieces:
                    size = (p.hi - p.lo) * row_bytes(req.tensors)
                    self.store.put(req.key, req.iteration, p.lo, p.hi, unpack_rows(host[off:off + size], req.tensors,
                                                                                   p.hi - p.lo))
                    off += size
        return {"sent_bytes": float(sent), "received_bytes": float(received)}

    # -- checkpoints -------------------------------------------------------------------------------------------
    def _trained_homes(self) -> list[tuple[str, ModelHandle]]:
        out = []
        for m in self.program.models:
            if self.program.is_trained(m):
                h = self._home(m)
                if h is not None:
                    out.append((m, h))
        return out

    def save(self, ckpt: Path, iteration: int) -> None:
        for m, h in self._trained_homes():
            dp_rank, tp_rank, pp_rank = h.coords
            # every dp rank takes part: a distributed optimizer gathers its sharded state (a collective)
            checkpoint.save_model_shard(ckpt, m, tp_rank, pp_rank, _layout_name(h.layout), h.model.params(),
                                        h.optimizer, write=dp_rank == 0, tp_pp=_tp_pp(h.layout))
        checkpoint.save_rng(ckpt, self.rank)
        self.partials.save(ckpt, iteration)

    def load(self, ckpt: Path, verify: bool) -> None:
        for m, h in self._trained_homes():
            _, tp_rank, pp_rank = h.coords
            checkpoint.load_model_shard(ckpt, m, tp_rank, pp_rank, _layout_name(h.layout), h.model.params(),
                                        h.optimizer, verify=verify, tp_pp=_tp_pp(h.layout))
        checkpoint.load_rng(ckpt, self.rank, verify=verify)

    def close(self) -> None:
        log.debug("closing: heartbeat")
        self.heartbeat.stop()
        self.heartbeat.join(timeout=2 * HEARTBEAT_INTERVAL)
        log.debug("closing: process group")
        if dist.is_initialized():
            dist.destroy_process_group()
        log.debug("closing: sockets")
        self.sock.close(linger=1000)
        self.zctx.term()
        log.debug("closed")


def _describe(req: protocol._Msg) -> str:
    """A request in a worker log line, iterations counted from 1 as the console and metrics.jsonl do."""
    it = getattr(req, "iteration", None)
    where = f"iteration {it + 1} " if isinstance(it, int) and it >= 0 else ""
    if isinstance(req, protocol.RunCall):
        rows = [tuple(r) for r in req.ranges] if req.ranges else [list(r) for r in req.rows] if req.rows else None
        return f"{where}call {req.call}" + (f" rows {rows}" if rows else "")
    if isinstance(req, protocol.Reallocate):
        return f"{where}realloc {req.model} {req.src_call}->{req.dst_call}"
    if isinstance(req, protocol.TransferData):
        return f"{where}data {req.key} -> {req.dst_call}"
    if isinstance(req, protocol.Offload):
        return f"{where}{'offload' if req.to_host else 'reload'} {req.model}"
    return f"{where}{req.type}"


def _layout_name(cl: CallLayout) -> str:
    return f"{cl.mesh.name} {cl.strategy}"


def _tp_pp(cl: CallLayout) -> tuple[int, int]:
    """What a checkpoint shard depends on: a layout with the same tp and pp resumes from it at any dp."""
    return cl.strategy.tp, cl.strategy.pp


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="realloc-worker", description="realloc model worker (started by `realloc run`)")
    for name in ("--experiment", "--run-dir", "--run-id"):
        p.add_argument(name, required=True)
    for name in ("--rank", "--world-size"):
        p.add_argument(name, type=int, required=True)
    p.add_argument("--store", required=True, help="host:port of the rendezvous TCPStore")
    p.add_argument("--store-fd", type=int, default=None, help="serve the store on this inherited listening socket")
    p.add_argument("--master", required=True, help="tcp://host:port of the master")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--set", action="append", default=[], help="KEY=VALUE experiment override (as the master's)")
    imported = time.time()  # this module's imports (torch, megatron) are done
    argv = worker_argv(sys.argv[1:] if argv is None else argv, preload=WORKER_PRELOAD)
    if argv is None:
        return 0  # started early, and the master stopped before the run did
    args = p.parse_args(argv)
    args.times = (process_start_time() or 0.0, imported, time.time())
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s worker{args.rank} %(levelname)s %(message)s",
                        force=True)  # a Ray actor's process may come with handlers of its own
    torch.set_num_threads(1)
    worker = ModelWorker(args)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, worker.on_stop_signal)
    try:
        worker.serve()
    finally:
        worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
