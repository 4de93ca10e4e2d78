"""Data parallelism (vLLM's --data-parallel-size D): D engine replicas on disjoint device groups of one host,
behind one front end.

Replica r is a whole LLMEngine on devices [r * W, (r + 1) * W) of this host (W = tp * pp): its own weights, KV
cache, scheduler and compiled programs, in its own process (jaxllm/engine/dp_process.py), as vLLM runs an engine
core process per DP rank. In one process the replicas' host work (scheduling, input preparation, output
processing, detokenization: Python, under the GIL, 0.5-0.7x of the device time per step at these batch sizes)
ran one replica at a time: two H200s gave 22,885 output tok/s against one GPU's 16,954 (1.35x; bench/multihost.py,
8B shape, 1000 prompts x 128/128, at 0a10660). This process keeps the front end: the tokenizer, the router and
the requests' bookkeeping; it never starts jax on the replicas' devices. Offline, DPEngine collects the steps'
outputs the replicas send; the server's DPAsyncLLM (dp_async.py) streams them to each request.

Requests go to the replica with the least load: the sequences it was given that have not finished (its waiting
plus running, and those on their way in), as vLLM's DP load balancer counts them. Where cheap it follows the
prefix cache: among replicas within LOAD_SLACK of the least loaded one, the one that served the longest
prefix of this prompt's first PREFIX_BLOCKS blocks (chained block hashes, as the block manager keys its cache)
gets it. Metrics carry vLLM's `engine` label, the replica's index. A replica process that dies fails its
requests with an error naming it, and the engine stops taking requests (the server then exits non-zero).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import queue
import weakref
from dataclasses import dataclass

from jaxllm.engine.args import EngineArgs
from jaxllm.engine.dp_process import ReplicaProcess, check_single_process
from jaxllm.engine.protocol import EngineDeadError, EngineStats, PromptType, SpecDecodeStats
from jaxllm.outputs import RequestOutput
from jaxllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PREFIX_BLOCKS = 32  # prompt blocks hashed for routing (512 tokens at block size 16)
PREFIXES_KEPT = 1 << 16  # block hashes remembered per replica (least recently used go first)
ROUTES_KEPT = 1 << 16  # request id -> replica, for the metrics' engine label
STEP_WAIT_S = 0.5  # DPEngine.step() waits this long at most for a replica's message


@dataclass(frozen=True)
class FrontEnd:
    """What this process's front end needs of the model: its tokenizer and generation_config.json's EOS ids and
    sampling defaults (loaded here, as each replica does), and the replicas' engine limits (from replica 0)."""

    tokenizer: object
    eos_token_ids: set[int]
    generation_defaults: dict
    model_name: str
    max_model_len: int
    vocab_size: int
    max_logprobs: int


def start_replicas(args: EngineArgs) -> tuple[list[ReplicaProcess], FrontEnd]:
    """Starts the D replica processes (they build their engines at once, side by side), loads the tokenizer here
    meanwhile, and waits until every replica is ready. A replica's start-up error is raised here, and the others
    are stopped."""
    from jax._src import xla_bridge

    from jaxllm.config import read_hf_config
    from jaxllm.engine.model_files import resolve_model_dir
    from jaxllm.engine.tokenizer_setup import tokenizer_parts

    args.validate()
    check_single_process()
    if xla_bridge.backends_are_initialized() and xla_bridge.get_backend().platform != "cpu":
        logger.warning(
            "jax already runs on this process's GPUs: the memory it holds there is not free for the data-parallel "
            "replicas (start them before any jax computation)"
        )
    path = resolve_model_dir(args)  # a model id downloads here, once, before the replicas look for it
    replicas: list[ReplicaProcess] = []
    try:
        for r in range(args.data_parallel_size):
            replicas.append(ReplicaProcess(args, r))
        tokenizer, eos, defaults, _ = tokenizer_parts(args, path, args.overridden_config(read_hf_config(path)))
        infos = [p.wait_ready() for p in replicas]
    except BaseException:
        for p in replicas:
            p.close(timeout=1.0)
        raise
    logger.info(
        "%d data-parallel replicas ready, processes %s, devices %s",
        len(replicas),
        ", ".join(str(i["pid"]) for i in infos),
        "; ".join(",".join(i["devices"]) + (f" (CUDA {i['visible']})" if i["visible"] else "") for i in infos),
    )
    first = infos[0]
    return replicas, FrontEnd(
        tokenizer, eos, defaults, args.model, first["max_model_len"], first["vocab_size"], first["max_logprobs"]
    )


