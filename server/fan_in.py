"""The engine fan-in of the generation routes: EngineRunner, admitted by server.admission, adds a route's
EngineRequests to the engine and merges their RequestOutputs into one ordered event stream, tracking per-choice
state (RequestState, ChoiceState) so streaming code can compute deltas. Leaving the runner any way (done, error,
client gone, handler cancelled, shutdown) closes every engine iterator and aborts what is unfinished; engine
errors become APIErrors (to_api_error).

The engine sends DELTA outputs (RequestOutputKind.DELTA, as vLLM's OpenAI server asks for them): each carries
only the text, tokens and logprobs that are new since the request's previous output, and only the choices that
have something new (their finish once), so a request of L tokens costs O(L) to hand over, not O(L^2).
ChoiceState joins them back into each choice's output so far, the one place the routes read it from.

Separate from serving_common.py (server state, request checks, sampling params), which prepares requests;
this module runs them. Both generation routes use it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from jaxllm.engine.protocol import EngineClient, EngineDeadError
from jaxllm.outputs import CompletionOutput, PoolingRequestOutput, PromptLogprobs, RequestOutput, SampleLogprobs
from jaxllm.sampling_params import SamplingParams
from server.admission import Ticket
from server.errors import APIError
from server.protocol import PromptTokenUsageInfo, UsageInfo
from server.serving_common import ServerState

logger = logging.getLogger("jaxllm.server")


@dataclass
class EngineRequest:
    prompt: Any  # what engine.generate takes
    params: SamplingParams  # (PoolingParams for an embedding request)
    request_id: str
    prompt_ids: list[int]
    prompt_text: str | None
    lora_request: Any = None  # the adapter the request's model names (jaxllm.lora.request.LoRARequest)
    beam: Any = None  # BeamSearchParams: the request is a beam search (engine.beam_search), params its bookkeeping


@dataclass
class ChoiceState:
    """One choice's output so far (its DELTA outputs joined), and how much of it a stream has sent."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs = field(default_factory=list)  # one entry per token when the request asks for them
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_text: int = 0
    sent_tokens: int = 0
    finish_sent: bool = False

    def add(self, o: CompletionOutput) -> None:
        """Appends a DELTA output's new text, tokens and logprobs; its finish comes with the last one."""
        self.text += o.text
        self.token_ids.extend(o.token_ids)
        self.logprobs.extend(o.logprobs or ())
        self.finish_reason, self.stop_reason = o.finish_reason, o.stop_reason


@dataclass
class RequestState:
    request: EngineRequest
    choices: list[ChoiceState]
    last: RequestOutput | None = None  # the latest output: its prompt and metrics (its completions are deltas)
    prompt_logprobs: PromptLogprobs | None = None  # a DELTA output carries them once
    finished: bool = False

    def apply(self, out: RequestOutput) -> None:
        self.last = out
        if isinstance(out, PoolingRequestOutput):  # an embedding request: one output, no choices
            self.finished = self.finished or out.finished
            return
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        for o in out.outputs:
            self.choices[o.index].add(o)
        self.finished = self.finished or out.finished

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)


_DONE = object()


