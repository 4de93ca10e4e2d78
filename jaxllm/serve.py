"""`python -m jaxllm.serve [MODEL] [vLLM serve flags]`: an alias of `jaxllm serve`.

The server is the top-level server package (server/serve.py holds this command), which imports jaxllm, never
the other way round; this module only forwards the command line when run with -m and imports nothing when
imported.
"""

if __name__ == "__main__":
    from server.serve import main

    main()
