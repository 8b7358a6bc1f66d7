"""Checkpoints during a run: the plan's saves, HF exports beside them, and the last save of a stopped run.

``CheckpointSaves`` is one part of ``Master`` (``master.py``), which creates the state these methods share.
A checkpoint is named after the iterations it holds (``iter_00000010`` is the state after iteration 10)
and written to a temporary folder that ``checkpoint.commit`` renames, so a crash never leaves a half one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from realloc.runtime.control.master_link import RunFailed
from realloc.runtime.control.stop_signals import SAVE_SAFETY, checkpoint_seconds
from realloc.runtime.persist import checkpoint
from realloc.runtime.persist.run_settings import checkpoint_settings
from realloc.runtime.records.run_record import resolved_experiment
from realloc.runtime.records.run_paths import os_error_line
from realloc.runtime.wire import protocol

log = logging.getLogger("realloc.master")


class CheckpointSaves:
    """When to save, saving, exporting, and the stop's final save (a part of ``Master``)."""

    def _saves_after(self, t: int) -> bool:
        """A checkpoint after iteration ``t``: the plan's every N (the last iteration included), or the run's
        final state (``save_final``: ``realloc run`` saves it unless ``--no-final-checkpoint``)."""
        return (self._every(self.save_every, t) or self._every(self.export_every, t)
                or (self.save_final and t == self.end - 1))

    def _every(self, n: int, t: int) -> bool:
        return n > 0 and ((t + 1) % n == 0 or t == self.end - 1)

    def _model_records(self) -> dict[str, dict[str, Any]]:
        """meta.json's description of each trained model, so that `realloc export` needs only the checkpoint."""
        from realloc.data.tokenizer import Tokenizer
        from realloc.runtime.persist.run_settings import model_record
        from realloc.runtime.records.text_io import SpecialTokens

        prog, cfg = self.program, self.config
        tokenizer = Tokenizer.load(cfg.tokenizer) if cfg.tokenizer else None
        ids = SpecialTokens.of(self.spec, tokenizer).hf_ids()
        out = {}
        for m in prog.models:
            if prog.is_trained(m):
                src = self.spec.models.get(m)
                out[m] = model_record(prog.model_config(m), prog.calls[prog.home_call(m)].strategy,
                                      src.path if src else None, cfg.tokenizer, ids)
        return out

    async def _save(self, t: int) -> None:
        # Named after the iterations it holds: iter_00000010 is the state after iteration 10 (t = 9).
        began = time.monotonic()
        done = t + 1
        tmp = checkpoint.begin(self.paths.checkpoints, done)
        rec = self._send(range(self.n_workers), "save", f"checkpoint {done}", t, "save",
                         lambda req: protocol.SaveCheckpoint(req=req, directory=str(tmp), iteration=t))
        await self._wait(rec)
        prog = self.program
        layouts = {m: f"{prog.calls[prog.home_call(m)].mesh.name} {prog.calls[prog.home_call(m)].strategy}"
                   for m in prog.models if prog.is_trained(m)}
        meta = {"next_iteration": done, "prompts_consumed": done * prog.batch_size, "seed": self.config.seed,
                "experiment": self.spec.name, "graph_digest": self.graph.digest, "run_id": self.run_id,
                "layouts": layouts, "models": self.model_records, "schedule_iterations": self.schedule_iterations,
                "settings": checkpoint_settings(self.spec, self.paths.root,
                                                resolved_experiment(self.spec, self.graph, self.config))}
        final = await asyncio.to_thread(checkpoint.commit, tmp, self.paths.checkpoints, done, meta,
                                        prog.plan.to_json())
        self.longest_save = max(self.longest_save or 0.0, time.monotonic() - began)
        self.last_saved = final
        if self._every(self.export_every, t):
            # The export reads the committed checkpoint on a thread while training goes on (the task is named
            # after it, so that pruning leaves it alone until the export is done).
            self.exports.append(asyncio.create_task(asyncio.to_thread(self._export, final, done), name=str(final)))
        if self.keep_checkpoints:
            busy = [Path(task.get_name()) for task in self.exports if not task.done()]
            await asyncio.to_thread(checkpoint.prune, self.paths.checkpoints, final, self.keep_checkpoints, busy)

    async def prune_after_exports(self) -> None:
        """At the end of the run, once every export is done: the checkpoints they kept from the saves' pruning
        (a save while they were read leaves them for the next save, and after the last there is none) go now."""
        if self.keep_checkpoints and self.exports and self.last_saved is not None:
            await asyncio.to_thread(checkpoint.prune, self.paths.checkpoints, self.last_saved, self.keep_checkpoints)

    def _export(self, ckpt: Path, done: int) -> None:
        from realloc.runtime.persist.export import export_checkpoint

        for m in self.model_records:
            out = self.paths.root / "exports" / checkpoint.checkpoint_name(done) / m
            try:
                export_checkpoint(ckpt, m, out)
            except OSError as e:  # (it named only the export's temporary folder)
                raise RunFailed(f"the export of {m} after iteration {done} (--export-every) could not be written: "
                                f"{os_error_line(e)}; checkpoint {ckpt} holds that state (`realloc export` it "
                                f"later)") from None
            log.info("exported %s after iteration %d to %s", m, done, out)

    async def _stop_after(self, t: int) -> None:
        """The stop's last step after iteration ``t``: a checkpoint if there is time, then the end of the run."""
        stop = self.stop
        assert stop is not None and self.all_done is not None
        stop.after_iteration = t + 1
        try:
            name = self.paths.checkpoints / checkpoint.checkpoint_name(t + 1)
            if self._saves_after(t):
                stop.checkpoint = str(name)  # the plan's own save of this iteration
            else:
                need = checkpoint_seconds(self.program, self.n_workers, self.longest_save)
                left = stop.deadline - time.monotonic()
                if SAVE_SAFETY * need <= left:
                    await self._save(t)
                    stop.checkpoint = str(name)
                else:
                    stop.note = (f"no checkpoint: one takes about {need:.1f} s and {max(left, 0.0):.1f} s were left; "
                                 f"the newest is in {self.paths.checkpoints}")
        except RunFailed:
            pass  # recorded; run() raises it
        except OSError as e:  # the master's part of the save: a full disk or a read-only run directory
            self.fail(f"checkpoint {t + 1} could not be written: {os_error_line(e)}")
        finally:
            self.all_done.set()
