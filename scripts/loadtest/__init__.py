"""What locustfile.py is made of: the workload, the scenarios and the batching panel.

- ``workload``: the request bodies users send (the mixed-length corpus for text models).
- ``scenarios``: the load shapes offered in the dashboard's class picker, and think time.
- ``service_metrics``: the service's own figures, read from its ``/metrics`` (pure).
- ``panel``: scrapes ``/metrics`` during a run and shows the figures in the web UI,
  the CSV files and the HTML report.
"""
