"""Command-line tools around the service; the tests import their helpers from here too."""
