"""deploy/ against the code: the port `loraplex serve` listens on, its liveness, readiness and
metrics paths, flags it accepts, a grace period longer than its drain, the pool's selector on the
replicas' labels, and the endpoint picker reading the metric names the server exports."""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from loraplex.cli.serve import DEFAULT_PORT
from loraplex.cli.serve import add_parser as add_serve_parser
from loraplex.server.metrics import (
    EPP_METRICS,
    KV_CACHE_METRIC,
    LORA_INFO_METRIC,
    QUEUE_METRIC,
    RUNNING_METRIC,
)
from loraplex.server.routes.health import LIVENESS_PATH, METRICS_PATH, READINESS_PATH

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def _documents() -> dict[tuple[str, str], dict]:
    documents = {}
    for path in sorted(DEPLOY.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            documents[(document["kind"], document["metadata"]["name"])] = document
    return documents


def _flags(args: list[str]) -> dict[str, str]:
    return dict(arg.removeprefix("--").split("=", 1) for arg in args)


def test_the_replicas_match_loraplex_serve() -> None:
    documents = _documents()
    deployment = documents[("Deployment", "loraplex")]
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert container["command"] == ["loraplex", "serve"]
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", *container["args"]])  # every flag exists and parses
    port = args.port
    assert port == DEFAULT_PORT and args.host == "0.0.0.0"
    (named,) = container["ports"]
    assert named["containerPort"] == port
    assert container["readinessProbe"]["httpGet"] == {"path": READINESS_PATH, "port": named["name"]}
    assert container["livenessProbe"]["httpGet"] == {"path": LIVENESS_PATH, "port": named["name"]}
    assert pod["metadata"]["annotations"]["prometheus.io/path"] == METRICS_PATH
    assert int(pod["metadata"]["annotations"]["prometheus.io/port"]) == port
    assert pod["spec"]["terminationGracePeriodSeconds"] > args.shutdown_timeout
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert {e["name"] for e in container["env"]} >= {"LORAPLEX_DATA_DIR", "LORAPLEX_DATABASE_URL"}

    labels = pod["metadata"]["labels"]
    service = documents[("Service", "loraplex")]
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == named["name"]
    pool = documents[("InferencePool", "loraplex")]
    assert pool["spec"]["targetPorts"] == [{"number": port}]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_the_endpoint_picker_reads_what_the_server_exports() -> None:
    documents = _documents()
    pool = documents[("InferencePool", "loraplex")]
    epp = documents[("Deployment", pool["spec"]["endpointPickerRef"]["name"])]
    (container,) = epp["spec"]["template"]["spec"]["containers"]
    flags = _flags(container["args"])
    assert flags["pool-name"] == pool["metadata"]["name"]
    assert int(flags["grpc-port"]) == pool["spec"]["endpointPickerRef"]["port"]["number"]
    assert flags["model-server-metrics-path"] == METRICS_PATH
    read = {flags["total-queued-requests-metric"]: QUEUE_METRIC,
            flags["total-running-requests-metric"]: RUNNING_METRIC,
            flags["kv-cache-usage-percentage-metric"]: KV_CACHE_METRIC,
            flags["lora-info-metric"]: LORA_INFO_METRIC}
    for name, expected in read.items():
        assert name == expected and name in EPP_METRICS
