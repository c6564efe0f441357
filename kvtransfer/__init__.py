"""pdserve kvtransfer."""
