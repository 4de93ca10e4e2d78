"""One engine over several processes (hosts), in JAX's multi-controller model.

Every process holds its shards of the weights and the KV cache and runs the same compiled programs, in the same
order, on the same inputs; process 0 (the driver) alone owns the scheduler, the tokenizer, the detokenizer and
the HTTP server. Per step:

    process 0: schedule -> prepare (host inputs, StepVariant) -> send_step ----.
                                                                               | jax collective (StepChannel)
    process i:                        follow(): recv -> host inputs, variant <-'
    every process: ModelRunner.run_step(variant, mode, host inputs)   (tp all-reduces, pp hops: collectives)
                   -> outputs moved to process 0's devices (to_driver) -> process 0 reads the sampled tokens

The message is the step's two packed host arrays (packing.py) and a small pickled header (the StepVariant, how
the step runs: whole / split / pipeline, and the packing layout), broadcast by a jitted sum over one device of
each process (StepChannel): jax's collectives (NCCL, gloo on CPU), no protocol of our own. A step whose decision
depends on a process's own state (is a background compile done? which sampler program?) is decided on process 0
and sent; programs missing on a worker are compiled there when the step needs them, as on process 0.

Pipeline stages on different processes hand hidden states (and the sampled tokens back to stage 0) over with
`move`: a jitted ppermute over a mesh of the two rows of devices (MultiHost.move). A jit whose devices all belong
to other processes is a no-op for this process, so every process runs the same Python for every stage.

Workers run `follow` (vLLM's headless mode): receive, run, repeat, until process 0 says END (an offline call
finished: the workers' LLM.generate returns [] then) or SHUTDOWN (the driver's engine is gone). An idle server
sends NOOP heartbeats so that no collective waits for long. Losing a process: jaxllm.distributed.Watchdog.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxllm.sharding import mesh_pp

logger = logging.getLogger(__name__)

STEP, END, SHUTDOWN, NOOP = 1, 2, 3, 4
_HEAD_WORDS = 4  # kind, header bytes, ints, floats
FIRST_WORDS = 1 << 14  # the first broadcast of every message (64 KB): a decode step's whole message at usual sizes
HEARTBEAT_S = 1.0  # an idle driver sends NOOP this often


@dataclass
class Message:
    kind: int
    header: object = None  # STEP: (StepVariant, mode, PackedLayout)
    ints: np.ndarray | None = None
    floats: np.ndarray | None = None


class StepChannel:
    """Messages from process 0 to every process through jax collectives: each message is one broadcast of
    FIRST_WORDS int32 words, and a second one for what did not fit (its size rounded up to a power of two, so
    there are few programs to compile). A broadcast is a jitted sum over one device of each process, the sender
    contributing the words and the others zeros: exact for int32 (floats travel as their bits)."""

    def __init__(self):
        self.process_id, self.num_processes = jax.process_index(), jax.process_count()
        firsts: dict[int, object] = {}
        for d in jax.devices():
            firsts.setdefault(d.process_index, d)
        mesh = Mesh(np.array([firsts[p] for p in sorted(firsts)]), ("process",))
        self._rows = NamedSharding(mesh, P("process"))
        self._sum = jax.jit(lambda x: x.sum(0, dtype=x.dtype), out_shardings=NamedSharding(mesh, P()))
        self._zeros: dict[int, np.ndarray] = {}
        self._sync_send = jax.default_backend() == "cpu"
        self.last_send = time.monotonic()
        self.lock = threading.Lock()  # a server's heartbeat and its steps come from one thread; offline from another

    def _broadcast(self, words: np.ndarray | None, n: int) -> np.ndarray | None:
        local = words if self.process_id == 0 else self._zeros.setdefault(n, np.zeros(n, np.int32))
        x = jax.make_array_from_process_local_data(self._rows, local[None], (self.num_processes, n))
        out = self._sum(x)
        if self.process_id != 0:
            return np.asarray(out.addressable_data(0))
        # Process 0 does not wait on GPUs: its step follows on the same device stream. The CPU client runs a
        # computation over several local devices on the calling thread, and one over a single local device (this
        # one) on another: the step would then run, and wait for workers still waiting for this, before it.
        if self._sync_send:
            out.block_until_ready()
        return None

    def send(self, msg: Message) -> None:
        header = b"" if msg.header is None else pickle.dumps(msg.header)
        ints = np.zeros(0, np.int32) if msg.ints is None else msg.ints
        floats = np.zeros(0, np.float32) if msg.floats is None else msg.floats
        parts = [
            np.array([msg.kind, len(header), ints.size, floats.size], np.int32),
            np.frombuffer(header + b"\0" * (-len(header) % 4), np.int32),
            ints,
            floats.view(np.int32),
        ]
        words = np.concatenate(parts)
        with self.lock:
            first = np.zeros(FIRST_WORDS, np.int32)
            first[: min(words.size, FIRST_WORDS)] = words[:FIRST_WORDS]
            self._broadcast(first, FIRST_WORDS)
            if words.size > FIRST_WORDS:
                rest = words[FIRST_WORDS:]
                n = _pow2(rest.size)
                self._broadcast(np.concatenate([rest, np.zeros(n - rest.size, np.int32)]), n)
            self.last_send = time.monotonic()

    def recv(self) -> Message:
        words = self._broadcast(None, FIRST_WORDS)
        kind, n_header, n_ints, n_floats = (int(w) for w in words[:_HEAD_WORDS])
        n_header_words = -(-n_header // 4)
        total = _HEAD_WORDS + n_header_words + n_ints + n_floats
        if total > FIRST_WORDS:
            words = np.concatenate([words, self._broadcast(None, _pow2(total - FIRST_WORDS))])
        at = _HEAD_WORDS
        header = pickle.loads(words[at : at + n_header_words].tobytes()[:n_header]) if n_header else None
        at += n_header_words
        ints = words[at : at + n_ints]
        floats = words[at + n_ints : at + n_ints + n_floats].view(np.float32)
        return Message(kind, header, ints, floats)


def _pow2(n: int) -> int:
    return max(1 << (n - 1).bit_length(), 1024)


def host_unpack(ints: np.ndarray, floats: np.ndarray, layout):
    """packing.unpack_host_args on the host: the step's host inputs (numpy), as process 0 prepared them."""
    out = []
    for dtype, shape, buf, off in layout.leaves:
        n = int(np.prod(shape, dtype=np.int64))
        x = (ints if buf == "i" else floats)[off : off + n].reshape(shape)
        if dtype == "uint32":
            x = x.view(np.uint32)
        elif dtype == "bool":
            x = x != 0
        out.append(x)
    return jax.tree.unflatten(layout.treedef, out)


