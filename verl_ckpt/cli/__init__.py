"""`verl-ckpt`, the command line (floor 1): one code path for a local root or a URL."""