def _close_all(replicas: list[ReplicaProcess]) -> None:
    for p in replicas:
        p.close()


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
    """LLM's engine for data_parallel_size > 1: the LLMEngine surface LLM uses, over D replica processes. Each
    replica steps on its own while it has work and sends its outputs; step() returns what arrived (waiting up to
    STEP_WAIT_S for something, without spinning)."""

    runner = None  # the models run in the replica processes (LLM checks runner for a multi-process engine)

    def __init__(self, args: EngineArgs):
        self.replicas, front = start_replicas(args)
        self._finalizer = weakref.finalize(self, _close_all, self.replicas)  # no replica outlives its engine
        self.args, self.tokenizer = args, front.tokenizer
        self.max_model_len, self.vocab_size, self.max_logprobs = (
            front.max_model_len,
            front.vocab_size,
            front.max_logprobs,
        )
        self.eos_token_ids, self.generation_defaults = front.eos_token_ids, front.generation_defaults
        self.model_name = front.model_name
        self.router = Router(len(self.replicas), args.block_size)
        self._where: dict[str, tuple[int, int]] = {}  # request id -> (replica, sequences)
        self._events: queue.Queue = queue.Queue()  # (replica, kind, payload) from the replicas' reader threads
        self._failed: dict[str, Exception] = {}
        self._dead: str | None = None
        for r, p in enumerate(self.replicas):
            p.start_io(lambda kind, payload, r=r, q=self._events: q.put((r, kind, payload)))

    def default_sampling_params(self) -> SamplingParams:
        return SamplingParams(**self.generation_defaults)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request=None,
    ) -> None:
        """Queues the request for its replica. Bad input (the replica's ValueError) fails it at a later step:
        pop_failures(), as any request that fails in flight."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if request_id in self._where:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        params = params or self.default_sampling_params()
        r = self.router.route(request_id, prompt, params.n, lora_request)
        try:
            self.replicas[r].send("add", request_id, prompt, params, arrival_time, priority, lora_request)
        except BaseException:
            self.router.done(r, params.n)
            raise
        self._where[request_id] = (r, params.n)

    def abort_request(self, request_id: str) -> None:
        where = self._where.pop(request_id, None)
        if where is not None:
            self.router.done(*where)
            with contextlib.suppress(EngineDeadError):  # a dead replica has nothing to abort
                self.replicas[where[0]].send("abort", request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._where)

    # LoRA adapters: every replica serves every adapter (vLLM's DP engines all get add_lora)
    def add_lora(self, lora_request) -> bool:
        return all([f.result() for f in [p.call("add_lora", lora_request) for p in self.replicas]])

    def remove_lora(self, lora_id: int) -> bool:
        return all([f.result() for f in [p.call("remove_lora", lora_id) for p in self.replicas]])

    def list_loras(self) -> set[int]:
        return self.replicas[0].call_sync("list_loras")

    def step(self) -> list[RequestOutput]:
        try:
            events = [self._events.get(timeout=STEP_WAIT_S)]
        except queue.Empty:
            return []
        while True:
            try:
                events.append(self._events.get_nowait())
            except queue.Empty:
                break
        outputs = []
        for r, kind, payload in events:
            if kind == "dead":
                self._replica_died(r, payload)
                continue
            outs, failures = payload
            for out in outs:
                if self._where.get(out.request_id, (None,))[0] == r:  # not aborted meanwhile
                    outputs.append(out)
                    if out.finished:
                        self._finished(out.request_id)
            for request_id, error in failures.items():
                if self._where.get(request_id, (None,))[0] == r:
                    self._failed[request_id] = error
                    self._finished(request_id)
        return outputs

    def _replica_died(self, replica: int, message: str) -> None:
        """Its requests fail with the error naming it; the engine takes no more requests."""
        self._dead = self._dead or message
        for request_id, (r, _) in list(self._where.items()):
            if r == replica:
                self._failed[request_id] = EngineDeadError(message)
                self._finished(request_id)

    def pop_failures(self) -> dict[str, Exception]:
        failed, self._failed = self._failed, {}
        return failed

    def _finished(self, request_id: str) -> None:
        where = self._where.pop(request_id, None)
        if where is not None:
            self.router.done(*where)

    def stats(self) -> EngineStats:
        return merge_stats([p.stats() for p in self.replicas])

    def cache_config_info(self) -> dict[str, str]:
        return self.replicas[0].info["cache_config_info"]

    def shutdown(self) -> None:
        """Stops the replica processes (also when this engine is collected, and at exit)."""
        self._finalizer()


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
