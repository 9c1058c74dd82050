"""``smgd status`` and ``smgd reload``: talk to a running daemon from the terminal.

Both read the daemon's config to find its admin listener (the unix socket
``<run_dir>/admin.sock`` by default, or TCP when ``[admin] port > 0``, with the bearer token
from ``admin.token_env``).

- ``status`` samples ``GET /admin/engines`` twice (tokens/s is the difference of the engines'
  ``tokens_total`` over the interval) and, when the public listener is known, ``GET /metrics``
  for request outcomes and abort causes; it prints one compact table. ``--watch N`` repeats
  every N seconds. Exit 1 with a clear message when the daemon cannot be reached.
- ``reload`` posts ``/admin/reload`` and prints the result: exit 0 applied, 1 rejected (the
  reason is printed; the old config stays) or applied with an engine that could not be started
  (named, with why; smgd retries it), 2 daemon not reachable.

The async functions take a :class:`Target`, so tests drive them against an in-process daemon;
rendering and rate computation are pure.
"""

from __future__ import annotations

import os
import sys
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

from smgd.config import run_dir

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Mapping

    from smgd.config import Config

__all__ = [
    "Clients",
    "DaemonUnreachable",
    "Sample",
    "Target",
    "fetch_sample",
    "open_clients",
    "render",
    "run_reload",
    "run_status",
    "target_from_config",
    "token_rates",
]

# Admin requests are local and answer in milliseconds; 5 s only catches a wedged daemon.
# A reload loads tokenizers and may start engines, so it gets a minute (plus the drain
# timeout when it replaces an engine, see reload_main).
ADMIN_TIMEOUT_S = 5.0
RELOAD_TIMEOUT_S = 60.0
# One-shot `smgd status` samples twice this far apart for tokens/s: long enough to average
# over many decode steps, short enough to feel instant.
DEFAULT_INTERVAL_S = 1.0

EXIT_OK, EXIT_REJECTED, EXIT_UNREACHABLE = 0, 1, 2


class DaemonUnreachable(Exception):
    """The admin listener did not answer (daemon not running, wrong config, no permission)."""


@dataclass(frozen=True)
class Target:
    admin_url: str  # base URL; with `uds` the host part is a placeholder
    uds: str | None = None
    token: str | None = None
    public_url: str | None = None  # for /metrics; None when unknown (port 0)

    def describe(self) -> str:
        return f"admin socket {self.uds}" if self.uds else f"admin endpoint {self.admin_url}"


def target_from_config(
    config: Config, environ: Mapping[str, str] | None = None, *, public_url: str | None = None
) -> Target:
    env = os.environ if environ is None else environ
    admin = config.admin
    token = env.get(admin.token_env) if admin.token_env else None
    if public_url is None and config.server.port > 0:
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(config.server.host, config.server.host)
        host = f"[{host}]" if ":" in host else host
        public_url = f"http://{host}:{config.server.port}"
    if admin.port > 0:
        host = f"[{admin.host}]" if ":" in admin.host else admin.host
        return Target(f"http://{host}:{admin.port}", token=token or None, public_url=public_url)
    sock = str(run_dir(config) / "admin.sock")  # the path smgd.api.http.server binds
    return Target("http://smgd", uds=sock, token=token or None, public_url=public_url)


def _verify(url: str) -> bool:
    # Plain-HTTP targets skip building a TLS context: on a loaded 2-core box that costs
    # 0.1-0.6 s per client, which would skew the tokens/s sampling interval.
    return not url.startswith("http://")


def _admin_client(target: Target, timeout: float) -> httpx.AsyncClient:
    verify = _verify(target.admin_url)
    transport = httpx.AsyncHTTPTransport(uds=target.uds, verify=verify) if target.uds else None
    headers = {"Authorization": f"Bearer {target.token}"} if target.token else {}
    return httpx.AsyncClient(
        base_url=target.admin_url,
        transport=transport,
        headers=headers,
        timeout=timeout,
        verify=verify,
    )


@dataclass
class Clients:
    """The HTTP clients of one `smgd status` run, reused across samples."""

    admin: httpx.AsyncClient
    public: httpx.AsyncClient | None


