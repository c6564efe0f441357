"""pdserve protos."""