class EngineRunner:
    """Runs engine requests concurrently and merges their outputs into one stream of (request index, state).

    Use as `async with EngineRunner(...) as run: await run.start(); async for i, rs in run.events(): ...`.
    """

    def __init__(self, state: ServerState, requests: list[EngineRequest], priority: int = 0):
        self.engine = state.engine
        self.metrics = state.metrics
        self.admission = state.admission
        self.priority = priority
        self.states = [RequestState(r, [ChoiceState() for _ in range(_n(r.params))]) for r in requests]
        self.request_ids = [r.request_id for r in requests]
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._buffer: list = []
        self._live = len(requests)
        self._ticket: Ticket | None = None

    async def __aenter__(self) -> EngineRunner:
        """Admission first (a 503 when the server is busy or shutting down), then the requests go in."""
        self._ticket = self.admission.admit(
            self,
            sum(_n(r.params) for r in (s.request for s in self.states)),
            sum(len(s.request.prompt_ids) for s in self.states),
        )
        self._tasks = [asyncio.create_task(self._pump(i)) for i in range(len(self.states))]
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def start(self) -> None:
        """Waits until every request has produced its first output, so that invalid input (the engine's
        ValueError before its first yield) is still answered with a status code, not inside a stream."""
        waiting = set(range(len(self.states)))
        while waiting:
            item = await self._queue.get()
            self._buffer.append(item)
            i, _, exc = item
            if exc is not None and exc is not _DONE:
                raise to_api_error(exc)
            waiting.discard(i)

    async def events(self) -> AsyncIterator[tuple[int, RequestState]]:
        while self._live:
            i, out, exc = self._buffer.pop(0) if self._buffer else await self._queue.get()
            if exc is _DONE:
                self._live -= 1
                continue
            if exc is not None:
                raise to_api_error(exc)
            rs = self.states[i]
            rs.apply(out)
            yield i, rs

    async def run_to_end(self) -> list[RequestState]:
        async for _ in self.events():
            pass
        return self.states

    def interrupt(self, err: APIError) -> None:
        """Ends the event stream with `err` (shutdown): leaving the runner then aborts what is unfinished."""
        self._queue.put_nowait((-1, None, err))

    async def close(self) -> None:
        try:
            for t in self._tasks:
                t.cancel()
            if self._tasks:
                # shielded: a second cancellation of the handler (the client hangs up while this waits) must
                # not cut the pumps' aborts short
                await asyncio.shield(asyncio.gather(*self._tasks, return_exceptions=True))
        finally:
            if self._ticket is not None:
                self._ticket.release()

    async def _pump(self, i: int) -> None:
        rs = self.states[i]
        req = rs.request
        tracker = self.metrics.tracker(req.request_id, getattr(req.params, "max_tokens", None))
        gen = None
        got_output = failed = False
        try:
            lora = {} if req.lora_request is None else {"lora_request": req.lora_request}
            if req.beam is not None:
                gen = self.engine.beam_search(req.prompt, req.request_id, req.beam, priority=self.priority, **lora)
            else:
                gen = self.engine.generate(req.prompt, req.params, req.request_id, priority=self.priority, **lora)
            async for out in gen:
                if not got_output:
                    got_output = True
                    self._ticket.prefilled(len(req.prompt_ids))
                tracker.on_output(out)
                if out.finished:
                    rs.finished = True
                self._queue.put_nowait((i, out, None))
            self._queue.put_nowait((i, None, _DONE))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            # Rejected (bad input, a request id already in use) or failed in the engine: either way the
            # engine holds nothing of it, and an abort by id could hit another request of the same id.
            failed = True
            self._queue.put_nowait((i, None, e))
        finally:
            if not rs.finished:
                if got_output or not failed:  # abandoned running or still waiting (vLLM counts both), or failed
                    tracker.on_abort(rs.last, _n(req.params))
                if not failed:
                    await _close_and_abort(self.engine, gen, req.request_id)


async def _close_and_abort(engine: EngineClient, gen, request_id: str) -> None:
    """Closing the iterator aborts the request (engine contract); abort() again in case it is not a generator."""
    try:
        aclose = getattr(gen, "aclose", None)
        if aclose is not None:
            await aclose()
    except Exception:
        logger.exception("closing the output stream of %s failed", request_id)
    try:
        await engine.abort(request_id)
    except Exception:
        logger.exception("aborting %s failed", request_id)


def _n(params) -> int:
    """A request's sequences: SamplingParams' n, 1 for an embedding request's PoolingParams."""
    return getattr(params, "n", 1)


def to_api_error(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValueError):
        return APIError(str(exc), 400)
    if isinstance(exc, EngineDeadError):
        return APIError(f"The engine is dead: {exc}", 500)
    logger.error("request failed in the engine", exc_info=exc)
    return APIError(f"Internal error: {type(exc).__name__}: {exc}", 500)


def output_size(states: list[RequestState]) -> int:
    """About how many bytes the response for `states` takes, to pick the worker lane that builds it."""
    total = 0
    for rs in states:
        lp = rs.request.params.logprobs
        per_token = 40 * (1 + (lp if lp is not None and lp > 0 else 0))
        total += sum(len(c.text) + per_token * len(c.token_ids) for c in rs.choices)
    return total


def usage_of(states: list[RequestState], cached_details: bool = False) -> UsageInfo:
    """The requests' summed usage; cached_details (--enable-prompt-tokens-details): with prompt_tokens_details'
    cached_tokens, the prompt tokens the prefix cache served, where there are any (vLLM's)."""
    prompt = sum(len(rs.request.prompt_ids) for rs in states)
    completion = sum(rs.completion_tokens for rs in states)
    usage = UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
    cached = sum((rs.last.num_cached_tokens or 0) for rs in states if rs.last is not None) if cached_details else 0
    if cached:
        usage.prompt_tokens_details = PromptTokenUsageInfo(cached_tokens=cached)
    return usage


def choice_usage(rs: RequestState, j: int | None) -> UsageInfo:
    """A stream chunk's usage under continuous_usage_stats, as vLLM's: its own prompt's tokens and the tokens its
    choice j has so far (j None: a chunk before any token, the role or the echo)."""
    prompt = len(rs.request.prompt_ids)
    completion = 0 if j is None else len(rs.choices[j].token_ids)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


# -------------------------------------------------------------------------------------------------- SSE
