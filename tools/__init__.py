"""Maintainers' tools: GPU-machine plumbing, profilers, benchmark tables; not part of the installed kit."""
