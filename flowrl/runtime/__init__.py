"""The runtime: controller loop, executors (local, Ray), pool workers, checkpoints, trace.

Imports torch; `flowrl check/plan/render` never load this package.
"""
