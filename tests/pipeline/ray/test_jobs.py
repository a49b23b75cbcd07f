"""What a Ray Job carries: the code and where things are, never a credential."""

from __future__ import annotations

import json

from pipeline.ray.jobs import job_runtime_env

SECRETS = {
    "MLFLOW_TRACKING_URI": "https://alice:s3cret-pass@mlflow.example:5000",
    "MLFLOW_TRACKING_TOKEN": "tok-123",
    "MLFLOW_TRACKING_USERNAME": "alice",
    "MLFLOW_TRACKING_PASSWORD": "pw-456",
    "AWS_ACCESS_KEY_ID": "AKIA-789",
    "AWS_SECRET_ACCESS_KEY": "secret-abc",
    "AWS_SESSION_TOKEN": "session-def",
}


def test_the_job_environment_names_the_stores_but_carries_no_credential() -> None:
    # the runtime env is readable from the dashboard: credentials come from the nodes' own env
    env = {**SECRETS, "AWS_ENDPOINT_URL": "http://s3.example:9000", "AWS_DEFAULT_REGION": "eu"}
    shipped = job_runtime_env(env)["env_vars"]
    assert isinstance(shipped, dict)
    assert shipped["MLFLOW_TRACKING_URI"] == "https://mlflow.example:5000"
    assert shipped["AWS_ENDPOINT_URL"] == "http://s3.example:9000"
    assert shipped["AWS_DEFAULT_REGION"] == "eu"
    text = json.dumps(job_runtime_env(env))
    for key, value in SECRETS.items():
        secret = value.split("//")[-1].split("@")[0] if key == "MLFLOW_TRACKING_URI" else value
        assert secret not in text, key
