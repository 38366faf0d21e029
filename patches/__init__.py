"""The few patches of third-party code this project needs, each guarded by a version/target check.

Each patch is applied explicitly by the training process (never on import) and has a test that fails
when its upstream target changes.
"""
