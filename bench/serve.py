"""Online load against a running OpenAI-compatible server (jaxllm or vLLM), like `vllm bench serve`:
streamed /v1/completions with random token-id prompts and ignore_eos, sent at a Poisson request rate
and/or under a concurrency cap. Only loopback targets (localhost, 127.0.0.0/8, ::1) are accepted.

  python -m jaxllm.serve MODEL --port 8000 &
  python bench/serve.py --port 8000 --num-prompts 200 --request-rate 8 --input-len 256 --output-len 128
  python bench/serve.py --port 8000 --max-concurrency 64 --dataset synthetic-sharegpt

Per request: TTFT (send -> first streamed token), ITL (gaps between streamed chunks), TPOT ((E2E - TTFT) /
(output tokens - 1), as vLLM's bench), E2E; reported as p50/p90/p99 and mean, plus requests/s and output tok/s
over the whole run. ITL is per chunk: chunks that reach the client in one read give gaps near 0 and a chunk
may carry several tokens (tokens_per_chunk says how often), so TPOT is the steadier per-token figure.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import socket
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default=None, help="model name in requests (default: the server's first model)")
    p.add_argument("--dataset", choices=("random", "synthetic-sharegpt"), default="random")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=None, help="default: ids below 1000, valid for any model")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf = all at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def check_loopback(host: str) -> None:
    addrs = {ai[4][0] for ai in socket.getaddrinfo(host, None)}
    bad = [a for a in addrs if not ipaddress.ip_address(a.split("%")[0]).is_loopback]
    if not addrs or bad:
        raise SystemExit(f"bench/serve.py only targets loopback servers; {host} resolves to {sorted(addrs)}.")


async def one_request(session, url, payload, rec):
    t0 = time.perf_counter()
    rec.update(start=t0, ttft=None, itl=[], output_tokens=0, ok=False, error=None)
    last = None
    try:
        async with session.post(url, json=payload) as resp:
            if resp.status != 200:
                rec["error"] = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            buf = b""
            async for data in resp.content.iter_any():
                buf += data
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data:"):
                            continue
                        body = line[5:].strip()
                        if body == b"[DONE]":
                            continue
                        msg = json.loads(body)
                        if msg.get("error"):
                            rec["error"] = str(msg["error"])[:200]
                            return
                        choices = msg.get("choices") or []
                        if choices and (choices[0].get("text") or choices[0].get("token_ids")):
                            now = time.perf_counter()
                            if rec["ttft"] is None:
                                rec["ttft"] = now - t0
                            else:
                                rec["itl"].append(now - last)
                            last = now
                        if msg.get("usage"):
                            rec["output_tokens"] = msg["usage"].get("completion_tokens", 0)
        rec["ok"] = True
    except (OSError, asyncio.TimeoutError, ValueError) as e:  # aiohttp.ClientError is an OSError
        rec["error"] = f"{type(e).__name__}: {e}"[:200]
    finally:
        rec["e2e"] = time.perf_counter() - t0


async def run(args) -> dict:
    import aiohttp

    base = f"http://{args.host}:{args.port}"
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        model = args.model
        if model is None:
            async with session.get(base + "/v1/models") as r:
                model = (await r.json())["data"][0]["id"]
        if args.dataset == "random":
            in_lens, out_lens = [args.input_len] * args.num_prompts, [args.output_len] * args.num_prompts
        else:
            in_lens, out_lens = common.synthetic_sharegpt(args.num_prompts, args.seed)
        prompts = common.random_token_prompts(args.num_prompts, 0, args.vocab_size or 1000, args.seed, in_lens)
        rng = np.random.default_rng(args.seed)
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        recs = [dict() for _ in prompts]

        async def task(i):
            payload = dict(
                model=model,
                prompt=prompts[i],
                max_tokens=out_lens[i],
                ignore_eos=True,
                stream=True,
                temperature=0.0,
                stream_options={"include_usage": True},
            )
            if sem is None:
                return await one_request(session, base + "/v1/completions", payload, recs[i])
            async with sem:
                return await one_request(session, base + "/v1/completions", payload, recs[i])

        t0 = time.perf_counter()
        tasks = []
        for i in range(len(prompts)):
            tasks.append(asyncio.create_task(task(i)))
            if args.request_rate != float("inf") and i + 1 < len(prompts):
                await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - t0
    ok = [r for r in recs if r.get("ok")]
    n_out = sum(r["output_tokens"] for r in ok)
    n_chunks = sum(len(r["itl"]) + 1 for r in ok if r["ttft"] is not None)
    tpot = [
        (r["e2e"] - r["ttft"]) / (r["output_tokens"] - 1)
        for r in ok
        if r["ttft"] is not None and r["output_tokens"] > 1
    ]
    ms = lambda xs: {k: (v * 1e3 if v is not None else None) for k, v in common.pct(xs).items()}  # noqa: E731
    return dict(
        workload=dict(
            dataset=args.dataset,
            num_prompts=args.num_prompts,
            input_len=args.input_len,
            output_len=args.output_len,
            request_rate=args.request_rate,
            max_concurrency=args.max_concurrency,
            model=model,
            target=base,
            ignore_eos=True,
        ),
        completed=len(ok),
        failed=len(recs) - len(ok),
        errors=sorted({r["error"] for r in recs if r.get("error")})[:5],
        elapsed_s=elapsed,
        requests_per_s=len(ok) / elapsed,
        output_tokens_per_s=n_out / elapsed,
        total_input_tokens=sum(in_lens[i] for i, r in enumerate(recs) if r.get("ok")),
        total_output_tokens=n_out,
        ttft_ms=ms([r["ttft"] for r in ok if r["ttft"] is not None]),
        itl_ms=ms([x for r in ok for x in r["itl"]]),
        tpot_ms=ms(tpot),
        tokens_per_chunk=n_out / n_chunks if n_chunks else None,
        e2e_ms=ms([r["e2e"] for r in ok]),
    )


def main(argv=None) -> dict:
    args = parse(argv)
    check_loopback(args.host)
    res = asyncio.run(run(args))
    res["env"] = common.environment(with_jax=False)
    p50 = lambda k: "-" if res[k]["p50"] is None else f"{res[k]['p50']:.1f}"  # noqa: E731
    print(
        f"{res['completed']} ok / {res['failed']} failed in {res['elapsed_s']:.1f} s: {res['requests_per_s']:.2f} req/s, "
        f"{res['output_tokens_per_s']:.1f} output tok/s; p50 ms: TTFT {p50('ttft_ms')}, ITL {p50('itl_ms')}, "
        f"TPOT {p50('tpot_ms')}, E2E {p50('e2e_ms')}",
        flush=True,
    )
    res["env"]["device"] = "server"
    common.write_result("serve", res, args.out)
    return res


if __name__ == "__main__":
    main()
