"""End to end on a GPU: each worker's allocator is capped at its planned share.

Skipped where there is no CUDA GPU; nothing here is mocked.
"""

from __future__ import annotations

import pytest
import requests

from service.config.settings import Settings, cuda_visible_devices
from service.topology.inventory import Inventory, read_inventory
from service.topology.plan import plan
from tests.support.server import Server, gunicorn

pytestmark = [pytest.mark.e2e, pytest.mark.gpu]

ENV = {
    "SERVE_MODEL": "tests.support.models:gpu_alloc",
    "SERVE_DEVICES": "cuda:0",
    "SERVE_WORKERS_PER_DEVICE": "2",
}


@pytest.fixture(scope="module")
def inventory_with_a_gpu() -> Inventory:
    torch = pytest.importorskip("torch")
    inventory = read_inventory(cuda_visible_devices())
    if not inventory.gpus or not torch.cuda.is_available():
        pytest.skip(
            f"needs a CUDA GPU and a CUDA build of torch; here: {inventory.gpu_note or 'CPU-only torch'}"
        )
    return inventory


def allocate(session: requests.Session, server: Server, mib: int) -> requests.Response:
    return session.post(server.url + "/predict/batched", json={"inputs": [mib]}, timeout=120)


def test_each_worker_is_capped_at_its_share_and_an_overrun_fails_only_its_request(
    inventory_with_a_gpu: Inventory,
) -> None:
    # Planned here as the master plans it, moments later; free memory may move a little.
    expected = plan(Settings.from_env(ENV), inventory_with_a_gpu)
    device = expected.devices[0]
    with gunicorn(ENV, ready_timeout=180) as server:
        # A keep-alive session stays with one gthread worker.
        with requests.Session() as first:
            answer = allocate(first, server, 1)
            assert answer.status_code == 200, answer.text
            _, fraction, pid = answer.json()["outputs"][0]
            assert fraction == pytest.approx(device.memory_fraction, abs=0.002)
            info = first.get(server.url + "/info", timeout=30).json()
            assert (info["pid"], info["device"], info["gpu_memory_fraction"]) == (pid, "cuda:0", fraction)

            too_much = allocate(first, server, device.allocator_mb + 1024)
            assert too_much.status_code == 503
            assert "ran out of memory" in too_much.json()["error"]

            again = allocate(first, server, device.allocator_mb // 2)
            assert again.status_code == 200, again.text
            assert again.json()["outputs"][0][2] == pid  # the same worker keeps serving

        # The other worker on the GPU still has its whole share.
        for _ in range(50):
            with requests.Session() as other:
                answer = allocate(other, server, device.allocator_mb // 2)
                assert answer.status_code == 200, answer.text
                if answer.json()["outputs"][0][2] != pid:
                    assert answer.json()["outputs"][0][1] == pytest.approx(device.memory_fraction, abs=0.002)
                    break
        else:
            pytest.fail("never reached the second worker")
