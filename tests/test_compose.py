"""compose.yaml and the Dockerfile, checked without a Docker engine (none runs on CI machines): every
pdserve command in compose.yaml parses with the CLI as it is, the addresses the services give each other
agree, every role waits for what it calls, and the image holds every package the distribution ships."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from serving.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
VARIABLE = re.compile(r"\$\{(\w+)(?::([-?])([^}]*))?\}")


def interpolate(value: Any, env: dict[str, str] | None = None) -> Any:
    """Compose's ${VAR:-default} / ${VAR:?message} with `env` set (default: nothing): the variable, else the
    default, or a stand-in path."""
    env = env or {}
    if isinstance(value, str):
        return VARIABLE.sub(
            lambda m: env.get(m.group(1)) or (m.group(3) if m.group(2) == "-" else "/models/set-by-user"),
            value,
        )
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    return value


def load_services(env: dict[str, str] | None = None) -> dict[str, dict]:
    return interpolate(yaml.safe_load((ROOT / "compose.yaml").read_text()), env)["services"]


@pytest.fixture(scope="module")
def services() -> dict[str, dict]:
    return load_services()


def parsed(service: dict) -> Any:
    command = service["command"]
    assert command[0] == "pdserve"
    return build_parser().parse_args(command[1:])  # argparse exits (the test fails) on a stale flag


def health_target(service: dict) -> list[str]:
    return service["healthcheck"]["test"]


def test_every_pdserve_command_parses_and_checks_its_own_health(services) -> None:
    roles: dict[str, list[str]] = {}
    for name, service in services.items():
        if name == "redis":
            continue
        args = parsed(service)
        roles.setdefault(args.command, []).append(name)
        if args.command in ("router", "prefill", "decode"):
            assert health_target(service)[1:] == ["pdserve", "health", f"{args.host}:{args.port}"], name
        if args.command == "gateway":
            assert f"127.0.0.1:{args.port}/health" in health_target(service)[-1]
    assert sorted(roles) == ["decode", "gateway", "prefill", "router"]


def test_the_router_calls_the_workers_and_redis_the_compose_file_starts(services) -> None:
    router = parsed(services["router"])
    workers = {name: parsed(s) for name, s in services.items() if name.startswith(("prefill", "decode"))}
    for role in ("prefill", "decode"):
        mine = sorted(f"{a.host}:{a.port}" for a in workers.values() if a.command == role)
        assert sorted(getattr(router, role).split(",")) == mine, role
    redis_port = services["redis"]["command"][services["redis"]["command"].index("--port") + 1]
    assert router.redis_url == f"redis://127.0.0.1:{redis_port}/0"
    assert set(services["router"]["depends_on"]) == {"redis", *workers}
    assert all(d["condition"] == "service_healthy" for d in services["router"]["depends_on"].values())
    gateway = parsed(services["gateway"])
    assert gateway.router == f"{router.host}:{router.port}"
    assert services["gateway"]["depends_on"] == {"router": {"condition": "service_healthy"}}


def test_cuda_ipc_workers_share_ipc_and_the_prefill_worker_sees_the_decode_gpu(services) -> None:
    decode_gpus = None
    for name, service in services.items():
        if not name.startswith(("prefill", "decode")):
            continue
        args = parsed(service)
        assert (
            args.kv_transport == "cuda_ipc" and service["ipc"] == "host" and service["network_mode"] == "host"
        )
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"]
        gpus = str(service["environment"]["CUDA_VISIBLE_DEVICES"]).split(",")
        if args.command == "decode":
            decode_gpus = gpus
        else:
            prefill_gpus = gpus
    assert decode_gpus is not None and decode_gpus[0] in prefill_gpus


def test_the_image_holds_every_package_the_distribution_ships() -> None:
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"][
        "include"
    ]
    packages = {p.rstrip("*") for p in include}
    copied = set(re.findall(r"^COPY (\w+) \1$", (ROOT / "Dockerfile").read_text(), re.M))
    assert packages == copied
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert not packages & set(ignored)


def test_docker_stop_waits_past_every_drain(services) -> None:
    """`docker stop` sends SIGTERM, then SIGKILL after the grace period: it must outlast the drain."""
    for name, service in services.items():
        if name == "redis":
            continue
        grace = service.get("stop_grace_period", "10s")
        assert grace.endswith("s"), (name, grace)
        drain = parsed(service).drain_timeout_s
        assert float(grace[:-1]) > drain + 5, (name, grace, drain)


# the example of compose.yaml's header
TP_ENV = {"DECODE_TP": "2", "DECODE_GPUS": "0,1", "PREFILL_TP": "2", "PREFILL_GPUS": "2,3,0,1"}


@pytest.mark.parametrize("env", [None, TP_ENV], ids=["defaults", "tp2"])
def test_each_worker_lists_a_gpu_per_rank_of_its_own_then_the_decode_gpus(env) -> None:
    workers = {name: s for name, s in load_services(env).items() if name.startswith(("prefill", "decode"))}
    own: dict[str, list[str]] = {}
    for name, service in workers.items():
        args = parsed(service)
        gpus = str(service["environment"]["CUDA_VISIBLE_DEVICES"]).split(",")
        assert len(gpus) >= args.tensor_parallel_size, name
        own[args.command] = gpus[: args.tensor_parallel_size]
        if args.command == "prefill":
            listed = gpus
    assert not set(own["prefill"]) & set(own["decode"])  # every rank computes on a GPU of its own
    assert set(own["decode"]) <= set(listed)  # the prefill worker's ranks can map every decode rank's pool
    if env is not None:
        assert {parsed(s).tensor_parallel_size for s in workers.values()} == {2}
