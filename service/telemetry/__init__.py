"""Telemetry: what the service says about itself while it runs.

Prometheus metrics per worker and per model (metrics, model_metrics), the log
formats of every line (logs), and the access tally that request threads and
the batch thread record into without taking a lock (tally). Nothing here
decides how a request is served; it only records what happened.
"""
