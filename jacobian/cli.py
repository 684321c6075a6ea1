"""The ``jacobian`` command: compute in-process, serve the API, run a worker, or bring the local stack up.

Nothing heavy at import: TensorFlow, the server stack and the worker code are imported inside the commands
that use them, so ``--help`` and the client commands run on a client-only install (``pip install
jacobian-service``); a command whose extra is missing says which one to install (``EXTRAS``).
Exit codes: 0 success, 1 a waited-for job failed or was canceled, 2 bad request, an error answer of the
API (the message names the field) or a missing extra, 130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from jacobian.cli_compute import add_parser as add_compute_parser

# -- extras ----------------------------------------------------------------------------------------

# The modules (import names) of each extra of pyproject.toml that the commands needing it import.
EXTRAS = {
    "api": ("fastapi", "uvicorn", "redis", "rq", "prometheus_client", "matplotlib"),
    "worker": ("tensorflow", "redis", "rq", "prometheus_client"),
    "server": ("redis", "rq", "prometheus_client"),
}
_EXTRA_WHAT = {"api": "the HTTP API server stack", "worker": "TensorFlow and the worker stack",
               "server": "Redis, rq and the metrics client"}


def _not_importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):
        return True


def missing_extras(extras: tuple[str, ...]) -> str | None:
    """``None`` when the modules of ``extras`` are importable, else a message naming what to install."""
    missing = {extra: [m for m in EXTRAS[extra] if _not_importable(m)] for extra in extras}
    missing = {extra: modules for extra, modules in missing.items() if modules}
    if not missing:
        return None
    needed = " and ".join(f"the {extra!r} extra ({_EXTRA_WHAT[extra]})" for extra in missing)
    modules = ", ".join(dict.fromkeys(m for ms in missing.values() for m in ms))
    return (f"needs {needed}; not installed: {modules}. Install with: pip install "
            f"'jacobian-service[{','.join(missing)}]' (in a checkout: bash scripts/setup.sh)")


# -- serve / worker --------------------------------------------------------------------------------


def _default_port() -> int:
    from contracts.settings import get_settings

    return urlparse(get_settings().api_url).port or 8000


def cmd_serve(args: argparse.Namespace) -> int:
    """The HTTP API (``app.main:app``) under uvicorn, in ``--workers`` processes.

    With more than one process, counters and histograms must be shared through prometheus_client's
    multiprocess files: ``PROMETHEUS_MULTIPROC_DIR`` is used when set, else a fresh temporary folder.
    """
    import tempfile

    import uvicorn

    workers = max(1, int(args.workers))
    if workers > 1 and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="jacobian-metrics-")
    uvicorn.run("app.main:app", host=args.host, port=args.port or _default_port(), log_level="info",
                workers=workers, access_log=not args.no_access_log)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    """One rq worker on this process (set ``JACOBIAN_GPU`` to pin a GPU)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.supervise:  # a parent that restarts the worker and notes how it died (worker.supervisor)
        from worker.supervisor import main as supervise

        return supervise([sys.executable, "-m", "jacobian", "worker"] + (["--burst"] if args.burst else []))
    from worker.main import run_worker

    run_worker(burst=args.burst)
    return 0


def cmd_notifier(args: argparse.Namespace) -> int:
    """The webhook notifier (``app.notifier``): delivers the jobs' ``notify`` events from the Redis outbox."""
    from app.notifier import run_notifier

    run_notifier()
    return 0


# -- up --------------------------------------------------------------------------------------------


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _redis_reachable(url: str) -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=2).ping())
    except (redis.RedisError, OSError, ValueError):
        return False


def _wait(check: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return False


def _start_redis(var: Path, configured_url: str) -> tuple[subprocess.Popen[bytes], str]:
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("jacobian up: no Redis at JACOBIAN_REDIS_URL and no redis-server on PATH; "
                         "install redis-server or point JACOBIAN_REDIS_URL at a running Redis")
    port = urlparse(configured_url).port or 6379
    if not _port_free("127.0.0.1", port):
        port = _free_port()
    data = var / "redis"
    data.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data),
                             "--appendonly", "yes"], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    if not _wait(lambda: _redis_reachable(url), 20):
        proc.terminate()
        raise SystemExit(f"jacobian up: redis-server did not answer on port {port}")
    return proc, url


