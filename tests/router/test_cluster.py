"""specroute on a real two-node Ray cluster, started the documented way on this one machine:
`ray start --head` (no CPUs: only Serve's controller and proxy live there) and a worker node with
`ray start --address …`, each with its own SPECROUTE_HOME, then `serve deploy` of deploy/serve.yaml
(test-sized) with Ray's token authentication (a token of the test's own). Every replica must run on
the worker node, set the embedded model up there (its home starts empty) and read nothing from the head's disk:
the profile file is deleted before a replica is killed, and the restarted replica still serves.
/healthz tells the truth meanwhile: 503 while a backend has no live replica or the last policy
was refused."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from router.serve_cmd import free_port
from tests.policies.profiles import synthetic_profile

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
READY_S = 600.0
COPY_PROMPT = "Repeat this list exactly, twice: apples, pears, plums, cherries, apricots, peaches, grapes."


@dataclass
class Cluster:
    gcs: str
    dashboard: str
    url: str
    env: dict[str, str]
    worker_home: Path
    profile: Path
    config: dict[str, Any]

    def state(self, kind: str) -> list[dict[str, Any]]:
        """What `ray list <kind> --detail` prints, read from the dashboard's state API with the
        cluster's token (a `ray` CLI call costs a Python start-up: seconds of a core, polled)."""
        response = httpx.get(
            f"{self.dashboard}/api/v0/{kind}",
            params={"detail": "1", "limit": "10000"},
            headers={"Authorization": f"Bearer {self.env['RAY_AUTH_TOKEN']}"},
            timeout=30,
        )
        response.raise_for_status()
        return response.json()["data"]["result"]["result"]

    def serve_deploy(self, tmp: Path, config: dict[str, Any]) -> None:
        path = tmp / f"serve-{time.monotonic_ns()}.yaml"
        path.write_text(yaml.safe_dump(config))
        command = [str(BIN / "serve"), "deploy", str(path), "--address", self.dashboard]
        done = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr[-2000:]

    def replicas(self) -> list[dict[str, Any]]:
        actors = self.state("actors")
        return [a for a in actors if "ServeReplica:specroute:" in a["class_name"] and a["state"] == "ALIVE"]

    def worker_node(self) -> str:
        nodes = self.state("nodes")
        (worker,) = [n for n in nodes if n["state"] == "ALIVE" and "specroute_worker" in n["resources_total"]]
        return worker["node_id"]


def _start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    # --block: the node lives as long as this process, and stopping it stops only this node (never
    # `ray stop`, which would also stop the Ray instance other tests of this session use).
    with open(log, "w") as out:
        return subprocess.Popen(
            [str(BIN / "ray"), "start", "--block", *args], env=env, stdout=out, stderr=subprocess.STDOUT
        )


def _stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()


def _wait(condition: Callable[[], Any], what: str, timeout_s: float = READY_S) -> Any:
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            found = condition()
            if found:
                return found
        except (httpx.HTTPError, AssertionError, ValueError, KeyError) as exc:
            last = exc
        time.sleep(1.0)
    raise AssertionError(f"{what}: not reached in {timeout_s:.0f} s ({last})")


def _test_config(profile: Path, port: int) -> dict[str, Any]:
    """deploy/serve.yaml as shipped, sized for a test: one torch thread, small batches, prompt lookup."""
    config = yaml.safe_load((REPO / "deploy" / "serve.yaml").read_text())
    config["http_options"]["port"] = port
    (app,) = config["applications"]
    args = app["args"]
    args["backend"].update(dtype="float32", threads=1, max_batch=4, drafters=["ngram"], k_max=4)
    args.update(profile=str(profile), router_cpus=0.1, backend_cpus=0.4)
    for deployment in app["deployments"]:
        if deployment["name"] == "Router":
            deployment["user_config"]["policy"]["speculation"]["drafters"] = ["ngram"]
    return config


@pytest.fixture(scope="module")
def cluster(loaded, tmp_path_factory) -> Iterator[Cluster]:  # `loaded`: pip's cache holds the model wheel
    tmp = tmp_path_factory.mktemp("cluster")
    head_home, worker_home = tmp / "head-home", tmp / "worker-home"
    head_home.mkdir()
    worker_home.mkdir()
    profile = head_home / "profile.json"
    synthetic_profile(quantized_agreement=0.9).save(profile)
    # The cluster's own token (not the user's ~/.ray/auth_token): every node, `serve` and this test use it.
    token = secrets.token_hex(32)
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token, "PATH": f"{BIN}:{os.environ['PATH']}"}
    env.pop("RAY_ADDRESS", None)
    port, dashboard, http = free_port(), free_port(), free_port()
    temp_dir = tempfile.mkdtemp(prefix="srcl-")  # short: Ray's socket paths must fit 107 bytes
    common = ["--object-store-memory", str(80 * 1024**2), "--disable-usage-stats", "--temp-dir", temp_dir]
    head = _start(
        ["--head", "--port", str(port), "--num-cpus", "0", "--dashboard-host", "127.0.0.1"]
        + ["--dashboard-port", str(dashboard), "--metrics-export-port", str(free_port()), *common],
        {**env, "SPECROUTE_HOME": str(head_home)},
        tmp / "head.log",
    )
    nodes = [head]
    cluster = Cluster(
        f"127.0.0.1:{port}", f"http://127.0.0.1:{dashboard}", f"http://127.0.0.1:{http}", env, worker_home, profile, {}
    )
    try:
        _wait(lambda: cluster.state("nodes"), "the head node", 120)
        worker = ["--address", cluster.gcs, "--num-cpus", "2", "--resources", '{"specroute_worker": 1}']
        worker += ["--metrics-export-port", str(free_port()), *common[:3]]
        nodes.append(_start(worker, {**env, "SPECROUTE_HOME": str(worker_home)}, tmp / "worker.log"))
        _wait(cluster.worker_node, "the worker node", 120)
        cluster.config = _test_config(profile, http)
        cluster.serve_deploy(tmp, cluster.config)
        _wait(lambda: httpx.get(f"{cluster.url}/healthz", timeout=10).status_code == 200, "a healthy service")
        yield cluster
    finally:
        subprocess.run([str(BIN / "serve"), "shutdown", "-y", "--address", cluster.dashboard], env=env, timeout=120)
        for node in reversed(nodes):
            _stop(node)


