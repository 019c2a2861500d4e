"""The deployment files against real tools: docker-compose, promtool, a real Prometheus.

- docker-compose validates the GPU stack and the GPU+CPU override.
- promtool accepts deploy/prometheus/prometheus.yml.
- every metric the Grafana dashboard references is one ServerMetrics exports.
- a real Prometheus (loopback, free port, temp storage, 1 s scrapes) scrapes a metrics endpoint; after some
  traffic every PromQL expression of the dashboard returns a non-empty, finite result through the HTTP API:
  once against a stand-in that serves ServerMetrics with traffic but no speculation at all (the panels must
  not go empty), once against a real `foresight serve` (the `live_server` fixture).

Needs Debian's `docker-compose` and `prometheus` packages (promtool ships with the latter); each test
skips with the reason when its binary is missing.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from foresight.protocol.messages import RoundStats
from foresight.server.metrics import ServerMetrics

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOY = REPO_ROOT / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
COMPOSE_CPU = DEPLOY / "docker-compose.cpu.yml"
PROMETHEUS_YML = DEPLOY / "prometheus" / "prometheus.yml"
COMPOSE_REPLICAS = DEPLOY / "docker-compose.replicas.yml"
COMPOSE_REPLICAS_CPU = DEPLOY / "docker-compose.replicas.cpu.yml"
PROMETHEUS_REPLICAS_YML = DEPLOY / "prometheus" / "prometheus-replicas.yml"
HAPROXY_CFG = DEPLOY / "haproxy" / "haproxy.cfg"
KUBERNETES = DEPLOY / "kubernetes" / "foresight.yaml"
REPLICA_ALIAS = "foresight-replica"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "foresight.json"
DATASOURCES = DEPLOY / "grafana" / "provisioning" / "datasources"
DASHBOARD_PROVIDERS = DEPLOY / "grafana" / "provisioning" / "dashboards"

# What Grafana would substitute: all models, and a rate window that holds several 1 s scrapes.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$model_name": ".*"}
METRIC_NAME = re.compile(r"\bforesight_[a-zA-Z0-9_]+")
SELECTOR = re.compile(r"\b(foresight_[a-zA-Z0-9_]+)(\{[^}]*\})?")  # a metric and its label matchers, if any


# ------------------------------------------------------------------ helpers


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"`{name}` not on PATH (apt-get install -y --no-install-recommends docker-compose prometheus)")
    return path


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_panels() -> list[dict]:
    out = []
    for panel in dashboard()["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # collapsed rows hold their panels
    return out


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title / refId, PromQL as Grafana sends it) for every target of every panel."""
    queries = []
    for panel in dashboard_panels():
        for target in panel.get("targets", []):
            expr = target["expr"]
            for var, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(var, value)
            queries.append((f"{panel['title']} / {target['refId']}", expr))
    return queries


def exported_sample_names() -> set[str]:
    metrics = ServerMetrics("m", max_draft_tokens=2)
    body, _ = metrics.render()
    return {s.name for family in text_string_to_metric_families(body.decode()) for s in family.samples}


class Prometheus:
    """A real Prometheus on loopback scraping one target every second."""

    def __init__(self, url: str) -> None:
        self.url = url

    def api(self, path: str, **params) -> dict:
        query = urllib.parse.urlencode(params, doseq=True)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as e:  # 400 on a bad expression: report Prometheus' error
            body = json.load(e)
        if body.get("status") != "success":
            raise AssertionError(f"Prometheus {path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.api("query", query=expr)["result"]

    def scalar(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None

    def wait_for_scrapes(self, n: int = 3, timeout_s: float = 60.0) -> None:
        """Until every target was scraped successfully at least n times (counters then have a baseline)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (self.scalar('min(sum_over_time(up{job="foresight"}[1m]))') or 0) >= n:
                return
            time.sleep(0.5)
        raise AssertionError(f"Prometheus did not scrape the target {n} times: "
                             f"{self.api('targets')['activeTargets']}")


@contextmanager
def run_prometheus(target: str | list[str], workdir: Path):
    """Start `prometheus` scraping http://<target>/metrics (each of a list) every second; yield a client."""
    exe = binary("prometheus")
    port = free_port()
    config = workdir / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "foresight", "metrics_path": "/metrics",
                            "static_configs": [{"targets": [target] if isinstance(target, str) else target}]}],
    }))
    (workdir / "data").mkdir()
    log_path = workdir / "prometheus.log"
    cmd = [exe, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
           f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while http_status(url + "/-/ready") != 200:
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"Prometheus did not become ready:\n{log_path.read_text(errors='replace')}")
            time.sleep(0.2)
        yield Prometheus(url)
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def assert_every_panel_has_data(prom: Prometheus, timeout_s: float = 30.0) -> None:
    """Every dashboard expression returns at least one series, all finite; retried while scrapes land."""
    deadline = time.monotonic() + timeout_s
    while True:
        problems = []
        for name, expr in dashboard_queries():
            result = prom.query(expr)  # a broken expression raises with Prometheus' error at once
            if not result:
                problems.append(f"{name}: empty result for {expr}")
            elif any(not math.isfinite(float(r["value"][1])) for r in result):
                problems.append(f"{name}: non-finite {[r['value'][1] for r in result]} for {expr}")
        variable = prom.api("label/model_name/values", **{"match[]": "foresight_requests_running"})
        if not variable:
            problems.append("template variable model_name: no values")
        if not problems:
            return
        if time.monotonic() > deadline:
            raise AssertionError("dashboard panels without data:\n" + "\n".join(problems))
        time.sleep(1.0)


