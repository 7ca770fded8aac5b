"""The batching core: the batcher, admission, its native-thread primitives, waiting and the watchdog.

Runs in each gunicorn worker: one OS batch thread takes requests off a queue and
runs them through the model; request threads or greenlets only submit and wait.
"""
