"""Serving and deploying: nginx in front, the container image, rendered configs, tuning."""
