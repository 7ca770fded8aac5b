"""Load test with Locust (placeholder: the full file comes with the benchmarks)."""

from locust import HttpUser, between, task


class BatchedUser(HttpUser):
    wait_time = between(1, 3)

    @task
    def predict(self) -> None:
        self.client.post("/predict/batched", json={"inputs": ["A sentence to embed."]})
