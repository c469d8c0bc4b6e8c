"""Deployment files checked by schema (no Docker engine here): compose, k8s, Dockerfile,
the Grafana dashboard and provisioning, and the rendered nginx config."""

from __future__ import annotations

import argparse
import json
import re
import runpy
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
TP_K8S = DEPLOY / "k8s" / "tensor-parallel"  # not applied by `kubectl apply -f deploy/k8s/`
TP_FLAG = "--tensor-parallel-size"
SINGLE_GPU_SERVICES = ("specserve-1", "specserve-2")


def _k8s_docs(folder: Path) -> dict:
    """The manifests of one folder by kind (one object of each kind per folder)."""
    docs = {}
    for path in sorted(folder.glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        assert {"apiVersion", "kind", "metadata"} <= set(doc), path
        assert doc["kind"] not in docs, f"a second {doc['kind']} in {folder}: {path.name}"
        docs[doc["kind"]] = doc
    return docs


def _selects(selector: dict, labels: dict) -> bool:
    """A Kubernetes label selector (matchLabels, matchExpressions) against a pod's labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        present, value = e["key"] in labels, labels.get(e["key"])
        ok = {"In": present and value in e.get("values", []),
              "NotIn": not present or value not in e.get("values", []),
              "Exists": present, "DoesNotExist": not present}[e["operator"]]
        if not ok:
            return False
    return True  # an empty selector selects every pod


def _bytes(quantity: str) -> int:
    """A k8s quantity ("8Gi") or a compose size ("8gb") in bytes."""
    m = re.fullmatch(r"(\d+)\s*([kmgt]?)(i?)b?", str(quantity).strip().lower())
    assert m, quantity
    base = 1024 if m.group(3) or "b" in str(quantity).lower() else 1000
    return int(m.group(1)) * base ** " kmgt".index(m.group(2) or " ")


def _without_tp(args: list[str]) -> list[str]:
    i = args.index(TP_FLAG)
    return args[:i] + args[i + 2:]


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
        assert "deploy" not in svc  # runs anywhere; the GPUs come from docker-compose.gpu.yml
        assert "models:/models" in svc["volumes"]
        assert int(svc["stop_grace_period"].rstrip("s")) > drain
        assert svc["depends_on"]["fetch-models"]["condition"] == "service_completed_successfully"
    # nginx resolves the replicas once: a restarted replica keeps its address and its MAC
    # (a new MAC on the old address is unreachable until nginx's ARP entry ages out)
    subnet = compose["networks"]["default"]["ipam"]["config"][0]["subnet"]
    pinned = [services[n]["networks"]["default"] for n in ("specserve-1", "specserve-2")]
    assert len({p["ipv4_address"] for p in pinned}) == len({p["mac_address"] for p in pinned}) == 2
    for p in pinned:
        assert p["ipv4_address"].rsplit(".", 1)[0] == subnet.rsplit(".", 1)[0]
        first_octet = int(p["mac_address"].split(":")[0], 16)
        assert first_octet & 0b11 == 0b10  # locally administered, unicast
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


def test_compose_gpu_file_reserves_one_gpu_per_replica_and_builds_the_cuda_image():
    """docker-compose.gpu.yml over docker-compose.yml: the Dockerfile's default (CUDA) build
    args, its own image tag, one GPU per replica; the CPU file builds the CPU image."""
    base = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    gpu = yaml.safe_load((ROOT / "docker-compose.gpu.yml").read_text())["services"]
    assert set(gpu) <= set(base)
    defaults = dict(re.findall(r"^ARG (\w+)=(\S+)$", (ROOT / "Dockerfile").read_text(), re.M))
    for name, svc in gpu.items():
        assert svc["build"]["args"] == {k: defaults[k] for k in ("BASE_IMAGE", "TORCH_INDEX")}
        assert svc["image"] != base[name]["image"]  # the CPU and CUDA images keep apart
        assert "cpu" in base[name]["build"]["args"]["TORCH_INDEX"]
    for name in SINGLE_GPU_SERVICES:
        assert gpu[name]["deploy"]["resources"]["reservations"]["devices"] == [
            {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]


def test_image_check_agrees_with_compose(routes, default_config):
    """scripts/image_check.sh runs docker-compose.yml: the services it starts exist, the ports
    and paths it calls are the compose file's and the server's, its health-check loop keeps the
    compose interval, and its stand-in nginx/Prometheus images take the files compose mounts."""
    script = (ROOT / "scripts" / "image_check.sh").read_text()
    client = (ROOT / "scripts" / "image_check" / "client.py").read_text()
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    started = re.search(r"^SERVICES=\((.*)\)$", script, re.M).group(1).split()
    assert set(started) == set(services) - {"grafana", "specserve-tp"}
    assert "SERVICES+=(grafana)" in script  # where its image can be pulled
    for svc in ("specserve-1", "specserve-2", "fetch-models"):
        assert f"ctr {svc}" in script or f"stop {svc}" in script or svc in started
    assert re.search(r"^API=http://127\.0\.0\.1:(\d+)/v1$", script, re.M).group(1) + ":8080" \
        in services["nginx"]["ports"]
    assert "9090:9090" in services["prometheus"]["ports"] and "127.0.0.1:9090" in script
    port = default_config["server"]["port"]
    for path in re.findall(rf"http://127\.0\.0\.1:{port}(/\w+)", script):
        assert path in routes, path
    interval = services["specserve-1"]["healthcheck"]["interval"]
    assert f"while sleep {interval.rstrip('s')}; do" in script
    assert "stop_grace_period" in script and "compose.podman" not in script
    for name in ("specserve:num_requests_running", "specserve:generation_tokens_total",
                 "specserve:spec_decode_num_accepted_tokens_total"):
        assert name in script + client
        assert name.split(":")[1].removesuffix("_total") in (ROOT / "server" / "metrics.py").read_text()
    for tool, target in (("nginx", "/etc/nginx/nginx.conf"),
                         ("prometheus", "/etc/prometheus/prometheus.yml")):
        assert any(v.endswith(f"{target}:ro") for v in services[tool]["volumes"])
        containerfile = (ROOT / "scripts" / "image_check" / f"{tool}.Containerfile").read_text()
        assert ("nginx" in containerfile) if tool == "nginx" else (target in containerfile)
        assert f"${{{tool.upper()}_IMAGE:-" in services[tool]["image"]


def test_k8s_manifests(routes):
    docs = _k8s_docs(DEPLOY / "k8s")  # what `kubectl apply -f deploy/k8s/` creates
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
    assert _selects(docs["PodMonitor"]["spec"]["selector"], dep["spec"]["template"]["metadata"][
        "labels"])
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
    # a CA for pip only as a build secret, never stored in a layer
    assert text.count("--mount=type=secret,id=ca") == text.count("pip install --no-cache-dir /src") + 1
    assert "PIP_CERT" not in "".join(ln for ln in text.splitlines() if ln.startswith(("ENV", "ARG")))
    assert re.search(r"^USER specserve$", text, re.M)
    assert 'VOLUME ["/models"]' in text
    health = re.search(r"HEALTHCHECK.*\n.*http://127\.0\.0\.1:8000(/\w+)", text)
    assert health and health.group(1) in routes
    assert 'ENTRYPOINT ["specserve", "serve"]' in text
    assert "COPY configs /etc/specserve" in text
    runtime = text[text.rindex("FROM "):]
    # the C++ CPU kernels: compiled at build time as the user that serves (its cache), and
    # again at start where that cache is missing
    user = runtime.index("USER specserve")
    assert "RUN python -m engine.kernels.cpu_ext" in runtime[user:]
    assert "g++" in runtime and "python3-dev" in runtime
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


def test_k8s_tensor_parallel_manifests(routes):
    """deploy/k8s/tensor-parallel/: the single-GPU Deployment's pod on N GPUs, with its own
    Service; the config map, the model volume and the PodMonitor are shared."""
    base = _k8s_docs(DEPLOY / "k8s")
    docs = _k8s_docs(TP_K8S)
    assert set(docs) == {"Deployment", "Service"}
    dep, svc, base_dep = docs["Deployment"], docs["Service"], base["Deployment"]
    pod, base_pod = dep["spec"]["template"]["spec"], base_dep["spec"]["template"]["spec"]
    container, base_container = pod["containers"][0], base_pod["containers"][0]
    assert len(pod["containers"]) == 1 and dep["spec"]["replicas"] == 1  # all ranks, one pod

    # N GPUs in the pod = --tensor-parallel-size N; otherwise the single-GPU server's args
    args = container["args"]
    n = int(args[args.index(TP_FLAG) + 1])
    assert n > 1 and container["resources"]["limits"]["nvidia.com/gpu"] == n
    assert _without_tp(args) == base_container["args"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["config"] == base_pod["volumes"][1] and volumes["config"]["configMap"][
        "name"] == base["ConfigMap"]["metadata"]["name"]
    config = yaml.safe_load(base["ConfigMap"]["data"]["config.yaml"])
    assert config["engine"]["device"] == "cuda"  # rank r takes cuda:r
    claim = volumes["models"]["persistentVolumeClaim"]["claimName"]
    assert claim == base["PersistentVolumeClaim"]["metadata"]["name"]

    # a memory-backed /dev/shm, larger than the runtime's 64 MiB, inside the memory limit
    shm = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert len(shm) == 1
    empty_dir = volumes[shm[0]["name"]]["emptyDir"]
    assert empty_dir["medium"] == "Memory"
    size = _bytes(empty_dir["sizeLimit"])
    assert 2**30 <= size < _bytes(container["resources"]["limits"]["memory"])
    assert [m for m in container["volumeMounts"] if m not in shm] == base_container["volumeMounts"]

    # the same probes, drain and ports as the single-GPU pods (a dead rank: /health 503)
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready" in routes
    assert container["livenessProbe"]["httpGet"]["path"] == "/health" in routes
    assert container["startupProbe"]["httpGet"]["path"] in routes
    for key in ("image", "env", "ports", "startupProbe", "livenessProbe", "readinessProbe",
                "lifecycle"):
        assert container[key] == base_container[key], key
    for key in ("terminationGracePeriodSeconds", "securityContext", "initContainers"):
        assert pod[key] == base_pod[key], key
    template = dep["spec"]["template"]["metadata"]
    assert template["annotations"] == base_dep["spec"]["template"]["metadata"]["annotations"]

    # its own Service; the single-GPU Service and HPA do not take these pods, the PodMonitor does
    labels = template["labels"]
    assert dep["spec"]["selector"]["matchLabels"] == labels == svc["spec"]["selector"]
    assert dep["metadata"]["name"] != base_dep["metadata"]["name"]
    assert svc["metadata"]["name"] != base["Service"]["metadata"]["name"]
    assert not _selects({"matchLabels": base["Service"]["spec"]["selector"]}, labels)
    assert not _selects(base_dep["spec"]["selector"], labels)
    assert _selects(base["PodMonitor"]["spec"]["selector"], labels)
    assert svc["spec"]["ports"] == base["Service"]["spec"]["ports"]
    assert all(p["targetPort"] != "metrics" for p in svc["spec"]["ports"])


def test_compose_tensor_parallel_service():
    """specserve-tp: the replicas' service on N GPUs, only with the profile `tp`."""
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    tp, base = services["specserve-tp"], services[SINGLE_GPU_SERVICES[0]]
    assert tp["profiles"] == ["tp"]
    assert all("profiles" not in svc for name, svc in services.items() if name != "specserve-tp")
    cmd = tp["command"]
    n = int(cmd[cmd.index(TP_FLAG) + 1])
    assert n > 1 and cmd[cmd.index("--device") + 1] == "cuda"
    assert [a for a in _without_tp(cmd) if a not in ("--device", "cuda")] == base["command"]
    gpus = tp["deploy"]["resources"]["reservations"]["devices"]
    assert gpus == [{"driver": "nvidia", "count": n, "capabilities": ["gpu"]}]
    assert tp.get("ipc") == "host" or _bytes(tp["shm_size"]) >= 2**30
    for key in ("image", "environment", "volumes", "depends_on", "restart", "stop_grace_period",
                "healthcheck"):
        assert tp[key] == base[key], key
    # not behind nginx: published on this host only (/metrics is on the API port here)
    assert tp["ports"] and all(p.startswith("127.0.0.1:") for p in tp["ports"])


def test_deploy_args_are_serve_flags():
    """The server args in compose and k8s parse with `specserve serve`'s own parser."""
    from server.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    serve = sub.choices["serve"]
    known = {flag for action in serve._actions for flag in action.option_strings}
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    arg_lists = {f"compose {name}": compose[name]["command"]
                 for name in (*SINGLE_GPU_SERVICES, "specserve-tp")}
    for folder in (DEPLOY / "k8s", TP_K8S):
        dep = _k8s_docs(folder)["Deployment"]
        arg_lists[f"k8s {dep['metadata']['name']}"] = dep["spec"]["template"]["spec"][
            "containers"][0]["args"]
    for where, args in arg_lists.items():
        assert [a for a in args if a.startswith("--") and a not in known] == [], where
        parsed = serve.parse_args(args)
        if TP_FLAG in args:
            assert parsed.tensor_parallel_size == int(args[args.index(TP_FLAG) + 1]) > 1, where


def test_every_cpu_kernel_is_compiled_by_the_image_build(monkeypatch):
    """`python -m engine.kernels.cpu_ext` (the Dockerfile's build step) compiles KERNELS: every
    C++ source is in it, and a CPU without a kernel's features gets the reason, not a crash."""
    from engine.kernels import cpu_ext

    sources = {spec[0] for spec in cpu_ext.KERNELS.values()}
    assert sources == {p.name for p in cpu_ext.SOURCES.glob("*.cpp")}
    assert all(not f.startswith("arch") for spec in cpu_ext.KERNELS.values() for f in spec[1])
    monkeypatch.setattr(cpu_ext, "cpu_flags", lambda: set())
    assert cpu_ext.load("int4_vnni") == "the CPU lacks " + ", ".join(
        cpu_ext.KERNELS["int4_vnni"][1])
