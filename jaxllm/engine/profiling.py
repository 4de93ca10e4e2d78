"""Trace: one jax.profiler trace at a time in this process (XProf / TensorBoard), for what starts and stops
profiles: LLM.start_profile, AsyncLLM (the server's /start_profile), a data-parallel replica's process."""

from __future__ import annotations


class Trace:
    def __init__(self) -> None:
        self.running = False

    def start(self, log_dir: str) -> None:
        import jax

        if self.running:
            raise RuntimeError("A profile is already running.")
        jax.profiler.start_trace(log_dir)
        self.running = True

    def stop(self) -> None:
        import jax

        if not self.running:
            raise RuntimeError("No profile is running.")
        jax.profiler.stop_trace()
        self.running = False
