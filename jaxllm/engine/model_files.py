"""Model and tokenizer folders from what the user named: a local folder, or a model id downloaded as vLLM does.

    resolve_model_dir(args) -> str       the model's local folder (config, tokenizer files, weights)
    resolve_tokenizer_dir(args, model_dir) -> str

A name that is not an existing folder is a Hugging Face Hub id, fetched with huggingface_hub.snapshot_download
into --download-dir (its cache_dir; default: the HF cache), at --revision (--tokenizer-revision for a separate
tokenizer, defaulting to --revision as in vLLM), with HF_HUB_OFFLINE (local_files_only) and the cache honoured:
a snapshot already in the cache is used without a request. As vLLM does, only one weight format is fetched:
the first of the load format's patterns the repo has (safetensors before .bin), minus --ignore-patterns
(default "original/**/*", vLLM's: Meta's repos keep a second copy of the weights there). With
VLLM_USE_MODELSCOPE=True (or JAXLLM_USE_MODELSCOPE) ids come from ModelScope through the `modelscope` package.
"""

from __future__ import annotations

import fnmatch
import glob
import logging
import os
import time

logger = logging.getLogger("jaxllm")

MODELSCOPE_ENV_VARS = ("JAXLLM_USE_MODELSCOPE", "VLLM_USE_MODELSCOPE")
# Weight files per load format, in order of preference (vLLM's: safetensors first).
WEIGHT_PATTERNS = {
    "auto": ["*.safetensors", "*.bin", "*.pt"],
    "safetensors": ["*.safetensors"],
    "pt": ["*.bin", "*.pt"],
    "dummy": [],
}
# Everything else the engine reads from the folder: config, generation config, tokenizer files (tokenizer.json,
# sentencepiece / tiktoken models, vocab + merges), chat templates, remote code, and weight index files.
SUPPORT_PATTERNS = ["*.json", "*.model", "*.txt", "*.tiktoken", "*.py", "*.jinja", "tokenizer*"]
DEFAULT_IGNORE_PATTERNS = ["original/**/*"]


def use_modelscope(environ=os.environ) -> bool:
    """vLLM's VLLM_USE_MODELSCOPE (jaxllm's name too): model ids are ModelScope's, not the Hugging Face Hub's."""
    return any(environ.get(v, "").strip().lower() in ("1", "true") for v in MODELSCOPE_ENV_VARS)


def resolve_model_dir(args) -> str:
    """args: EngineArgs (model, revision, download_dir, load_format, ignore_patterns, hf_token)."""
    if args.model is None:
        from jaxllm.demo import demo_model_path

        return str(demo_model_path())
    model = os.path.expanduser(args.model)
    if os.path.isdir(model):
        from jaxllm.demo import is_gguf_folder

        if args.load_format == "gguf" and not is_gguf_folder(model):  # (its safetensors loaded silently)
            raise ValueError(
                f"load_format='gguf' needs a local .gguf file as the model, got the folder {args.model!r}: pass "
                "the .gguf file itself (with --tokenizer for its tokenizer), or drop load_format to load the "
                "folder's own weights."
            )
        return model
    if os.path.isfile(model) and model.endswith(".gguf"):  # vLLM's `serve x.gguf --tokenizer ...`
        from jaxllm.demo import gguf_model_dir

        return gguf_model_dir(model, write_tokenizer=not args.tokenizer)
    if args.load_format == "gguf":
        raise ValueError(f"load_format='gguf' needs a local .gguf file as the model, got {args.model!r}.")
    if os.path.isfile(model):  # (it said the folder "does not exist")
        raise ValueError(
            f"Model {args.model!r} is a file, not a model folder: jaxllm loads a Hugging Face layout folder "
            "(config.json with safetensors or .bin weights), a Hub model id or a local .gguf file."
        )
    weights = WEIGHT_PATTERNS.get(args.load_format, WEIGHT_PATTERNS["auto"])
    ignore = args.ignore_patterns or DEFAULT_IGNORE_PATTERNS
    ignore = [ignore] if isinstance(ignore, str) else list(ignore)
    return _download(model, args.revision, args.download_dir, weights, ignore, args.hf_token, what="model")


def resolve_tokenizer_dir(args, model_dir: str) -> str:
    """The tokenizer's folder: the model's unless --tokenizer names another folder or id (tokenizer files only,
    at --tokenizer-revision, else --revision)."""
    if not args.tokenizer or args.tokenizer == args.model:
        return model_dir
    tokenizer = os.path.expanduser(args.tokenizer)
    if os.path.isdir(tokenizer):
        return tokenizer
    revision = args.tokenizer_revision or args.revision
    return _download(tokenizer, revision, args.download_dir, [], [], args.hf_token, what="tokenizer")


