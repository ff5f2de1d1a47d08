"""The deployment and pod specs: plain, typed, parsed data that backends import."""