# ------------------------------------------------------------------ docker-compose, promtool


# The stack refuses to start without a Grafana admin password; the tests give one.
COMPOSE_ENV = {"GRAFANA_ADMIN_PASSWORD": "test-password"}
COMPOSE_VARS = ("GRAFANA_ADMIN_PASSWORD", "FORESIGHT_BIND_ADDRESS", "FORESIGHT_API_KEY", "FORESIGHT_PORT",
                "PROMETHEUS_PORT", "GRAFANA_PORT", "FORESIGHT_REPLICAS")


def run_compose_config(*files: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    exe = binary("docker-compose")
    cmd = [exe] + [a for f in files for a in ("-f", str(f))] + ["config"]
    base = {k: v for k, v in os.environ.items() if k not in COMPOSE_VARS}  # the defaults, not this shell's
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                          env={**base, **(COMPOSE_ENV if env is None else env)})


def compose_config(*files: Path, env: dict | None = None) -> dict:
    proc = run_compose_config(*files, env=env)
    assert proc.returncode == 0, f"docker-compose config failed:\n{proc.stderr}"
    return yaml.safe_load(proc.stdout)


def published(service: dict) -> list[tuple[str, str]]:
    """(host address, host port) of each published port, from v1 strings or v2 long syntax."""
    out = []
    for port in service.get("ports", []):
        if isinstance(port, dict):
            out.append((port.get("host_ip", "0.0.0.0"), str(port["published"])))
        else:
            parts = str(port).split("/")[0].split(":")
            out.append((parts[0] if len(parts) == 3 else "0.0.0.0", parts[-2]))
    return out


def test_compose_gpu_stack_validates():
    services = compose_config(COMPOSE)["services"]
    assert {"foresight", "prometheus", "grafana"} <= set(services)
    app = services["foresight"]
    assert app["ipc"] == "host"
    (device,) = app["deploy"]["resources"]["reservations"]["devices"]
    assert device["device_ids"] == ["0", "1"] and device["capabilities"] == ["gpu"]
    command = " ".join(app["command"])
    assert "--target-device cuda:0" in command and "--drafter-device cuda:1" in command
    assert "healthcheck" in app and "/health" in " ".join(app["healthcheck"]["test"])
    assert app["restart"] and app["stop_grace_period"]
    assert "profiles" not in app  # plain `up` starts it


def test_compose_publishes_on_loopback_and_locks_grafana():
    services = compose_config(COMPOSE)["services"]
    ports = {name: published(services[name]) for name in ("foresight", "prometheus", "grafana")}
    assert ports == {"foresight": [("127.0.0.1", "8000")], "prometheus": [("127.0.0.1", "9090")],
                     "grafana": [("127.0.0.1", "3000")]}
    grafana = services["grafana"]["environment"]
    assert grafana["GF_SECURITY_ADMIN_PASSWORD"] == "test-password"
    assert str(grafana["GF_AUTH_ANONYMOUS_ENABLED"]).lower() == "false"
    exposed = compose_config(COMPOSE, env={**COMPOSE_ENV, "FORESIGHT_BIND_ADDRESS": "0.0.0.0",
                                           "FORESIGHT_API_KEY": "k"})["services"]
    assert published(exposed["foresight"]) == [("0.0.0.0", "8000")]
    assert exposed["foresight"]["environment"]["FORESIGHT_API_KEY"] == "k"