class MultiHost:
    """This process's part in an engine whose mesh spans several processes: the step channel (process 0 sends,
    the others receive), moving arrays between the devices of different processes, and start-up agreement."""

    def __init__(self, mesh: Mesh):
        from jaxllm.distributed import watchdog

        self.mesh = mesh
        self.process_id, self.num_processes = jax.process_index(), jax.process_count()
        owners = sorted({d.process_index for d in mesh.devices.flat})
        if owners != list(range(self.num_processes)):
            idle = sorted(set(range(self.num_processes)) - set(owners))
            raise ValueError(
                f"The (pp, tp) mesh of {mesh.devices.size} devices has no device of process(es) {idle}: every "
                f"process must hold part of the model. Use tensor_parallel_size * pipeline_parallel_size of at "
                f"least {self.num_processes} (one stage per process: --pipeline-parallel-size "
                f"{self.num_processes}), or fewer processes."
            )
        self.is_driver = self.process_id == 0
        # XLA's CPU client runs each device's part of a program on a thread pool, and a program with collectives
        # in flight while the next one starts on the same devices deadlocked gloo (2 processes x 4 devices, tp 8,
        # after ~14 steps). On CPU every process therefore finishes each step before the next message; GPUs
        # order programs on each device's stream, and every process enqueues them in the same order.
        self.sync_steps = jax.default_backend() == "cpu"
        self.channel = StepChannel()
        self.watchdog = watchdog()
        # Sampled tokens are read on process 0: from the first mesh row, which holds process 0's first device.
        self.driver_sharding = NamedSharding(Mesh(mesh.devices[:1].reshape(-1), ("d",)), P())
        self._hops: dict[tuple, object] = {}
        self._placeholders: dict[tuple, jax.Array] = {}
        self._replicate: dict[tuple, object] = {}

    # ---- start-up ----
    @staticmethod
    def check_args(args) -> None:
        """What the processes cannot run together yet (ValueError naming it, before anything loads): the step
        message carries neither a speculative step and its drafter's program nor LoRA adapters' weights, which
        process 0 alone would load."""
        for name, given in (("speculative_config", args.speculative() is not None), ("enable_lora", args.enable_lora)):
            if given:
                raise ValueError(
                    f"{name} is not supported on an engine over several processes (jax.process_count() "
                    f"= {jax.process_count()}) yet: run it on one host."
                )

    def agree_engine(
        self, cfg, args, num_blocks: int, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int
    ) -> int:
        """The KV blocks every process can hold (the fewest), once the processes are found to run the same model
        with the same flags that shape the compiled programs (a hash of them), and the same step limits."""
        import hashlib

        what = repr(
            (
                cfg,
                args.tensor_parallel_size,
                args.pipeline_parallel_size,
                args.block_size,
                args.kv_cache_dtype,
                args.enable_prefix_caching,
                args.enable_chunked_prefill,
                args.max_logprobs,
                args.enforce_eager,
                args.attention_backend,
                args.load_format,
                args.seed,
            )
        )
        fingerprint = int.from_bytes(hashlib.sha256(what.encode()).digest()[:8], "little") >> 1  # 63 bits
        return self.agree(
            {
                "num_blocks": num_blocks,
                "max_num_seqs": max_num_seqs,
                "max_num_batched_tokens": max_num_batched_tokens,
                "max_model_len": max_model_len,
                "model_config": fingerprint,
            },
            take_min=("num_blocks",),
        )["num_blocks"]

    def agree(self, values: dict[str, int], take_min: tuple[str, ...] = ()) -> dict[str, int]:
        """The values every process computed for itself (they size the KV cache and name the compiled programs,
        so they must be equal everywhere): those in take_min become the smallest over the processes (KV blocks:
        the device with least free memory decides), the others must be equal, else ValueError naming the
        process that differs."""
        from jax.experimental import multihost_utils

        names = list(values)
        table = np.asarray(multihost_utils.process_allgather(np.array([values[k] for k in names], np.int64)))
        out = dict(values)
        for j, name in enumerate(names):
            column = table[:, j].tolist()
            if name in take_min:
                out[name] = int(min(column))
            elif len(set(column)) > 1:
                other = next(p for p, v in enumerate(column) if v != column[0])
                raise ValueError(
                    f"Process {other} has {name}={column[other]} where process 0 has {column[0]}: every "
                    "process must run the same model with the same flags (and the same kind of device)."
                )
        return out

    # ---- steps ----
    def send_step(self, variant, mode: str, host_args) -> None:
        from jaxllm.engine.packing import pack_host_args

        ints, floats, layout = pack_host_args(host_args)
        self.channel.send(Message(STEP, (variant, mode, layout), ints, floats))

    def send(self, kind: int) -> None:
        if self.is_driver and self.watchdog.lost is None:
            self.channel.send(Message(kind))

    def heartbeat(self) -> None:
        """An idle driver's NOOP, at most every HEARTBEAT_S: a worker never waits long in a collective."""
        if time.monotonic() - self.channel.last_send >= HEARTBEAT_S:
            self.send(NOOP)

    def step_outputs(self, outputs, state):
        """Every process, after a step's programs are dispatched: its outputs where process 0 reads them
        (to_driver); on CPU it waits for them and the step's new state (sync_steps)."""
        outputs = self.to_driver(outputs)
        if self.sync_steps:
            jax.block_until_ready((state, outputs))
        return outputs

    # ---- moving arrays between processes' devices ----
    def sampled_zeros(self, shape) -> jax.Array:
        """prev_tokens' zeros (int32) where the sampling runs: the last stage's devices (every device without
        pipeline stages), each process making its own replicas."""
        rows = self.mesh.devices[-1:] if mesh_pp(self.mesh) > 1 else self.mesh.devices
        return self.zeros(shape, np.int32, NamedSharding(Mesh(rows, ("pp", "tp")), P()))

    def zeros(self, shape, dtype, sharding) -> jax.Array:
        """A zero array with a sharding over several processes (each makes its own shards)."""
        host = np.zeros(shape, dtype)
        return jax.make_array_from_callback(shape, sharding, lambda idx: host[idx], dtype=host.dtype)

    def move(self, tree, dst: NamedSharding):
        """jax.device_put(tree, dst) across processes: numpy leaves are placed by every process on its own devices
        of dst; an array on devices of other processes is replicated on its devices, goes over a ppermute to as
        many of dst's, and is resharded there (every process calls this; those holding neither side do
        nothing)."""
        leaves, treedef = jax.tree.flatten(tree)
        out: list = [None] * len(leaves)
        hop: dict[tuple, list[int]] = {}  # source devices -> indices of the leaves that cross there
        dst_devices = tuple(dst.mesh.devices.flat)
        for i, x in enumerate(leaves):
            if not isinstance(x, jax.Array):
                host = np.asarray(x)
                out[i] = jax.make_array_from_callback(host.shape, dst, lambda idx, h=host: h[idx], dtype=host.dtype)
                continue
            src = tuple(x.sharding._device_assignment)
            if set(src) == set(dst_devices):
                out[i] = x if x.sharding.is_equivalent_to(dst, x.ndim) else self._resharded(x, dst)
                continue
            owners = {d.process_index for d in src} | {d.process_index for d in dst_devices}
            if len(owners) == 1:  # both sides on one process: a local copy there, nothing elsewhere
                out[i] = (
                    jax.device_put(x, dst)
                    if self.process_id in owners
                    else jax.make_array_from_single_device_arrays(x.shape, dst, [], dtype=x.dtype)
                )
                continue
            if len(src) != len(dst_devices):
                raise ValueError(f"Cannot move an array between {len(src)} and {len(dst_devices)} devices.")
            if not x.sharding.is_fully_replicated:
                x = leaves[i] = self._replicated(x, src)
            hop.setdefault(src, []).append(i)
        replicas = NamedSharding(Mesh(np.array(dst_devices), ("d",)), P())
        for src, idx in hop.items():
            for i, y in zip(idx, self._hop([leaves[i] for i in idx], src, dst_devices), strict=True):
                x = leaves[i]
                y = jax.make_array_from_single_device_arrays(
                    x.shape,
                    replicas,
                    [s.data for s in y.addressable_shards if s.device in dst.device_set],
                    dtype=x.dtype,
                )
                out[i] = y if dst.is_fully_replicated else self._resharded(y, dst)
        return jax.tree.unflatten(treedef, out)

    def _resharded(self, x, dst: NamedSharding):
        """x (on dst's devices) in dst's sharding: a jitted identity (no communication from replicas)."""
        key = (x.sharding, dst)
        fn = self._replicate.get(key)
        if fn is None:
            fn = self._replicate[key] = jax.jit(lambda a: a, out_shardings=dst)
        return fn(x)

    def _replicated(self, x, devices: tuple):
        key = (devices, x.sharding)
        fn = self._replicate.get(key)
        if fn is None:
            fn = self._replicate[key] = jax.jit(
                lambda a: a, out_shardings=NamedSharding(Mesh(np.array(devices), ("d",)), P())
            )
        return fn(x)

    def _hop(self, xs: list, src: tuple, dst: tuple) -> list:
        """Replicated arrays on src's devices -> on dst's devices, by one ppermute over the (2, n) mesh of the two
        rows: each side's shards are the rows of a [2 * d0, ...] array (dst's rows placeholders), so nothing is
        copied to make it. Returns the hop's outputs ([2 * d0, ...], dst's rows hold the data)."""
        union = Mesh(np.array([src, dst]), ("hop", "col"))
        rows = NamedSharding(union, P("hop"))
        fn = self._hops.get((src, dst))
        if fn is None:
            send = jax.shard_map(
                lambda *a: tuple(jax.lax.ppermute(t, "hop", [(0, 1)]) for t in a),
                mesh=union,
                in_specs=P("hop"),
                out_specs=P("hop"),
            )
            fn = self._hops[(src, dst)] = jax.jit(send, out_shardings=rows)
        mine_src = [d for d in src if d.process_index == self.process_id]
        mine_dst = [d for d in dst if d.process_index == self.process_id]
        glob = []
        for x in xs:
            if x.ndim == 0:
                raise ValueError("Scalars cannot be moved between processes' devices here.")
            by_device = {s.device: s.data for s in x.addressable_shards}
            local = [by_device[d] for d in mine_src] + [self._placeholder(d, x.shape, x.dtype) for d in mine_dst]
            glob.append(
                jax.make_array_from_single_device_arrays((2 * x.shape[0],) + x.shape[1:], rows, local, dtype=x.dtype)
            )
        return list(fn(*glob))

    def _placeholder(self, device, shape, dtype) -> jax.Array:
        """The receiving side's half of a hop's input (its values are never read), one per device and shape."""
        key = (device, tuple(shape), np.dtype(dtype))
        buf = self._placeholders.get(key)
        if buf is None:
            buf = self._placeholders[key] = jax.device_put(np.zeros(shape, dtype), device)
        return buf

    def to_driver(self, tree):
        """Every process: the step's outputs where process 0 can read them (a replicated array with a shard on
        process 0 stays as it is; the last pipeline stage's are moved to the first row)."""
        leaves = jax.tree.leaves(tree)
        if all(
            x.sharding.is_fully_replicated and any(d.process_index == 0 for d in x.sharding.device_set) for x in leaves
        ):
            return tree
        return self.move(tree, self.driver_sharding)

    @staticmethod
    def fetch(tree):
        """Process 0: the outputs on the host (to_driver put a replica on one of its devices)."""
        leaves, treedef = jax.tree.flatten(tree)
        local = [x if x.is_fully_addressable else x.addressable_data(0) for x in leaves]
        return jax.tree.unflatten(treedef, jax.device_get(local))


