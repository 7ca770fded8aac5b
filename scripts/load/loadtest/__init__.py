"""What locustfile.py is made of: the workload, the scenarios and the batching panel.

- ``workload``: the request bodies users send (the mixed-length corpus for text models);
  ``retrieval``: a search's two requests, a query to embed and its candidates to rerank.
- ``scenarios``: the scenarios' user counts, turns and think time (pure); ``shapes``: the
  load shapes that run them, offered in the dashboard's class picker.
- ``service_metrics``: the service's own figures, read from its ``/metrics`` (pure).
- ``panel``: scrapes ``/metrics`` during a run and shows the figures in the web UI,
  the CSV files and the HTML report.
"""
