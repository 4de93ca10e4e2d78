"""Model ids download as vLLM does: huggingface_hub's real snapshot_download against a local server with the Hub's
endpoints (tests/fake_hub.py), with --download-dir, --revision, --tokenizer-revision, HF_HUB_OFFLINE and the cache
honoured, one weight format (safetensors before .bin), and ModelScope through the `modelscope` package.

The suite's conftest sets HF_HUB_OFFLINE=1 and an empty HF_HOME for every test process; these tests set the Hub's
endpoint, offline mode and cache themselves (huggingface_hub.constants in-process, the environment in a subprocess).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jaxllm.engine.args import EngineArgs
from jaxllm.engine.model_files import resolve_model_dir, resolve_tokenizer_dir
from tests.fake_hub import FakeHub, folder_files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    from tests.tiny_models import make_tiny_model_dir

    tiny, _ = make_tiny_model_dir("llama", str(tmp_path_factory.mktemp("tiny")))
    main = folder_files(tiny)
    # What a real repo also holds: .bin weights beside the safetensors, Meta's original/ copy, a README.
    main.update(
        {
            "pytorch_model.bin": b"not to be downloaded",
            "original/consolidated.00.pth": b"nor this",
            "README.md": b"# tiny",
        }
    )
    v2 = dict(main, **{"generation_config.json": json.dumps({"temperature": 0.25, "eos_token_id": 2}).encode()})
    bin_only = {k: v for k, v in main.items() if not k.endswith(".safetensors")}
    tokenizer = {k: v for k, v in main.items() if k.startswith(("tokenizer", "special_tokens"))}
    tok_v1 = dict(tokenizer, **{"tokenizer_config.json": main["tokenizer_config.json"].replace(b"}", b', "x": 1}', 1)})
    with FakeHub(
        {
            "org/tiny": {"main": main, "v2": v2},
            "org/bin-only": {"main": bin_only},
            "org/tok": {"main": tokenizer, "tok-v1": tok_v1},
        }
    ) as h:
        yield h


@pytest.fixture
def online(hub, tmp_path, monkeypatch):
    """huggingface_hub talking to the fake Hub, with an empty cache of its own."""
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "ENDPOINT", hub.url)
    monkeypatch.setattr(c, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.delenv("VLLM_USE_MODELSCOPE", raising=False)
    monkeypatch.delenv("JAXLLM_USE_MODELSCOPE", raising=False)
    hub.requests.clear()
    return hub


def _files(folder: str) -> set[str]:
    return set(folder_files(folder))


def test_model_id_downloads_one_weight_format_into_download_dir(online, tmp_path):
    folder = resolve_model_dir(EngineArgs(model="org/tiny", download_dir=str(tmp_path / "dl")))
    assert folder.startswith(str(tmp_path / "dl" / "models--org--tiny" / "snapshots"))
    files = _files(folder)
    assert "model.safetensors" in files and "config.json" in files and "tokenizer.json" in files
    assert "pytorch_model.bin" not in files  # safetensors preferred, as vLLM's allow_patterns
    assert not any(f.startswith("original/") for f in files)  # vLLM's default ignore_patterns
    assert not (tmp_path / "hf-cache").exists()  # download_dir is the cache used
    # a repo with only .bin weights gets those
    bin_folder = resolve_model_dir(EngineArgs(model="org/bin-only"))
    assert "pytorch_model.bin" in _files(bin_folder) and bin_folder.startswith(str(tmp_path / "hf-cache"))
    # load_format="dummy" fetches no weights at all
    dummy = resolve_model_dir(EngineArgs(model="org/tiny", load_format="dummy", download_dir=str(tmp_path / "d2")))
    assert not any(f.endswith((".safetensors", ".bin")) for f in _files(dummy))


def test_revisions_and_a_separate_tokenizer(online):
    main = resolve_model_dir(EngineArgs(model="org/tiny"))
    v2 = resolve_model_dir(EngineArgs(model="org/tiny", revision="v2"))
    assert main != v2 and os.path.basename(v2) == FakeHub.commit("org/tiny", "v2")
    with open(os.path.join(v2, "generation_config.json")) as f:
        assert json.load(f)["temperature"] == 0.25
    args = EngineArgs(model="org/tiny", tokenizer="org/tok", tokenizer_revision="tok-v1")
    tok = resolve_tokenizer_dir(args, main)
    assert os.path.basename(tok) == FakeHub.commit("org/tok", "tok-v1") and "model.safetensors" not in _files(tok)
    with open(os.path.join(tok, "tokenizer_config.json")) as f:
        assert json.load(f)["x"] == 1
    # the tokenizer revision defaults to the model's revision (vLLM); the model's own folder serves its tokenizer
    assert resolve_tokenizer_dir(EngineArgs(model="org/tiny", revision="v2"), v2) == v2
    with pytest.raises(ValueError, match=r"Revision 'nope' of 'org/tok' does not exist"):
        resolve_tokenizer_dir(EngineArgs(model="org/tiny", tokenizer="org/tok", revision="nope"), main)


def test_offline_mode_uses_the_cache_without_a_request(online, monkeypatch):
    import huggingface_hub.constants as c

    folder = resolve_model_dir(EngineArgs(model="org/tiny"))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    online.requests.clear()
    assert resolve_model_dir(EngineArgs(model="org/tiny")) == folder and online.requests == []
    with pytest.raises(
        ValueError,
        match=r"'org/tiny' \(revision v2\) is not in the Hugging Face cache .*"
        r"HF_HUB_OFFLINE=1",
    ):
        resolve_model_dir(EngineArgs(model="org/tiny", revision="v2"))
    assert online.requests == []


def test_an_unreachable_hub_serves_the_cache(online, monkeypatch):
    """The Hub down (connection refused, HF_HUB_OFFLINE unset): a cached model loads from the cache, as
    snapshot_download and vLLM do; an uncached one gets the "not in the cache" message. The file listing's
    connection error (httpx's, not an OSError) escaped as a raw network error (black-box report)."""
    import huggingface_hub.constants as c

    folder = resolve_model_dir(EngineArgs(model="org/tiny"))
    dead = "http://127.0.0.1:9"  # discard port: nothing listens
    monkeypatch.setattr(c, "ENDPOINT", dead)
    monkeypatch.setattr(c, "HUGGINGFACE_CO_URL_TEMPLATE", dead + "/{repo_id}/resolve/{revision}/{filename}")
    assert resolve_model_dir(EngineArgs(model="org/tiny")) == folder
    with pytest.raises(ValueError, match=r"Could not download 'org/bin-only' from the Hugging Face Hub and it is not"):
        resolve_model_dir(EngineArgs(model="org/bin-only"))


def test_bad_names_fail_clearly(online, tmp_path):
    with pytest.raises(ValueError, match=r"Model directory './baichuan-7B/' does not exist"):
        resolve_model_dir(EngineArgs(model="./baichuan-7B/"))
    not_a_folder = tmp_path / "weights.safetensors"
    not_a_folder.write_bytes(b"x")
    with pytest.raises(ValueError, match=r"is a file, not a model folder"):
        resolve_model_dir(EngineArgs(model=str(not_a_folder)))
    with pytest.raises(
        ValueError,
        match=r"'org/missing' is not a local folder and was not found on the Hugging "
        r"Face Hub",
    ):
        resolve_model_dir(EngineArgs(model="org/missing"))
    with pytest.raises(ValueError, match=r"Revision 'v9' of 'org/tiny' does not exist"):
        resolve_model_dir(EngineArgs(model="org/tiny", revision="v9"))


def test_llm_serves_a_model_id(online, tmp_path):
    from jaxllm import LLM, SamplingParams

    llm = LLM(
        "org/tiny",
        revision="v2",
        download_dir=str(tmp_path / "dl"),
        dtype="float32",
        enforce_eager=True,
        num_gpu_blocks_override=32,
        max_num_seqs=2,
        max_num_batched_tokens=32,
        block_size=8,
        max_model_len=64,
    )
    assert llm.llm_engine.model_name == "org/tiny"
    assert llm.get_default_sampling_params().temperature == 0.25  # v2's generation_config.json
    out = llm.generate(
        {"prompt_token_ids": [5, 9, 2]}, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False
    )[0]
    assert len(out.outputs[0].token_ids) == 3


# Set from HF_HOME by libraries other tests import in this process (gptqmodel, also through transformers' GPTQ
# integration, sets them on import); each would win over the HF_HOME these tests give their subprocesses.
_CACHE_OVERRIDES = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE", "HF_MODULES_CACHE")


def _without_cache_overrides(environ) -> dict:
    return {k: v for k, v in environ.items() if k not in _CACHE_OVERRIDES}


def _resolve_in_subprocess(env: dict, **args) -> subprocess.CompletedProcess:
    code = (
        "import json, sys; from jaxllm.engine.args import EngineArgs; "
        "from jaxllm.engine.model_files import resolve_model_dir; "
        "print(resolve_model_dir(EngineArgs(**json.loads(sys.argv[1]))))"
    )
    return subprocess.run(
        [sys.executable, "-c", code, json.dumps(args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**_without_cache_overrides(os.environ), "PYTHONPATH": ROOT, **env},
        timeout=120,
    )


def test_environment_variables_hf_endpoint_hf_home_and_hf_hub_offline(hub, tmp_path):
    """What a user sets: HF_ENDPOINT, HF_HOME and HF_HUB_OFFLINE, read by huggingface_hub at import."""
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "0"}
    first = _resolve_in_subprocess(env, model="org/tiny")
    assert first.returncode == 0, first.stderr[-2000:]
    folder = first.stdout.strip().splitlines()[-1]
    assert folder.startswith(str(tmp_path / "home" / "hub" / "models--org--tiny"))
    hub.requests.clear()
    again = _resolve_in_subprocess({**env, "HF_HUB_OFFLINE": "1"}, model="org/tiny")
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout.strip().splitlines()[-1] == folder and hub.requests == []


def test_modelscope(tmp_path, monkeypatch):
    """VLLM_USE_MODELSCOPE=True (or JAXLLM_USE_MODELSCOPE): ids go to modelscope's snapshot_download, with vLLM's
    arguments; without the package, an error naming the pip command."""
    for var in ("VLLM_USE_MODELSCOPE", "JAXLLM_USE_MODELSCOPE"):
        monkeypatch.delenv("VLLM_USE_MODELSCOPE", raising=False)
        monkeypatch.delenv("JAXLLM_USE_MODELSCOPE", raising=False)
        monkeypatch.setenv(var, "True")
        for name in [m for m in sys.modules if m.startswith("modelscope.")]:
            monkeypatch.delitem(sys.modules, name)
        monkeypatch.setitem(sys.modules, "modelscope", None)  # not installed
        with pytest.raises(ImportError, match=r"pip install modelscope"):
            resolve_model_dir(EngineArgs(model="qwen/Qwen2.5-7B-Instruct"))
        pkg = tmp_path / var / "modelscope"
        (pkg / "hub").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "hub" / "__init__.py").write_text("")
        (pkg / "hub" / "snapshot_download.py").write_text(
            "calls = []\n"
            "def snapshot_download(model_id, revision=None, cache_dir=None, local_files_only=False, **kw):\n"
            "    calls.append(dict(model_id=model_id, revision=revision, cache_dir=cache_dir,\n"
            "                      local_files_only=local_files_only, **kw))\n"
            "    return '/ms/' + model_id\n"
        )
        for name in [m for m in sys.modules if m == "modelscope" or m.startswith("modelscope.")]:
            monkeypatch.delitem(sys.modules, name)
        monkeypatch.syspath_prepend(str(tmp_path / var))
        folder = resolve_model_dir(EngineArgs(model="qwen/Qwen2.5-7B-Instruct", revision="v1.0", download_dir="/dl"))
        assert folder == "/ms/qwen/Qwen2.5-7B-Instruct"
        from modelscope.hub.snapshot_download import calls

        (call,) = calls
        assert (call["model_id"], call["revision"], call["cache_dir"]) == ("qwen/Qwen2.5-7B-Instruct", "v1.0", "/dl")
        assert call["local_files_only"] is True  # this test process runs with HF_HUB_OFFLINE=1 (conftest)
        assert "*.safetensors" in call["allow_patterns"]
