"""The "limits and timeouts" flag group of `jaxllm serve`: what one client may cost the server, and how it stops.

Read by server.admission (queue limits) and server.http_server (timeouts, body size, shutdown drain). Separate from
args.py because these flags are jaxllm's server policy rather than vLLM's engine and API flags.
"""

from __future__ import annotations

import argparse

from server.arg_types import count, seconds


def add_limit_args(p: argparse.ArgumentParser) -> None:
    """What one client may cost the server, and how it stops (server.admission, server.http_server)."""
    g = p.add_argument_group(
        "limits and timeouts",
        "Bounds on what one client can make the server hold. Requests past a queue limit get 503 with "
        "Retry-After; a request body too large gets 413 (--max-request-body-bytes), one too slow 408.",
    )
    g.add_argument(
        "--max-num-queued-reqs",
        type=count,
        default=None,
        help="Most sequences in flight (waiting or running; a request with n choices counts n), as "
        "vLLM's flag (none: no limit).",
    )
    g.add_argument(
        "--max-num-queued-tokens",
        type=count,
        default=None,
        help="No new request while this many prompt tokens wait to be prefilled (bounds the time to "
        "first token), as vLLM's flag; accepts 32k (none: no limit).",
    )
    g.add_argument(
        "--timeout-keep-alive",
        type=seconds,
        default=5.0,
        help="Close a connection that stays idle, or has not sent a complete request head, this long "
        "(uvicorn's flag and vLLM's default; 0: never).",
    )
    g.add_argument(
        "--timeout-request-body",
        type=seconds,
        default=60.0,
        help="A request body must arrive within this many seconds of its headers, else 408 and the "
        "connection closes. 0: no limit.",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=seconds,
        default=25.0,
        help="On SIGTERM/SIGINT, new requests are refused and running ones may finish for this long; "
        "then streams end with an error event and [DONE] and the rest get 503. vLLM's default is "
        "0 (abort at once); 25 fits Kubernetes' default 30 s grace period. A second signal ends "
        "the drain at once.",
    )
