"""Turning a prompt into tokens: chunked prefill, the decode loop, sampling and logits
processors, the compiled one-token step, speculative verification and its drafters."""