def follow(engine, *, until_shutdown: bool = False) -> bool:
    """A worker process's loop (vLLM's headless engine): runs each step process 0 sends, until END (an offline
    call finished; ignored with until_shutdown) or SHUTDOWN. Returns True at SHUTDOWN."""
    runner = engine.runner
    mh: MultiHost = runner.multihost
    mh.watchdog.arm()
    try:
        while True:
            msg = mh.channel.recv()
            if msg.kind == STEP:
                variant, mode, layout = msg.header
                _run_received(runner, variant, mode, host_unpack(msg.ints, msg.floats, layout))
            elif msg.kind == SHUTDOWN:
                return True
            elif msg.kind == END and not until_shutdown:
                return False
    finally:
        mh.watchdog.disarm()


def _run_received(runner, v, mode: str, host_args) -> None:
    """A worker: runs the step process 0 sent as process 0 runs it (ModelRunner.launch decided the mode)."""
    from jaxllm.engine.sampler import SamplerFlags

    if mode == "whole":
        runner.programs.wait_for_background_compile(v)
    elif mode == "split" and v.flags != SamplerFlags():
        # start the whole program's background compile when process 0 does (not needed before then)
        runner.programs.runs_whole(v, host_args, runner.params, runner.kv_caches, runner.prev_tokens)
    runner.run_step(v, mode, host_args)


class OfflineCall:
    """An LLM.generate / chat call on process 0 of a multi-process engine: the processes stay armed against a lost
    peer while it runs, and the workers, following its steps, are told when it is over (END) so that their own
    generate returns, whatever happens here."""

    def __init__(self, mh: MultiHost):
        self.mh = mh

    def __enter__(self) -> OfflineCall:
        self.mh.watchdog.arm()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.mh.send(END)
        finally:
            self.mh.watchdog.disarm()
