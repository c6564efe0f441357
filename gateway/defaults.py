"""The gateway's defaults that its command line shows, kept apart from the web stack so that building
`pdserve`'s parser (every role does) imports no fastapi."""

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024  # a larger request body gets 413, unread
