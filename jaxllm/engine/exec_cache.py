"""On-disk cache of compiled step executables, so a warm start loads each shape bucket's program instead of
tracing and lowering it again (issue 7: time to ready).

JAX's persistent compilation cache is keyed by the lowered program, so even on a hit every bucket is traced
and lowered first (~1 s per bucket for a 32-layer model). This cache is keyed by what the program is built
from, known before tracing:
  - jax and jaxlib versions, the platform and its version, the devices the step runs on (ids, kinds, count),
    XLA_FLAGS, the JAXLLM_* overrides that change a step (PROGRAM_ENV) and the jax options that change lowering;
  - a hash of every .py file of jaxllm/ and kernels_pallas/ (any code change is a miss);
  - the step's name and static arguments (model config, attention backend and mesh, sampler flags, prompt
    logprobs k);
  - the tree structure, shape, dtype and sharding of every argument: params, KV cache (num_blocks, block
    size, kv dtype, layout) and the bucket's inputs (T, B, max pages, sampler row widths).

An entry is one file `<key>.jxe`: a magic line, the sha256 of the body, then the pickled body (the serialized
executable, its argument and result tree structures, the ids of the devices it runs on, its key). Before
anything is deserialized, load() checks the digest, the key, the devices and the argument structure; after,
every argument's shape and dtype. Any failure is a miss with a warning (the caller traces and compiles as
usual), never a wrong program. Writes go to a temporary file renamed into place, so concurrent engines
(pytest-xdist workers) never read half an entry; two writers of one key write the same program.

Only executables XLA compiled in the storing call are stored. One that JAX's persistent compilation cache
supplied (deserialized) does not survive a second serialization on CPU (running the copy fails with
"Function ... not found"), and JAX's in-memory cache hands an executable out again, with no event, to any
later compile of the same program in the process, also one that an untracked compile got from the persistent
cache (a runner without an executable cache: stored, such copies broke test engines' steps for every later
start). So compile_and_store() stores only what jax.monitoring saw XLA compile (a backend compile without a
persistent cache hit) in the compiling thread during the call. After a code change that leaves a step's HLO
unchanged, that step keeps coming from JAX's cache (traced and lowered each start) until its HLO changes or
JAX's entry is gone. The same happens to two variants that lower to one program (on CPU, where decode_only
changes nothing, decode and mixed buckets of equal T and B): the second compile is JAX's in-memory copy of the
first, so only the first is stored.

Entries are pickles that load native code: the cache directory must be as trusted as JAX's own cache.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import pickle
import threading
import time
import uuid

import jax

logger = logging.getLogger(__name__)

FORMAT = 1
_MAGIC = b"jaxllm-executable-cache %d\n" % FORMAT
_SUFFIX = ".jxe"
# jax.monitoring events, recorded in the compiling thread: a persistent cache hit, and the end of a compile that
# XLA or JAX's persistent cache answered (not recorded when JAX's in-memory cache answers).
JAX_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
JAX_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
# Environment overrides (bench A/B runs) that change what a step traces to or how it compiles: xla_options'
# cuBLAS cutoff, the decode attention backend, the fp8 GEMV of the batch-1 bucket, the fp8 dot's bfloat16 output,
# the fp8 MLP's fused silu * up pass, the int4 nk layout, the residual add + norm pass. A switch missing here makes an
# A/B run that shares a --compilation-cache-dir load the other side's programs (stop 51: JAXLLM_FP8_SILU_MLP was
# missing, and every fp8 A/B pair of that stop ran one program twice; stop 60: JAXLLM_ADD_NORM).
PROGRAM_ENV = (
    "JAXLLM_ADD_NORM",
    "JAXLLM_CUBLAS_MIN_DECODE_SEQS",
    "JAXLLM_DECODE_COMMAND_BUFFER",
    "JAXLLM_DECODE_BACKEND",
    "JAXLLM_FP8_ADD_NORM_E4M3",
    "JAXLLM_FP8_GEMV",
    "JAXLLM_FP8_GEMV_SILU",
    "JAXLLM_FP8_DOT_BF16",
    "JAXLLM_FP8_NORM",
    "JAXLLM_FP8_SILU_MLP",
    "JAXLLM_INT4_NK",
    "JAXLLM_INT4_NK_INLINE",
    "JAXLLM_INT4_NK_WIDE",
)
# jax options that change what a traced step lowers to.
_JAX_OPTIONS = (
    "jax_enable_x64",
    "jax_default_matmul_precision",
    "jax_numpy_rank_promotion",
    "jax_numpy_dtype_promotion",
    "jax_default_prng_impl",
    "jax_threefry_partitionable",
    "jax_use_shardy_partitioner",
    "jax_enable_custom_prng",
)


@functools.cache
def source_digest() -> str:
    """sha256 over the .py files of the packages that build the step (read once per process)."""
    import jaxllm
    import kernels_pallas

    h = hashlib.sha256()
    for pkg in (jaxllm, kernels_pallas):
        root = os.path.dirname(os.path.abspath(pkg.__file__))
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in sorted(f for f in filenames if f.endswith(".py")):
                path = os.path.join(dirpath, name)
                h.update(os.path.relpath(path, os.path.dirname(root)).encode() + b"\0")
                with open(path, "rb") as f:
                    h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def _environment(devices) -> str:
    import jaxlib

    options = {}
    for name in _JAX_OPTIONS:
        try:
            options[name] = str(getattr(jax.config, name))
        except AttributeError:
            pass
    d0 = devices[0]
    return json.dumps(
        dict(
            format=FORMAT,
            jax=jax.__version__,
            jaxlib=jaxlib.__version__,
            platform=d0.platform,
            platform_version=d0.client.platform_version,
            device_count=jax.device_count(),
            process_count=jax.process_count(),
            devices=[(d.id, d.device_kind, d.process_index) for d in devices],
            xla_flags=os.environ.get("XLA_FLAGS", ""),
            program_env={k: os.environ.get(k, "") for k in PROGRAM_ENV},
            options=options,
            sources=source_digest(),
        ),
        sort_keys=True,
    )


_local = threading.local()
_listener_lock = threading.Lock()
_listening = False


def _on_event(event: str, **kwargs) -> None:
    if event == JAX_CACHE_HIT_EVENT:
        _local.jax_cache_hit = True


def _on_duration(event: str, duration: float, **kwargs) -> None:
    if event == JAX_COMPILE_EVENT:
        _local.compiled = True


def compile_tracking_xla(compile_fn):
    """compile_fn() and whether XLA compiled it in this call (not JAX's persistent or in-memory cache)."""
    global _listening
    with _listener_lock:
        if not _listening:
            jax.monitoring.register_event_listener(_on_event)
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            _listening = True
    _local.jax_cache_hit = _local.compiled = False
    exe = compile_fn()
    return exe, exe is not None and _local.compiled and not _local.jax_cache_hit


@functools.lru_cache(maxsize=4096)
def _layout(sharding, shape) -> str:
    """Which slice of an array each device holds: the same for equivalent shardings spelled differently
    (a step returns the KV cache as P() on a one-device mesh where it came in as P("tp", ...))."""
    slices = sharding.devices_indices_map(shape)
    return f"{sorted((d.id, repr(idx)) for d, idx in slices.items())}|{getattr(sharding, 'memory_kind', None)}"


def _leaf_signature(x) -> str:
    sharding = getattr(x, "sharding", None)  # numpy inputs: placed by the executable
    shape = tuple(getattr(x, "shape", ()))
    layout = "host" if sharding is None else _layout(sharding, shape)
    return f"{shape}|{getattr(x, 'dtype', type(x).__name__)}|{getattr(x, 'weak_type', '')}|{layout}"


def _device_ids(compiled) -> list[int]:
    """The devices compiled runs on, in its device-assignment order (what deserializing needs)."""
    devices = getattr(getattr(compiled._executable, "_unloaded_executable", None), "device_list", None)
    if devices is None:
        devices = compiled.runtime_executable().local_devices()  # one process (see ModelRunner)
    return [d.id for d in devices]


def _load_kernel_runtimes() -> None:
    """A Mosaic GPU kernel in a loaded executable finds its runtime library (mosaic_gpu_launch_kernel, ...)
    through an environment variable that jax's Mosaic GPU module sets when it is imported; a warm start loads
    executables without tracing anything, so nothing else would import it (every entry with the Mosaic GPU
    prefill kernel was unusable: "Failed to lookup host symbol")."""
    try:
        import jax.experimental.mosaic.gpu  # noqa: F401
    except ImportError:
        pass


class ExecutableCache:
    """Compiled executables on disk, keyed by key(); counters say what happened (tests, logs)."""

    def __init__(self, directory: str, devices, max_bytes: int = 16 << 30):
        self.dir = os.path.expanduser(directory)
        self.devices = tuple(devices)  # in the order of the executables' device assignment (mesh order)
        self.max_bytes = max_bytes  # prune() drops least recently used entries beyond this
        self.hits = self.misses = self.errors = self.stores = 0
        self.from_jax_cache = 0  # compiles JAX's caches answered: not stored (see the module docstring)
        self._lock = threading.Lock()
        self._env = _environment(self.devices)
        if self.devices and self.devices[0].platform == "gpu":
            _load_kernel_runtimes()

    def key(self, name: str, args, static) -> str:
        """Digest of the environment, the function name, its static arguments (their repr) and the
        structure, shapes, dtypes and shardings of its arguments: everything the program depends on."""
        leaves, tree = jax.tree.flatten(args)
        h = hashlib.sha256(self._env.encode())
        h.update(f"\0{name}\0{static!r}\0{tree}\0".encode())
        h.update("\n".join(map(_leaf_signature, leaves)).encode())
        return h.hexdigest()[:48]

    def path(self, key: str) -> str:
        return os.path.join(self.dir, key + _SUFFIX)

    def load(self, key: str, args):
        """The executable stored under key, ready to call with args like these; None on a miss or an
        unusable entry (logged)."""
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            self._count("misses")
            return None
        except OSError as e:
            return self._unusable(path, e)
        try:
            exe = self._deserialize(key, data, args)
        except Exception as e:  # noqa: BLE001 - any failure means: compile instead
            return self._unusable(path, e)
        self._count("hits")
        try:
            os.utime(path)  # recency for prune()
        except OSError:
            pass
        return exe

    def _deserialize(self, key: str, data: bytes, args):
        from jax.experimental.serialize_executable import deserialize_and_load

        if not data.startswith(_MAGIC):
            raise ValueError("not an entry of this format")
        digest, body = data[len(_MAGIC) : len(_MAGIC) + 32], data[len(_MAGIC) + 32 :]
        if hashlib.sha256(body).digest() != digest:
            raise ValueError("checksum mismatch (truncated or corrupt)")
        entry = pickle.loads(body)
        if entry["key"] != key:
            raise ValueError(f"entry holds key {entry['key']}")
        # Deserializing for other devices than the program's aborts the process: check first.
        if entry["device_ids"] != [d.id for d in self.devices]:
            raise ValueError(f"entry is for devices {entry['device_ids']}")
        if entry["in_tree"] != jax.tree.structure((tuple(args), {})):
            raise ValueError("argument structure differs")
        exe = deserialize_and_load(
            entry["payload"],
            entry["in_tree"],
            entry["out_tree"],
            backend=self.devices[0].client,
            execution_devices=list(self.devices),
        )
        want = [(tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(args)]
        got = [(tuple(a.shape), str(a.dtype)) for a in jax.tree.leaves(exe.args_info)]
        if want != got:
            raise ValueError("argument shapes or dtypes differ")
        return exe

    def _unusable(self, path: str, err: Exception):
        self._count("errors")
        logger.warning(
            "Executable cache entry %s is unusable (%s: %s); compiling instead", path, type(err).__name__, err
        )
        return None

    def compile_and_store(self, key: str, compile_fn):
        """compile_fn() (an executable, or None), stored under key if XLA compiled it in this call."""
        exe, by_xla = compile_tracking_xla(compile_fn)
        if exe is not None:
            if by_xla:
                self.store(key, exe)
            else:
                self._count("from_jax_cache")
                logger.debug("Not storing %s: JAX's compilation cache supplied it", key)
        return exe

    def store(self, key: str, compiled) -> bool:
        """Writes compiled under key (atomically); False, with a warning, when it cannot be serialized."""
        from jax.experimental.serialize_executable import serialize

        try:
            ids = _device_ids(compiled)
            if ids != [d.id for d in self.devices]:
                raise ValueError(f"runs on devices {ids}, not the cache's {[d.id for d in self.devices]}")
            payload, in_tree, out_tree = serialize(compiled)
            body = pickle.dumps(
                dict(key=key, device_ids=ids, payload=payload, in_tree=in_tree, out_tree=out_tree),
                protocol=pickle.HIGHEST_PROTOCOL,
            )
            os.makedirs(self.dir, exist_ok=True)
            tmp = os.path.join(self.dir, f".{key}.{uuid.uuid4().hex}.tmp")
            try:
                with open(tmp, "wb") as f:
                    f.write(_MAGIC + hashlib.sha256(body).digest() + body)
                os.replace(tmp, self.path(key))
            finally:
                if os.path.exists(tmp):
                    os.remove(tmp)
        except Exception as e:  # noqa: BLE001 - the cache is an optimisation; serving goes on without it
            logger.warning("Could not write executable cache entry %s (%s: %s)", key, type(e).__name__, e)
            return False
        self._count("stores")
        return True

    def prune(self) -> None:
        """Drops least recently used entries while the directory holds more than max_bytes, and temporary
        files an interrupted writer left over an hour ago."""
        try:
            entries = []
            for name in os.listdir(self.dir):
                path = os.path.join(self.dir, name)
                st = os.stat(path)
                if name.endswith(".tmp") and st.st_mtime < time.time() - 3600:
                    os.remove(path)
                elif name.endswith(_SUFFIX):
                    entries.append((st.st_mtime, st.st_size, path))
            total = sum(size for _, size, _ in entries)
            for _, size, path in sorted(entries):
                if total <= self.max_bytes:
                    break
                os.remove(path)
                total -= size
        except OSError as e:  # another process pruning at the same time, or the directory is gone
            logger.debug("Executable cache prune: %s", e)

    def _count(self, name: str) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + 1)
