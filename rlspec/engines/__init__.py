"""Engines: the vLLM engine and its CPU kernel fix, the DeepSpeed engine, and the weight-sync
transports. No Ray actors here: workers/ wraps these."""
