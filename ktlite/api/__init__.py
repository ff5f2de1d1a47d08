"""The user-facing objects: Compute, Image, Secret, fn/cls/app, decorators, futures."""
