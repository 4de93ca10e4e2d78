"""A model-free EngineClient and a tiny real tokenizer, so server and streaming tests need no model.

FakeEngine schedules like the real engine in miniature: a step loop admits waiting requests up to
max_num_seqs and the free KV blocks, prefills them in one step, then appends one token per running sequence
per step (a short asyncio sleep). Output is deterministic: each sequence replays a fixed script of tokens
from an offset hashed from (prompt, sample index, seed). Stop strings, stop token ids, EOS, min/max tokens,
logprobs, prompt logprobs, n, abort and the block accounting use real logic, so tests can check them and
check that nothing leaks (`live_requests()`, `used_blocks`). Outputs are cumulative, or DELTA ones as the real
engine builds them (jaxllm/engine/request_state.py) where the request asks for them (the server does).

Fault injection through the prompt text: "FAIL_MID_STREAM" raises RuntimeError after two tokens;
"ENGINE_REJECTS" raises ValueError before the first output.
"""

from __future__ import annotations

import asyncio
import collections
import math
import random
import time
import zlib
from dataclasses import dataclass, field

from jaxllm.engine.protocol import EngineDeadError, EngineStats
from jaxllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxllm.sampling_params import RequestOutputKind, SamplingParams

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_WORDS = (
    "the quick brown fox jumps over lazy dog a river runs through green valley where old trees "
    "stand tall and birds sing every morning while children play near small houses made of stone "
    "wood light falls on quiet water people walk slowly home after long day work is done night "
    "comes with stars bright moon cold wind soft rain warm fire bread tea story book friend"
).split()
SCRIPT = (
    "The quick brown fox jumps over the lazy dog. A river runs through the green valley, where old "
    "trees stand tall and birds sing every morning. Children play near the small houses made of stone "
    "and wood, and light falls on the quiet water. People walk slowly home after a long day; the work "
    "is done, and night comes with bright stars and a cold wind."
)


def corpus(lines: int = 400, seed: int = 0) -> list[str]:
    """A few hundred lines of plain English-like text, deterministic, for training a tokenizer."""
    rng = random.Random(seed)
    out = [SCRIPT]
    for _ in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(6, 16))]
        line = " ".join(words).capitalize() + rng.choice([".", ".", ",", "?", "!", ";"])
        if rng.random() < 0.2:
            line += f" {rng.randint(0, 999)}"
        out.append(line)
    return out


