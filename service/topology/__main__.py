"""``python -m service.topology``: print the plan for this machine and settings."""

from __future__ import annotations

import sys

from service.config.model_spec import weights
from service.config.settings import Settings, cuda_visible_devices
from service.errors import SettingsError
from service.topology.inventory import read_inventory
from service.topology.plan import plan
from service.topology.table import render


def main() -> int:
    try:
        settings = Settings.from_env()
        models = [weights(entry.spec) for entry in settings.models]
        topology = plan(settings, read_inventory(cuda_visible_devices()), models)
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(render(topology))
    return 0


if __name__ == "__main__":
    sys.exit(main())