def _looks_like_path(name: str) -> bool:
    """A name no Hub id can be ("./x", "/x", "~/x", "a/b/c", "x/")."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or name.endswith("/")


def _download(
    repo_id: str,
    revision: str | None,
    cache_dir: str | None,
    weight_patterns: list[str],
    ignore_patterns: list[str],
    token: str | None,
    *,
    what: str,
) -> str:
    if _looks_like_path(repo_id):  # a path that does not exist: not an id to look up
        raise ValueError(
            f"{what.capitalize()} directory {repo_id!r} does not exist. Pass a local folder in Hugging "
            "Face layout, or a model id such as Qwen/Qwen2.5-7B-Instruct to download it."
        )
    if use_modelscope():
        return _download_modelscope(repo_id, revision, cache_dir, weight_patterns + SUPPORT_PATTERNS, ignore_patterns)
    from huggingface_hub import constants, errors

    offline = constants.HF_HUB_OFFLINE
    t0 = time.perf_counter()
    try:
        if weight_patterns and not offline:
            weight_patterns = _weight_format(repo_id, revision, token, weight_patterns)
        folder = _snapshot(repo_id, revision, cache_dir, weight_patterns, ignore_patterns, token, offline)
    except errors.HFValidationError as e:
        raise ValueError(
            f"{what.capitalize()} {repo_id!r} is neither a local folder nor a valid Hugging Face Hub model id: {e}"
        ) from None
    except errors.RevisionNotFoundError:
        raise ValueError(f"Revision {revision!r} of {repo_id!r} does not exist on the Hugging Face Hub.") from None
    except errors.GatedRepoError:
        raise ValueError(
            f"{repo_id!r} is a gated model: accept its license on the Hugging Face Hub and pass a "
            "token (--hf-token, or HF_TOKEN)."
        ) from None
    except errors.RepositoryNotFoundError:
        raise ValueError(
            f"{what.capitalize()} {repo_id!r} is not a local folder and was not found on the Hugging "
            "Face Hub (private repos need a token: --hf-token, or HF_TOKEN)."
        ) from None
    except errors.LocalEntryNotFoundError as e:
        where = cache_dir or constants.HF_HUB_CACHE
        if offline:
            raise ValueError(
                f"{what.capitalize()} {repo_id!r} (revision {revision or 'main'}) is not in the "
                f"Hugging Face cache at {where}, and HF_HUB_OFFLINE=1 forbids downloading it."
            ) from None
        raise ValueError(
            f"Could not download {repo_id!r} from the Hugging Face Hub and it is not in the cache at {where}: {e}"
        ) from None
    logger.info(
        "%s %s (revision %s) at %s (%.1f s)",
        what.capitalize(),
        repo_id,
        revision or "main",
        folder,
        time.perf_counter() - t0,
    )
    return folder


def _snapshot(repo_id, revision, cache_dir, weight_patterns, ignore_patterns, token, offline) -> str:
    """snapshot_download of the support files and one weight format: as vLLM, each pattern in turn until the
    folder has weights of it (offline, the cache may hold either format; online the list is down to one)."""
    import huggingface_hub
    from huggingface_hub import errors

    for i, pattern in enumerate(weight_patterns or [None]):
        try:
            folder = huggingface_hub.snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=cache_dir,
                allow_patterns=([pattern] if pattern else []) + SUPPORT_PATTERNS,
                ignore_patterns=ignore_patterns or None,
                token=token,
                local_files_only=offline,
            )
        except errors.LocalEntryNotFoundError:  # this format is not (all) in the cache: the next one may be
            if i == len(weight_patterns) - 1 or not offline:
                raise
            continue
        if pattern is None or glob.glob(os.path.join(folder, "**", pattern), recursive=True):
            return folder
    return folder  # no weights of any format: the loader says so, naming the folder


def _weight_format(repo_id: str, revision: str | None, token: str | None, patterns: list[str]) -> list[str]:
    """The first of patterns the repo's files match (vLLM fetches one weight format); all of them when the file
    list cannot be had (then snapshot_download's own errors speak, or it serves the cache: the Hub unreachable)."""
    from huggingface_hub import HfApi

    try:
        files = HfApi().list_repo_files(repo_id, revision=revision, token=token)
    except Exception:  # noqa: BLE001 - HTTP errors, and the Hub unreachable (httpx's errors are no OSError)
        return patterns
    for pattern in patterns:
        if fnmatch.filter(files, pattern):
            logger.info("Using model weights format %s", [pattern])
            return [pattern]
    return patterns


def _download_modelscope(
    model_id: str, revision: str | None, cache_dir: str | None, allow: list[str], ignore: list[str]
) -> str:
    from huggingface_hub import constants

    try:
        from modelscope.hub.snapshot_download import snapshot_download
    except ImportError:
        raise ImportError(
            f"VLLM_USE_MODELSCOPE is set, so {model_id!r} is a ModelScope model id, which needs the "
            "modelscope package: pip install modelscope"
        ) from None
    return snapshot_download(
        model_id=model_id,
        cache_dir=cache_dir,
        revision=revision,
        local_files_only=constants.HF_HUB_OFFLINE,
        allow_patterns=allow,
        ignore_file_pattern=ignore or None,
    )
