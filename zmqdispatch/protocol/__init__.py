"""Sans-IO per-engine state: request table, mailboxes, aborts, death, request checks.

Imports only ``zmqdispatch.wire`` and ``zmqdispatch.errors``; never zmq or trio.
"""
