"""Speculative decoding: proposers (n-gram prompt lookup on the host; draft models and EAGLE heads on the device),
the switch-off policy and the acceptance counters. The rejection sampler sits beside the plain sampler
(jaxllm/engine/rejection_sampler.py); the config is jaxllm.engine.configs.SpeculativeConfig."""
