"""Data parallelism (vLLM's --data-parallel-size D): D engine replicas on disjoint device groups of one host,
behind one front end.

Replica r is a whole LLMEngine on devices [r * W, (r + 1) * W) of this host (W = tp * pp): its own weights, KV
cache, scheduler and compiled programs. All replicas live in this one process. jax dispatches a step and
returns, so one host thread keeps several devices busy (a replica's step runs on its devices while the host
prepares another's); a process per replica would add an IPC layer of our own for nothing jax needs. Offline,
DPEngine steps the replicas in turn from the caller's thread; the server's DPAsyncLLM gives each its own
AsyncLLM (engine thread).

Requests go to the replica with the least load: the sequences it was given that have not finished (its waiting
plus running, and those on their way in), as vLLM's DP load balancer counts them. Where cheap it follows the
prefix cache: among replicas within LOAD_SLACK of the least loaded one, the one that served the longest
prefix of this prompt's first PREFIX_BLOCKS blocks (chained block hashes, as the block manager keys its cache)
gets it. Metrics carry vLLM's `engine` label, the replica's index.
"""

from __future__ import annotations

import collections
import itertools
import logging
from collections.abc import AsyncIterator

from jaxllm.engine.args import EngineArgs
from jaxllm.engine.protocol import EngineStats, PromptType, SpecDecodeStats
from jaxllm.outputs import RequestOutput
from jaxllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PREFIX_BLOCKS = 32  # prompt blocks hashed for routing (512 tokens at block size 16)
PREFIXES_KEPT = 1 << 16  # block hashes remembered per replica (least recently used go first)
ROUTES_KEPT = 1 << 16  # request id -> replica, for the metrics' engine label


def replica_devices(args: EngineArgs, replica: int) -> list:
    """Replica r's devices: the r-th group of tp * pp of this host's devices."""
    import jax

    width = args.tensor_parallel_size * args.pipeline_parallel_size
    devices = jax.local_devices()
    if args.data_parallel_size * width > len(devices):
        raise ValueError(
            f"data_parallel_size * tensor_parallel_size * pipeline_parallel_size = {args.data_parallel_size} * "
            f"{args.tensor_parallel_size} * {args.pipeline_parallel_size} exceeds the {len(devices)} devices of "
            "this host."
        )
    return devices[replica * width : (replica + 1) * width]


def build_replicas(args: EngineArgs) -> list:
    """The D LLMEngines, one after another. (Built side by side in threads, two tokenizer threads imported
    transformers at once and one found it half imported: AttributeError on PreTrainedTokenizerFast.)"""
    import jax

    from jaxllm.engine.llm_engine import LLMEngine

    if jax.process_count() > 1:
        raise ValueError(
            "data_parallel_size > 1 runs replicas on the devices of one host; it cannot be combined "
            "with several processes (--num-processes)."
        )
    groups = [replica_devices(args, r) for r in range(args.data_parallel_size)]
    engines = [LLMEngine(args, devices=g) for g in groups]
    logger.info(
        "%d data-parallel replicas ready, on devices %s",
        len(engines),
        "; ".join(",".join(str(d.id) for d in g) for g in groups),
    )
    return engines