def _chat(cluster: Cluster, backend: str = "auto", content: str = "Name three colours.") -> dict[str, Any]:
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 16,
        "temperature": 0,
        "specroute": {"backend": backend},
    }
    response = httpx.post(f"{cluster.url}/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def test_every_replica_runs_on_the_worker_node_with_the_model_set_up_there(cluster):
    replicas = cluster.replicas()
    deployments = {a["class_name"].rsplit(":", 1)[-1] for a in replicas}
    assert deployments == {"Router", "SpeculativeBackend", "PlainBackend", "QuantizedBackend"}
    worker = cluster.worker_node()
    assert all(a["node_id"] == worker for a in replicas), [(a["class_name"], a["node_id"]) for a in replicas]
    assert (cluster.worker_home / "models" / "smollm2-135m-instruct" / "model.safetensors").is_file()
    answers = {backend: _chat(cluster, backend) for backend in ("plain", "speculative", "quantized")}
    assert {b: a["specroute"]["backend"] for b, a in answers.items()} == {b: b for b in answers}
    greedy = answers["plain"]["choices"][0]["message"]["content"]
    assert greedy and answers["speculative"]["choices"][0]["message"]["content"] == greedy  # lossless


def test_metrics_on_the_service_port_parse_as_prometheus_text(cluster):
    _chat(cluster, "speculative", COPY_PROMPT)  # an answer that copies its prompt: prompt lookup drafts
    response = httpx.get(f"{cluster.url}/metrics", timeout=30)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    requests = {(s.labels["backend"], s.labels["stage"]): s.value for s in families["specroute_requests"].samples}
    assert requests[("speculative", "forced")] >= 2 and requests[("plain", "forced")] >= 1
    drafted = [s for s in families["vllm:spec_decode_num_draft_tokens"].samples if s.name.endswith("_total")]
    assert drafted and all(s.labels["drafter"] == "ngram" for s in drafted)
    running = {s.labels["backend"] for s in families["vllm:num_requests_running"].samples}
    assert running == {"speculative", "plain", "quantized"}  # every backend's step loop, fetched from its replica
    steps = [s for s in families["specroute_batch_size_per_step"].samples if s.name.endswith("_count")]
    assert {s.labels["backend"] for s in steps if s.value > 0} == {"speculative", "plain", "quantized"}


def test_serve_deploy_reloads_the_policy_and_healthz_reports_a_refused_one(cluster, tmp_path):
    def health() -> httpx.Response:
        return httpx.get(f"{cluster.url}/healthz", timeout=30)

    bad = json.loads(json.dumps(cluster.config))
    policy = bad["applications"][0]["deployments"][0]["user_config"]["policy"]
    policy["speculation"]["enabled"] = "maybe"
    cluster.serve_deploy(tmp_path, bad)
    refused = _wait(lambda: health().status_code == 503 and health().json(), "the refusal on /healthz", 120)
    assert "speculation.enabled" in refused["policy_error"] and refused["status"] == "degraded"
    assert _chat(cluster)["choices"][0]["message"]["content"]  # the last good policy still serves
    cluster.serve_deploy(tmp_path, cluster.config)
    _wait(lambda: health().status_code == 200, "the good policy back", 120)


def test_a_killed_replica_restarts_without_the_head_profile_and_healthz_says_so_meanwhile(cluster):
    cluster.profile.unlink()  # replicas carry the profile in their arguments: none reads this file
    (plain,) = [a for a in cluster.replicas() if a["class_name"].endswith(":PlainBackend")]
    os.kill(plain["pid"], signal.SIGKILL)
    down = _wait(
        lambda: (r := httpx.get(f"{cluster.url}/healthz", timeout=30)).status_code == 503 and r.json(),
        "/healthz reporting the dead replica",
        60,
    )
    assert down["backends"]["plain"] != "live" and any(p.startswith("plain:") for p in down["problems"])
    _wait(lambda: httpx.get(f"{cluster.url}/healthz", timeout=30).status_code == 200, "the replica back", 300)
    (restarted,) = [a for a in cluster.replicas() if a["class_name"].endswith(":PlainBackend")]
    assert restarted["pid"] != plain["pid"] and restarted["node_id"] == cluster.worker_node()
    assert _chat(cluster, "plain")["specroute"]["retried"] is False
