"""The control protocol's wire facts, shared by the daemon (``server``) and its clients.

Clients import only this module (and ``client``), never the daemon stack.
"""

CONTROL_NAME = ".cachefs-control"    # the hidden control file at the root of every mount
