"""deploy/: the Serve config and the KubeRay manifest are valid for Ray's own schema and for the
application they build, and serve.yaml carries the same policy as deploy/policy.yaml."""

from pathlib import Path

import yaml
from ray.serve.schema import ServeDeploySchema

from policies.config import load_policy, parse_policy
from router.serve_cmd import serve_config
from router.service import ServiceSettings

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _apps(config: dict) -> list[dict]:
    ServeDeploySchema.model_validate(config)  # what `serve run` / `serve deploy` validate it with
    return config["applications"]


def test_serve_yaml_is_a_valid_serve_config_for_this_app():
    (app,) = _apps(yaml.safe_load((DEPLOY / "serve.yaml").read_text()))
    assert app["import_path"] == "router.service:app_builder"
    settings = ServiceSettings.model_validate(app["args"])
    assert settings == ServiceSettings()  # the file spells out the defaults
    router = next(d for d in app["deployments"] if d["name"] == "Router")
    assert parse_policy(router["user_config"]["policy"]) == load_policy(DEPLOY / "policy.yaml")
    names = {d["name"] for d in app["deployments"]}
    assert names == {"Router", "SpeculativeBackend", "PlainBackend", "QuantizedBackend"}


def test_the_config_specroute_serve_applies_is_valid_too():
    (app,) = _apps(serve_config(ServiceSettings(), {"speculation": {"enabled": False}}))
    assert app["deployments"][0]["user_config"]["policy"]["speculation"]["enabled"] is False


def test_kuberay_rayservice_embeds_a_valid_serve_config():
    (service,) = list(yaml.safe_load_all((DEPLOY / "kuberay" / "rayservice.yaml").read_text()))
    assert service["kind"] == "RayService"
    (app,) = _apps(yaml.safe_load(service["spec"]["serveConfigV2"]))
    ServiceSettings.model_validate(app["args"])
    router = next(d for d in app["deployments"] if d["name"] == "Router")
    parse_policy(router["user_config"]["policy"])
    workers = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    limits = [c["resources"]["limits"] for w in workers for c in w["template"]["spec"]["containers"]]
    assert any("nvidia.com/gpu" in limit for limit in limits)


def test_serve_on_one_machine_lowers_each_replicas_cpus_until_every_replica_fits():
    settings = ServiceSettings()
    assert settings.fitted_to(2) is settings  # 0.2 + 3 × 0.5 fit on two cores
    two = ServiceSettings(replicas=2).fitted_to(2)
    assert two.router_cpus + 6 * two.backend_cpus <= 2 and two.backend_cpus == 0.3
