"""The `ktlite` command line."""