def build_tokenizer(vocab_size: int = 600):
    """A byte-level BPE tokenizer trained in ~0.1 s, wrapped as transformers' PreTrainedTokenizerFast with
    ChatML-style special tokens and chat template (eos = <|im_end|>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


@dataclass
class _Seq:
    index: int
    offset: int
    ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative: float = 0.0
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # RequestOutputKind.DELTA: how much of the text and tokens earlier outputs carried, and whether one carried
    # the finish
    sent_text: int = 0
    sent_tokens: int = 0
    sent_finish: bool = False


@dataclass
class _Req:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    seqs: list[_Seq]
    queue: asyncio.Queue
    metrics: RequestMetrics
    fail_mid_stream: bool = False
    prefilled: bool = False
    blocks: int = 0
    prompt_logprobs: list | None = None
    prompt_logprobs_sent: bool = False  # RequestOutputKind.DELTA: an output carried them
    finished: bool = False


class FakeEngine:
    """An EngineClient over a real tokenizer, with scripted generation; see the module docstring."""

    def __init__(
        self,
        tokenizer,
        *,
        model_name: str = "fake-model",
        max_model_len: int = 256,
        max_logprobs: int = 20,
        step_s: float = 0.002,
        max_num_seqs: int = 256,
        block_size: int = 16,
        num_blocks: int = 4096,
        default_sampling_params: dict | None = None,
    ):
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = len(tokenizer)
        self.max_logprobs = max_logprobs
        self.step_s = step_s
        self.max_num_seqs = max_num_seqs
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._generation_defaults = dict(default_sampling_params or {})
        self.eos_token_id = tokenizer.eos_token_id
        self.script = tokenizer.encode(SCRIPT, add_special_tokens=False) + [self.eos_token_id]
        self.special_ids = set(tokenizer.all_special_ids)
        self.normal_ids = [i for i in range(self.vocab_size) if i not in self.special_ids]
        self.used_blocks = 0
        self.aborted: list[str] = []  # requests aborted while live (client gone, error, shutdown)
        self.abort_calls: list[str] = []
        self.profile_calls: list[tuple] = []
        self.requests_seen: list[str] = []
        self.peak_running = 0
        self.peak_waiting = 0
        self._live: dict[str, _Req] = {}
        self.prompts_seen: collections.deque = collections.deque(maxlen=64)  # what generate() was given
        self._waiting: list[_Req] = []
        self._running: list[_Req] = []
        self._loop_task: asyncio.Task | None = None
        self._dead: BaseException | None = None
        self._stats = EngineStats()
        self._seen_blocks: set[int] = set()

    # ------------------------------------------------------------------------------------- EngineClient

    def get_tokenizer(self):
        return self.tokenizer

    def default_sampling_params(self) -> SamplingParams:
        """generation_config defaults, the way AsyncLLM exposes them."""
        return SamplingParams(**self._generation_defaults)

    @property
    def is_running(self) -> bool:
        return self._dead is None

    @property
    def errored(self) -> bool:
        return self._dead is not None

    async def generate(self, prompt, sampling_params: SamplingParams, request_id: str, *, priority: int = 0):
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        self.prompts_seen.append(prompt)
        text, ids = self._prompt(prompt)
        sampling_params.verify_for_model(self.vocab_size, self.max_logprobs)
        if not ids:
            raise ValueError("The decoder prompt cannot be empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"The decoder prompt (length {len(ids)}) is longer than the maximum model length "
                f"of {self.max_model_len}."
            )
        if text is not None and "ENGINE_REJECTS" in text:
            raise ValueError("fake engine rejected this prompt")
        if request_id in self._live:
            raise ValueError(f"Request id {request_id} is already running.")
        sp = sampling_params
        room = self.max_model_len - len(ids)
        max_tokens = room if sp.max_tokens is None else min(sp.max_tokens, room)
        seed = sp.seed if sp.seed is not None else 0
        seqs = [_Seq(j, self._offset(ids, j if not sp.greedy else 0, seed)) for j in range(sp.n)]
        req = _Req(
            request_id,
            text,
            ids,
            sp,
            max_tokens,
            seqs,
            asyncio.Queue(),
            RequestMetrics(arrival_time=time.time()),
            fail_mid_stream=text is not None and "FAIL_MID_STREAM" in text,
        )
        self._live[request_id] = req
        self._waiting.append(req)
        self.requests_seen.append(request_id)
        self._ensure_loop()
        done = False
        try:
            while True:
                item = await req.queue.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                yield item
                if item.finished:
                    done = True
                    return
        finally:
            if not done:
                self._abort_now(request_id)

    async def abort(self, request_id: str) -> None:
        self.abort_calls.append(request_id)
        self._abort_now(request_id)

    def stats(self) -> EngineStats:
        s = self._stats
        snap = EngineStats(
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            kv_cache_usage=self.used_blocks / self.num_blocks,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=0,
            prompt_tokens=s.prompt_tokens,
            generation_tokens=s.generation_tokens,
            iteration_tokens=s.iteration_tokens,
        )
        s.iteration_tokens = []
        return snap

    def start_profile(self, log_dir: str) -> None:
        self.profile_calls.append(("start", log_dir))

    def stop_profile(self) -> None:
        self.profile_calls.append(("stop",))

    async def shutdown(self) -> None:
        self._fail_all(EngineDeadError("engine shut down"), mark_dead=False)
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)

    # ------------------------------------------------------------------------------------- test helpers

    def kill(self, reason: str = "fake engine killed") -> None:
        """Simulates the engine loop dying: live requests fail, /health turns 503."""
        self._fail_all(EngineDeadError(reason), mark_dead=True)

    def live_requests(self) -> list[str]:
        return list(self._live)

    # ------------------------------------------------------------------------------------- internals

    def _prompt(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = list(prompt["prompt_token_ids"])
                text = prompt.get("prompt")
                return (text if text is not None else self.tokenizer.decode(ids)), ids
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        ids = list(prompt)
        return self.tokenizer.decode(ids), ids

    def _offset(self, ids: list[int], j: int, seed: int) -> int:
        key = zlib.crc32(repr((ids, j, seed)).encode())
        return key % (len(self.script) - 1)

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    def _blocks_for(self, n_tokens: int) -> int:
        return math.ceil(n_tokens / self.block_size)

    async def _run(self) -> None:
        while self._live:
            await asyncio.sleep(self.step_s)
            try:
                self._step()
            except Exception as e:  # a bug here must fail requests, not hang them
                self._fail_all(EngineDeadError(f"engine step failed: {e!r}"), mark_dead=True)
                raise

    def _step(self) -> None:
        now = time.time()
        while self._waiting and len(self._running) < self.max_num_seqs:
            req = self._waiting[0]
            need = self._blocks_for(len(req.prompt_ids) + 1)
            if self.used_blocks + need > self.num_blocks:
                break
            self._waiting.pop(0)
            req.blocks = need
            self.used_blocks += need
            req.metrics.first_scheduled_time = now
            self._running.append(req)
        self.peak_running = max(self.peak_running, len(self._running))
        self.peak_waiting = max(self.peak_waiting, len(self._waiting))
        step_tokens = 0
        for req in list(self._running):
            if not req.prefilled:
                step_tokens += self._prefill(req)
            step_tokens += self._decode(req, now)
            if req.request_id in self._live:
                self._emit(req, now)
        if step_tokens:
            self._stats.iteration_tokens.append(step_tokens)

    def _prefill(self, req: _Req) -> int:
        req.prefilled = True
        n = len(req.prompt_ids)
        self._stats.prompt_tokens += n
        self._stats.prefix_cache_queries += n
        h, hit, hashes = 0, True, []
        for b in range(n // self.block_size):
            h = zlib.crc32(repr(req.prompt_ids[b * self.block_size : (b + 1) * self.block_size]).encode(), h)
            if hit and h in self._seen_blocks:
                self._stats.prefix_cache_hits += self.block_size
            else:
                hit = False
            hashes.append(h)
        self._seen_blocks.update(hashes)
        k = req.params.prompt_logprobs
        if k is not None:
            req.prompt_logprobs = [None] + [self._logprobs(t, k, p) for p, t in enumerate(req.prompt_ids[1:])]
        return n

    def _decode(self, req: _Req, now: float) -> int:
        if req.fail_mid_stream and any(len(s.ids) >= 2 for s in req.seqs):
            self._finish_request(req)
            req.queue.put_nowait(RuntimeError("fake engine failure (FAIL_MID_STREAM)"))
            self._live.pop(req.request_id, None)
            return 0
        n = 0
        for seq in req.seqs:
            if seq.finish_reason is None:
                self._append(req, seq)
                n += 1
        self._stats.generation_tokens += n
        total = len(req.prompt_ids) + max(len(s.ids) for s in req.seqs)
        need = self._blocks_for(total + 1) - req.blocks
        if need > 0:
            req.blocks += need
            self.used_blocks += need
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.metrics.last_token_time = now
        return n

    def _append(self, req: _Req, seq: _Seq) -> None:
        sp = req.params
        tok = self.script[(seq.offset + len(seq.ids)) % len(self.script)]
        seq.ids.append(tok)
        if sp.logprobs is not None:
            entry = self._logprobs(tok, sp.logprobs, len(seq.ids))
            seq.logprobs.append(entry)
            seq.cumulative += entry[tok].logprob
        n_out = len(seq.ids)
        may_stop = n_out >= sp.min_tokens
        stop_ids = set(sp.all_stop_token_ids) | ({self.eos_token_id} if not sp.ignore_eos else set())
        if may_stop and tok in stop_ids:
            seq.finish_reason = "stop"
            seq.stop_reason = None if tok == self.eos_token_id and tok not in sp.stop_token_ids else tok
            seq.text = self._decode_text(seq.ids[:-1], sp)  # the stop token's text is not output
            return
        prev_len = len(seq.text)
        seq.text = self._decode_text(seq.ids, sp)
        if may_stop and sp.stop:
            longest = max(len(s) for s in sp.stop)
            start = max(0, prev_len - longest + 1)
            hits = [(seq.text.find(s, start), s) for s in sp.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                i, s = min(hits)
                seq.text = seq.text[: i + len(s)] if sp.include_stop_str_in_output else seq.text[:i]
                seq.finish_reason, seq.stop_reason = "stop", s
                return
        if n_out >= req.max_tokens or len(req.prompt_ids) + n_out >= self.max_model_len:
            seq.finish_reason = "length"

    def _decode_text(self, ids: list[int], sp: SamplingParams) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=sp.skip_special_tokens)

    def _logprobs(self, tok: int, k: int, pos: int) -> dict[int, Logprob]:
        """The sampled token ranked first, then k-1 (or the whole vocab for -1) deterministic alternatives."""
        k = self.vocab_size if k == -1 else k
        entry = {tok: Logprob(-0.05 * (1 + (tok + pos) % 7), 1, self.tokenizer.decode([tok]))}
        r = 2
        step = 0
        while len(entry) < max(k, 1):
            alt = self.normal_ids[(tok * 31 + pos * 7 + step * 13) % len(self.normal_ids)]
            step += 1
            if alt not in entry:
                entry[alt] = Logprob(-1.0 - 0.5 * r, r, self.tokenizer.decode([alt]))
                r += 1
        return entry

    def _emit(self, req: _Req, now: float) -> None:
        sp = req.params
        holdback = max((len(s) for s in sp.stop), default=1) - 1 if sp.stop and not sp.include_stop_str_in_output else 0
        delta = sp.output_kind is RequestOutputKind.DELTA
        outputs = []
        for seq in req.seqs:
            text = seq.text
            done = seq.finish_reason is not None
            if not done and holdback:
                text = text[: max(0, len(text) - holdback)]
            t0 = n0 = 0
            if delta:  # a sequence only when it has something new, its finish once
                if seq.sent_finish or (not done and len(text) == seq.sent_text and len(seq.ids) == seq.sent_tokens):
                    continue
                t0, n0 = seq.sent_text, seq.sent_tokens
                seq.sent_text, seq.sent_tokens, seq.sent_finish = len(text), len(seq.ids), done
            outputs.append(
                CompletionOutput(
                    index=seq.index,
                    text=text[t0:],
                    token_ids=seq.ids[n0:],
                    cumulative_logprob=seq.cumulative if sp.logprobs is not None else None,
                    logprobs=seq.logprobs[n0:] if sp.logprobs is not None else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        finished = all(s.finish_reason is not None for s in req.seqs)
        prompt_logprobs = None if delta and req.prompt_logprobs_sent else req.prompt_logprobs  # DELTA: once
        if delta:
            req.prompt_logprobs_sent = True
            if not outputs and prompt_logprobs is None and not finished:
                return  # nothing new
        if finished:
            req.metrics.finished_time = now
            self._finish_request(req)
            self._live.pop(req.request_id, None)
        req.queue.put_nowait(
            RequestOutput(
                request_id=req.request_id,
                prompt=req.prompt,
                prompt_token_ids=list(req.prompt_ids),
                prompt_logprobs=prompt_logprobs,
                outputs=outputs,
                finished=finished,
                metrics=req.metrics,
            )
        )

    def _finish_request(self, req: _Req) -> None:
        if req.finished:
            return
        req.finished = True
        self.used_blocks -= req.blocks
        req.blocks = 0
        if req in self._running:
            self._running.remove(req)
        if req in self._waiting:
            self._waiting.remove(req)

    def _abort_now(self, request_id: str) -> None:
        req = self._live.pop(request_id, None)
        if req is None:
            return
        self.aborted.append(request_id)
        self._finish_request(req)

    def _fail_all(self, exc: BaseException, *, mark_dead: bool) -> None:
        if mark_dead:
            self._dead = exc
        for rid, req in list(self._live.items()):
            self._finish_request(req)
            req.queue.put_nowait(exc)
            self._live.pop(rid, None)
