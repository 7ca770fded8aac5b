"""The HTTP tier: the app factory, the protocols side by side, request parsing and the access log.

``routes`` serves the service's own JSON contract (/predict), ``v2`` the Open
Inference Protocol, ``openai_api`` OpenAI's embeddings API, ``rerank`` Cohere's
rerank API, ``tei`` Text Embeddings Inference's API; each only translates to
and from ``inference``, the one path they share. Runs in each
gunicorn worker, in its request threads (gthread) or greenlets (gevent); the
model's work is handed to the runtime and its batch thread.
"""
