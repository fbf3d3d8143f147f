"""`cachefs warmup`: fill a running mount's cache with a dataset before a training run.

A thin client of the daemon's control file (``cachefs/warm/engine.py`` does the work;
``cachefs/control/protocol.py`` is all it speaks).
"""
