"""What `wakegate up` is configured with (`Settings`), built once from its command line and checked."""

from __future__ import annotations

import argparse
import ssl
import sys
from dataclasses import dataclass
from pathlib import Path

from wakegate.control.delivery.errors import RegistryError
from wakegate.control.delivery.registry import load_auths
from wakegate.control.manifests import ManifestError, parse_models
from wakegate.control.schema import Model
from wakegate.control.up.engine import runnable
from wakegate.process import ProcessSettings, host_port, settings_from


@dataclass(frozen=True, kw_only=True)
class Settings(ProcessSettings):
    """Everything `wakegate up` is configured with; built once from its command line."""

    file: Path
    """The YAML file of Model documents."""
    models: tuple[Model, ...]
    """The Models the file holds, validated."""
    listen_host: str
    """Address of the gateway's listener."""
    listen_port: int
    """Port of the gateway's listener."""
    admin_listen: str
    """HTTP address of /status, /healthz and /metrics."""
    envoy_admin_listen: str | None
    """Envoy's admin API on this TCP address; None: an owner-only Unix socket in the state dir."""
    state_dir: Path
    """Logs and rendered configs (Envoy's bootstrap)."""
    api_keys_file: Path | None
    """API keys, one per line with an optional scope of models; None: no auth."""
    public_metrics: str
    """`/metrics` on the gateway's listener: off, open or keys (any valid API key)."""
    fairness_header: bool
    """Flow control: clients may name their tenant in x-gateway-inference-fairness-id (keys without one)."""
    max_body_bytes: int
    """Largest request body the gateway reads, bytes."""
    global_rps: float
    """Requests/s over all models; 0: unlimited."""
    global_burst: float
    """Burst of `global_rps`; 0: max(1, rps)."""
    envoy_concurrency: int
    """Envoy worker threads."""
    extproc_h2_limit: tuple[str, ...]
    """NAME=VALUE limits of extproc's HTTP/2 server (`wakegate extproc --h2-limit`)."""
    upstream_header: bool
    """Add x-wakegate-upstream (the backend's ip:port) to responses."""
    status_display: bool
    """The live status table on the terminal."""
    keepalive_seconds: float
    """SSE heartbeat interval of held keepalive requests."""
    scaler_listen: str | None
    """Also serve KEDA's ExternalScaler gRPC service here (HOST:PORT)."""
    fake_gpus: Path | None
    """JSON file of GPUs to pretend this machine has."""
    cache_dir: Path
    """This machine's model cache (oci:// and hf:// sources)."""
    cache_max_size: int | None
    """Cache budget in bytes; None: the file system's free space."""
    cache_verify: str
    """Check of a cached entry before each engine start: `blocks` or `sizes`."""
    registry_config: Path | None
    """Docker config with registry credentials; None: $DOCKER_CONFIG/config.json, ~/.docker/config.json."""
    ca_file: Path | None
    """Extra CA certificates trusted for registries."""
    plain_http: bool
    """Plain HTTP to every registry."""
    flash_dir: Path
    """Where `spec.cache.flash` stages weights (a tmpfs)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Settings:
        """Raises ValueError with a message for the user: no file, an invalid one, a malformed address."""
        if args.file is None:
            raise ValueError("-f FILE is required")
        try:
            models = tuple(parse_models(args.file.read_text(encoding="utf-8"), str(args.file)))
        except OSError as exc:
            raise ValueError(f"cannot read {args.file}: {exc.strerror}") from None
        except ManifestError as exc:
            raise ValueError(str(exc)) from None
        for model in models:
            problem = runnable(model, args.file.resolve().parent)
            if problem is not None:
                raise ValueError(f"{args.file}: Model {model.name!r}: {problem}")
        try:
            host, port = host_port(args.listen)
            host_port(args.admin_listen)
            if args.envoy_admin_listen is not None:
                host_port(args.envoy_admin_listen)
        except ValueError as exc:
            raise ValueError(f"--listen and --admin-listen take HOST:PORT: {exc}") from None
        display = sys.stderr.isatty() if args.status_display is None else args.status_display
        if args.registry_config is not None or args.ca_file is not None:
            try:
                load_auths(args.registry_config)  # unreadable or not a Docker config: say so now
                if args.ca_file is not None:
                    ssl.create_default_context().load_verify_locations(cafile=str(args.ca_file))
            except RegistryError as exc:
                raise ValueError(f"--registry-config: {exc}") from None
            except (OSError, ssl.SSLError) as exc:
                raise ValueError(f"--registry-ca-file {args.ca_file}: not a PEM file of certificates ({exc})") from None
        return settings_from(
            cls,
            args,
            models=models,
            listen_host=host,
            listen_port=port,
            status_display=display,
            extproc_h2_limit=tuple(getattr(args, "extproc_h2_limit", ())),
        )
