"""deploy/kubernetes renders with kustomize and every object validates against a Kubernetes schema.

Offline: Debian's ``kubectl kustomize`` renders, ``kubernetes-validate`` (schemas shipped in the
package) checks each object strictly against the newest Kubernetes version it knows. KEDA's
``ScaledObject`` / ``TriggerAuthentication`` and the Prometheus Operator's ``ServiceMonitor`` are
custom resources whose schemas are not in Kubernetes': they are checked here for the fields the
stack relies on instead. No cluster is involved.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy/kubernetes"
CUSTOM_KINDS = {"ScaledObject", "TriggerAuthentication", "ServiceMonitor"}

pytestmark = pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl not installed (apt-get install kubectl)"
)


def render(path: Path) -> list[dict]:
    out = subprocess.run(
        ["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    return render(KUBERNETES)


def by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


@pytest.mark.parametrize(
    "path", [KUBERNETES, KUBERNETES / "overlays/servicemonitor"], ids=["base", "servicemonitor"]
)
def test_every_object_validates_against_the_kubernetes_schema(path):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    version = kubernetes_validate.latest_version()
    objects = render(path)
    assert objects
    for obj in objects:
        if obj["kind"] in CUSTOM_KINDS:
            continue  # custom resources: no schema in Kubernetes' own; checked below
        kubernetes_validate.validate(obj, version, strict=True)  # raises ValidationError


def test_the_stack_is_complete(objects):
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert {
        ("StatefulSet", "redis"),
        ("Secret", "redis-auth"),
        ("Deployment", "gateway"),
        ("Service", "gateway"),
        ("Deployment", "scheduler"),
        ("Deployment", "worker"),
        ("PodDisruptionBudget", "worker"),
        ("ScaledObject", "worker"),
    } <= kinds


def _container(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]["containers"][0]


def test_redis_password_comes_from_the_secret_and_every_service_uses_it(objects):
    secret = by_kind(objects, "Secret")["redis-auth"]
    redis = _container(by_kind(objects, "StatefulSet")["redis"])
    assert "--requirepass" in redis["args"]
    for name, deployment in by_kind(objects, "Deployment").items():
        container = _container(deployment)
        env = {e["name"]: e for e in container["env"]}
        ref = env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == secret["metadata"]["name"], name
        url = container["args"][container["args"].index("--redis-url") + 1]
        assert url == "redis://:$(REDIS_PASSWORD)@redis:6379", name


def test_gateway_requires_the_api_key_from_its_secret(objects):
    from fuseserve.config import API_KEY_ENV

    secrets = by_kind(objects, "Secret")
    gateway = _container(by_kind(objects, "Deployment")["gateway"])
    ref = {e["name"]: e for e in gateway["env"]}[API_KEY_ENV]["valueFrom"]["secretKeyRef"]
    assert ref["name"] in secrets and ref["key"] in secrets[ref["name"]]["data"]
    assert ref["name"].startswith("gateway-api-key")  # kustomize's content hash: pods roll on a new key
    for name, deployment in by_kind(objects, "Deployment").items():
        if name != "gateway":  # only the gateway holds the key
            assert API_KEY_ENV not in {e["name"] for e in _container(deployment).get("env", [])}, name


def test_network_policies_keep_grpc_and_redis_internal(objects):
    policies = by_kind(objects, "NetworkPolicy")
    deployments = by_kind(objects, "Deployment")
    worker = policies["worker"]["spec"]
    assert worker["podSelector"]["matchLabels"] == deployments["worker"]["spec"]["selector"]["matchLabels"]
    grpc_rule, metrics_rule = worker["ingress"]
    assert grpc_rule["ports"] == [{"port": "grpc"}]
    assert grpc_rule["from"] == [{"podSelector": deployments["scheduler"]["spec"]["selector"]}]
    assert metrics_rule == {"ports": [{"port": "metrics"}]}  # scrapers anywhere, nothing else
    (redis_rule,) = policies["redis"]["spec"]["ingress"]
    allowed = redis_rule["from"][0]["podSelector"]["matchExpressions"][0]["values"]
    assert set(allowed) == {"gateway", "scheduler", "worker"} and redis_rule["ports"] == [{"port": "redis"}]
    assert policies["scheduler"]["spec"]["ingress"] == [{"ports": [{"port": "metrics"}]}]


def test_probes_gpu_and_disruption_budget(objects):
    deployments = by_kind(objects, "Deployment")
    gateway = _container(deployments["gateway"])
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/health"
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/health"
    worker = _container(deployments["worker"])
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    probe = " ".join(worker["readinessProbe"]["exec"]["command"])
    assert "fuseserve:worker:" in probe  # Ready = its registration record exists in Redis
    pdb = by_kind(objects, "PodDisruptionBudget")["worker"]
    assert pdb["spec"]["selector"]["matchLabels"] == deployments["worker"]["spec"]["selector"]["matchLabels"]
    for name, deployment in deployments.items():
        assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True, name


def test_keda_scales_the_workers_on_the_requests_stream(objects):
    from fuseserve import messages

    scaled = by_kind(objects, "ScaledObject")["worker"]
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert scaled["spec"]["scaleTargetRef"]["name"] == "worker"
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "redis-streams"
    assert trigger["metadata"]["stream"] == messages.REQUESTS
    assert trigger["metadata"]["consumerGroup"] == messages.SCHEDULER_GROUP
    auth = by_kind(objects, "TriggerAuthentication")[trigger["authenticationRef"]["name"]]
    assert (
        auth["spec"]["secretTargetRef"][0]["name"]
        == by_kind(objects, "Secret")["redis-auth"]["metadata"]["name"]
    )


def test_servicemonitor_scrapes_each_service_once_on_every_pod():
    """The ServiceMonitor selects one Service of the gateway, of the schedulers and of the workers,
    each with a port it scrapes that targets the pods' container port. The operator scrapes a
    Service's Endpoints: one target per replica."""
    objects = render(KUBERNETES / "overlays/servicemonitor")
    monitor = by_kind(objects, "ServiceMonitor")["fuseserve"]
    ports = {e["port"] for e in monitor["spec"]["endpoints"]}
    (expr,) = monitor["spec"]["selector"]["matchExpressions"]
    assert expr["operator"] == "In"
    selected = [
        service
        for service in by_kind(objects, "Service").values()
        if service["metadata"].get("labels", {}).get(expr["key"]) in expr["values"]
    ]
    deployments = by_kind(objects, "Deployment")
    for name in ("gateway", "scheduler", "worker"):
        pod_labels = deployments[name]["spec"]["template"]["metadata"]["labels"]
        scraped = [
            port
            for service in selected
            if service["spec"]["selector"].items() <= pod_labels.items()
            for port in service["spec"]["ports"]
            if port["name"] in ports
        ]
        assert len(scraped) == 1, (name, scraped)  # scraped, and once
        assert scraped[0]["targetPort"] in {p["name"] for p in _container(deployments[name])["ports"]}


def test_every_scheduler_replica_is_discoverable(objects):
    """Several schedulers run side by side: a rolling update starts the new one before the old one
    drains, and their metrics Service is headless (one DNS A record per pod, not a load-balanced
    address), as the workers' is."""
    deployments = by_kind(objects, "Deployment")
    strategy = deployments["scheduler"]["spec"]["strategy"]
    assert strategy["type"] == "RollingUpdate" and strategy["rollingUpdate"]["maxUnavailable"] == 0
    services = by_kind(objects, "Service")
    for name in ("scheduler", "worker"):
        service = services[f"{name}-metrics"]["spec"]
        assert service["clusterIP"] == "None", name
        pod_labels = deployments[name]["spec"]["template"]["metadata"]["labels"]
        assert service["selector"].items() <= pod_labels.items(), name
    # each scheduler writes its pod IP into its stats record: fuseserve top reaches its metrics there
    # (a pod's host name does not resolve from other pods)
    container = _container(deployments["scheduler"])
    args = container["args"]
    assert args[args.index("--advertise-host") + 1] == "$(POD_IP)"
    pod_ip = next(e for e in container["env"] if e["name"] == "POD_IP")
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
