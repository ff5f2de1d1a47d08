"""Caller -> pod: the one HTTP stack, the pod client, code bundles, progress of long transfers."""
