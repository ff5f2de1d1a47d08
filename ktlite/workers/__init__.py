"""NeMo RL's worker-group vocabulary over ktlite.groups."""
