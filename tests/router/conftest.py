"""The real service, started once for the tests that use it (all in this package, run one after
another on one pytest-xdist worker, see tests/conftest.py): a local Ray instance, the Serve application
with all three backends on the embedded model (one torch thread each), routing with a synthetic
profile whose closed forms make the policy's choices predictable (prompt lookup α 0.8 on the
'copy' category, a decode step of 70 ms + 2.5 ms per sequence)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.policies.profiles import synthetic_profile

# Decode turns 'compute-bound' from ~8 sequences in flight, where this policy stops speculating, so a
# modest burst moves work to plain.
POLICY: dict[str, Any] = {
    "speculation": {"drafters": ["ngram"]},
    "bottleneck": {"compute_bound_elasticity": 0.2, "skip_speculation_when_compute_bound": True},
}
PORT = 8431


@dataclass
class Service:
    url: str
    profile: Path

    def redeploy(self, policy: dict[str, Any]) -> None:
        """Apply the config again with only the Router's user_config changed (what `serve deploy`
        does with an edited serve.yaml): a hot policy reload, no replica restarts."""
        from router.serve_cmd import apply_config, serve_config
        from router.service import ServiceSettings

        apply_config(serve_config(ServiceSettings.model_validate(_settings(self.profile)), policy))


def _settings(profile: Path) -> dict[str, Any]:
    return {
        "backend": {"threads": 1, "max_batch": 16, "batch_wait_ms": 10, "drafters": ["ngram"]},
        # A slow client's body times out in 10 s rather than 30: the hostile corpus's two slow cases
        # wait for it, and a normal request sent meanwhile is answered in well under that.
        "limits": {
            "max_prompt_tokens": 1024,
            "max_tokens": 128,
            "max_messages": 16,
            "max_body_bytes": 65536,
            "body_timeout_s": 10,
        },
        "profile": str(profile),
        "router_cpus": 0.1,
        "backend_cpus": 0.3,
    }


# Package scope: once those tests are done, Ray and the replicas stop, instead of idling on a share of
# a core for the rest of the session.
@pytest.fixture(scope="package")
def service(loaded, tmp_path_factory) -> Iterator[Service]:  # `loaded`: the embedded model is set up
    from router.serve_cmd import deploy, shutdown, start_ray
    from router.service import ServiceSettings

    profile = tmp_path_factory.mktemp("service") / "profile.json"
    synthetic_profile(quantized_agreement=0.9).save(profile)  # below the 95 % floor
    temp_dir = start_ray(num_cpus=2)
    try:
        url = deploy(ServiceSettings.model_validate(_settings(profile)), "127.0.0.1", PORT, POLICY)
        yield Service(url, profile)
    finally:
        shutdown(temp_dir)
