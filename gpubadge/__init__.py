"""The `gpubadge` command line."""