class Router:
    """Picks a replica per request: least load, prefix-cache aware (see the module docstring). Not thread-safe:
    one caller (the event loop, or the offline caller's thread)."""

    LOAD_SLACK = 0.25  # a prefix match may send a request to a replica this much (relative, at least 1) busier

    def __init__(self, num_replicas: int, block_size: int):
        self.block_size = block_size
        self.load = [0] * num_replicas  # sequences given and not finished
        self.counts = [0] * num_replicas  # requests routed, ever
        self._prefixes = [collections.OrderedDict() for _ in range(num_replicas)]
        self._routes: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._turn = itertools.count()

    def route(self, request_id: str, prompt, num_seqs: int, lora_request=None) -> int:
        hashes = self._block_hashes(prompt, 0 if lora_request is None else lora_request.lora_int_id)
        low = min(self.load)
        slack = max(1, int(low * self.LOAD_SLACK))
        order = next(self._turn)  # ties between equal replicas rotate
        n = len(self.load)
        best, best_key = 0, None
        for j in range(n):
            r = (order + j) % n
            if self.load[r] > low + slack:
                continue
            key = (self._matched(r, hashes), -self.load[r])
            if best_key is None or key > best_key:
                best, best_key = r, key
        self.load[best] += num_seqs
        self.counts[best] += 1
        seen = self._prefixes[best]
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > PREFIXES_KEPT:
            seen.popitem(last=False)
        self._routes[request_id] = best
        while len(self._routes) > ROUTES_KEPT:
            self._routes.popitem(last=False)
        return best

    def done(self, replica: int, num_seqs: int) -> None:
        self.load[replica] -= num_seqs

    def replica_of(self, request_id: str) -> int:
        return self._routes.get(request_id, 0)

    def _matched(self, replica: int, hashes: list[int]) -> int:
        seen, n = self._prefixes[replica], 0
        for h in hashes:
            if h not in seen:
                break
            n += 1
        return n

    def _block_hashes(self, prompt, lora_id: int = 0) -> list[int]:
        """Chained hashes of the prompt's first full blocks of token ids (a text prompt: of its characters, a
        block_size * 4 at a time), salted with its cache_salt and LoRA adapter: the engine's prefix cache keys
        blocks alike."""
        salt, ids = None, prompt
        if isinstance(prompt, dict):
            salt = prompt.get("cache_salt")
            ids = prompt.get("prompt_token_ids", prompt.get("prompt"))
        size = self.block_size * (4 if isinstance(ids, str) else 1)
        if not isinstance(ids, (str, list, tuple)):
            return []
        out, h = [], hash((salt, lora_id))
        for i in range(min(len(ids) // size, PREFIX_BLOCKS)):
            h = hash(
                (
                    h,
                    tuple(ids[i * size : (i + 1) * size])
                    if not isinstance(ids, str)
                    else ids[i * size : (i + 1) * size],
                )
            )
            out.append(h)
        return out


class DPEngine:
    """LLM's engine for data_parallel_size > 1: the LLMEngine surface LLM uses, over D replicas. step() steps
    every replica with work, in turn: each dispatches its next step before it waits for its previous one, so
    the replicas' devices run at once."""

    def __init__(self, args: EngineArgs):
        self.replicas = build_replicas(args)
        first = self.replicas[0]
        self.args, self.tokenizer, self.runner = args, first.tokenizer, first.runner
        self.model_config, self.max_model_len, self.vocab_size = (
            first.model_config,
            first.max_model_len,
            first.vocab_size,
        )
        self.max_logprobs, self.eos_token_ids = first.max_logprobs, first.eos_token_ids
        self.generation_defaults, self.model_name = first.generation_defaults, first.model_name
        self.router = Router(len(self.replicas), args.block_size)
        self._where: dict[str, tuple[int, int]] = {}  # request id -> (replica, sequences)

    def default_sampling_params(self) -> SamplingParams:
        return self.replicas[0].default_sampling_params()

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request=None,
    ) -> None:
        if request_id in self._where:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        n = (params or self.default_sampling_params()).n
        r = self.router.route(request_id, prompt, n, lora_request)
        try:
            self.replicas[r].add_request(request_id, prompt, params, arrival_time, priority, lora_request=lora_request)
        except BaseException:
            self.router.done(r, n)
            raise
        self._where[request_id] = (r, n)

    def abort_request(self, request_id: str) -> None:
        where = self._where.pop(request_id, None)
        if where is not None:
            self.replicas[where[0]].abort_request(request_id)
            self.router.done(*where)

    def has_unfinished_requests(self) -> bool:
        return any(e.has_unfinished_requests() for e in self.replicas)

    # LoRA adapters: every replica serves every adapter (vLLM's DP engines all get add_lora)
    def add_lora(self, lora_request) -> bool:
        return all([e.add_lora(lora_request) for e in self.replicas])

    def remove_lora(self, lora_id: int) -> bool:
        return all([e.remove_lora(lora_id) for e in self.replicas])

    def list_loras(self) -> set[int]:
        return self.replicas[0].list_loras()

    def step(self) -> list[RequestOutput]:
        outputs = []
        for e in self.replicas:
            if e.has_unfinished_requests():
                outputs += e.step()
        for out in outputs:
            if out.finished:
                self._finished(out.request_id)
        return outputs

    def pop_failures(self) -> dict[str, Exception]:
        failed = {}
        for e in self.replicas:
            failed.update(e.pop_failures())
        for request_id in failed:
            self._finished(request_id)
        return failed

    def _finished(self, request_id: str) -> None:
        where = self._where.pop(request_id, None)
        if where is not None:
            self.router.done(*where)

    def stats(self) -> EngineStats:
        return merge_stats([e.stats() for e in self.replicas])


def merge_stats(stats: list[EngineStats]) -> EngineStats:
    """One snapshot for all replicas (the stats log line): sums, and the mean KV usage."""
    specs = [s.spec_decode for s in stats if s.spec_decode is not None]
    spec = None
    if specs:  # speculative decoding's counters, per draft position too
        width = max(len(sd.num_accepted_tokens_per_pos) for sd in specs)
        spec = SpecDecodeStats(
            sum(sd.num_drafts for sd in specs),
            sum(sd.num_draft_tokens for sd in specs),
            sum(sd.num_accepted_tokens for sd in specs),
            [
                sum(sd.num_accepted_tokens_per_pos[i] for sd in specs if i < len(sd.num_accepted_tokens_per_pos))
                for i in range(width)
            ],
        )
    return EngineStats(
        sum(s.num_running for s in stats),
        sum(s.num_waiting for s in stats),
        sum(s.kv_cache_usage for s in stats) / len(stats),
        sum(s.prefix_cache_queries for s in stats),
        sum(s.prefix_cache_hits for s in stats),
        sum(s.num_preemptions for s in stats),
        sum(s.prompt_tokens for s in stats),
        sum(s.generation_tokens for s in stats),
        [n for s in stats for n in s.iteration_tokens],
        spec_decode=spec,
    )


class DPAsyncLLM:
    """The server's EngineClient over D replicas, each an AsyncLLM (its own engine thread)."""

    def __init__(self, replicas: list):
        self.replicas = replicas
        first = replicas[0]
        self.model_name, self.max_model_len = first.model_name, first.max_model_len
        self.vocab_size, self.max_logprobs = first.vocab_size, first.max_logprobs
        self.router = Router(len(replicas), first.engine.args.block_size)

    @classmethod
    def from_engine_args(cls, **kwargs) -> DPAsyncLLM:
        from jaxllm.engine.async_engine import AsyncLLM

        kwargs.setdefault("server_mode", True)
        return cls([AsyncLLM(e) for e in build_replicas(EngineArgs.from_kwargs(**kwargs))])

    @property
    def num_engines(self) -> int:
        return len(self.replicas)

    def get_tokenizer(self):
        return self.replicas[0].get_tokenizer()

    def default_sampling_params(self) -> dict:
        return self.replicas[0].default_sampling_params()

    @property
    def is_running(self) -> bool:
        return all(r.is_running for r in self.replicas)

    @property
    def errored(self) -> bool:
        return any(r.errored for r in self.replicas)

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        lora_request=None,
    ) -> AsyncIterator[RequestOutput]:
        n = sampling_params.n
        r = self.router.route(request_id, prompt, n, lora_request)
        try:
            async for out in self.replicas[r].generate(
                prompt, sampling_params, request_id, priority=priority, lora_request=lora_request
            ):
                yield out
        finally:
            self.router.done(r, n)

    async def abort(self, request_id: str) -> None:
        await self.replicas[self.router.replica_of(request_id)].abort(request_id)

    async def add_lora(self, lora_request) -> bool:
        return all([await r.add_lora(lora_request) for r in self.replicas])

    async def remove_lora(self, lora_id: int) -> bool:
        return all([await r.remove_lora(lora_id) for r in self.replicas])

    async def list_loras(self) -> set[int]:
        return await self.replicas[0].list_loras()

    def engine_index(self, request_id: str) -> int:
        """The replica that serves (or served) request_id: the metrics' engine label."""
        return self.router.replica_of(request_id)

    def stats(self) -> EngineStats:
        return merge_stats(self.stats_per_engine())

    def stats_per_engine(self) -> list[EngineStats]:
        return [r.stats() for r in self.replicas]

    def cache_config_info(self) -> dict[str, str]:
        return self.replicas[0].cache_config_info()

    def cache_config_info_per_engine(self) -> list[dict[str, str]]:
        """vllm:cache_config_info's labels per replica (each sized its own KV cache)."""
        return [r.cache_config_info() for r in self.replicas]

    def start_profile(self, log_dir: str) -> None:
        self.replicas[0].start_profile(log_dir)  # jax's profiler traces the whole process: every replica

    def stop_profile(self) -> None:
        self.replicas[0].stop_profile()

    async def shutdown(self) -> None:
        for r in self.replicas:
            await r.shutdown()
