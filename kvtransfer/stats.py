"""One worker's KV transfers for its /metrics: bytes moved, failures, and (at the sender) seconds per
transfer, keyed as serving/worker_metrics.py reads them ("<name>/<transport>")."""

from __future__ import annotations

from engine.stats import KV_TRANSFER_BUCKETS, Histogram, HistogramSnapshot


class TransferStats:
    def __init__(self, transport: str, bytes_per_block: int) -> None:
        self.transport, self.bytes_per_block = transport, bytes_per_block
        self.bytes = 0
        self.failures = 0
        self.seconds = Histogram(KV_TRANSFER_BUCKETS)

    def moved(self, num_blocks: int, seconds: float | None = None) -> None:
        """A transfer of `num_blocks` blocks completed (`seconds`: how long it took, where it is timed)."""
        self.bytes += num_blocks * self.bytes_per_block
        if seconds is not None:
            self.seconds.observe(seconds)

    def failed(self) -> None:
        self.failures += 1

    def counters(self) -> dict[str, int]:
        t = self.transport
        return {f"kv_transfer_bytes/{t}": self.bytes, f"kv_transfer_failures/{t}": self.failures}

    def histograms(self) -> dict[str, HistogramSnapshot]:
        return (
            {f"kv_transfer_seconds/{self.transport}": self.seconds.snapshot()} if self.seconds.count else {}
        )
