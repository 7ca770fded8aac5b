"""Benchmarks: throughput and latency against the model's limit, the request path's cost, memory."""
