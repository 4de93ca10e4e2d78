"""jaxllm's OpenAI-compatible HTTP server (aiohttp), built only on jaxllm.engine.protocol.EngineClient.

    server.app.build_app(engine, args) -> aiohttp.web.Application
    server.app.start_server(app, host, port) -> (runner, bound port)
    server.args.parse_args(argv)                 vLLM's `vllm serve` flags
    server.testing.FakeEngine                    an EngineClient without a model, for tests
    server.server_thread.ServerThread            the server in a background thread, for synchronous tests
    server.serve.main(argv)                      `jaxllm serve` / `python -m jaxllm.serve`: the command
    server.cli.main(argv)                        `jaxllm serve|convert|bench`: the `jaxllm` console script
The library (jaxllm/) never imports this package; jaxllm/serve.py only forwards `python -m jaxllm.serve`.
"""
