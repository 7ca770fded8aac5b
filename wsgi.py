"""WSGI entry point: ``gunicorn -c gunicorn_conf.py wsgi:app``."""

from service import create_app

app = create_app()
