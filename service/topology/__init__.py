"""Worker topology: what the machine offers, and the plan of workers, devices and threads.

Runs in the gunicorn master, before any fork (and in ``python -m service.topology``),
so nothing here imports torch or creates a CUDA context: the inventory reads the
cgroup and NVML, the plan is a pure function of settings and inventory.
"""
