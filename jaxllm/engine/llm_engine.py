"""LLMEngine: requests in, RequestOutputs out, one step() at a time (synchronous core of LLM and AsyncLLM).

step() keeps one device step in flight: it schedules and dispatches step N+1 before it waits for step N's
tokens, so host work (scheduling, input preparation, detokenization) overlaps the device. Requests whose
sampling needs exact token history on the host (penalties, min_tokens, bad_words) turn this off for the steps
they run in, so their inputs are never one token stale. Structured outputs need less: step N+1's masks need
step N's tokens in the grammar matchers only. So step N+1 is scheduled and prepared while step N runs, as
usual, and its model part is dispatched; then step() waits for step N's tokens, advances the constrained
sequences' matchers, writes their new masks into the prepared inputs, dispatches step N+1's sampling, and
processes step N's outputs (detokenization, stops). The grammar work overlaps the model on the device
(runner.launch's before_sample; with runner.overlap_min_masked set huge, step N+1 is dispatched whole after it).
"""

from __future__ import annotations

import collections
import gc
import logging
import random
import threading
import time

import numpy as np

from jaxllm.config import ModelConfig
from jaxllm.engine.args import EngineArgs
from jaxllm.engine.configs import cache_config_info
from jaxllm.engine.detokenizer import NO_TEXT, IncrementalDetokenizer, StopChecker
from jaxllm.engine.per_token import bias_row, collect_prompt_logprobs, logprob_dict
from jaxllm.engine.protocol import EngineStats, PromptType
from jaxllm.engine.request_state import Request as _Request
from jaxllm.engine.request_state import SeqState as _SeqState
from jaxllm.engine.request_state import build_output
from jaxllm.engine.request_state import state_of as _state_of
from jaxllm.engine.runner import ModelRunner
from jaxllm.engine.scheduler import Scheduler
from jaxllm.engine.sequence import Sequence, SequenceStatus
from jaxllm.engine.step_io import StepHandle, StepResult
from jaxllm.engine.structured import Grammars
from jaxllm.lora.engine import EngineLoRAMethods
from jaxllm.outputs import PoolingOutput, PoolingRequestOutput, RequestMetrics, RequestOutput
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import (
    ParameterError,
    RequestOutputKind,
    SamplingParams,
    truncate_prompt_ids,
)
from jaxllm.spec_decode.engine import SpecDecoding

logger = logging.getLogger(__name__)


