"""pdserve gateway."""
