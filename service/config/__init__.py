"""Configuration: what the operator asked for, read and checked before anything runs.

The ``SERVE_*`` settings (settings), what ``SERVE_MODEL`` names and lists
(model_spec, model_list, image_spec, prompt_spec), the precisions a device allows
(precision_spec) and the budgets of what clients may make a worker hold
(budget). Pure: no torch, no numpy, no model code, so the gunicorn master
refuses a bad value here before it forks a worker.
"""