class LLMEngine(EngineLoRAMethods):
    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **_) -> LLMEngine:
        """vLLM's constructor (its usage_context and the like are accepted and unused)."""
        return cls(engine_args)

    def __init__(self, args: EngineArgs, devices=None):
        """devices: the ones the engine's mesh uses (a data-parallel replica's group, jaxllm/engine/dp.py);
        default: the first tensor_parallel_size * pipeline_parallel_size of jax.devices()."""
        from jaxllm.engine.setup import build_engine_parts

        parts = build_engine_parts(args, devices)
        self.args = args
        self.model_config: ModelConfig = parts.model_config
        self.tokenizer = parts.tokenizer  # None with skip_tokenizer_init
        self._tokenizer_eos = None if self.tokenizer is None else self.tokenizer.eos_token_id
        self.runner: ModelRunner = parts.runner
        self.cache_config = parts.cache_config
        # Speculative decoding (None: off; see step() and jaxllm/spec_decode/engine.py)
        self.speculation = None if parts.speculation is None else SpecDecoding(parts.speculation)
        self.spec = None if self.speculation is None else self.speculation.config
        self._prev_spec = False  # the step in flight verifies proposals: the next one waits for its tokens
        self.scheduler = Scheduler(
            parts.scheduler_config,
            parts.cache_config,
            **(self.speculation.scheduler_kwargs if self.speculation else {}),
        )
        self.max_model_len = parts.scheduler_config.max_model_len
        self.vocab_size = self.model_config.vocab_size
        self.max_logprobs = args.max_logprobs
        self.eos_token_ids: set[int] = parts.eos_token_ids
        self.generation_defaults: dict = parts.generation_defaults
        self.model_name = args.model
        self._requests: dict[str, _Request] = {}
        self._seq_to_req: dict[str, str] = {}
        self._inflight: StepHandle | None = None
        self._rng = random.Random(args.seed)
        self.grammars: Grammars = parts.grammars
        self.lora = parts.lora  # LoRASlots, or None without enable_lora
        self._advanced: list[_SeqState] = []  # constrained sequences that took a token: their masks are stale
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        # Tokens per step since the last stats(); bounded, since offline runs never call stats().
        self._iteration_tokens: collections.deque[int] = collections.deque(maxlen=4096)
        self._stats_lock = threading.Lock()  # stats() runs on the front end's thread
        # each request's time between its steps' tokens, once record_token_intervals() asks (LLM.get_metrics)
        self._token_intervals: collections.deque[float] | None = None
        self.failed: dict[str, Exception] = {}  # request_id -> error, for requests that failed mid-flight
        self.pooler = parts.pooler  # an embedding (pooling) model's PoolerConfig, else None
        # Start-up leaves ~10^6 long-lived objects (tokenizer, traced model code, compiled programs). Each full
        # collection walked them all and stalled the step in flight (a 483 ms step in a 14.2 s throughput run on
        # the H100). As vLLM does, collect once and move them out of the collector's view; later objects are
        # collected as usual.
        gc.collect()
        gc.freeze()

    # ---- requests ----
    def default_sampling_params(self) -> SamplingParams:
        return SamplingParams(**self.generation_defaults)

    def tokenize_prompt(self, prompt: PromptType, add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if prompt.get("multi_modal_data"):
                raise ValueError("multi_modal_data is not supported: jaxllm serves text-only models.")
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) for t in ids):
                    raise ValueError(f"prompt_token_ids must be a list of ints, got {ids!r:.80}.")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("A prompt dict needs 'prompt' or 'prompt_token_ids'.")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("You cannot pass text prompts when `skip_tokenizer_init` is True: give token ids.")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}.")

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request=None,
    ) -> None:
        if request_id in self._requests:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        if self.is_sleeping():
            raise ValueError("The engine is sleeping: call wake_up() before adding requests.")
        if priority != 0 and self.args.scheduling_policy != "priority":
            raise ValueError(f"Got priority {priority} but Priority scheduling is not enabled.")
        pooling = None
        if isinstance(params, PoolingParams):
            pooling, params = self._pooling_request(params)
        elif self.pooler is not None:
            raise ValueError(
                "This engine runs an embedding (pooling) model: it takes PoolingParams requests (LLM.embed, "
                "/v1/embeddings), not generation."
            )
        params = (params or self.default_sampling_params()).clone()
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError("Parameter 'cache_salt' must be a non-empty string if provided.")
        text, ids = self.tokenize_prompt(prompt)
        ids = truncate_prompt_ids(ids, params.truncate_prompt_tokens, self.max_model_len)
        self.validate_prompt(ids)
        params.verify_for_model(self.vocab_size, self.max_logprobs)
        if self.tokenizer is None:  # skip_tokenizer_init: token ids in and out, as vLLM's
            for name in ("stop", "bad_words", "structured_outputs"):
                if getattr(params, name):
                    raise ParameterError(
                        f"{name} needs the tokenizer, which skip_tokenizer_init=True leaves out.", parameter=name
                    )
            params.detokenize = False
        lora_id, lora_key = self._lora_of(lora_request)
        so = params.structured_outputs
        grammar = None if so is None else self.grammars.compile(so)
        thinking = grammar is not None and self.grammars.waits_for_reasoning(ids)
        if not params.ignore_eos:
            params.all_stop_token_ids |= self.eos_token_ids
        # None fills the context; a prompt of exactly max_model_len still samples one token (vLLM V1). As in vLLM,
        # generation_config.json's max_new_tokens is a default (default_sampling_params(), and the server's cap on
        # its requests' max_tokens), not a cap on an explicit max_tokens (update_from_generation_config: EOS only)
        max_tokens = max(self.max_model_len - len(ids), 1) if params.max_tokens is None else params.max_tokens
        metrics = RequestMetrics(arrival_time=arrival_time or time.time())
        req = _Request(request_id, text, ids, params, [], metrics, lora_id=lora_id, pooling=pooling)
        for i in range(params.n):
            seq_id = request_id if params.n == 1 else f"{request_id}#{i}"
            seq = Sequence(
                seq_id,
                ids,
                priority=priority,
                max_tokens=max_tokens,
                skip_prefix_cache_read=params.prompt_logprobs is not None,
                cache_salt=salt,
                sampling_params=params,
                lora_id=lora_id,
                lora_key=lora_key,
            )
            seq.rng_seed = params.seed + i if params.seed is not None else self._rng.getrandbits(32)
            detok = (
                IncrementalDetokenizer(
                    self.tokenizer, ids, params.skip_special_tokens, params.spaces_between_special_tokens
                )
                if self.tokenizer is not None
                else NO_TEXT
            )
            state = _SeqState(
                seq,
                i,
                detok,
                StopChecker(params.stop, params.include_stop_str_in_output),
                logprobs=[] if params.logprobs is not None else None,
            )
            if grammar is not None:
                state.matcher = self.grammars.matcher(grammar)
                state.thinking = thinking
            req.seqs.append(state)
        if grammar is not None:
            self._fill_masks(req.seqs)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]
        self._requests[request_id] = req
        try:
            for state in req.seqs:
                state.seq.bias_row = bias_row(state.seq, self.tokenizer)
                self._seq_to_req[state.seq.seq_id] = request_id
                self.scheduler.add(state.seq)
        except Exception:  # all or nothing: a half-added request would wait forever
            self.abort_request(request_id)
            raise

    def validate_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("The decoder prompt cannot be empty.")
        if len(ids) > self.max_model_len:
            raise ValueError(
                f"The decoder prompt (length {len(ids)}) is longer than the maximum model length of "
                f"{self.max_model_len}. Make sure that `max_model_len` is no smaller than the number of text tokens."
            )
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"Token id {bad[0]} is out of vocabulary (vocab size {self.vocab_size}).")

    def _pooling_request(self, pooling: PoolingParams) -> tuple[PoolingParams, SamplingParams]:
        """An embedding request runs as a one-token greedy request whose prompt's last hidden state is kept."""
        if self.pooler is None:
            raise ValueError(
                "Pooling (embedding) requests need an embedding model: create the engine with runner='pooling' "
                "(or convert / task 'embed')."
            )
        pooling.verify(self.model_config.hidden_size, self.pooler.matryoshka)
        params = SamplingParams(
            max_tokens=1,
            temperature=0.0,
            detokenize=False,
            ignore_eos=True,
            truncate_prompt_tokens=pooling.truncate_prompt_tokens,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        return pooling, params

    def _pool_step(self, handle: StepHandle, appended: list[Sequence]) -> None:
        """The embeddings of appended's requests: their prompts' last tokens ran in handle's step."""
        pooled = [(seq, req) for seq in appended if (req := self._request_of(seq.seq_id)) and req.pooling is not None]
        if pooled:
            hidden = self.runner.final_hidden(handle, [seq.seq_id for seq, _ in pooled])
            for (_, req), h in zip(pooled, hidden, strict=True):
                self._pool(req, h)

    def _pool(self, req: _Request, hidden) -> None:
        """The request's embedding from its prompt's last final-normed hidden state: the first `dimensions`
        values, L2-normalized unless asked not to be (or the model's pooler does not)."""
        x = hidden[: req.pooling.dimensions] if req.pooling.dimensions else hidden
        normalize = self.pooler.normalize if req.pooling.normalize is None else req.pooling.normalize
        if normalize:
            x = x / max(float(np.linalg.norm(x)), 1e-12)
        req.pooled = x

    def abort_request(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        for state in req.seqs:
            self.scheduler.abort(state.seq.seq_id)
            self._seq_to_req.pop(state.seq.seq_id, None)

    def pop_failures(self) -> dict[str, Exception]:
        failed, self.failed = self.failed, {}
        return failed

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or self._inflight is not None

    # ---- sleep mode (vLLM's) ----
    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep: level 1 moves the weights to host memory and frees the KV cache (the prefix cache is
        reset), so the device memory serves something else (a trainer in the same process) until wake_up().
        Needs enable_sleep_mode=True and no request in the engine."""
        if not self.args.enable_sleep_mode:
            raise ValueError("Sleep mode is not enabled: create the engine with enable_sleep_mode=True.")
        if level == 2:
            raise ValueError(
                "Sleep level 2 (discard the weights, to receive new ones on waking) is not supported: jaxllm has no "
                "weight-update API. Use level 1 (the weights wait in host memory)."
            )
        if level != 1:
            raise ValueError(f"Sleep level must be 1 or 2, got {level!r}.")
        if self.has_unfinished_requests():
            raise ValueError("The engine cannot sleep while requests are running: finish or abort them first.")
        self.scheduler.block_manager.reset_prefix_cache()
        self.runner.sleep()

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's wake_up: puts back the weights and an empty KV cache, or only what tags name ("weights",
        "kv_cache")."""
        tags = ["weights", "kv_cache"] if tags is None else list(tags)
        unknown = [t for t in tags if t not in ("weights", "kv_cache")]
        if unknown:
            raise ValueError(f"wake_up tags must be 'weights' or 'kv_cache', got {unknown}.")
        self.runner.wake_up(weights="weights" in tags, kv_cache="kv_cache" in tags)

    def is_sleeping(self) -> bool:
        """True while anything sleep() freed is still away (the engine runs again once both are back)."""
        return any(self.runner.sleeping.values())

    # ---- one step ----
    def step(self) -> list[RequestOutput]:
        """Dispatches the next step and returns the outputs of the previous one (see the module docstring).

        Speculative decoding: a step that verifies proposals needs the previous step's tokens on the host (the
        n-gram lookup reads them; the scheduler needs to know how many were accepted), so when the policy
        speculates (jaxllm.spec_decode.policy: the batch is small enough for it to pay) the previous step is
        processed first, proposals are made, then the step is scheduled: no host/device overlap for it."""
        prev, result = self._inflight, None
        sd = self.speculation
        speculate = sd is not None and sd.policy.speculate(self.scheduler.num_running)
        if prev is not None and (self._needs_sync() or speculate or self._prev_spec):
            self._inflight = None
            outputs = self._process(prev, self.runner.collect(prev))
            prev = None
        else:
            outputs = []
        if speculate:
            sd.propose(self.scheduler.running)
        if sd is not None:
            self.scheduler.speculate = speculate
        sched = self.scheduler.schedule()
        self._prev_spec = sched.verify
        self._inflight = None
        if not sched.is_empty:
            p = self.runner.prepare(sched)
            before_sample = None
            if prev is not None and p.masked:

                def before_sample():
                    nonlocal result
                    result = self.runner.collect(prev)
                    self._advance_grammars(prev, result)
                    self.runner.refresh_masks(p)

            self._inflight = self.runner.launch(p, before_sample)
        if self._inflight is not None:
            now = time.time()
            for s in sched.scheduled:
                req = self._requests.get(self._seq_to_req.get(s.seq.seq_id, ""))
                if req is not None and req.metrics.first_scheduled_time is None:
                    req.metrics.first_scheduled_time = now
            with self._stats_lock:
                self._iteration_tokens.append(sched.num_batched_tokens)
        if prev is not None:
            outputs += self._process(prev, result if result is not None else self.runner.collect(prev))
        if not outputs and self._inflight is None and self._requests:
            # Nothing could run (e.g. every request waits for a pending token): finish stalled ones cleanly.
            outputs = self._finish_stalled()
        self._drop_removed_loras()
        return outputs

    def _needs_sync(self) -> bool:
        for seq in self.scheduler.running:
            sp = seq.sampling_params
            if sp is not None and (
                sp.presence_penalty
                or sp.frequency_penalty
                or sp.repetition_penalty != 1
                or sp.min_tokens
                or sp.bad_words
            ):
                return True
        return False

    def _advance_grammars(self, handle: StepHandle, result: StepResult) -> None:
        """Structured outputs: feeds the step's tokens to the constrained sequences' matchers and fills their next
        masks, before the step's outputs are processed (see the module docstring): the same tokens that
        scheduler.update will append."""
        advanced, tokens = [], []
        for s in handle.sched.scheduled:
            seq = s.seq
            if not s.sample or seq.is_finished or seq.token_bitmask is None:
                continue
            req = self._requests.get(self._seq_to_req.get(seq.seq_id, ""))
            state = None if req is None else _state_of(req, seq)
            if state is None or state.matcher is None or state.finish_reason is not None:
                continue
            advanced.append(state)
            row = handle.rows[seq.seq_id]
            tokens.append(int(result.tokens[row] if result.num_emitted is None else result.tokens[row, 0]))
        self._consume(advanced, tokens)
        self._fill_masks(advanced)

    def _consume(self, states: list[_SeqState], tokens: list[int]) -> None:
        """Feeds each sequence's matcher its token (on llguidance's thread pool when there are several); a
        sequence still reasoning only looks for the token that ends it (the grammar starts after that one)."""
        live = []
        for state, token in zip(states, tokens, strict=True):
            state.matched += 1
            if state.thinking:
                state.thinking = token != self.grammars.reasoning_end
            elif state.grammar_error is None:
                live.append((state, token))
        accepted = self.grammars.consume([(state.matcher, token) for state, token in live])
        for (state, token), ok in zip(live, accepted):
            if not ok:  # llguidance's error goes on with its whole parser state: its first line names the problem
                why = (state.matcher.get_error() or "").strip().splitlines()
                state.grammar_error = (
                    f"Token {token} does not follow the request's structured-output grammar: "
                    f"{why[0][:300] if why else 'refused'}"
                )

    def _finish_stalled(self) -> list[RequestOutput]:
        outputs = []
        for req in list(self._requests.values()):
            for state in req.seqs:
                if state.finish_reason is None and not self.scheduler._wants_tokens(state.seq):
                    self._finish(state, "length", None)
            out = self._make_output(req)
            if out is not None:
                outputs.append(out)
        return outputs

    def _process(self, handle: StepHandle, result: StepResult) -> list[RequestOutput]:
        if result.num_emitted is None:
            sampled = {seq_id: int(result.tokens[row]) for seq_id, row in handle.rows.items()}
        else:  # a speculative step: each row's emitted tokens
            sampled = {
                seq_id: result.tokens[row, : result.num_emitted[row]].tolist() for seq_id, row in handle.rows.items()
            }
            self.speculation.after_verify(handle, result, sampled)
        appended = self.scheduler.update(handle.sched, sampled)
        if self.pooler is not None:  # an embedding model: the embeddings of the prompts whose last token ran
            self._pool_step(handle, appended)
        if self.speculation is not None:
            self.speculation.take_drafts(handle, result)
        touched: dict[str, _Request] = {}
        if result.prompt is not None:
            collect_prompt_logprobs(handle, result, self._request_of, self.tokenizer, self.vocab_size)
        now = time.time()
        for seq in appended:
            req = self._requests.get(self._seq_to_req.get(seq.seq_id, ""))
            if req is None:
                continue
            new = sampled[seq.seq_id]
            try:
                self._on_tokens(req, seq, handle, result, now, len(new) if isinstance(new, list) else 1)
            except Exception as e:  # noqa: BLE001 - one request's failure must not take the others down
                logger.exception("Request %s failed while processing its output", req.request_id)
                self.abort_request(req.request_id)
                self.failed[req.request_id] = e
                touched.pop(req.request_id, None)
                continue
            touched[req.request_id] = req
        if self._advanced:
            self._fill_masks(self._advanced)
            self._advanced = []
        outputs = []
        for req in touched.values():
            out = self._make_output(req)
            if out is not None:
                outputs.append(out)
        return outputs

    def _on_tokens(
        self, req: _Request, seq: Sequence, handle: StepHandle, result: StepResult, now: float, count: int
    ) -> None:
        """The step's count new tokens of seq (more than one from a speculative step), one at a time: each is
        checked for stops and changes the biases as if it came alone; tokens after a stop are dropped."""
        new = seq.output_token_ids[len(seq.output_token_ids) - count :]
        del seq.output_token_ids[len(seq.output_token_ids) - count + 1 :]
        state = _state_of(req, seq)
        for j, token in enumerate(new):
            if j:
                if state.finish_reason is not None:
                    return
                seq.output_token_ids.append(token)
            self._on_token(req, state, seq, handle.rows[seq.seq_id], result, now, token, j)

    def _on_token(
        self,
        req: _Request,
        state: _SeqState,
        seq: Sequence,
        row: int,
        result: StepResult,
        now: float,
        token: int,
        j: int,
    ) -> None:
        """token: seq's newest output token, the step's j-th for this sequence (its row j of a speculative
        step's results)."""
        at = row if result.num_emitted is None else (row, j)
        if req.pooling is None:  # an embedding request's one token is not generated output (vLLM counts none)
            self.generation_tokens_total += 1
        if j == 0 and seq.num_output_tokens == 1:  # each sequence's prefill, as vLLM counts n's child requests
            self.prompt_tokens_total += len(req.prompt_token_ids)
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        elif self._token_intervals is not None:
            last = req.metrics.last_token_time
            if last is not None and now > last:  # once a step per request (its other sequences share the step)
                with self._stats_lock:
                    self._token_intervals.append(now - last)
        req.metrics.last_token_time = now
        lp = float(result.logprobs[at])
        state.cumulative_logprob += lp
        if state.logprobs is not None:
            state.logprobs.append(
                logprob_dict(
                    self.tokenizer if req.params.detokenize else None,
                    self.vocab_size,
                    token,
                    lp,
                    int(result.ranks[at]),
                    result.top_ids[at],
                    result.top_logprobs[at],
                    req.params.logprobs,
                )
            )
        self._append_token(req, state, token)
        seq.bias_row = bias_row(seq, self.tokenizer)
        if state.matcher is not None:
            if state.matched < seq.num_output_tokens and state.finish_reason is None:
                self._consume([state], [token])  # not advanced before the step was processed (_advance_grammars)
                self._advanced.append(state)
            if state.grammar_error is not None:  # the request's grammar and the tokenizer disagree: the request's fault
                raise ValueError(state.grammar_error)  # (a 400 on the server; the engine and other requests go on)

    def _append_token(self, req: _Request, state: _SeqState, token: int) -> None:
        p, seq = req.params, state.seq
        n_out = seq.num_output_tokens
        if token in p.all_stop_token_ids and n_out >= p.min_tokens:
            # The stop token's text is kept only with include_stop_str_in_output (vLLM). The tokenizer's EOS
            # reports stop_reason None; any other stop id (generation_config's extra EOS ids too) reports itself.
            if p.detokenize:
                state.text += (state.detok.append(token) if p.include_stop_str_in_output else "") + state.detok.flush()
            model_eos = token == self._tokenizer_eos and token not in p.stop_token_ids
            self._finish(state, "stop", None if model_eos else token)
            return
        final_text_only = p.final_text_only or p.output_kind is RequestOutputKind.FINAL_ONLY
        if p.detokenize and final_text_only and not state.stops.stop:
            state.detok.hold(token)  # no one reads the text before the end: decoded in one go when it finishes
            delta = ""
        else:
            delta = state.detok.append(token) if p.detokenize else ""
        state.text += delta
        if delta and state.stops.stop and n_out > p.min_tokens:  # vLLM V1: past min_tokens
            match = state.stops.check(state.text, len(delta))
            if match is not None:
                state.text = state.text[: match.text_end]
                self._finish(state, "stop", match.stop)
                return
        if n_out >= (seq.max_tokens or 1 << 62) or seq.num_known_tokens >= self.max_model_len:
            state.text += state.detok.flush() if p.detokenize else ""
            self._finish(state, "length", None)

    def _finish(self, state: _SeqState, reason: str, stop_reason) -> None:
        if state.detok.held:
            state.text += state.detok.flush()
        state.finish_reason, state.stop_reason = reason, stop_reason
        status = SequenceStatus.FINISHED_STOPPED if reason == "stop" else SequenceStatus.FINISHED_LENGTH
        self.scheduler.finish(state.seq.seq_id, status)

    def _fill_masks(self, states: list[_SeqState]) -> None:
        """Structured outputs: each sequence's allowed next tokens, for all of them at once (Grammars.fill)."""
        states = [s for s in states if s.finish_reason is None]
        for state in [s for s in states if s.thinking]:
            state.seq.token_bitmask = self.grammars.allow_all()
        states = [s for s in states if not s.thinking]
        if states:
            masks = self.grammars.fill([s.matcher for s in states])
            allows_some = masks.any(axis=1).tolist()
            for state, mask, some in zip(states, masks, allows_some):
                state.seq.token_bitmask = mask
                if not some and state.grammar_error is None:  # the sampler would pick token 0
                    state.grammar_error = (
                        f"No token of the model's vocabulary (ids < {self.vocab_size}) can "
                        f"continue the request's structured-output grammar after "
                        f"{state.matched} tokens"
                    )

    def _request_of(self, seq_id: str) -> _Request | None:
        return self._requests.get(self._seq_to_req.get(seq_id, ""))

    def _make_output(self, req: _Request) -> RequestOutput | None:
        """The request's output now (None for a FINAL_ONLY request still running); a finished request is
        forgotten."""
        out = build_output(req)
        if out is not None and req.pooling is not None:
            if not out.finished:
                return None
            pooled = PoolingRequestOutput(
                req.request_id,
                PoolingOutput(req.pooled),
                req.prompt_token_ids,
                True,
                out.num_cached_tokens,
            )
            pooled.metrics = out.metrics
            out = pooled  # type: ignore[assignment]
        if out is not None and out.finished:
            del self._requests[req.request_id]
            for s in req.seqs:
                self._seq_to_req.pop(s.seq.seq_id, None)
        return out

    # ---- stats ----
    def cache_config_info(self) -> dict[str, str]:
        return cache_config_info(self.cache_config, self.args)

    def record_token_intervals(self) -> None:
        """From now on, keep each request's inter-token latencies (vLLM's per step and request) for
        pop_token_intervals(): the offline LLM's metrics, which see only final outputs."""
        with self._stats_lock:
            if self._token_intervals is None:
                self._token_intervals = collections.deque(maxlen=1 << 16)

    def pop_token_intervals(self) -> list[float]:
        with self._stats_lock:
            if not self._token_intervals:
                return []
            out = list(self._token_intervals)
            self._token_intervals.clear()
            return out

    def stats(self) -> EngineStats:
        st = self.scheduler.stats
        with self._stats_lock:
            it = list(self._iteration_tokens)
            self._iteration_tokens.clear()
        spec = self.speculation.stats(st.spec_decode) if self.speculation is not None else None
        return EngineStats(
            st.num_running,
            st.num_waiting,
            st.kv_cache_usage,
            st.prefix_cache_queries,
            st.prefix_cache_hits,
            st.num_preemptions,
            self.prompt_tokens_total,
            self.generation_tokens_total,
            it,
            spec,
        )
