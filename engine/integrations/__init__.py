"""agentloop's workers where agents already live, each behind an optional extra.

- ``engine.integrations.mcp``: the MCP server behind ``agentloop mcp`` (``agentloop[mcp]``).
- ``engine.integrations.smolagents``: an executor for smolagents' ``CodeAgent``
  (``agentloop[smolagents]``).

Nothing here is imported by the engine itself: without the extra, only the module that needs it
fails to import, with a message that names the extra to install.
"""

__all__: list[str] = []