def test_compose_refuses_to_start_without_grafana_password():
    proc = run_compose_config(COMPOSE, env={})
    assert proc.returncode != 0 and "GRAFANA_ADMIN_PASSWORD" in proc.stderr


def test_compose_cpu_override_validates():
    services = compose_config(COMPOSE, COMPOSE_CPU)["services"]
    assert services["foresight"]["profiles"] == ["gpu"]  # the GPU service is parked
    cpu = services["foresight-cpu"]
    assert "profiles" not in cpu and "deploy" not in cpu
    command = " ".join(cpu["command"])
    assert "--target-device cpu" in command and "--drafter-device cpu" in command
    assert "foresight" in cpu["networks"]["default"]["aliases"]  # Prometheus scrapes foresight:8000
    assert published(cpu) == [("127.0.0.1", "8000")]


def test_promtool_accepts_prometheus_config():
    exe = binary("promtool")
    proc = subprocess.run([exe, "check", "config", str(PROMETHEUS_YML)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    targets = yaml.safe_load(PROMETHEUS_YML.read_text())["scrape_configs"][0]["static_configs"][0]["targets"]
    assert targets == ["foresight:8000"]


# ------------------------------------------------------------------ replicas: compose, HAProxy, Kubernetes


def replica_services(services: dict) -> dict:
    """The services the balancer and Prometheus find: those carrying the replicas' network alias."""
    return {name: svc for name, svc in services.items()
            if REPLICA_ALIAS in ((svc.get("networks") or {}).get("default") or {}).get("aliases", [])}


def assert_behind_the_balancer(services: dict) -> None:
    for name, svc in replica_services(services).items():
        assert "profiles" not in svc and not svc.get("ports"), f"{name} must be reached through the balancer only"
        assert "/health" in " ".join(svc["healthcheck"]["test"]) and svc["stop_grace_period"]
        assert svc["environment"]["FORESIGHT_API_KEY"] == "k"  # each replica checks the key itself
    balancer = services["balancer"]
    assert published(balancer) == [("127.0.0.1", "8000")]
    assert any(str(v).startswith(f"{HAPROXY_CFG}:") for v in balancer["volumes"])
    mounts = services["prometheus"]["volumes"]
    assert any(str(v).startswith(f"{PROMETHEUS_REPLICAS_YML}:/etc/prometheus/prometheus.yml") for v in mounts)
    assert not any(str(v).startswith(f"{PROMETHEUS_YML}:") for v in mounts)


def test_compose_replicas_on_gpus_validate():
    services = compose_config(COMPOSE, COMPOSE_REPLICAS, env={**COMPOSE_ENV, "FORESIGHT_API_KEY": "k"})["services"]
    assert services["foresight"]["profiles"] == ["single"]  # the single server is parked
    replicas = replica_services(services)
    assert len(replicas) == 2
    gpus = [tuple(svc["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]) for svc in replicas.values()]
    assert sorted(gpus) == [("0", "1"), ("2", "3")]  # a pair of GPUs each, none shared
    for svc in replicas.values():
        assert svc["ipc"] == "host" and "--target-device cuda:0 --drafter-device cuda:1" in " ".join(svc["command"])
    assert_behind_the_balancer(services)


def test_compose_replicas_on_cpus_validate():
    env = {**COMPOSE_ENV, "FORESIGHT_API_KEY": "k"}
    services = compose_config(COMPOSE, COMPOSE_REPLICAS_CPU, env=env)["services"]
    assert services["foresight"]["profiles"] == ["gpu"]
    (replica,) = replica_services(services).values()
    assert int(replica["deploy"]["replicas"]) == 2 and "deploy" not in services["balancer"]
    assert "--target-device cpu --drafter-device cpu" in " ".join(replica["command"])
    assert_behind_the_balancer(services)
    more = compose_config(COMPOSE, COMPOSE_REPLICAS_CPU, env={**env, "FORESIGHT_REPLICAS": "3"})["services"]
    assert int(more["foresight-replica"]["deploy"]["replicas"]) == 3


def test_balancer_and_replica_scrapes_are_valid_configs():
    proc = subprocess.run([binary("haproxy"), "-c", "-f", str(HAPROXY_CFG)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{REPLICA_ALIAS}:8000" in HAPROXY_CFG.read_text()
    proc = subprocess.run([binary("promtool"), "check", "config", str(PROMETHEUS_REPLICAS_YML)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    jobs = {job["job_name"]: job for job in yaml.safe_load(PROMETHEUS_REPLICAS_YML.read_text())["scrape_configs"]}
    (dns,) = jobs["foresight"]["dns_sd_configs"]
    assert dns["names"] == [REPLICA_ALIAS] and dns["port"] == 8000


def kubernetes_documents() -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(KUBERNETES.read_text())}


@pytest.mark.parametrize("version", ["1.30", "1.33"])
def test_kubernetes_manifests_validate(version):
    """Every manifest against the Kubernetes API's own schemas (kubernetes-validate; strict: unknown fields
    are errors)."""
    import kubernetes_validate

    docs = kubernetes_documents()
    assert set(docs) == {"PersistentVolumeClaim", "Deployment", "Service", "PodDisruptionBudget"}
    for doc in docs.values():
        kubernetes_validate.validate(doc, version, strict=True)


def test_kubernetes_deployment_drains_and_probes_as_the_server_expects():
    docs = kubernetes_documents()
    pod = docs["Deployment"]["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    args = container["args"]
    drain_s = float(args[args.index("--drain-timeout") + 1])
    pre_stop_s = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["spec"]["terminationGracePeriodSeconds"] >= pre_stop_s + drain_s + 10
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["startupProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["httpGet"]["path"] == "/metrics"  # answers while loading and draining
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert "--target-device" in args and "--drafter-device" in args
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    labels = pod["metadata"]["labels"]
    assert docs["Service"]["spec"]["selector"].items() <= labels.items()
    assert docs["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    claims = {v["persistentVolumeClaim"]["claimName"] for v in pod["spec"]["volumes"] if "persistentVolumeClaim" in v}
    assert claims == {docs["PersistentVolumeClaim"]["metadata"]["name"]}


# ------------------------------------------------------------------ Grafana files


def test_grafana_provisioning_matches_dashboard():
    text = DASHBOARD.read_text()
    assert "${DS_" not in text, "dashboard must use the provisioned datasource uid, not an import placeholder"
    (datasource,) = yaml.safe_load(next(DATASOURCES.glob("*.yml")).read_text())["datasources"]
    uids = {p["datasource"]["uid"] for p in dashboard_panels() if "datasource" in p}
    uids |= {t["datasource"]["uid"] for p in dashboard_panels() for t in p.get("targets", [])}
    assert uids == {datasource["uid"]}
    (provider,) = yaml.safe_load(next(DASHBOARD_PROVIDERS.glob("*.yml")).read_text())["providers"]
    mounts = yaml.safe_load(COMPOSE.read_text())["services"]["grafana"]["volumes"]
    assert f"./grafana/dashboards:{provider['options']['path']}:ro" in mounts
    (variable,) = dashboard()["templating"]["list"]
    assert variable["name"] == "model_name" and variable["includeAll"] and variable["allValue"] == ".*"


def test_dashboard_uses_only_exported_metrics():
    exported = exported_sample_names()
    queries = dashboard_queries()
    assert len(queries) >= 20
    referenced = {name for _, expr in queries for name in METRIC_NAME.findall(expr)}
    referenced |= set(METRIC_NAME.findall(dashboard()["templating"]["list"][0]["definition"]))
    assert referenced - exported == set(), "dashboard references metrics ServerMetrics does not export"
    for _, expr in queries:
        for name, matchers in SELECTOR.findall(expr):
            assert 'model_name=~".*"' in matchers, f"{name} must be selected through $model_name: {expr}"


# ------------------------------------------------------------------ a real Prometheus


@contextmanager
def serve_metrics(metrics: ServerMetrics):
    """A stand-in HTTP endpoint that serves metrics.render() at /metrics."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body, content_type = metrics.render()
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def plain_traffic(metrics: ServerMetrics, requests: int = 3) -> None:
    """`requests` requests of 8 tokens each, decoded without speculation."""
    for _ in range(requests):
        metrics.set_queue(running=1, waiting=0)
        metrics.record_prompt_tokens(12)
        metrics.record_first_token(0.2)
        for _ in range(8):
            metrics.record_round(RoundStats(drafted=0, accepted=0, nucleus_extra=0, verify_s=0.05,
                                            exposed_draft_s=None, cache_hit=None))
            metrics.record_inter_token(0.05)
        metrics.record_generation_tokens(8)
        metrics.record_finished("length", 0.6)
    metrics.set_queue(running=0, waiting=0)


def up_metrics() -> ServerMetrics:
    metrics = ServerMetrics("SmolLM2-135M-Instruct")
    metrics.set_worker_up("target", True)
    metrics.set_worker_up("drafter", True)
    return metrics


def test_panels_have_data_without_speculation(tmp_path):
    """ar traffic only: no drafts, no cache lookups, no exposed latency — still no empty panel."""
    metrics = up_metrics()
    with serve_metrics(metrics) as target, run_prometheus(target, tmp_path) as prom:
        prom.wait_for_scrapes()
        plain_traffic(metrics)
        assert_every_panel_has_data(prom)
        assert prom.scalar("sum(foresight_generation_tokens_total)") == 24


def panel_query(title: str, ref: str = "A") -> str:
    (expr,) = [e for name, e in dashboard_queries() if name == f"{title} / {ref}"]
    return expr


def test_panels_sum_over_two_replicas_and_break_them_down(tmp_path):
    """Two replicas scraped as two instances (as the replicas stacks do): the panels sum over both, the
    Replicas row shows one series per replica, and a replica whose target is down stops counting as serving."""
    first, second = up_metrics(), up_metrics()
    with serve_metrics(first) as a, serve_metrics(second) as b, run_prometheus([a, b], tmp_path) as prom:
        prom.wait_for_scrapes()
        plain_traffic(first, 3)
        plain_traffic(second, 1)
        assert_every_panel_has_data(prom)
        deadline = time.monotonic() + 30
        while prom.scalar("sum(foresight_generation_tokens_total)") != 32:
            assert time.monotonic() < deadline, "Prometheus never saw both replicas' tokens"
            time.sleep(0.5)
        by_replica = prom.query(panel_query("Tokens per second by replica"))
        assert {r["metric"]["instance"] for r in by_replica} == {a, b}
        assert len(prom.query(panel_query("Running and waiting requests by replica", "B"))) == 2
        assert prom.scalar(panel_query("Replicas serving")) == 2
        second.set_worker_up("target", False)
        while prom.scalar(panel_query("Replicas serving")) != 1:
            assert time.monotonic() < deadline + 30, "the panel still counts a replica whose target is down"
            time.sleep(0.5)
        assert prom.scalar(panel_query("Replicas serving", "B")) == 2
        (target_up,) = [r for r in prom.query(panel_query("Workers up")) if r["metric"]["worker"] == "target"]
        assert float(target_up["value"][1]) == 0  # the lowest over the replicas


def _traffic(base_url: str) -> int:
    """A few completions against the real server (plain and streamed); returns how many finished."""
    import httpx

    with httpx.Client(base_url=base_url, timeout=300) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        prompts = ["def fibonacci(n):", "The capital of France is", "List three colors: red,"]
        for prompt in prompts:
            r = client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 16,
                                                     "temperature": 0})
            assert r.status_code == 200, r.text
        with client.stream("POST", "/v1/chat/completions", json={
                "model": model, "messages": [{"role": "user", "content": "Count from 1 to 10."}],
                "max_tokens": 16, "temperature": 0, "stream": True}) as r:
            assert r.status_code == 200, r.read()
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
    return len(prompts) + 1


def test_panels_have_data_with_live_server(live_server, tmp_path):
    target = live_server.base_url.removeprefix("http://")
    with run_prometheus(target, tmp_path) as prom:
        prom.wait_for_scrapes()
        finished = _traffic(live_server.base_url)
        deadline = time.monotonic() + 30
        while (prom.scalar("sum(foresight_request_success_total)") or 0) < finished:
            assert time.monotonic() < deadline, "Prometheus never saw the finished requests"
            time.sleep(0.5)
        assert prom.scalar("sum(foresight_generation_tokens_total)") > 0
        assert prom.scalar("sum(foresight_prompt_tokens_total)") > 0
        assert prom.scalar("min(foresight_worker_up)") == 1
        assert_every_panel_has_data(prom)
