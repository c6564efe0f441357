"""The packages' layering, read from every import statement in the tree (function-level ones included):

kernels/            torch, triton and the standard library only
engine/             kernels/, never a serving layer above it
kvtransfer/         engine/ and kernels/, never a serving layer
serving/            what every role shares; only its CLI (cli.py, roles.py, serve.py) starts roles by name
prefill_worker/,    engine/, serving/, kvtransfer/: never the router, the gateway or each other
decode_worker/
router/             engine/, serving/
gateway/            engine/, serving/: never the router or a worker
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKERS = {"prefill_worker", "decode_worker"}
ROLES = {"router", "gateway", *WORKERS}
FORBIDDEN: dict[str, set[str]] = {
    "engine": {"serving", *ROLES},
    "kvtransfer": {"serving", *ROLES},
    "prefill_worker": {"router", "gateway", "decode_worker"},
    "decode_worker": {"router", "gateway", "prefill_worker"},
    "gateway": {"router", *WORKERS},
    "serving": ROLES,
}
SERVING_CLI = {"serving/cli.py", "serving/roles.py", "serving/serve.py"}  # the top: it starts every role
KERNELS_MAY_IMPORT = {"kernels", "torch", "triton", "numpy", *sys.stdlib_module_names}
SKIP_DIRS = {".venv", ".git", "build", "dist", "node_modules", "__pycache__"}


def imported_modules(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, top-level package) of every absolute import in the tree."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module.split(".")[0]


def violations(path: str, source: str) -> list[str]:
    """`path:line: a imports b` for each import that breaks the layering; `path` is relative to the root."""
    package = path.split("/")[0]
    if package == "serving" and path in SERVING_CLI:
        return []
    found = []
    for line, module in imported_modules(ast.parse(source, filename=path)):
        if package == "kernels":
            bad = module not in KERNELS_MAY_IMPORT
        else:
            bad = module in FORBIDDEN.get(package, set())
        if bad:
            found.append(f"{path}:{line}: {package}/ imports {module}")
    return found


def python_files() -> list[Path]:
    return [
        p
        for p in sorted(ROOT.rglob("*.py"))
        if not SKIP_DIRS & set(p.relative_to(ROOT).parts) and not p.name.endswith(("_pb2.py", "_pb2_grpc.py"))
    ]


def test_the_tree_keeps_its_layers() -> None:
    found = [
        v
        for p in python_files()
        for v in violations(p.relative_to(ROOT).as_posix(), p.read_text(encoding="utf-8"))
    ]
    assert not found, "imports across the layering (see this test's docstring):\n" + "\n".join(found)


def test_every_package_is_read() -> None:
    read = {p.relative_to(ROOT).parts[0] for p in python_files()}
    assert {"kernels", "engine", "kvtransfer", "serving", "router", "gateway", *WORKERS} <= read


@pytest.mark.parametrize(
    ("path", "source", "where"),
    [
        ("engine/x.py", "from serving.mux import ManyStream\n", "engine/x.py:1: engine/ imports serving"),
        ("engine/x.py", "def f():\n    import router.index\n", "engine/x.py:2: engine/ imports router"),
        ("engine/x.py", "def f():\n    from gateway import app\n", "engine/x.py:2: engine/ imports gateway"),
        ("engine/x.py", "import decode_worker.core\n", "engine/x.py:1: engine/ imports decode_worker"),
        (
            "kernels/x.py",
            "from engine.config import CacheConfig\n",
            "kernels/x.py:1: kernels/ imports engine",
        ),
        ("kernels/x.py", "import grpc\n", "kernels/x.py:1: kernels/ imports grpc"),
        (
            "prefill_worker/x.py",
            "from router.index import X\n",
            "prefill_worker/x.py:1: prefill_worker/ imports router",
        ),
        (
            "decode_worker/x.py",
            "from gateway.app import X\n",
            "decode_worker/x.py:1: decode_worker/ imports gateway",
        ),
        (
            "decode_worker/x.py",
            "from prefill_worker import core\n",
            "decode_worker/x.py:1: decode_worker/ imports prefill_worker",
        ),
        ("gateway/x.py", "x = 1\nfrom router.server import R\n", "gateway/x.py:2: gateway/ imports router"),
        ("gateway/x.py", "import prefill_worker\n", "gateway/x.py:1: gateway/ imports prefill_worker"),
        ("kvtransfer/x.py", "from serving import trace\n", "kvtransfer/x.py:1: kvtransfer/ imports serving"),
        (
            "kvtransfer/x.py",
            "from decode_worker.core import D\n",
            "kvtransfer/x.py:1: kvtransfer/ imports decode_worker",
        ),
        ("serving/mux.py", "from router.server import R\n", "serving/mux.py:1: serving/ imports router"),
    ],
)
def test_a_crossing_is_named_with_its_line(path: str, source: str, where: str) -> None:
    assert violations(path, source) == [where]


@pytest.mark.parametrize(
    ("path", "source"),
    [
        ("engine/x.py", "from kernels.silu_and_mul import silu_and_mul\nimport torch\n"),
        (
            "kernels/x.py",
            "import torch\nimport triton.language as tl\nfrom kernels import _backend\nimport os\n",
        ),
        (
            "prefill_worker/x.py",
            "from serving.kv_events import KVEventPublisher\nfrom kvtransfer import connect\n",
        ),
        ("gateway/x.py", "from serving.grpc_common import CHANNEL_OPTIONS\nfrom engine.tokenizer import T\n"),
        ("router/x.py", "from serving.mux import ManyStream\n"),
        ("serving/roles.py", "from router.main import serve_router\n"),
        ("engine/x.py", "from . import trace\n"),
    ],
)
def test_an_allowed_import_passes(path: str, source: str) -> None:
    assert violations(path, source) == []


@pytest.mark.parametrize(
    "module, heavy",
    [
        ("serving.cli", ("torch", "fastapi", "tokenizers")),  # every role builds its parser
        ("serving.worker", ("torch",)),  # a worker's gRPC process: only its engine process needs torch
        ("decode_worker.server", ("torch",)),
        ("prefill_worker.server", ("torch",)),
        ("router.main", ("torch",)),
        ("gateway.app", ("torch",)),
    ],
)
def test_server_processes_stay_light(module: str, heavy: tuple[str, ...]) -> None:
    """The processes that only speak gRPC or HTTP import no torch (about 2 s of a worker's start, and its
    memory), and the CLI that every role starts with imports no web stack or tokenizer."""
    import subprocess

    code = f"import sys, {module}; print(','.join(m for m in {heavy!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"{module} imports {out.stdout.strip()}"
