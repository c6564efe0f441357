"""The committed gRPC stubs are what `make protos` generates from protos/*.proto today."""

from pathlib import Path

from protos.generate import ROOT, generate


def test_stubs_are_fresh(tmp_path: Path):
    (tmp_path / "protos").mkdir()
    generate(tmp_path)
    fresh = sorted(p.name for p in (tmp_path / "protos").iterdir())
    assert fresh == ["pdserve_pb2.py", "pdserve_pb2.pyi", "pdserve_pb2_grpc.py"]
    for name in fresh:
        committed = (ROOT / "protos" / name).read_text()
        assert committed == (tmp_path / "protos" / name).read_text(), (
            f"protos/{name} is stale: run `make protos`"
        )