@asynccontextmanager
async def open_clients(target: Target) -> AsyncIterator[Clients]:
    async with _admin_client(target, ADMIN_TIMEOUT_S) as admin:
        if target.public_url is None:
            yield Clients(admin, None)
            return
        public = httpx.AsyncClient(
            base_url=target.public_url, timeout=ADMIN_TIMEOUT_S, verify=_verify(target.public_url)
        )
        async with public:
            yield Clients(admin, public)


@dataclass
class Sample:
    t: float  # trio.current_time() when taken
    admin: dict[str, Any]  # the /admin/engines body
    requests: dict[str, float] = field(default_factory=dict)  # by status, from /metrics
    aborts: dict[str, float] = field(default_factory=dict)  # by reason, from /metrics

    def tokens(self) -> dict[str, int]:
        return {e["name"]: int(e["tokens_total"]) for e in self.admin.get("engines", [])}


async def fetch_sample(target: Target, clients: Clients) -> Sample:
    """One reading of the admin endpoint (required) and /metrics (best effort)."""
    try:
        response = await clients.admin.get("/admin/engines")
    except (httpx.HTTPError, OSError) as exc:
        raise DaemonUnreachable(
            f"cannot reach {target.describe()}: {exc} (is smgd running with this config?)"
        ) from None
    if response.status_code != 200:
        raise DaemonUnreachable(
            f"{target.describe()} answered {response.status_code}: {response.text[:200]}"
        )
    sample = Sample(trio.current_time(), response.json())
    if clients.public is not None:
        try:
            metrics = await clients.public.get("/metrics")
            if metrics.status_code == 200:
                _fold_metrics(sample, metrics.text)
        except (httpx.HTTPError, OSError):
            pass  # the table still stands without the request totals
    return sample


def _fold_metrics(sample: Sample, text: str) -> None:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "smgd_requests_total":
                key = s.labels.get("status", "?")
                sample.requests[key] = sample.requests.get(key, 0.0) + s.value
            elif s.name == "smgd_aborts_total":  # one per reason (and worker): summed
                key = s.labels.get("reason", "?")
                sample.aborts[key] = sample.aborts.get(key, 0.0) + s.value


def token_rates(before: Sample | None, after: Sample) -> dict[str, float | None]:
    """Generated tokens per second per engine between two samples (None: no earlier sample).

    A counter that went down means the engine client was rebuilt (restart): count from 0.
    """
    if before is None or after.t <= before.t:
        return dict.fromkeys(after.tokens())
    old = before.tokens()
    span = after.t - before.t
    rates: dict[str, float | None] = {}
    for name, now in after.tokens().items():
        prev = old.get(name)
        if prev is None:
            rates[name] = None
        else:
            rates[name] = (now - prev if now >= prev else now) / span
    return rates


def _cell(value: object) -> str:
    return "-" if value is None else str(value)


