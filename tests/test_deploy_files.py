"""Deployment files checked by schema (no Docker engine here): compose, k8s, Dockerfile,
the Grafana dashboard and provisioning, and the rendered nginx config."""

from __future__ import annotations

import json
import re
import runpy
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"


@pytest.fixture(scope="module")
def routes():
    from server.app import create_app
    from server.config import AppConfig
    from server.state import ServerState

    app = create_app(ServerState(AppConfig()))
    return {r.path for r in app.routes}


@pytest.fixture(scope="module")
def default_config():
    return yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())


def test_dashboard_is_valid_grafana_json_in_sync_with_its_generator():
    dash = json.loads((DEPLOY / "grafana" / "specserve.json").read_text())
    module = runpy.run_path(str(DEPLOY / "grafana" / "make_dashboard.py"))
    assert dash == json.loads(json.dumps(module["dashboard"]())), "run make_dashboard.py"
    provisioned = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    uid = provisioned["datasources"][0]["uid"]
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) >= 15
    for p in dash["panels"]:
        assert p["type"] == "timeseries" and p["title"]
        assert set(p["gridPos"]) == {"h", "w", "x", "y"}
        assert p["datasource"]["uid"] == uid
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["refId"] and t["expr"] and t["datasource"]["uid"] == uid
            assert "specserve:" in t["expr"]
    var = dash["templating"]["list"][0]
    assert var["name"] == "instance" and var["datasource"]["uid"] == uid
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for needed in ("tokens/s", "acceptance rate", "accepted length", "position", "k chosen",
                   "first token", "inter-token", "end-to-end", "queue", "running", "kv cache",
                   "preemptions", "prefix", "error"):
        assert needed in titles, needed


def test_grafana_dashboard_provider_points_at_the_mounted_file():
    provider = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "dashboards" / "specserve.yml").read_text())
    path = provider["providers"][0]["options"]["path"]
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert any(m.endswith(f"{path}/specserve.json:ro") for m in mounts)


def test_nginx_compose_config_is_rendered_from_the_template():
    render = runpy.run_path(str(DEPLOY / "nginx" / "render.py"))["render"]
    expected = render(["specserve-1:8000", "specserve-2:8000"], "8080", "/tmp",
                      "/dev/stdout", "/dev/stderr")
    assert (DEPLOY / "nginx" / "nginx.compose.conf").read_text() == expected
    assert "proxy_buffering off" in expected and "proxy_read_timeout 3600s" in expected


def test_compose_services_ports_and_health(routes, default_config):
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"specserve-1", "specserve-2", "nginx", "prometheus", "grafana",
            "fetch-models"} <= set(services)
    port = default_config["server"]["port"]
    drain = default_config["server"]["drain_timeout_s"]
    for name in ("specserve-1", "specserve-2"):
        svc = services[name]
        cmd = svc["command"]
        assert cmd[cmd.index("--port") + 1] == str(port)
        health = " ".join(svc["healthcheck"]["test"])
        path = re.search(r"127\.0\.0\.1:(\d+)(/\w+)", health)
        assert path and int(path.group(1)) == port and path.group(2) in routes
        gpu = svc["deploy"]["resources"]["reservations"]["devices"][0]
        assert gpu["capabilities"] == ["gpu"] and gpu["count"] == 1
        assert "models:/models" in svc["volumes"]
        assert int(svc["stop_grace_period"].rstrip("s")) > drain
        assert svc["depends_on"]["fetch-models"]["condition"] == "service_completed_successfully"
    assert "8080:8080" in services["nginx"]["ports"]
    for svc in services.values():
        for volume in svc.get("volumes", []):
            host = volume.split(":")[0]
            if host.startswith("./"):
                assert (ROOT / host).exists(), host
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = prom["scrape_configs"][0]["static_configs"][0]["targets"]
    assert targets == [f"specserve-1:{port}", f"specserve-2:{port}"]
    assert prom["scrape_configs"][0]["metrics_path"] in routes


def test_k8s_manifests(routes):
    docs = {}
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        assert {"apiVersion", "kind", "metadata"} <= set(doc), path
        docs[doc["kind"]] = doc
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "PodMonitor", "ConfigMap",
            "PersistentVolumeClaim"} <= set(docs)
    dep = docs["Deployment"]
    pod = dep["spec"]["template"]["spec"]
    container = pod["containers"][0]
    config = yaml.safe_load(docs["ConfigMap"]["data"]["config.yaml"])
    port = config["server"]["port"]
    assert container["ports"][0]["containerPort"] == port
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready" in routes
    assert container["livenessProbe"]["httpGet"]["path"] == "/health" in routes
    assert container["startupProbe"]["httpGet"]["path"] in routes
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] >= config["server"]["drain_timeout_s"] + pre_stop
    assert dep["spec"]["selector"]["matchLabels"] == dep["spec"]["template"]["metadata"]["labels"]
    svc = docs["Service"]
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    assert svc["spec"]["ports"][0]["targetPort"] == container["ports"][0]["name"]
    hpa = docs["HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]
    assert docs["PodMonitor"]["spec"]["podMetricsEndpoints"][0]["path"] == "/metrics"
    # metrics on their own port, scraped on the pods and not exposed by the Service
    metrics_port = {p["name"]: p["containerPort"] for p in container["ports"]}["metrics"]
    assert metrics_port == config["server"]["metrics_port"]
    assert docs["PodMonitor"]["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    assert dep["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(
        metrics_port)
    assert all(p["targetPort"] != "metrics" for p in docs["Service"]["spec"]["ports"])
    claim = pod["volumes"][0]["persistentVolumeClaim"]["claimName"]
    assert claim == docs["PersistentVolumeClaim"]["metadata"]["name"]
    from server.config import AppConfig

    AppConfig(**config).engine_config()  # the config map is a valid specserve config


def test_dockerfile(routes):
    text = (ROOT / "Dockerfile").read_text()
    assert text.count("FROM ") >= 2  # multi-stage
    assert "ARG BASE_IMAGE=nvidia/cuda" in text and "whl/cpu" in text
    assert re.search(r"^USER specserve$", text, re.M)
    assert 'VOLUME ["/models"]' in text
    health = re.search(r"HEALTHCHECK.*\n.*http://127\.0\.0\.1:8000(/\w+)", text)
    assert health and health.group(1) in routes
    assert 'ENTRYPOINT ["specserve", "serve"]' in text
    assert "COPY configs /etc/specserve" in text
    runtime = text[text.rindex("FROM "):]  # compiles the C++ CPU kernels at the first start
    assert "g++" in runtime and "python3-dev" in runtime
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored
