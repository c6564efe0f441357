"""pdserve decode_worker."""