def render(sample: Sample, rates: dict[str, float | None]) -> str:
    admin = sample.admin
    head = (
        f"smgd up {_duration(float(admin.get('uptime_s', 0.0)))}"
        f"{'  DRAINING' if admin.get('draining') else ''}"
        f"  reloads {admin.get('reloads_total', 0)}"
        f" (failed {admin.get('reload_failures_total', 0)})"
    )
    columns = ("ENGINE", "WIRE", "STATE", "INFLIGHT", "QUEUED", "RUN/WAIT", "KV", "TOK/S", "ERRORS")
    rows: list[tuple[str, ...]] = [columns]
    errors: list[str] = []
    for e in admin.get("engines", []):
        load = e.get("load") or {}
        kv = load.get("kv_usage")
        rate = rates.get(e["name"])
        rows.append(
            (
                e["name"],
                e["wire"],
                e["state"],
                str(e["in_flight"]),
                str(e["queue_depth"]),
                f"{load['running']}/{load['waiting']}" if load else "-",
                f"{kv * 100:.0f}%" if kv is not None else "-",
                f"{rate:.1f}" if rate is not None else "-",
                f"rej {e['rejected_total']} dec {e['decode_errors']}",
            )
        )
        if e.get("last_error"):
            errors.append(f"  {e['name']}: {e['last_error']}")
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines = [head, ""]
    lines += [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    if len(rows) == 1:
        lines.append("(no engines)")
    if sample.requests:
        totals = " ".join(f"{k}={v:g}" for k, v in sorted(sample.requests.items()))
        lines += ["", f"requests: {totals}"]
    if sample.aborts:
        lines.append("aborts: " + " ".join(f"{k}={v:g}" for k, v in sorted(sample.aborts.items())))
    if errors:
        lines += ["", "recent errors:", *errors]
    return "\n".join(lines) + "\n"


def _duration(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


async def run_status(
    target: Target,
    *,
    out: TextIO,
    err: TextIO,
    watch: float | None = None,
    interval: float = DEFAULT_INTERVAL_S,
    iterations: int | None = None,
) -> int:
    """Print the status table (once, or every ``watch`` seconds ``iterations`` times)."""
    try:
        async with open_clients(target) as clients:
            return await _status_loop(target, clients, out, watch, interval, iterations)
    except DaemonUnreachable as exc:
        err.write(f"smgd: {exc}\n")
        return 1


async def _status_loop(
    target: Target,
    clients: Clients,
    out: TextIO,
    watch: float | None,
    interval: float,
    iterations: int | None,
) -> int:
    before = await fetch_sample(target, clients)
    await trio.sleep(watch or interval)
    count = 0
    while True:
        after = await fetch_sample(target, clients)
        text = render(after, token_rates(before, after))
        if watch and out.isatty():
            text = "\x1b[H\x1b[2J" + text  # redraw in place
        out.write(text)
        out.flush()
        count += 1
        if not watch or (iterations is not None and count >= iterations):
            return EXIT_OK
        before = after
        await trio.sleep(watch)


async def run_reload(
    target: Target, *, out: TextIO, err: TextIO, answer_within_s: float = RELOAD_TIMEOUT_S
) -> int:
    """POST /admin/reload; 0 applied, 1 rejected or an engine did not start (reason printed),
    2 daemon unreachable. A reload answers after the drain of the engines it replaces."""
    try:
        async with _admin_client(target, answer_within_s) as client:
            response = await client.post("/admin/reload")
    except (httpx.HTTPError, OSError) as exc:
        err.write(f"smgd: cannot reach {target.describe()}: {exc} (is smgd running?)\n")
        return EXIT_UNREACHABLE
    try:
        body: dict[str, Any] = response.json()
    except ValueError:
        body = {}
    if response.status_code == 200 and body.get("ok"):
        parts = [
            f"{key} {', '.join(body[key])}"
            for key in ("added", "removed", "changed", "replaced")
            if body.get(key)
        ]
        out.write("reload applied" + (f": {'; '.join(parts)}" if parts else " (no engine changes)"))
        out.write("\n")
        if body.get("needs_restart"):
            out.write(f"needs a restart to apply: {', '.join(body['needs_restart'])}\n")
        failed: dict[str, str] = body.get("failed") or {}
        for name, why in failed.items():
            err.write(f"smgd: engine {name} did not start: {why} (smgd retries it)\n")
        return EXIT_REJECTED if failed else EXIT_OK
    reason = body.get("error")
    if isinstance(reason, dict):
        reason = reason.get("message")
    err.write(f"smgd: reload rejected ({response.status_code}): {reason or response.text}\n")
    return EXIT_REJECTED


def status_main(config: Config, *, watch: float | None, url: str | None) -> int:
    target = target_from_config(config, public_url=url)
    return trio.run(lambda: run_status(target, out=sys.stdout, err=sys.stderr, watch=watch))


def reload_main(config: Config) -> int:
    target = target_from_config(config)
    # A reload that replaces an engine answers after its streams drained (drain_timeout_s).
    within = RELOAD_TIMEOUT_S + config.server.drain_timeout_s
    return trio.run(
        lambda: run_reload(target, out=sys.stdout, err=sys.stderr, answer_within_s=within)
    )
