"""The sandbox side of agentloop: what runs inside a worker, a fork server, a sample slot and the
tool process.  It imports nothing of ``engine``; both sides share ``worker.contract``."""

__all__: list[str] = []
