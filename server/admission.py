"""What the server has given the engine, the limits on it, and draining it at shutdown.

Admission counts, on the event loop, every generation request between being handed to the engine and
finishing: sequences in flight (waiting or running; a request with n choices counts n, as vLLM's
--max-num-queued-reqs) and prompt tokens not yet prefilled (requests without a first output yet, as vLLM's
--max-num-queued-tokens). A request past either limit gets 503 with Retry-After before it reaches the engine.

Shutdown (`drain`): new generation requests get 503 and /health turns 503 so that load balancers stop sending;
running ones may finish for up to --shutdown-timeout seconds; then each one left is interrupted: a stream ends
with an error event and [DONE], a non-streaming request gets a 503, and the abort is logged.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Protocol

from server.errors import APIError

logger = logging.getLogger("jaxllm.server")


@dataclass(frozen=True)
class ServerLimits:
    """The operator's limits (server/args.py's "limits and timeouts" flags); None means unlimited."""

    max_body_bytes: int = 64 * 2**20
    timeout_request_body: float | None = 60.0
    timeout_keep_alive: float = 5.0
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None
    shutdown_timeout: float = 25.0
    retry_after_s: int = 1

    @classmethod
    def from_args(cls, args) -> ServerLimits:
        """From server.args' namespace; fields it lacks keep their defaults, a timeout of 0 means none."""
        d = cls()

        def opt(name: str, default):
            value = getattr(args, name, None)
            return default if value is None else value

        return cls(
            max_body_bytes=opt("max_request_body_bytes", d.max_body_bytes),
            timeout_request_body=opt("timeout_request_body", d.timeout_request_body) or None,
            timeout_keep_alive=opt("timeout_keep_alive", d.timeout_keep_alive),
            max_num_queued_reqs=opt("max_num_queued_reqs", None),
            max_num_queued_tokens=opt("max_num_queued_tokens", None),
            shutdown_timeout=opt("shutdown_timeout", d.shutdown_timeout),
        )


class Interruptible(Protocol):
    """What Admission needs of a running request: its ids (for the log) and a way to end it with an error."""

    request_ids: list[str]

    def interrupt(self, err: APIError) -> None: ...


@dataclass(eq=False)  # held in a set by identity
class Ticket:
    """One admitted request's share of the counts; `release` is idempotent."""

    admission: Admission
    seqs: int
    prefill_tokens: int
    owner: Interruptible
    released: bool = field(default=False)

    def prefilled(self, tokens: int) -> None:
        """Part of the prompt has produced output: it no longer waits for prefill."""
        tokens = min(tokens, self.prefill_tokens)
        self.prefill_tokens -= tokens
        self.admission.queued_tokens -= tokens

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.admission._release(self)


class Admission:
    def __init__(self, limits: ServerLimits):
        self.limits = limits
        self.seqs = 0
        self.queued_tokens = 0
        self.draining = False
        self._tickets: set[Ticket] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    def admit(self, owner: Interruptible, seqs: int, prompt_tokens: int) -> Ticket:
        """Counts a request in, or raises 503 (shutting down, or a queue limit reached)."""
        lim = self.limits
        if self.draining:
            raise APIError("The server is shutting down and takes no new requests.", 503)
        if lim.max_num_queued_reqs is not None and self.seqs and self.seqs + seqs > lim.max_num_queued_reqs:
            raise self._busy(
                f"{self.seqs} sequences are already waiting or running, and this request adds {seqs} "
                f"(--max-num-queued-reqs {lim.max_num_queued_reqs})"
            )
        if lim.max_num_queued_tokens is not None and self.queued_tokens >= lim.max_num_queued_tokens:
            raise self._busy(
                f"{self.queued_tokens} prompt tokens are already waiting to be prefilled "
                f"(--max-num-queued-tokens {lim.max_num_queued_tokens})"
            )
        ticket = Ticket(self, seqs, prompt_tokens, owner)
        self.seqs += seqs
        self.queued_tokens += prompt_tokens
        self._tickets.add(ticket)
        self._idle.clear()
        return ticket

    def _busy(self, why: str) -> APIError:
        return APIError(
            f"The server is busy: {why}. Retry later.", 503, headers={"Retry-After": str(self.limits.retry_after_s)}
        )

    def _release(self, ticket: Ticket) -> None:
        self.seqs -= ticket.seqs
        self.queued_tokens -= ticket.prefill_tokens
        self._tickets.discard(ticket)
        if not self._tickets:
            self._idle.set()

    @property
    def in_flight(self) -> int:
        return len(self._tickets)

    async def drain(self, timeout: float, force: asyncio.Event | None = None) -> None:
        """Refuses new requests, waits up to `timeout` seconds (or until `force` is set) for the running ones,
        then interrupts those left and waits a moment for them to send their error."""
        self.draining = True
        if self._tickets:
            logger.info("Draining %d running requests for up to %g s (--shutdown-timeout)", len(self._tickets), timeout)
        waits = [asyncio.ensure_future(self._idle.wait())]
        if force is not None:
            waits.append(asyncio.ensure_future(force.wait()))
        try:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        if not self._tickets:
            return
        ids = [rid for t in self._tickets for rid in t.owner.request_ids]
        shown = ", ".join(ids[:10]) + (f" and {len(ids) - 10} more" if len(ids) > 10 else "")
        logger.warning(
            "Shutdown: aborting %d requests still running after %g s (--shutdown-timeout): %s",
            len(self._tickets),
            timeout,
            shown,
        )
        err = APIError(
            f"The server is shutting down: this request was aborted after {timeout:g} s of draining "
            "(--shutdown-timeout).",
            503,
        )
        for t in list(self._tickets):
            t.owner.interrupt(err)
        try:
            await asyncio.wait_for(self._idle.wait(), 5.0)
        except TimeoutError:
            pass  # a client that does not read: aiohttp's shutdown closes its connection
