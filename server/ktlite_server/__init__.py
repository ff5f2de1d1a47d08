"""ktlite's in-pod server: owns the rank processes and coordinates fan-out of calls.

Run it with ``python -m ktlite_server``; build the app with ``ktlite_server.app.create_app``.
"""