def _stop(procs: list[tuple[str, subprocess.Popen[bytes]]]) -> None:
    for _name, proc in reversed(procs):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for _name, proc in reversed(procs):
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def cmd_up(args: argparse.Namespace) -> int:
    """Redis (if none is reachable), the API, one worker and the webhook notifier; results and models under
    ``./var``."""
    from contracts.settings import get_settings

    var = Path(args.var).resolve()
    env = os.environ.copy()
    env.setdefault("JACOBIAN_RESULTS_URL", str(var / "results"))
    env.setdefault("JACOBIAN_MODEL_ROOTS", str(var / "models"))
    if not env["JACOBIAN_RESULTS_URL"].startswith(("s3://", "s3a://")):
        Path(env["JACOBIAN_RESULTS_URL"].removeprefix("file://")).mkdir(parents=True, exist_ok=True)
    for root in env["JACOBIAN_MODEL_ROOTS"].split(","):
        if root.strip():
            Path(root.strip()).mkdir(parents=True, exist_ok=True)
    def _interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops the children too, as Ctrl-C does
    procs: list[tuple[str, subprocess.Popen[bytes]]] = []
    redis_url = env.get("JACOBIAN_REDIS_URL") or get_settings().redis_url
    if not _redis_reachable(redis_url):
        proc, redis_url = _start_redis(var, redis_url)
        procs.append(("redis", proc))
        print(f"redis   {redis_url} (started, data in {var / 'redis'})", flush=True)
    else:
        print(f"redis   {redis_url} (already running)", flush=True)
    env["JACOBIAN_REDIS_URL"] = redis_url
    port = args.port or _default_port()
    if not _port_free(args.host, port):
        port = _free_port()
    api_url = f"http://{args.host}:{port}"
    env["JACOBIAN_API_URL"] = api_url
    cli = [sys.executable, "-m", "jacobian.cli"]
    try:
        procs.append(("api", subprocess.Popen(cli + ["serve", "--host", args.host, "--port", str(port)], env=env)))
        procs.append(("worker", subprocess.Popen(cli + ["worker", "--supervise"], env=env)))
        procs.append(("notifier", subprocess.Popen(cli + ["notifier"], env=env)))
        print(f"api     {api_url}  (docs {api_url}/docs, jobs {api_url}/v1/jobs, ui {api_url}/ui)", flush=True)
        allow = env.get("JACOBIAN_WEBHOOK_ALLOW") or "off (set JACOBIAN_WEBHOOK_ALLOW)"
        print(f"webhooks {allow} (jacobian notifier)", flush=True)
        print(f"results {env['JACOBIAN_RESULTS_URL']}", flush=True)
        print(f"models  {env['JACOBIAN_MODEL_ROOTS']}", flush=True)
        print("Ctrl-C stops everything.", flush=True)
        while True:
            for name, proc in procs:
                if proc.poll() is not None:
                    print(f"jacobian up: {name} exited with {proc.returncode}; stopping", file=sys.stderr)
                    return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("stopping...", file=sys.stderr, flush=True)
        return 0
    finally:
        _stop(procs)


# -- parser ----------------------------------------------------------------------------------------


def _add_client_commands(sub: Any) -> None:
    """``submit``, ``status``, ``fetch``, ``list`` and ``cancel``: HTTP clients of the API (``jacobian.cli_client``)."""
    from jacobian.cli_client import register

    register(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jacobian", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    add_compute_parser(sub)
    p = sub.add_parser("serve", help="run the HTTP API")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, help="default: the port of JACOBIAN_API_URL (8000)")
    p.add_argument("--workers", type=int, default=1,
                   help="uvicorn processes (metrics shared through PROMETHEUS_MULTIPROC_DIR; default 1)")
    p.add_argument("--no-access-log", action="store_true", help="no uvicorn access-log line per request")
    p.set_defaults(func=cmd_serve, needs=("api",))
    p = sub.add_parser("worker", help="run one worker (one per GPU)")
    p.add_argument("--burst", action="store_true", help="quit when the queue is empty")
    p.add_argument("--supervise", action="store_true", help="run the worker as a child process, restart it when it "
                   "dies and note the signal (SIGKILL, SIGSEGV) for the job's WorkerDied error")
    p.set_defaults(func=cmd_worker, needs=("worker",))
    p = sub.add_parser("notifier", help="deliver the jobs' webhooks (notify) from the Redis outbox")
    p.set_defaults(func=cmd_notifier, needs=("server",))
    p = sub.add_parser("up", help="Redis (if none reachable), the API, one worker and the webhook notifier, "
                       "results on local disk")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, help="API port (default: that of JACOBIAN_API_URL, 8000)")
    p.add_argument("--var", default="var", help="folder for Redis data, results and models (default ./var)")
    p.set_defaults(func=cmd_up, needs=("api", "worker"))
    _add_client_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point; returns the exit code."""
    args = build_parser().parse_args(argv)
    # httpx logs every request at INFO: never the CLI's output, whatever logging the process set up before
    logging.getLogger("httpx").setLevel(logging.WARNING)
    problem = missing_extras(getattr(args, "needs", ()))
    if problem:
        print(f"error: MissingDependency: jacobian {args.command} {problem}", file=sys.stderr, flush=True)
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


def _exit_now(code: int) -> None:
    """Exit without the interpreter's teardown of TensorFlow (1.1 s after a MobileNet Jacobian): the
    result and its manifest are complete and closed by then; output and logs are flushed first."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def console() -> None:
    """The ``jacobian`` console script: ``main``, then a fast exit after ``compute``."""
    argv = sys.argv[1:]
    code = main(argv)
    if argv[:1] == ["compute"]:
        _exit_now(code)
    sys.exit(code)


if __name__ == "__main__":
    console()
