"""ktlite's wire contract: what the client, the pod server and the rank processes say to
each other. Stdlib plus cloudpickle (for user values, in :mod:`ktlite_wire.codec` only),
no import side effects, and no client or server code: both sides import it, it imports
neither.

Modules, one noun each:

- :mod:`~ktlite_wire.version`: the protocol version both sides must speak.
- :mod:`~ktlite_wire.headers`: the HTTP header names.
- :mod:`~ktlite_wire.envelope`: the framing, a JSON header plus opaque buffers.
- :mod:`~ktlite_wire.codec`: user values (cloudpickle), opaque to the pod server.
- :mod:`~ktlite_wire.frames`: the frame stream ``POST /call`` answers with.
- :mod:`~ktlite_wire.heartbeat`: the frame stream's heartbeat and silence timeout.
- :mod:`~ktlite_wire.status`, :mod:`~ktlite_wire.outcome`: how a rank's call ended.
- :mod:`~ktlite_wire.errors`: error codes, protocol errors, a rank's exception info.
- :mod:`~ktlite_wire.launch`, :mod:`~ktlite_wire.plan`: the deploy and call messages.
- :mod:`~ktlite_wire.rankchannel`: the pod server <-> rank process messages.
- :mod:`~ktlite_wire.distenv`: the distributed env contract (RANK, WORLD_SIZE, ...).
- :mod:`~ktlite_wire.rankdata`, :mod:`~ktlite_wire.shm`, :mod:`~ktlite_wire.sourcelines`.
- :mod:`~ktlite_wire.privatefiles`: what ktlite writes on a machine (0700 directories, 0600 files).
"""
