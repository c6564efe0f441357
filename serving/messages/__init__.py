"""The messages between a worker's gRPC server and its engine process (serving/engine_proc.py).

One small frozen dataclass per kind, one module per direction: `to_engine` (server -> engine) and
`from_engine` (engine -> server). They cross the socket pair pickled; a receiver dispatches on the type.

A request's hops, each named once:

    decode server  -> decode engine   Admit, KVArrived | KVFailed, Abort
    decode engine  -> decode server   BlocksReserved, Landed, Tokens | Error
    prefill server -> prefill engine  PrefillPrompt, Grant, Abort, TakeSnapshot
    prefill engine -> prefill server  FirstToken, KVSent | Error, Snapshot, KVEvents
    either server  -> its engine      Embed, Abort
    either engine  -> its server      Embedded | Error

and, for the process itself: Ready or StartFailed once, Load every 0.1 s, Shutdown. A remotely
prefilled prompt's first token reaches the decode server as the prefill worker's FirstToken and goes
straight on to the router; the decode engine's Landed then says whether that token ended the completion.
"""
