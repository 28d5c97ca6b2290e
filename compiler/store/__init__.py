"""What ctxc keeps between runs: exported programs and their block maps, on disk."""
