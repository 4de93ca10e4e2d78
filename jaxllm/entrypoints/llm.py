"""LLM: vLLM's offline API. generate() and chat() run the engine until every request is done."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import os
import random
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxllm.beam_search import BeamSearchOutput, run_beam_search
from jaxllm.engine.args import EngineArgs
from jaxllm.engine.llm_engine import LLMEngine
from jaxllm.engine.profiling import Trace
from jaxllm.entrypoints.chat_utils import CONTENT_FORMATS, template_message
from jaxllm.metrics.prometheus import EngineMetrics, RequestTracker
from jaxllm.metrics.reader import Metric, get_metrics_snapshot
from jaxllm.outputs import EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import BeamSearchParams, ParameterError, RequestOutputKind, SamplingParams

# vLLM's words for a generative model (its LLM.encode and friends need a pooling model)
_NO_POOLING = (
    "LLM.{}() is only supported for pooling models: create the LLM with runner='pooling' (or convert / task "
    "'embed') to run the model as an embedding model."
)
_NOT_EMBED = "LLM.{}() needs a classification or scoring model: jaxllm's pooling models embed (LLM.embed, LLM.encode)."


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any):
        self.engine_args = EngineArgs.from_kwargs(model=model, **kwargs)
        self.llm_engine: Any  # LLMEngine, or DPEngine (the same surface) over data-parallel replicas
        if self.engine_args.data_parallel_size > 1:  # replicas on this host's device groups
            from jaxllm.engine.dp import DPEngine

            self.engine_args.validate()
            self.llm_engine = DPEngine(self.engine_args)
        else:
            self.llm_engine = LLMEngine(self.engine_args)
        self._counter = itertools.count()
        self._trace = Trace()
        # vLLM's offline metrics (LLM.get_metrics) with disable_log_stats=False; its default here is True, as vLLM's
        self._metrics: EngineMetrics | None = None
        self._trackers: dict[str, tuple[RequestTracker, int]] = {}  # request id -> (its tracker, its n)
        if not kwargs.get("disable_log_stats", True):
            name = self.engine_args.served_model_name or self.engine_args.model or ""
            self._metrics = EngineMetrics(self.llm_engine, name)
            record = getattr(self.llm_engine, "record_token_intervals", None)  # not across data-parallel processes
            if record is not None:
                record()
        if self.engine_args.seed is not None:  # vLLM seeds the process's own generators too (set_random_seed)
            random.seed(self.engine_args.seed)
            np.random.seed(self.engine_args.seed)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return self.llm_engine.default_sampling_params()

    def start_profile(self, profile_dir: str | None = None) -> None:
        """vLLM's LLM.start_profile: a jax.profiler trace (XProf / TensorBoard) of what runs until stop_profile,
        written under profile_dir, else $VLLM_TORCH_PROFILER_DIR (vLLM's switch: unset, profiling is off)."""
        log_dir = profile_dir or os.environ.get("VLLM_TORCH_PROFILER_DIR")
        if not log_dir:
            raise RuntimeError("Profiler is not enabled: set VLLM_TORCH_PROFILER_DIR (or pass profile_dir).")
        self._trace.start(log_dir)

    def stop_profile(self) -> None:
        self._trace.stop()

    def get_metrics(self) -> list[Metric]:
        """vLLM's LLM.get_metrics(): the engine's Prometheus metrics (vLLM's names and labels, as the server's
        /metrics shows them) as jaxllm.metrics.reader's Counter / Gauge / Histogram / Vector objects. Needs
        LLM(..., disable_log_stats=False)."""
        if self._metrics is None:
            raise RuntimeError("Stat logging disabled: LLM.get_metrics() needs LLM(..., disable_log_stats=False).")
        self._metrics.poll()
        return get_metrics_snapshot(self._metrics.registry)

    def sleep(self, level: int = 1) -> None:
        """vLLM's LLM.sleep (needs LLM(..., enable_sleep_mode=True) and no request running): level 1 moves the weights
        to host memory and frees the KV cache until wake_up(). Level 2 is refused (no weight-update API)."""
        sleep = getattr(self.llm_engine, "sleep", None)
        if sleep is None:
            raise ValueError("Sleep mode is not supported with data_parallel_size > 1.")
        sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's LLM.wake_up: the weights and an empty KV cache back on the devices (or what tags name:
        "weights", "kv_cache")."""
        wake_up = getattr(self.llm_engine, "wake_up", None)
        if wake_up is None:
            raise ValueError("Sleep mode is not supported with data_parallel_size > 1.")
        wake_up(tags)

    def reset_prefix_cache(self, device=None) -> bool:
        """vLLM's: forgets the prefix cache's pages that no running sequence holds; False where it cannot
        (data-parallel replicas in their own processes)."""
        scheduler = getattr(self.llm_engine, "scheduler", None)
        if scheduler is None:
            return False
        scheduler.block_manager.reset_prefix_cache()
        return True

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request=None,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """use_tqdm: show a progress bar, or (vLLM's) a callable that makes it, e.g. partial(tqdm, leave=False).
        lora_request: a LoRARequest for every prompt, or a list of them (None entries: the base model).

        Over several processes (jaxllm.distributed) every process calls it, as in vLLM's external_launcher mode:
        process 0 runs the engine and returns the outputs; the others run the steps it sends and return []."""
        runner = self.llm_engine.runner  # None: data-parallel replicas, each in its own process
        mh = runner.multihost if runner is not None else None
        if mh is not None and not mh.is_driver:
            from jaxllm.engine.multihost import follow

            follow(self.llm_engine)
            return []
        prompts = _as_prompt_list(prompts)
        params = self._params_list(sampling_params, len(prompts))
        loras = _per_prompt(lora_request, len(prompts), "lora_request")
        if mh is None:
            return self._run(self._add(prompts, params, priority, loras), use_tqdm)
        from jaxllm.engine.multihost import OfflineCall

        with OfflineCall(mh):
            return self._run(self._add(prompts, params, priority, loras), use_tqdm)

    def chat(
        self,
        messages,
        sampling_params=None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request=None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools=None,
        chat_template_kwargs: dict | None = None,
        mm_processor_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """vLLM's LLM.chat, arguments in its order: each conversation through the tokenizer's chat template, then
        generate(). chat_template_content_format: "auto" and "string" give the template each message's content as
        one string (text parts joined with newlines), "openai" as a list of {"type": "text", "text": ...} parts.
        Text-only models: mm_processor_kwargs are accepted and unused, other content parts are refused."""
        if chat_template_content_format not in CONTENT_FORMATS:
            raise ValueError(
                f"chat_template_content_format must be one of {CONTENT_FORMATS}, got {chat_template_content_format!r}."
            )
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.get_tokenizer()
        if tok is None:
            raise ValueError("LLM.chat needs the tokenizer's chat template, which skip_tokenizer_init=True leaves out.")
        prompts = []
        for conv in conversations:
            conv = [template_message(m, chat_template_content_format) for m in conv]
            ids = tok.apply_chat_template(
                conv,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                tokenize=True,
                **(chat_template_kwargs or {}),
            )
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            prompts.append({"prompt_token_ids": list(ids)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def beam_search(
        self,
        prompts,
        params: BeamSearchParams,
        lora_request=None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search (jaxllm/beam_search.py): prompts are TextPrompt / TokensPrompt dicts (or strings);
        each output's sequences are its best beams, best first, their tokens and text the whole sequence (prompt
        included), as vLLM returns them. concurrency_limit: prompts searched at a time (all by default)."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}.")
        max_logprobs = self.llm_engine.max_logprobs
        if max_logprobs != -1 and 2 * params.beam_width > max_logprobs:
            raise ParameterError(
                f"beam_width ({params.beam_width}) needs 2 * beam_width log-probabilities a step, more than "
                f"max_logprobs ({max_logprobs}); raise max_logprobs or lower beam_width.",
                parameter="beam_width",
            )
        if concurrency_limit is not None and (not isinstance(concurrency_limit, int) or concurrency_limit < 1):
            raise ValueError(f"concurrency_limit must be a positive integer, got {concurrency_limit!r}.")
        prompts = _as_prompt_list(prompts)
        loras = _per_prompt(lora_request, len(prompts), "lora_request")
        tok = self.get_tokenizer()
        ids = []
        for p in prompts:
            if isinstance(p, dict) and "prompt_token_ids" in p:
                ids.append(list(p["prompt_token_ids"]))
            elif isinstance(p, (list, tuple)) and all(isinstance(t, int) for t in p):
                ids.append(list(p))
            elif isinstance(p, (str, dict)) and isinstance(p.get("prompt") if isinstance(p, dict) else p, str):
                if tok is None:
                    raise ValueError("You cannot pass text prompts when `skip_tokenizer_init` is True: give token ids.")
                ids.append(tok.encode(p if isinstance(p, str) else p["prompt"]))
            else:
                raise ValueError(
                    f"A beam search prompt must be a string, a TextPrompt, a TokensPrompt or token ids, got {p!r:.80}."
                )

        def generate(batch, sp, lora_requests):
            return self.generate(batch, sp, use_tqdm=False, lora_request=lora_requests)

        limit = concurrency_limit or max(len(ids), 1)
        outputs: list[BeamSearchOutput] = []
        for start in range(0, len(ids), limit):
            outputs += run_beam_search(
                ids[start : start + limit],
                params,
                generate,
                eos_token_id=tok.eos_token_id if tok is not None else None,
                max_model_len=self.llm_engine.max_model_len,
                loras=loras[start : start + limit] if loras else None,
            )
        for out in outputs:
            for beam in out.sequences:
                beam.text = tok.decode(beam.tokens) if tok is not None else None
        return outputs

    def encode(
        self,
        prompts,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request=None,
        pooling_task: str | None = None,
    ) -> list[PoolingRequestOutput]:
        """vLLM's LLM.encode on an embedding model (LLM(..., runner="pooling")): each prompt's pooled hidden state
        (outputs.data, a float32 numpy array)."""
        if not self.engine_args.pooling:
            raise ValueError(_NO_POOLING.format("encode"))
        if pooling_task not in (None, "embed"):
            raise ValueError(f"pooling_task {pooling_task!r} is not supported: jaxllm's pooling models embed.")
        prompts = _as_prompt_list(prompts)
        if pooling_params is None:
            pooling_params = PoolingParams()
        params = _params_per_prompt(pooling_params, len(prompts), PoolingParams, "pooling_params")
        if truncate_prompt_tokens is not None:
            params = [dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in params]
        loras = _per_prompt(lora_request, len(prompts), "lora_request")
        return self._run(self._add(prompts, params, None, loras), use_tqdm)  # type: ignore[return-value]

    def embed(
        self,
        prompts,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        lora_request=None,
    ) -> list[EmbeddingRequestOutput]:
        """vLLM's LLM.embed: one embedding per prompt (outputs.embedding, a list of floats) from an embedding model
        (LLM(..., runner="pooling"), or convert / task "embed"): its prompt's last-token hidden state, normalized
        (jaxllm/pooling_params.py)."""
        if not self.engine_args.pooling:
            raise ValueError(_NO_POOLING.format("embed"))
        outs = self.encode(
            prompts,
            pooling_params,
            truncate_prompt_tokens=truncate_prompt_tokens,
            use_tqdm=use_tqdm,
            lora_request=lora_request,
            pooling_task="embed",
        )
        return [EmbeddingRequestOutput.from_base(o) for o in outs]

    def classify(self, *args, **kwargs):
        raise ValueError(_NOT_EMBED.format("classify"))

    def score(self, *args, **kwargs):
        raise ValueError(_NOT_EMBED.format("score"))

    def reward(self, *args, **kwargs):
        raise ValueError(_NOT_EMBED.format("reward"))

    # ---- internals ----
    def _params_list(self, sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * n
        return _params_per_prompt(sampling_params, n, SamplingParams, "sampling_params")

    def _add(self, prompts, params, priority, loras=None) -> list[str]:
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(
                f"The lengths of prompts ({len(prompts)}) and priority ({len(priority)}) must be the same."
            )
        ids, engine = [], self.llm_engine
        try:
            for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
                request_id = str(next(self._counter))
                if isinstance(sp, SamplingParams) and sp.output_kind is not RequestOutputKind.FINAL_ONLY:
                    # Only finished outputs are returned: the engine then builds no output per step (at 500
                    # running sequences, 2.4 ms of host time a step on the H100's host). The copy leaves the
                    # caller's params as they were.
                    sp = copy.copy(sp)
                    sp.output_kind = RequestOutputKind.FINAL_ONLY
                engine.add_request(
                    request_id,
                    prompt,
                    sp,
                    priority=priority[i] if priority else 0,
                    lora_request=loras[i] if loras else None,
                )
                ids.append(request_id)
                if self._metrics is not None:
                    max_tokens, n = (sp.max_tokens, sp.n) if isinstance(sp, SamplingParams) else (None, 1)
                    tracker = self._metrics.tracker(request_id, max_tokens, engine_times=True)
                    self._trackers[request_id] = (tracker, n)
        except Exception:
            for request_id in ids:  # a bad prompt in the list leaves nothing behind
                engine.abort_request(request_id)
                self._trackers.pop(request_id, None)
            raise
        return ids

    def _run(self, ids: list[str], use_tqdm: bool | Callable[..., Any]) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        done: dict[str, RequestOutput] = {}
        if callable(use_tqdm):  # vLLM's: the caller's bar factory, with its own settings
            bar = use_tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        else:
            bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while self.llm_engine.has_unfinished_requests():
                bar.update(self._step(ids, done))
        except BaseException:  # an engine error or a KeyboardInterrupt: leave nothing of this call behind
            for request_id in ids:
                self.llm_engine.abort_request(request_id)
                if request_id in self._trackers:
                    tracker, n = self._trackers.pop(request_id)
                    tracker.on_abort(None, n)
            raise
        finally:
            bar.close()
        return [done[i] for i in ids]

    def _step(self, ids: list[str], done: dict[str, RequestOutput]) -> int:
        """One engine step for the requests ids: finished outputs go into done (returns how many); a failed
        request raises its error (and _run aborts them all)."""
        engine = self.llm_engine
        n = 0
        for out in engine.step():
            if out.request_id in self._trackers:
                self._trackers[out.request_id][0].on_output(out)
            if out.finished:
                done[out.request_id] = out
                self._trackers.pop(out.request_id, None)
                n += 1
        failed = engine.pop_failures()
        if failed:
            raise next(iter(failed.values()))
        return n


def _params_per_prompt(value, n: int, kind: type, name: str) -> list:
    """One params object (kind) for every prompt, or a list of n of them."""
    if isinstance(value, kind):
        return [value] * n
    if not isinstance(value, (list, tuple)) or not all(isinstance(p, kind) for p in value):
        raise ValueError(f"{name} must be a {kind.__name__} or a list of them, got {type(value).__name__}.")
    if len(value) != n:
        raise ValueError(f"The lengths of prompts ({n}) and {name} ({len(value)}) must be the same.")
    return list(value)


def _per_prompt(value, n: int, name: str) -> list | None:
    """One value for every prompt, or a list of n (vLLM's lora_request)."""
    if value is None or not isinstance(value, (list, tuple)):
        return None if value is None else [value] * n
    if len(value) != n:
        raise ValueError(f"The lengths of prompts ({n}) and {name} ({len(value)}) must be the same.")
    return list(value)


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(
            f"prompts must be a string, a dict, a list of token ids or a list of these, got {type(prompts).__name__}."
        )
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt of token ids
    return prompts
