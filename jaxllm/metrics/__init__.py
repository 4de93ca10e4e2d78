"""vLLM's metrics: the Prometheus families (prometheus.py) and the reader of LLM.get_metrics() (reader.py)."""
