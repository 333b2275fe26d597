"""kvstore.configs: the configurations that ship in the wheel (default.yaml is the daemon's embedded default)."""
