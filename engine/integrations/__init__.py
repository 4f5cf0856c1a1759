"""agentloop's workers where agents already live, each behind an optional extra.

- ``engine.integrations.mcp``: the MCP server behind ``agentloop mcp`` (the ``mcp`` extra).
- ``engine.integrations.smolagents``: an executor for smolagents' ``CodeAgent``
  (the ``smolagents`` extra).

Nothing here is imported by the engine itself: without the extra, only the module that needs it
fails to import, with a message that says how to install the extra (``engine.extras``).
"""

__all__: list[str] = []
