"""Real observability services on loopback for tests: Prometheus and an OTLP receiver."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from kvpool.connector.contract.metric_names import VLLM_NAME_RELABEL
from kvpool.connector.local.pool import LOOPBACK, free_port, start_logged, stop_process, wait_for_port
from kvpool.connector.local.ports import held_port, release_port


def send_body(handler: BaseHTTPRequestHandler, body: bytes, content_type: str) -> None:
    """Answer ``handler``'s request 200 with ``body``."""
    handler.send_response(200)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


@dataclass
class PrometheusServer:
    """Debian's ``prometheus`` scraping the given loopback targets every second."""

    targets: dict[str, list[str]]  # job name -> ["127.0.0.1:port", ...]
    # job name -> labels its targets get (as the chart's monitors give the pod's namespace and pool)
    target_labels: dict[str, dict[str, str]] = field(default_factory=dict)
    rule_files: list[Path] = field(default_factory=list)
    port: int = field(default_factory=held_port)  # drawn: held until stop
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvpool-prom-")))
    process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> PrometheusServer:
        binary = shutil.which("prometheus")
        if binary is None:
            raise FileNotFoundError("prometheus not installed: run scripts/setup.sh")
        jobs = [
            {
                "job_name": name,
                "static_configs": [{"targets": targets, "labels": self.target_labels.get(name, {})}],
                "scrape_interval": "1s",
                "metric_relabel_configs": [VLLM_NAME_RELABEL],
            }
            for name, targets in self.targets.items()
        ]
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": jobs,
            "rule_files": [str(p) for p in self.rule_files],
        }
        config_path = self.workdir / "prometheus.yml"
        config_path.write_text(json.dumps(config))  # JSON is valid YAML
        command = [
            binary,
            f"--config.file={config_path}",
            f"--storage.tsdb.path={self.workdir / 'data'}",
            f"--web.listen-address={LOOPBACK}:{self.port}",
            "--log.level=warn",
        ]
        log = self.workdir / "prometheus.log"
        self.process = start_logged(command, log)
        wait_for_port(self.port, timeout, self.process, log_path=log)
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://{LOOPBACK}:{self.port}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError("Prometheus never became ready")

    def stop(self) -> None:
        stop_process(self.process)
        release_port(self.port)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def api(self, path: str, **params: str) -> Any:
        url = f"http://{LOOPBACK}:{self.port}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.loads(response.read())
        if body.get("status") != "success":
            raise RuntimeError(f"Prometheus {path} failed: {body}")
        return body["data"]

    def query(self, promql: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query, now or at the Unix time ``at``."""
        if at is None:
            return self.api("query", query=promql)["result"]
        return self.api("query", query=promql, time=f"{at:.3f}")["result"]

    def wait_for_scrapes(self, job: str, scrapes: int = 2, timeout: float = 30.0) -> None:
        """Until every target of ``job`` was scraped ``scrapes`` times and is up."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rows = self.query(f'count_over_time(up{{job="{job}"}}[1m])')
            ups = self.query(f'up{{job="{job}"}}')
            if (
                rows
                and len(ups) == len(self.targets[job])
                and all(float(r["value"][1]) >= scrapes for r in rows)
                and all(float(u["value"][1]) == 1 for u in ups)
            ):
                return
            time.sleep(0.5)
        raise TimeoutError(f"Prometheus never scraped {job} {scrapes} times")


class OTLPReceiver:
    """An OTLP/HTTP trace receiver on loopback that keeps every span it gets."""

    def __init__(self) -> None:
        self.port = free_port()
        self.spans: list[Any] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
                    ExportTraceServiceRequest,
                    ExportTraceServiceResponse,
                )

                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                with receiver._lock:
                    for resource_spans in request.resource_spans:
                        for scope_spans in resource_spans.scope_spans:
                            receiver.spans.extend(scope_spans.spans)
                send_body(self, ExportTraceServiceResponse().SerializeToString(), "application/x-protobuf")

            def log_message(self, *args: object) -> None:
                return

        self._server = ThreadingHTTPServer((LOOPBACK, self.port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://{LOOPBACK}:{self.port}/v1/traces"

    def __enter__(self) -> OTLPReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def received(self) -> list[Any]:
        with self._lock:
            return list(self.spans)
