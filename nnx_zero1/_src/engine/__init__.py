"""Private: the MaxText-shaped training engine (``fwd_bwd`` / ``update``) and its Zero-1 hooks."""
