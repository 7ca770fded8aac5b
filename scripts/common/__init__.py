"""What the tools and the end-to-end tests share: starting gunicorn, reading /proc."""
