"""The server's periodic stats line (vLLM's "Avg prompt throughput: ..." log), over the Prometheus metrics of
jaxllm.metrics.prometheus (EngineMetrics, which /metrics renders)."""

from __future__ import annotations

import asyncio
import logging
import time

from jaxllm.metrics.prometheus import EngineMetrics

logger = logging.getLogger("jaxllm.server")


class StatsLogger:
    """Logs vLLM's periodic line; quiet while the engine stays idle."""

    def __init__(self, metrics: EngineMetrics, interval: float):
        self.metrics = metrics
        self.interval = interval
        self._prev = (time.monotonic(), 0, 0)
        self._was_idle = True
        self._prev_spec = None  # the last line's SpecDecodeStats (speculative decoding's interval counts)

    def line(self) -> str | None:
        s = self.metrics.poll()
        now = time.monotonic()
        t0, p0, g0 = self._prev
        dt = max(now - t0, 1e-6)
        prompt_tput = (s.prompt_tokens - p0) / dt
        gen_tput = (s.generation_tokens - g0) / dt
        self._prev = (now, s.prompt_tokens, s.generation_tokens)
        idle = s.num_running == 0 and s.num_waiting == 0 and prompt_tput == 0 and gen_tput == 0
        if idle and self._was_idle:
            return None
        self._was_idle = idle
        hit_rate = 100.0 * s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        line = (
            f"Avg prompt throughput: {prompt_tput:.1f} tokens/s, Avg generation throughput: {gen_tput:.1f} tokens/s, "
            f"Running: {s.num_running} reqs, Waiting: {s.num_waiting} reqs, "
            f"GPU KV cache usage: {100.0 * s.kv_cache_usage:.1f}%, Prefix cache hit rate: {hit_rate:.1f}%"
        )
        spec = self._spec_line(s.spec_decode, dt)
        return line if spec is None else line + "\n" + spec

    def _spec_line(self, sd, dt: float) -> str | None:
        """vLLM's "SpecDecoding metrics" line over the interval since the last one (None: no drafts in it)."""
        prev, self._prev_spec = self._prev_spec, sd
        if sd is None:
            return None
        p = prev or type(sd)()
        drafts, drafted = sd.num_drafts - p.num_drafts, sd.num_draft_tokens - p.num_draft_tokens
        accepted = sd.num_accepted_tokens - p.num_accepted_tokens
        if not drafts:
            return None
        old = p.num_accepted_tokens_per_pos + [0] * len(sd.num_accepted_tokens_per_pos)
        rates = ", ".join(f"{(n - o) / drafts:.3f}" for n, o in zip(sd.num_accepted_tokens_per_pos, old, strict=False))
        return (
            f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, "
            f"Accepted throughput: {accepted / dt:.2f} tokens/s, Drafted throughput: {drafted / dt:.2f} tokens/s, "
            f"Accepted: {accepted} tokens, Drafted: {drafted} tokens, Per-position acceptance rate: {rates}, "
            f"Avg Draft acceptance rate: {100.0 * accepted / drafted if drafted else float('nan'):.1f}%"
        )

    async def run(self) -> None:
        s = self.metrics.poll()
        self._prev = (time.monotonic(), s.prompt_tokens, s.generation_tokens)
        self._prev_spec = s.spec_decode
        while True:
            await asyncio.sleep(self.interval)
            try:
                line = self.line()
            except Exception:
                logger.exception("stats logging failed")
                continue
            if line:
                logger.info(line)
