"""SamplerPrograms: the sampler-only programs of a runner, the half of StepPrograms (programs.py) that samples
rows whose hidden states a step's start-up program returned.

A step with non-default sampler flags whose whole step program is not compiled yet runs "split": the bucket's
start-up program, then one of these (sampler_call). They are small and compile on first use, from the executable
cache, or in the background (a wider structured-output program serves meanwhile; sampler_ahead compiles the next
penalty width early). Cached in memory in `samplers` by (B, flags, row widths), and on disk in the executable
cache under the "sample" kind.

Separate from programs.py because these programs have their own keys, widths and background policy; StepPrograms
inherits them and owns the state they share (set in its __init__: cfg, exec_cache, the background pool
_background, samplers, _sampler_jobs, _sampler_jit, _rows_spec, exact_samplers, max_penalty_width and the
num_compiles_after_warmup counter), so every compiled program still has one owner.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import jax
import numpy as np

from jaxllm.engine.packing import pack_host_args
from jaxllm.engine.sampler import SamplingMetadata
from jaxllm.engine.step_io import StepVariant

logger = logging.getLogger("jaxllm.engine.programs")  # one logger for every compile message, as before


def array_spec(a) -> jax.ShapeDtypeStruct:
    """A device array's shape, dtype and sharding (to lower a program without holding the array)."""
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)


class SamplerPrograms:
    """Base of StepPrograms: its sampler-only programs (see the module docstring for the state it shares)."""

    def sampler_call(self, v: StepVariant, head, rows, prev_tokens, smd: SamplingMetadata):
        """(program, arguments) that sample v's rows (the hidden states of a step run by v's bucket's start-up
        program; head: the final norm and output weights). Each number of structured-output masks (a power of
        two up to B) is a program of its own, and one missing would be compiled in the engine loop (~1 s for an
        8B model's vocabulary), stalling every request. So when the exact one is neither compiled nor in the
        executable cache, a program for more masks samples this step (smd's masks padded with all-allowed
        rows, which no row's slot points at) while the exact one compiles in the background; the first such
        step of a B and flags compiles the one for B masks, which serves every count after it."""
        self._rows_spec.setdefault(v.num_seqs, array_spec(rows))
        args = (head, rows, prev_tokens, *pack_host_args(smd))
        key = (v.num_seqs, v.flags, v.sampler_widths)
        n_masks, B = v.sampler_widths[-1], v.num_seqs
        exe = self.samplers.get(key)
        if exe is not None or not v.flags.grammar or n_masks >= B or self.exact_samplers:
            return exe or self._sampler_executable(v, args), args
        exe = self._load_sampler(v, args)
        if exe is not None:
            return exe, args
        wider = sorted(
            k[2][-1] for k in self.samplers if k[:2] == key[:2] and k[2][:-1] == key[2][:-1] and k[2][-1] > n_masks
        )
        wide_v = dataclasses.replace(v, sampler_widths=v.sampler_widths[:-1] + (wider[0] if wider else B,))
        bitmask = np.full((wide_v.sampler_widths[-1], smd.token_bitmask.shape[1]), -1, np.int32)
        bitmask[:n_masks] = smd.token_bitmask
        wide_args = (head, rows, prev_tokens, *pack_host_args(dataclasses.replace(smd, token_bitmask=bitmask)))
        exe = self._sampler_executable(wide_v, wide_args)
        if key not in self._sampler_jobs:  # specs: the step's device arrays may be donated before it runs (the
            # head's too: a LoRA slot write donates the lm_head slot arrays)
            self._sampler_in_background(
                v, (jax.tree.map(array_spec, head), array_spec(rows), array_spec(prev_tokens), *args[3:])
            )
        return exe, wide_args

    def sampler_ahead(self, v: StepVariant, head, prev_tokens, smd: SamplingMetadata) -> None:
        """Penalty rows hold each sequence's token ids, so their width (a power of two) doubles as sequences
        grow, and each width is a step program and a sampler program of its own. A step with penalties makes
        sure the next width's sampler program is compiled or compiling in the background, so the step that
        crosses it runs split (see runs_whole) without waiting for a compiler (every running request would)."""
        widths = (2 * v.sampler_widths[0], 2 * v.sampler_widths[1]) + tuple(v.sampler_widths[2:])
        key = (v.num_seqs, v.flags, widths)
        rows = self._rows_spec.get(v.num_seqs)  # None until a split step of this B ran (so never when eager)
        if rows is None or key in self.samplers or key in self._sampler_jobs or widths[0] > self.max_penalty_width:
            return
        wider = lambda a: np.zeros((a.shape[0], 2 * a.shape[1]), a.dtype)  # noqa: E731
        smd = dataclasses.replace(
            smd, penalty_tokens=wider(smd.penalty_tokens), penalty_is_output=wider(smd.penalty_is_output)
        )
        self._sampler_in_background(
            dataclasses.replace(v, sampler_widths=widths),
            (jax.tree.map(array_spec, head), rows, array_spec(prev_tokens), *pack_host_args(smd)),
        )

    def _sampler_in_background(self, v: StepVariant, specs) -> None:
        """Compiles v's sampler program in the background for arguments like specs (stored in the executable
        cache, filed in self.samplers). A failure is only logged: the program is an optimisation (a wider one
        serves meanwhile, or the step that needs it compiles it then)."""

        def compile_sampler():
            try:
                self._compile_sampler(v, specs)
            except Exception:  # noqa: BLE001 - only an optimisation (see above)
                logger.exception(
                    "Compiling the sampler for B=%d %s %s in the background failed",
                    v.num_seqs,
                    v.flags,
                    v.sampler_widths,
                )

        self._sampler_jobs[(v.num_seqs, v.flags, v.sampler_widths)] = self._background.submit(compile_sampler)

    def _load_sampler(self, v: StepVariant, args):
        """v's sampler program from the executable cache (filed in self.samplers), or None."""
        if self.exec_cache is None:
            return None
        exe = self.exec_cache.load(self.exec_cache.key("sample", args, (self.cfg, v.flags)), args)
        if exe is not None:
            self.samplers[(v.num_seqs, v.flags, v.sampler_widths)] = exe
        return exe

    def _compile_sampler(self, v: StepVariant, args):
        """Compiles v's sampler program (storing it in the executable cache) and files it in self.samplers."""
        t0 = time.perf_counter()
        compile_fn = self._sampler_jit.lower(*args, cfg=self.cfg, flags=v.flags, mesh=self.attn.mesh).compile
        if self.exec_cache is None:
            exe = compile_fn()
        else:
            exe = self.exec_cache.compile_and_store(
                self.exec_cache.key("sample", args, (self.cfg, v.flags)), compile_fn
            )
        self.num_compiles_after_warmup += 1
        self.samplers.setdefault((v.num_seqs, v.flags, v.sampler_widths), exe)
        logger.info(
            "Sampler for B=%d %s %s compiled in %.2f s", v.num_seqs, v.flags, v.sampler_widths, time.perf_counter() - t0
        )
        return exe

    def _sampler_executable(self, v: StepVariant, args):
        """The sampler-only program for v's B, flags and row widths (compiled, from the executable cache, or
        compiled now: a small program, ~1.3 s on an H100 host for an 8B model's vocabulary)."""
        exe = self.samplers.get((v.num_seqs, v.flags, v.sampler_widths))
        return exe or self._load_sampler(v, args) or self._compile_sampler(v, args)
