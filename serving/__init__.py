"""What every served role shares: the engine process and its messages, the stream mux, gRPC helpers, KV
events, draining, roles, supervision and the `pdserve` CLI."""
